"""A post-LN BERT encoder block and the whole BERT encoder (embeddings' LayerNorm + blocks), in numpy.

The block (transformers' ``BertLayer``, encoder only, eval mode: no dropout), at every position t of a
sequence X of N tokens x_1..x_N in R^d::

    a_t = W_O attn(X)_t + b_O                       (BertSelfAttention + BertSelfOutput.dense)
    z_t = LN1(x_t + a_t)                            (BertSelfOutput.LayerNorm)
    y_t = LN2(z_t + W_2 GELU(W_1 z_t + b_1) + b_2)  (BertIntermediate, BertOutput.dense, BertOutput.LayerNorm)

    LN(u) = gamma * (u - mean(u)) / sqrt(var(u) + eps) + beta      (var: the biased one, as torch's)
    GELU(s) = s Phi(s) = s (1 + erf(s / sqrt 2)) / 2               (exact, BERT's "gelu"; not the tanh form)

Attention is bidirectional (no mask) and is :class:`~headthief.models.mha.AttentionLayer` itself (its
``forward`` gives ``a`` at every position, the output dense's bias included); only the residuals, the
two LayerNorms and the FFN are new here. ``eps`` is 1e-12, as BERT (and all-MiniLM-L6-v2) uses.

Precision: a block holds its parameters in ``dtype`` and evaluates every stage in it (float32 rounds
like the real float32 model, stage by stage; float64 gives the mapping of the same weights). Answers are
returned as float64 arrays whatever the dtype.

The encoder (:class:`Encoder`, transformers' ``BertModel`` queried with ``inputs_embeds``)::

    h_0 = LN_emb(inputs_embeds + token_type_embeddings[0] + position_embeddings[0..N-1])   (BertEmbeddings)
    h_k = block_k(h_{k-1}),   k = 1..L

answering per position either the concatenation ``[h_0, h_1, ..., h_L]`` (``hidden="all"``, d_out =
(L + 1) d: exactly ``BertModel(..., output_hidden_states=True).hidden_states`` concatenated along the
last axis) or ``h_L`` only (``hidden="last"``, d_out = d: ``last_hidden_state``). Sequences longer than
the position table (512 for all-MiniLM-L6-v2) are refused.

Blocks are numbered 0..5 in :func:`from_minilm`, as the attention-only kinds (``minilm:``,
``minilm-layer:``) number them: block L is ``encoder.layer.{L}.*`` in the checkpoint and maps
``hidden_states[L]`` to ``hidden_states[L+1]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidQuery
from ..oracles.answers import Output
from .activations import SMOOTH, activation, gelu, gelu_prime
from .mha import AttentionLayer, evaluate_by_length, read_only

BERT_EPS = 1e-12
ACTIVATIONS = (*SMOOTH, "relu")      # relu: a deliberately wrong block (kinks), for the checks
INITS = ("trained", "bert")     # random_block: a trained block's scales, or BertModel's own init


def layer_norm(u: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = BERT_EPS) -> np.ndarray:
    """LayerNorm over the last axis in ``u``'s dtype (biased variance, eps inside the square root)."""
    dt = u.dtype.type
    c = u - u.mean(axis=-1, keepdims=True)
    var = (c * c).mean(axis=-1, keepdims=True)
    return c * (dt(1.0) / np.sqrt(var + dt(eps))) * gamma + beta


def _activation(name: str, s: np.ndarray) -> np.ndarray:
    if name == "relu":
        return np.maximum(s, s.dtype.type(0.0))
    return activation(name).f(s)


