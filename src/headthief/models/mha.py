"""A multi-head attention layer with output projection that answers with vectors (BERT's self-attention
followed by its output ``dense``; ``torch.nn.MultiheadAttention``), and its canonical form.

The layer (one sequence X of N tokens, rows x_i; heads h = 1..H of dimension d_h)::

    q_t = Q_h x_t + bq_h,  k_i = K_h x_i + bk_h,  v_i = V_h x_i + bv_h
    a_{h,t,.} = softmax_i(q_t . k_i / sqrt(d_h))     (i <= t when causal)
    y_t = Wo [sum_i a_{h,t,i} v_i]_h + bo

answers ``y_t`` at the last position (``output="last"``) or at every position (``output="all"``).

**What the answers identify** (the canonical form, :class:`CanonicalLayer`). Writing the score of key i
for query t as ``x_i^T W_h x_t + c_h^T x_i`` plus terms constant in i (which the softmax cancels)::

    W_h = K_h^T Q_h / sqrt(d_h),   c_h = K_h^T bq_h / sqrt(d_h),
    O_h = Wo[:, h] V_h,            b = bo + Wo bv,
    y_t = b + sum_h O_h sum_i a_{h,t,i} x_i.

``bk`` never changes an answer (it adds the same number to every score of a query), ``bv`` only through
``b``; ``Q_h, K_h`` are fixed only up to ``Q_h -> G Q_h, K_h -> G^{-T} K_h`` and ``V_h, Wo[:, h]`` up to
``V_h -> G V_h, Wo[:, h] -> Wo[:, h] G^{-1}`` (any invertible d_h x d_h G). So ``(W_h, c_h, O_h)`` per head
and ``b`` are what an extraction can recover, up to a permutation of the heads; with vector answers they
are identifiable when the heads' output spaces ``col(O_h)`` are independent (see
:mod:`headthief.extraction.vector`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..oracles.answers import Output


def _groups(batch):
    """(indices, stacked (k, N, d) array) per sequence length of a batch."""
    if isinstance(batch, np.ndarray) and batch.ndim == 3:
        return [(np.arange(batch.shape[0]), batch)]
    seqs = [np.asarray(x) for x in batch]
    lengths = np.array([x.shape[0] for x in seqs])
    out = []
    for N in np.unique(lengths):
        idx = np.flatnonzero(lengths == N)
        out.append((idx, np.stack([seqs[i] for i in idx])))
    return out


def _assemble(output: Output, batch, groups_out, d_out: int):
    """Per-length answers back in the batch's order: (n, d_out) for last; (n, N, d_out) or a list for all."""
    if output is Output.LAST:
        n = sum(len(idx) for idx, _ in groups_out)
        y = np.empty((n, d_out))
        for idx, Y in groups_out:
            y[idx] = Y[:, -1, :]
        return y
    if len(groups_out) == 1 and isinstance(batch, np.ndarray):
        return groups_out[0][1]
    n = sum(len(idx) for idx, _ in groups_out)
    out: list[Any] = [None] * n
    for idx, Y in groups_out:
        for j, i in enumerate(idx):
            out[i] = Y[j]
    return out


def read_only(a, dtype) -> np.ndarray:
    """A read-only copy of ``a`` in ``dtype`` (the frozen models' arrays)."""
    a = np.array(a, dtype=dtype)
    a.setflags(write=False)
    return a


def evaluate_by_length(model, batch):
    """Answer ``batch`` with ``model.forward`` run once per group of equal-length sequences, packed as
    ``model.output`` says (``model.d_out`` numbers per answer): the ``evaluate`` of every numpy vector model."""
    return _assemble(model.output, batch, [(idx, model.forward(A)) for idx, A in _groups(batch)], model.d_out)


def _softmax_rows(S: np.ndarray, causal: bool) -> np.ndarray:
    if causal:
        N = S.shape[-1]
        S = np.where(np.tril(np.ones((N, N), dtype=bool)), S, -np.inf)
    S = S - S.max(axis=-1, keepdims=True)
    E = np.exp(S)
    return E / E.sum(axis=-1, keepdims=True)


