"""Causal attention with rotary position embeddings (RoPE) and grouped-query heads: the mathematics of
transformers' ``LlamaAttention`` (eager), in numpy.

One sequence X of N tokens x_0..x_{N-1} (positions are the token indices); H query heads of dimension d_h,
G key/value groups (``kv_heads``; H/G query heads share one group: head h reads group ``h // (H/G)``)::

    q_{h,t} = R(t) (Q_h x_t + bq_h),   k_{g,i} = R(i) (K_g x_i + bk_g),   v_{g,i} = V_g x_i + bv_g
    a_{h,t,i} = softmax_{i <= t}(q_{h,t} . k_{g(h),i} / sqrt(d_h))
    y_t = Wo [sum_{i <= t} a_{h,t,i} v_{g(h),i}]_h + bo

``R(p)`` is transformers' rotation (non-interleaved halves): with ``inv_freq_j = theta^(-2j/d_h)``
(j = 0..d_h/2-1), ``cos = cat(cos(p inv_freq), cos(p inv_freq))`` and likewise ``sin``,
``R(p) u = u * cos + rotate_half(u) * sin``, ``rotate_half(u) = cat(-u_2, u_1)`` (u_1, u_2 the two halves):
coordinate j and j + d_h/2 form one plane turned by the angle ``p inv_freq_j``. Since ``R(t)^T R(i) = R(i - t)``,
the score of key i for query t is ``(Q_h x_t + bq_h)^T R(i - t) (K_g x_i + bk_g) / sqrt(d_h)``: it depends on
the positions only through the offset i - t.

:class:`RopeAttention` is evaluated stage by stage in its ``dtype`` (projections, rotation, scores, softmax,
weighted values, ``o_proj``) and answers in float64. The rotary tables are computed in float64 and rounded
once to ``dtype``. (transformers itself computes them in float32 whatever the module's dtype, and its eager
attention takes the softmax in float32: a float64 ``LlamaAttention`` agrees with this layer only to float32
precision; see ``docs/decoder.md``.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..oracles.answers import Output
from .mha import _softmax_rows, evaluate_by_length, read_only

_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")


def rotary_tables(positions, head_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """transformers' ``cos, sin`` (``LlamaRotaryEmbedding``, default rope type) in float64: (P, head_dim)."""
    head_dim = int(head_dim)
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    return np.cos(emb), np.sin(emb)


def rotate_half(u: np.ndarray) -> np.ndarray:
    """``cat(-u_2, u_1)`` along the last axis (u_1, u_2 its two halves), as transformers writes it."""
    h = u.shape[-1] // 2
    return np.concatenate([-u[..., h:], u[..., :h]], axis=-1)