@dataclass(frozen=True, eq=False)
class BertBlock:
    """One post-LN BERT encoder block (see the module docstring); ``nn.Linear`` layouts: ``W1`` is
    (ffn, d), ``W2`` is (d, ffn). ``attention`` answers at every position (``output="all"``); the
    block's own ``output`` is ``all`` (a d-vector at every position) or ``last``.

    ``activation``: BERT's exact ``"gelu"``, another smooth one of :mod:`.activations` (``"gelu_tanh"``,
    ``"silu"``, ``"quick_gelu"``: blocks of other encoders, extracted with ``--activation``; wrong blocks for
    a method that assumes GELU), or ``"relu"`` (a deliberately wrong block with kinks, for the checks)."""

    attention: AttentionLayer
    ln1_gamma: np.ndarray
    ln1_beta: np.ndarray
    W1: np.ndarray
    b1: np.ndarray
    W2: np.ndarray
    b2: np.ndarray
    ln2_gamma: np.ndarray
    ln2_beta: np.ndarray
    eps: float = BERT_EPS
    activation: str = "gelu"
    output: Output = Output.ALL
    dtype: Any = np.float64
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "output", Output.parse(self.output))
        if not self.output.vector:
            raise ValueError(f"a block answers with vectors: output must be last or all, got {self.output.value}")
        dt = np.dtype(self.dtype).type
        if dt not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        object.__setattr__(self, "dtype", dt)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        att = self.attention
        if att.causal:
            raise ValueError("a BERT block's attention is bidirectional: got a causal attention layer")
        if att.d_out != att.d:
            raise ValueError(f"the attention's output dimension {att.d_out} must equal d = {att.d} (the residual)")
        if att.output is not Output.ALL or att.dtype is not dt:
            att = dataclasses.replace(att, output=Output.ALL, dtype=dt)
            object.__setattr__(self, "attention", att)
        d = att.d
        M = np.shape(self.W1)[0] if np.ndim(self.W1) == 2 else -1
        for name, shape in (("ln1_gamma", (d,)), ("ln1_beta", (d,)), ("W1", (M, d)), ("b1", (M,)),
                            ("W2", (d, M)), ("b2", (d,)), ("ln2_gamma", (d,)), ("ln2_beta", (d,))):
            if np.shape(getattr(self, name)) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {np.shape(getattr(self, name))}")
            object.__setattr__(self, name, read_only(getattr(self, name), dt))
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")

    # ------------------------------------------------------------------ shape
    @property
    def d(self) -> int:
        return self.attention.d

    @property
    def d_out(self) -> int:
        return self.attention.d

    @property
    def heads(self) -> int:
        return self.attention.heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @property
    def ffn(self) -> int:
        return int(self.W1.shape[0])

    def value_output_sum(self) -> tuple[np.ndarray, np.ndarray]:
        """``B = I + W_O V`` (all heads) and ``b = W_O b_V + b_O``: the block's attention on one token is
        ``x -> B x + b`` before LN1 (float64; what the block method's stage V recovers modulo ones)."""
        a = self.attention
        d = self.d
        B = np.eye(d) + a.Wo.astype(np.float64) @ a.V.reshape(d, d).astype(np.float64)
        b = a.Wo.astype(np.float64) @ a.bv.reshape(d).astype(np.float64) + a.bo.astype(np.float64)
        return B, b

    def with_output(self, output) -> "BertBlock":
        return dataclasses.replace(self, output=Output.parse(output))

    def astype(self, dtype) -> "BertBlock":
        """The same weights (values unchanged; float32 -> float64 is exact) evaluated in ``dtype``."""
        return dataclasses.replace(self, attention=dataclasses.replace(self.attention, dtype=dtype), dtype=dtype)

    # ------------------------------------------------------------------ evaluation
    def trace(self, X: np.ndarray) -> dict[str, np.ndarray]:
        """Every stage for a (k, N, d) array of equal-length sequences, in ``dtype``: ``a`` (attention
        output, bias included), ``z`` (after LN1), ``s`` (FFN pre-activations, (k, N, ffn)), ``f`` (the
        FFN's output, b_2 included) and ``y`` (after LN2)."""
        dt = self.dtype
        X = np.asarray(X, dtype=dt)
        a = self.attention.forward(X).astype(dt)          # computed in dt, handed back as float64: exact
        z = layer_norm(X + a, self.ln1_gamma, self.ln1_beta, self.eps)
        flat = z.reshape(-1, z.shape[-1])                 # every position in one BLAS product (not one per sequence)
        s = (flat @ self.W1.T + self.b1).reshape(*z.shape[:-1], -1)
        f = (_activation(self.activation, s).reshape(flat.shape[0], -1) @ self.W2.T + self.b2).reshape(z.shape)
        y = layer_norm(z + f, self.ln2_gamma, self.ln2_beta, self.eps)
        return {"a": a, "z": z, "s": s, "f": f, "y": y}

    def forward(self, X: np.ndarray) -> np.ndarray:
        """All positions' outputs for a (k, N, d) array of equal-length sequences: (k, N, d), float64."""
        return self.trace(X)["y"].astype(np.float64)

    def evaluate(self, batch):
        return evaluate_by_length(self, batch)

    # ------------------------------------------------------------------ transformers' naming
    def state_dict(self) -> dict[str, np.ndarray]:
        """The block's tensors under transformers' ``BertLayer`` names (``attention.self.query.weight``
        ... ``output.LayerNorm.bias``), as ``dtype`` arrays; the same tensors the checkpoint holds under
        ``encoder.layer.{i}.``."""
        a = self.attention
        d = self.d
        return {
            "attention.self.query.weight": a.Q.reshape(d, d), "attention.self.query.bias": a.bq.reshape(d),
            "attention.self.key.weight": a.K.reshape(d, d), "attention.self.key.bias": a.bk.reshape(d),
            "attention.self.value.weight": a.V.reshape(d, d), "attention.self.value.bias": a.bv.reshape(d),
            "attention.output.dense.weight": a.Wo, "attention.output.dense.bias": a.bo,
            "attention.output.LayerNorm.weight": self.ln1_gamma, "attention.output.LayerNorm.bias": self.ln1_beta,
            "intermediate.dense.weight": self.W1, "intermediate.dense.bias": self.b1,
            "output.dense.weight": self.W2, "output.dense.bias": self.b2,
            "output.LayerNorm.weight": self.ln2_gamma, "output.LayerNorm.bias": self.ln2_beta,
        }

    @classmethod
    def from_state_dict(cls, tensors: dict[str, Any], heads: int, *, prefix: str = "", eps: float = BERT_EPS,
                        output="all", dtype=np.float64, info: dict | None = None) -> "BertBlock":
        """A block from ``BertLayer`` tensors (``prefix`` e.g. ``"encoder.layer.1."``), ``heads`` heads."""
        t = {k: np.asarray(tensors[prefix + k]) for k in _NAMES}
        d = t["attention.self.query.weight"].shape[1]
        if d % heads:
            raise ValueError(f"heads={heads} does not divide d={d}")
        dh = d // heads
        sh = lambda w: w.reshape(heads, dh, d)                              # noqa: E731
        sb = lambda b: b.reshape(heads, dh)                                 # noqa: E731
        att = AttentionLayer(Q=sh(t["attention.self.query.weight"]), K=sh(t["attention.self.key.weight"]),
                             V=sh(t["attention.self.value.weight"]), Wo=t["attention.output.dense.weight"],
                             bq=sb(t["attention.self.query.bias"]), bk=sb(t["attention.self.key.bias"]),
                             bv=sb(t["attention.self.value.bias"]), bo=t["attention.output.dense.bias"],
                             output="all", dtype=dtype)
        return cls(attention=att, ln1_gamma=t["attention.output.LayerNorm.weight"],
                   ln1_beta=t["attention.output.LayerNorm.bias"], W1=t["intermediate.dense.weight"],
                   b1=t["intermediate.dense.bias"], W2=t["output.dense.weight"], b2=t["output.dense.bias"],
                   ln2_gamma=t["output.LayerNorm.weight"], ln2_beta=t["output.LayerNorm.bias"], eps=eps,
                   output=output, dtype=dtype, info=dict(info or {}))