@dataclass(frozen=True, eq=False)
class AttentionLayer:
    """Multi-head self-attention with output projection, in BERT's parameterisation (``nn.Linear``
    layout: ``Q[h]`` is (d_h, d), ``Wo`` is (d, H d_h)). Evaluated in ``dtype`` the way the real module
    computes (projections, scores, softmax, output dense), so float32 answers round like torch's."""

    Q: np.ndarray
    K: np.ndarray
    V: np.ndarray
    Wo: np.ndarray
    bq: np.ndarray
    bk: np.ndarray
    bv: np.ndarray
    bo: np.ndarray
    causal: bool = False
    output: Output = Output.LAST
    dtype: Any = np.float64
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "output", Output.parse(self.output))
        if not self.output.vector:
            raise ValueError(f"an attention layer answers with vectors: output must be last or all, got {self.output.value}")
        H, dh, d = self.Q.shape
        for name, shape in (("K", (H, dh, d)), ("V", (H, dh, d)), ("Wo", (d, H * dh)), ("bq", (H, dh)),
                            ("bk", (H, dh)), ("bv", (H, dh)), ("bo", (d,))):
            if getattr(self, name).shape != shape:
                raise ValueError(f"{name} must have shape {shape}, got {getattr(self, name).shape}")
        for name in ("Q", "K", "V", "Wo", "bq", "bk", "bv", "bo"):
            object.__setattr__(self, name, read_only(getattr(self, name), self.dtype))

    @property
    def d(self) -> int:
        return int(self.Q.shape[2])

    @property
    def heads(self) -> int:
        return int(self.Q.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.Q.shape[1])

    @property
    def d_out(self) -> int:
        return int(self.Wo.shape[0])

    def with_output(self, output) -> "AttentionLayer":
        import dataclasses
        return dataclasses.replace(self, output=Output.parse(output))

    def forward(self, X: np.ndarray) -> np.ndarray:
        """All positions' outputs for a (k, N, d) array of equal-length sequences: (k, N, d_out)."""
        dt = self.dtype
        X = np.asarray(X, dtype=dt)
        scale = dt(1.0 / np.sqrt(self.head_dim)) if dt is np.float32 else 1.0 / np.sqrt(self.head_dim)
        K_, N_, d = X.shape
        H, dh = self.heads, self.head_dim
        Xf = X.reshape(K_ * N_, d)

        def project(W, b):             # every position in one BLAS product (einsum without BLAS was 3-4x slower)
            return (Xf @ W.reshape(H * dh, d).T + b.reshape(H * dh)).reshape(K_, N_, H, dh).transpose(0, 2, 1, 3)

        q, k, v = project(self.Q, self.bq), project(self.K, self.bk), project(self.V, self.bv)
        S = (q @ k.swapaxes(-1, -2)) * scale
        A = _softmax_rows(S, self.causal).astype(dt)
        ctx = (A @ v).transpose(0, 2, 1, 3).reshape(K_ * N_, H * dh)         # heads concatenated
        return (ctx @ self.Wo.T + self.bo).reshape(K_, N_, -1).astype(np.float64)

    def evaluate(self, batch):
        return evaluate_by_length(self, batch)

    def canonical(self) -> "CanonicalLayer":
        """The identifiable parameters (W_h, c_h, O_h, b) in float64 (see the module docstring)."""
        f = np.float64
        s = 1.0 / np.sqrt(self.head_dim)
        Q, K, V, Wo = (np.asarray(a, f) for a in (self.Q, self.K, self.V, self.Wo))
        dh = self.head_dim
        A = np.stack([K[h].T * s for h in range(self.heads)])            # (H, d, dh): W_h = A_h B_h^T
        B = np.stack([Q[h].T for h in range(self.heads)])
        C = np.stack([K[h].T @ np.asarray(self.bq[h], f) * s for h in range(self.heads)])
        U = np.stack([Wo[:, h * dh:(h + 1) * dh] for h in range(self.heads)])   # O_h = U_h V_h^T
        Vt = np.stack([V[h].T for h in range(self.heads)])
        b = np.asarray(self.bo, f) + Wo @ np.asarray(self.bv, f).reshape(-1)
        return CanonicalLayer(A=A, B=B, C=C, U=U, Vt=Vt, b=b, causal=self.causal, output=self.output)