def apply_rotary(u: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``u * cos + rotate_half(u) * sin`` (cos, sin broadcast over u's leading axes)."""
    return u * cos + rotate_half(u) * sin


def _check_theta(theta) -> float:
    t = float(theta)
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"rope theta must be a finite number > 0, got {theta}")
    return t


@dataclass(frozen=True, eq=False)
class RopeAttention:
    """Causal RoPE attention with grouped-query heads and output projection (``LlamaAttention``).

    ``Q`` is (H, d_h, d), ``K`` and ``V`` are (G, d_h, d) (``nn.Linear`` rows of ``q_proj``, ``k_proj``,
    ``v_proj`` split per head), ``Wo`` is ``o_proj.weight`` (d, H d_h); ``bq`` (H, d_h), ``bk``, ``bv``
    (G, d_h), ``bo`` (d,) are zero unless ``bias`` (Llama's ``attention_bias``). ``output``: ``"all"`` (a
    d-vector at every position) or ``"last"``."""

    Q: np.ndarray
    K: np.ndarray
    V: np.ndarray
    Wo: np.ndarray
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None
    theta: float = 10000.0
    bias: bool = False
    output: Output = Output.ALL
    dtype: Any = np.float64
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "output", Output.parse(self.output))
        if not self.output.vector:
            raise ValueError(f"a RoPE attention layer answers with vectors: output must be last or all, "
                             f"got {self.output.value}")
        try:
            dt = np.dtype(self.dtype).type
        except TypeError:
            dt = None
        if dt not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "theta", _check_theta(self.theta))
        if np.ndim(self.Q) != 3 or np.ndim(self.K) != 3:
            raise ValueError(f"Q must be (heads, head_dim, d) and K (kv_heads, head_dim, d), got shapes "
                             f"{np.shape(self.Q)} and {np.shape(self.K)}")
        H, dh, d = np.shape(self.Q)
        G = np.shape(self.K)[0]
        if H < 1 or G < 1 or dh < 1 or d < 1:
            raise ValueError(f"need heads, kv_heads, head_dim, d >= 1, got {H}, {G}, {dh}, {d}")
        if H % G:
            raise ValueError(f"heads={H} is not a multiple of kv_heads={G} (each key/value group serves "
                             "heads / kv_heads query heads)")
        if dh % 2:
            raise ValueError(f"head_dim={dh} is odd: the rotation turns pairs of coordinates (j, j + head_dim/2)")
        shapes = {"K": (G, dh, d), "V": (G, dh, d), "Wo": (d, H * dh), "bq": (H, dh), "bk": (G, dh),
                  "bv": (G, dh), "bo": (d,)}
        for name, shape in shapes.items():
            a = getattr(self, name)
            if a is None:
                if name in ("K", "V", "Wo"):
                    raise ValueError(f"{name} is required")
                a = np.zeros(shape)
            if np.shape(a) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {np.shape(a)}")
            if name.startswith("b") and not self.bias and np.any(np.asarray(a) != 0):
                raise ValueError(f"{name} is not zero but bias=False (give bias=True for a layer with biases)")
            object.__setattr__(self, name, a)
        for name in ("Q", "K", "V", "Wo", "bq", "bk", "bv", "bo"):
            object.__setattr__(self, name, read_only(getattr(self, name), self.dtype))

    # ------------------------------------------------------------------ shape
    @property
    def d(self) -> int:
        return int(self.Q.shape[2])

    @property
    def d_out(self) -> int:
        return int(self.Wo.shape[0])

    @property
    def heads(self) -> int:
        return int(self.Q.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.K.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.Q.shape[1])

    @property
    def group_size(self) -> int:
        """Query heads per key/value group (H / G)."""
        return self.heads // self.kv_heads

    def __repr__(self) -> str:
        return (f"RopeAttention(d={self.d}, heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"theta={self.theta:g}, bias={self.bias}, output={self.output.value}, "
                f"dtype={np.dtype(self.dtype).name})")

    def astype(self, dtype) -> "RopeAttention":
        """The same weights (values unchanged; float32 -> float64 is exact) evaluated in ``dtype``."""
        return dataclasses.replace(self, dtype=dtype)

    def with_output(self, output) -> "RopeAttention":
        return dataclasses.replace(self, output=Output.parse(output))

    # ------------------------------------------------------------------ evaluation
    def rotary(self, N: int) -> tuple[np.ndarray, np.ndarray]:
        """``cos, sin`` for positions 0..N-1, (N, head_dim), in ``dtype``."""
        cos, sin = rotary_tables(np.arange(int(N)), self.head_dim, self.theta)
        return cos.astype(self.dtype), sin.astype(self.dtype)

    def trace(self, X: np.ndarray) -> dict[str, np.ndarray]:
        """Every stage for a (k, N, d) array of equal-length sequences, in ``dtype``: rotated queries ``q``
        (k, H, N, d_h) and keys ``k`` (k, G, N, d_h), values ``v`` (k, G, N, d_h), scaled scores ``S`` and
        attention weights ``A`` (k, H, N, N; zero above the diagonal), and the answers ``y`` (k, N, d)."""
        dt = self.dtype
        X = np.asarray(X, dtype=dt)
        if X.ndim != 3 or X.shape[2] != self.d:
            raise ValueError(f"X must be (k, N, {self.d}), got shape {X.shape}")
        N = X.shape[1]
        cos, sin = self.rotary(N)
        q = np.einsum("knd,hed->khne", X, self.Q) + self.bq[None, :, None, :]
        k = np.einsum("knd,ged->kgne", X, self.K) + self.bk[None, :, None, :]
        v = np.einsum("knd,ged->kgne", X, self.V) + self.bv[None, :, None, :]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        r = self.group_size
        kh, vh = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)        # head h reads group h // r
        scale = dt(1.0 / np.sqrt(self.head_dim))
        S = np.einsum("khte,khie->khti", q, kh) * scale
        A = _softmax_rows(S, True).astype(dt)
        ctx = np.einsum("khti,khie->kthe", A, vh).reshape(X.shape[0], N, -1)     # heads concatenated
        y = ctx @ self.Wo.T + self.bo
        return {"q": q, "k": k, "v": v, "S": S, "A": A, "y": y}

    def forward(self, X: np.ndarray) -> np.ndarray:
        """All positions' outputs for a (k, N, d) array of equal-length sequences: (k, N, d), float64."""
        return self.trace(X)["y"].astype(np.float64)

    def evaluate(self, batch):
        return evaluate_by_length(self, batch)

    # ------------------------------------------------------------------ transformers' naming
    def state_dict(self) -> dict[str, np.ndarray]:
        """The tensors under ``LlamaAttention``'s names (``q_proj.weight`` ... ``o_proj.weight``, and the
        ``.bias`` of each when ``bias``), as ``dtype`` arrays."""
        d = self.d
        out = {"q_proj.weight": self.Q.reshape(-1, d), "k_proj.weight": self.K.reshape(-1, d),
               "v_proj.weight": self.V.reshape(-1, d), "o_proj.weight": self.Wo}
        if self.bias:
            out.update({"q_proj.bias": self.bq.reshape(-1), "k_proj.bias": self.bk.reshape(-1),
                        "v_proj.bias": self.bv.reshape(-1), "o_proj.bias": self.bo})
        return out

    @classmethod
    def from_state_dict(cls, tensors: dict[str, Any], heads: int, kv_heads: int | None = None, *,
                        theta: float = 10000.0, prefix: str = "", output="all", dtype=np.float64,
                        info: dict | None = None) -> "RopeAttention":
        """A layer from ``LlamaAttention`` tensors (``prefix`` e.g. ``"model.layers.0.self_attn."``):
        ``heads`` query heads, ``kv_heads`` key/value groups (default ``heads``); biases read when
        ``q_proj.bias`` is present."""
        G = int(kv_heads or heads)
        t = {k: np.asarray(v) for k, v in tensors.items() if k.startswith(prefix)}
        t = {k[len(prefix):]: v for k, v in t.items()}
        missing = [n + ".weight" for n in _NAMES if n + ".weight" not in t]
        if missing:
            raise ValueError(f"missing tensor(s): {', '.join(prefix + m for m in missing)}")
        Wq = t["q_proj.weight"]
        d = Wq.shape[1]
        if Wq.shape[0] % int(heads):
            raise ValueError(f"q_proj.weight has {Wq.shape[0]} rows, not a multiple of heads={heads}")
        dh = Wq.shape[0] // int(heads)
        bias = "q_proj.bias" in t
        if bias and any(n + ".bias" not in t for n in _NAMES):
            raise ValueError("q_proj.bias is present but not every projection has a bias (Llama's attention_bias "
                             "gives all four one)")
        sw = lambda w, n: np.asarray(w).reshape(n, dh, d)                   # noqa: E731
        sb = lambda b, n: np.asarray(b).reshape(n, dh)                      # noqa: E731
        return cls(Q=sw(Wq, heads), K=sw(t["k_proj.weight"], G), V=sw(t["v_proj.weight"], G), Wo=t["o_proj.weight"],
                   bq=sb(t["q_proj.bias"], heads) if bias else None, bk=sb(t["k_proj.bias"], G) if bias else None,
                   bv=sb(t["v_proj.bias"], G) if bias else None, bo=t["o_proj.bias"] if bias else None,
                   theta=theta, bias=bias, output=output, dtype=dtype, info=dict(info or {}))