_NAMES = ("attention.self.query.weight", "attention.self.query.bias", "attention.self.key.weight",
          "attention.self.key.bias", "attention.self.value.weight", "attention.self.value.bias",
          "attention.output.dense.weight", "attention.output.dense.bias", "attention.output.LayerNorm.weight",
          "attention.output.LayerNorm.bias", "intermediate.dense.weight", "intermediate.dense.bias",
          "output.dense.weight", "output.dense.bias", "output.LayerNorm.weight", "output.LayerNorm.bias")


def random_block(d: int, heads: int, ffn: int, *, seed: int = 0, dtype=np.float64, output="all",
                 activation: str = "gelu", init: str = "trained", eps: float = BERT_EPS) -> BertBlock:
    """A seeded random block with the scales of a trained one, for tokens on a LayerNorm's image
    (entries O(1), norm ~sqrt(d)):

    * attention: ``Q, K ~ N(0, 2/d)`` (scores of std ~2 per head: attention clearly non-uniform, rarely
      one-hot), ``V ~ N(0, 1/d)``, ``W_O ~ N(0, 1/d)``; biases ``bq, bk, bv ~ N(0, 0.5^2)``,
      ``b_O ~ N(0, 0.1^2)``;
    * FFN: ``W_1 ~ N(0, 1/d)``, ``b_1 ~ N(-0.25, 0.5^2)`` (pre-activations of std ~1.1, mostly within
      GELU's curved region |s| < 3), ``W_2 ~ N(0, 1/ffn)``, ``b_2 ~ N(0, 0.1^2)``;
    * LayerNorms: ``gamma ~ 1 + N(0, 0.1^2)``, ``beta ~ N(0, 0.05^2)``.

    ``init="bert"``: instead, the layers of a transformers ``BertModel`` built from a config (its
    ``_init_weights``, ``initializer_range`` 0.02): every weight ``N(0, 0.02^2)``, biases 0, LayerNorms
    ``gamma = 1``, ``beta = 0``. Its attention is nearly uniform and its FFN nearly linear (pre-activations of
    std ~0.02 sqrt(d)). (A ``BertLayer`` built alone keeps PyTorch's ``Linear`` init, ``U(+-1/sqrt(fan_in))``.)

    Drawn in float64 from ``default_rng(seed)`` and rounded once to ``dtype``; ``eps``: both LayerNorms'
    (BERT's 1e-12 by default; RoBERTa's 1e-5)."""
    d, heads, ffn = int(d), int(heads), int(ffn)
    if d < 1 or heads < 1 or ffn < 1:
        raise ValueError(f"need d, heads, ffn >= 1, got d={d}, heads={heads}, ffn={ffn}")
    if d % heads:
        raise ValueError(f"heads={heads} does not divide d={d}")
    if init not in INITS:
        raise ValueError(f"init must be 'trained' (a trained block's scales) or 'bert' (BertModel's own init), "
                         f"got {init!r}")
    dh = d // heads
    rng = np.random.default_rng(seed)
    g = lambda *s: rng.standard_normal(s)                                  # noqa: E731
    if init == "bert":
        w = lambda *s: 0.02 * g(*s)                                        # noqa: E731
        z = np.zeros
        att = AttentionLayer(Q=w(heads, dh, d), K=w(heads, dh, d), V=w(heads, dh, d), Wo=w(d, d),
                             bq=z((heads, dh)), bk=z((heads, dh)), bv=z((heads, dh)), bo=z(d), output="all",
                             dtype=dtype)
        return BertBlock(attention=att, ln1_gamma=np.ones(d), ln1_beta=z(d), W1=w(ffn, d), b1=z(ffn),
                         W2=w(d, ffn), b2=z(d), ln2_gamma=np.ones(d), ln2_beta=z(d), output=output, dtype=dtype,
                         activation=activation, info={"seed": int(seed), "init": "bert"}, eps=eps)
    att = AttentionLayer(Q=g(heads, dh, d) * np.sqrt(2.0 / d), K=g(heads, dh, d) * np.sqrt(2.0 / d),
                         V=g(heads, dh, d) / np.sqrt(d), Wo=g(d, d) / np.sqrt(d),
                         bq=0.5 * g(heads, dh), bk=0.5 * g(heads, dh), bv=0.5 * g(heads, dh), bo=0.1 * g(d),
                         output="all", dtype=dtype)
    return BertBlock(attention=att, ln1_gamma=1.0 + 0.1 * g(d), ln1_beta=0.05 * g(d),
                     W1=g(ffn, d) / np.sqrt(d), b1=-0.25 + 0.5 * g(ffn), W2=g(d, ffn) / np.sqrt(ffn), b2=0.1 * g(d),
                     ln2_gamma=1.0 + 0.1 * g(d), ln2_beta=0.05 * g(d), output=output, dtype=dtype,
                     activation=activation, info={"seed": int(seed)}, eps=eps)