@dataclass(frozen=True, eq=False)
class CanonicalLayer:
    """A layer in its identifiable form: ``W_h = A_h B_h^T``, ``c_h``, ``O_h = U_h Vt_h^T``, ``b``
    (float64; A, B, U, Vt are (H, d, r_h)). What :func:`~headthief.extraction.vector.extract_vector`
    returns and what a target's truth is compared in."""

    A: np.ndarray
    B: np.ndarray
    C: np.ndarray
    U: np.ndarray
    Vt: np.ndarray
    b: np.ndarray
    causal: bool = False
    output: Output = Output.LAST

    def __post_init__(self):
        object.__setattr__(self, "output", Output.parse(self.output))
        for name in ("A", "B", "C", "U", "Vt", "b"):
            object.__setattr__(self, name, read_only(getattr(self, name), np.float64))

    @property
    def d(self) -> int:
        return int(self.A.shape[1])

    @property
    def heads(self) -> int:
        return int(self.A.shape[0])

    @property
    def d_out(self) -> int:
        return int(self.U.shape[1])

    def W(self, h: int) -> np.ndarray:
        return self.A[h] @ self.B[h].T

    def O(self, h: int) -> np.ndarray:
        return self.U[h] @ self.Vt[h].T

    @property
    def M(self) -> np.ndarray:
        return sum(self.O(h) for h in range(self.heads))

    def forward(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        Xb = X[:, None]                                                 # (k, 1, n, d): batched matmuls (BLAS)
        keys = Xb @ self.A[None]                                         # (k, H, n, r)
        qs = Xb @ self.B[None]
        S = qs @ keys.transpose(0, 1, 3, 2) + (X @ self.C.T).transpose(0, 2, 1)[:, :, None, :]
        Att = _softmax_rows(S, self.causal)
        Z = Att @ Xb                                                     # each head's attended mean of tokens
        return self.b + ((Z @ self.Vt[None]) @ self.U.transpose(0, 2, 1)[None]).sum(1)

    def evaluate(self, batch):
        return evaluate_by_length(self, batch)

    def attention(self, X: np.ndarray) -> np.ndarray:
        """Attention weights (H, N, N) of one sequence."""
        X = np.asarray(X, dtype=np.float64)
        S = (X @ self.B) @ (X @ self.A).transpose(0, 2, 1) + (X @ self.C.T).T[:, None, :]
        return _softmax_rows(S, self.causal)

    def errors(self, truth: "CanonicalLayer") -> dict[str, Any]:
        """Per-head relative errors of W_h, c_h, O_h after matching heads (Hungarian on O_h), and b's."""
        from scipy.optimize import linear_sum_assignment
        H, Ht = self.heads, truth.heads
        cost = np.array([[_rel(self.O(i), truth.O(j)) for j in range(Ht)] for i in range(H)])
        rows, cols = linear_sum_assignment(cost)
        per = []
        for i, j in zip(rows, cols):
            per.append({"head": int(j), "recovered_as": int(i), "W_rel_err": _rel(self.W(i), truth.W(j)),
                        "c_rel_err": _rel(self.C[i], truth.C[j]), "O_rel_err": _rel(self.O(i), truth.O(j))})
        per.sort(key=lambda r: r["head"])
        worst = {k: max(r[k] for r in per) if per else None for k in ("W_rel_err", "c_rel_err", "O_rel_err")}
        return {**worst, "b_rel_err": _rel(self.b, truth.b), "heads_found": H, "heads_true": Ht,
                "per_head": per}


def _rel(a, b) -> float:
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b))) / (nb if nb > 0 else 1.0)


def random_layer(d: int, heads: int, *, head_dim: int | None = None, seed: int = 0, bias: bool = False,
                 causal: bool = False, output="last", dtype=np.float64) -> AttentionLayer:
    """A seeded random layer: Gaussian weights scaled like a trained layer's (scores and outputs O(1) for
    tokens of norm ~sqrt(d)); biases with ``bias=True``, else zero."""
    dh = int(head_dim) if head_dim else d // heads
    if heads < 1 or dh < 1:
        raise ValueError(f"need heads >= 1 and head_dim >= 1, got heads={heads}, head_dim={dh}")
    if not head_dim and d % heads:
        raise ValueError(f"heads={heads} does not divide d={d}: give head_dim=K")
    if heads * dh > d:
        raise ValueError(f"heads * head_dim = {heads * dh} > d = {d}: the heads' output spaces cannot be "
                         "independent (the split into heads is then not identifiable)")
    rng = np.random.default_rng(seed)
    g = lambda *s: rng.standard_normal(s)                                  # noqa: E731
    Q, K, V = g(heads, dh, d) / np.sqrt(d), g(heads, dh, d) / np.sqrt(d), g(heads, dh, d) / np.sqrt(d)
    Wo = g(d, heads * dh) / np.sqrt(heads * dh)
    z = np.zeros
    bq, bk, bv, bo = ((g(heads, dh) * 0.5, g(heads, dh) * 0.5, g(heads, dh) * 0.5, g(d) * 0.5) if bias else
                      (z((heads, dh)), z((heads, dh)), z((heads, dh)), z(d)))
    return AttentionLayer(Q=Q, K=K, V=V, Wo=Wo, bq=bq, bk=bk, bv=bv, bo=bo, causal=causal, output=output,
                          dtype=dtype)


__all__ = ["AttentionLayer", "CanonicalLayer", "random_layer"]