def random_rope_layer(d: int, heads: int, kv_heads: int | None = None, *, head_dim: int | None = None,
                      theta: float = 10000.0, seed: int = 0, bias: bool = False, dtype=np.float64,
                      output="all") -> RopeAttention:
    """A seeded random layer with the scales of a trained one, for tokens of norm ~sqrt(d) (entries O(1)):

    * ``q_proj, k_proj, v_proj ~ N(0, 1/d)``: every query/key coordinate of std ~1, so scores
      ``q'.k'/sqrt(d_h)`` of std ~1 (the rotation keeps norms): attention clearly non-uniform, rarely one-hot
      (tests measure it);
    * ``o_proj ~ N(0, 1/(H d_h))``: answers of entries O(1);
    * with ``bias``: ``bq, bk, bv, bo ~ N(0, 0.5^2)``, else zero.

    ``head_dim`` defaults to d / heads (then heads must divide d); ``kv_heads`` to heads (no sharing).
    Drawn in float64 from ``default_rng(seed)`` in the order q, k, v, o (then the biases) and rounded once to
    ``dtype``."""
    d, H = int(d), int(heads)
    G = H if kv_heads is None else int(kv_heads)
    if d < 1 or H < 1 or G < 1:
        raise ValueError(f"need d, heads, kv_heads >= 1, got d={d}, heads={H}, kv_heads={G}")
    if H % G:
        raise ValueError(f"heads={H} is not a multiple of kv_heads={G} (each key/value group serves "
                         "heads / kv_heads query heads)")
    if head_dim is None and d % H:
        raise ValueError(f"heads={H} does not divide d={d}: give head_dim=K")
    dh = int(head_dim) if head_dim is not None else d // H
    if dh < 2 or dh % 2:
        raise ValueError(f"head_dim={dh} must be even and >= 2 (the rotation turns pairs of coordinates)")
    rng = np.random.default_rng(seed)
    g = lambda *s: rng.standard_normal(s)                                  # noqa: E731
    Q, K, V = g(H, dh, d) / np.sqrt(d), g(G, dh, d) / np.sqrt(d), g(G, dh, d) / np.sqrt(d)
    Wo = g(d, H * dh) / np.sqrt(H * dh)
    b = ({"bq": 0.5 * g(H, dh), "bk": 0.5 * g(G, dh), "bv": 0.5 * g(G, dh), "bo": 0.5 * g(d)} if bias else {})
    return RopeAttention(Q=Q.astype(dtype), K=K.astype(dtype), V=V.astype(dtype), Wo=Wo.astype(dtype),
                         **{k: v.astype(dtype) for k, v in b.items()}, theta=theta, bias=bool(bias),
                         output=output, dtype=dtype)


__all__ = ["RopeAttention", "apply_rotary", "random_rope_layer", "rotary_tables", "rotate_half"]