# --------------------------------------------------------------------------- all-MiniLM-L6-v2


def _check_block_layer(layer) -> int:
    from .minilm import N_LAYERS
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer must be an integer, got {layer!r}")
    if not 0 <= int(layer) < N_LAYERS:
        raise ValueError(f"layer must be in 0..{N_LAYERS - 1} (block L is encoder.layer.L and maps hidden_states[L] "
                         f"to hidden_states[L+1]), got {layer}")
    return int(layer)


_TENSORS: dict[str, dict[str, np.ndarray]] = {}


def _minilm_tensors() -> dict[str, np.ndarray]:
    """Every tensor of the packaged checkpoint (read once, kept read-only)."""
    try:
        from safetensors.numpy import load_file
    except ImportError as e:
        raise ModuleNotFoundError("reading the MiniLM weights needs safetensors: pip install -e '.[real]' in the "
                                  "headthief clone, or bash scripts/setup.sh", name="safetensors") from e
    from .minilm import minilm_weights_path
    path = str(minilm_weights_path())
    if path not in _TENSORS:
        t = load_file(path)
        for a in t.values():
            a.setflags(write=False)
        _TENSORS[path] = t
    return _TENSORS[path]


def from_minilm(layer: int, *, output="all", dtype=np.float32) -> BertBlock:
    """Block ``layer`` (0..5) of all-MiniLM-L6-v2 from the packaged weights (``encoder.layer.{layer}.*``).

    ``dtype=np.float32`` (default) evaluates as the real model does; ``np.float64`` gives the mapping of
    the same float32 weights without rounding."""
    from .minilm import MODEL_NAME, N_HEADS
    layer = _check_block_layer(layer)
    return BertBlock.from_state_dict(_minilm_tensors(), N_HEADS, prefix=f"encoder.layer.{layer}.", output=output,
                                     dtype=dtype, info={"model": MODEL_NAME, "layer": layer,
                                                        "checkpoint_prefix": f"encoder.layer.{layer}."})


@dataclass(frozen=True, eq=False)
class Encoder:
    """BERT's encoder queried with ``inputs_embeds`` (see the module docstring): the embeddings' sum and
    LayerNorm, then ``blocks``. Answers a vector at every position (``output`` is ``all``): the
    concatenated hidden states (``hidden="all"``, d_out = (L + 1) d) or the last one (``hidden="last"``)."""

    position: np.ndarray                 # (P, d) position_embeddings
    token_type: np.ndarray               # (d,) token_type_embeddings[0]
    ln_gamma: np.ndarray
    ln_beta: np.ndarray
    blocks: tuple
    hidden: str = "all"
    eps: float = BERT_EPS
    dtype: Any = np.float32
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.hidden not in ("all", "last"):
            raise ValueError(f"hidden must be 'all' (every layer's hidden states) or 'last', got {self.hidden!r}")
        dt = np.dtype(self.dtype).type
        if dt not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        object.__setattr__(self, "dtype", dt)
        blocks = tuple(b if b.dtype is dt else b.astype(dt) for b in self.blocks)
        if not blocks:
            raise ValueError("an encoder needs at least one block")
        d = blocks[0].d
        if any(b.d != d for b in blocks):
            raise ValueError("every block must have the same d")
        object.__setattr__(self, "blocks", blocks)
        if np.ndim(self.position) != 2 or np.shape(self.position)[1] != d:
            raise ValueError(f"position must be (P, {d}), got {np.shape(self.position)}")
        for name in ("token_type", "ln_gamma", "ln_beta"):
            if np.shape(getattr(self, name)) != (d,):
                raise ValueError(f"{name} must have shape ({d},), got {np.shape(getattr(self, name))}")
        for name in ("position", "token_type", "ln_gamma", "ln_beta"):
            object.__setattr__(self, name, read_only(getattr(self, name), dt))

    @property
    def d(self) -> int:
        return self.blocks[0].d

    @property
    def layers(self) -> int:
        return len(self.blocks)

    @property
    def max_positions(self) -> int:
        return int(self.position.shape[0])

    @property
    def output(self) -> Output:
        return Output.ALL

    @property
    def d_out(self) -> int:
        return (self.layers + 1) * self.d if self.hidden == "all" else self.d

    def with_hidden(self, hidden: str) -> "Encoder":
        return dataclasses.replace(self, hidden=hidden)

    def astype(self, dtype) -> "Encoder":
        return dataclasses.replace(self, dtype=dtype)

    def hidden_states(self, X: np.ndarray) -> list[np.ndarray]:
        """``[h_0, ..., h_L]`` for a (k, N, d) array of equal-length sequences, each (k, N, d) in ``dtype``."""
        dt = self.dtype
        X = np.asarray(X, dtype=dt)
        N = X.shape[1]
        if N > self.max_positions:
            raise InvalidQuery(f"a sequence of {N} tokens is longer than the encoder's {self.max_positions} positions")
        h = layer_norm(X + self.token_type + self.position[:N], self.ln_gamma, self.ln_beta, self.eps)
        out = [h]
        for b in self.blocks:
            h = b.trace(h)["y"]
            out.append(h)
        return out

    def forward(self, X: np.ndarray) -> np.ndarray:
        hs = self.hidden_states(X)
        y = np.concatenate(hs, axis=-1) if self.hidden == "all" else hs[-1]
        return y.astype(np.float64)

    def evaluate(self, batch):
        return evaluate_by_length(self, batch)


def random_encoder(d: int, heads: int, ffn: int, layers: int, *, positions: int = 32, seed: int = 0,
                   hidden: str = "all", dtype=np.float64, activation: str = "gelu", eps: float = BERT_EPS) -> Encoder:
    """A seeded random encoder: position embeddings ~ N(0, 0.5^2), token type ~ N(0, 0.1^2), the embeddings'
    LayerNorm as :func:`random_block` draws its own, and ``layers`` blocks ``random_block(..., seed=1000 seed + i)``
    (each with the FFN ``activation``); ``eps``: every LayerNorm's (BERT's 1e-12 by default)."""
    rng = np.random.default_rng(seed)
    blocks = tuple(random_block(d, heads, ffn, seed=1000 * seed + i, dtype=dtype, activation=activation, eps=eps)
                   for i in range(layers))
    return Encoder(position=0.5 * rng.standard_normal((positions, d)), token_type=0.1 * rng.standard_normal(d),
                   ln_gamma=1.0 + 0.1 * rng.standard_normal(d), ln_beta=0.05 * rng.standard_normal(d), blocks=blocks,
                   hidden=hidden, dtype=dtype, info={"seed": int(seed)}, eps=eps)


def minilm_encoder(hidden: str = "all", *, dtype=np.float32) -> Encoder:
    """all-MiniLM-L6-v2's encoder (embeddings' LayerNorm + 6 blocks) from the packaged weights."""
    from .minilm import MODEL_NAME, N_LAYERS
    t = _minilm_tensors()
    blocks = tuple(from_minilm(L, dtype=dtype) for L in range(N_LAYERS))
    return Encoder(position=t["embeddings.position_embeddings.weight"],
                   token_type=t["embeddings.token_type_embeddings.weight"][0],
                   ln_gamma=t["embeddings.LayerNorm.weight"], ln_beta=t["embeddings.LayerNorm.bias"],
                   blocks=blocks, hidden=hidden, dtype=dtype, info={"model": MODEL_NAME})


__all__ = ["BertBlock", "Encoder", "random_block", "random_encoder", "from_minilm", "minilm_encoder", "gelu",
           "gelu_prime", "layer_norm", "BERT_EPS"]
