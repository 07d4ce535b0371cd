"""The one-layer transformer of Section 4.1: attention read at the last token, then a ReLU FFN.

Merged form (the paper's ``(W, A, w_o)``, here with H heads, optional biases and a linear skip)::

    TF(X) = w_o^T ReLU( sum_h alpha_h(X)^T X A_h + b_1 ) + b_2 + sum_h lin_h^T (alpha_h(X)^T X),
    alpha_h(X) = softmax(X W_h x_N + X c_h),

for a sequence X of N >= 1 tokens x_1..x_N in R^d (x_N is the query token). ``A_h = V_h^T W_1^T``
(d x m) merges head h's value map ``V_h`` (d x d, token -> R^d) with the FFN's first layer ``W_1``
(m x d), and ``w_o = w_2``. With one head, no biases and no ``lin`` this is exactly the paper's
``TF(X) = w_o^T ReLU(alpha(X, W)^T X A)``.

The unmerged form (:meth:`Transformer.from_unmerged`) takes ``Q_h, K_h`` (r x d), ``V_h`` (d x d),
``W_1`` (m x d), ``w_2`` (m,) and the optional ``b_1``, ``b_2``; it sets ``W_h = K_h^T Q_h``.

Two facts the extraction methods rest on:

- *one token*: ``TF([x]) = w_o^T ReLU(x^T sum_h A_h + b_1) + b_2 (+ sum_h lin_h^T x)``: the FFN alone
  (:meth:`Transformer.ffn_params`);
- *antisymmetry* (no FFN bias): negating every token leaves every softmax unchanged, so
  ``TF(X) - TF(-X) = sum_h alpha_h^T X v_h`` with ``v_h = A_h w_o (+ 2 lin_h)`` is multi-head attention
  (:meth:`Transformer.attention_part`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InvalidQuery
from .attention import AttentionHead, as_float_array, evaluate_by_length, group_array
from .multihead import MultiHeadAttention


def _arr(a, dt, shape_ok, what: str) -> np.ndarray:
    a = as_float_array(a, dt)
    if not shape_ok(a.shape):
        raise ValueError(what + f", got shape {a.shape}")
    return a


@dataclass(frozen=True, eq=False)
class Transformer:
    """A one-layer transformer as a scalar regressor (merged parameters).

    Args:
        W: score matrices, (d, d) for one head or (H, d, d).
        A: merged value-FFN maps, (d, m) for one head or (H, d, m).
        w_o: the FFN's output weights, (m,).
        b1: the FFN's hidden bias (m,), or None.
        b2: the FFN's output bias, or None.
        C: score biases, (d,) or (H, d), or None (the paper's attention has none).
        lin: a linear term on each head's attended token, (d,) or (H, d), or None (a recovered FFN
            may carry one: a flipped neuron ``w ReLU(a^T x) = w ReLU(-a^T x) + w a^T x``).
        dtype: float64 or float32, the precision the model computes in.
    """

    W: np.ndarray
    A: np.ndarray
    w_o: np.ndarray
    b1: np.ndarray | None = None
    b2: float | None = None
    C: np.ndarray | None = None
    lin: np.ndarray | None = None
    dtype: type = np.float64

    def __post_init__(self):
        dt = np.dtype(self.dtype)
        if dt not in (np.dtype(np.float64), np.dtype(np.float32)):
            raise ValueError(f"dtype must be float64 or float32, got {dt}")
        object.__setattr__(self, "dtype", dt.type)
        W = np.asarray(self.W, dtype=dt)
        if W.ndim == 2:
            W = W[None]
        W = _arr(W, dt, lambda s: len(s) == 3 and s[1] == s[2] and s[0] >= 1, "W must be (d, d) or (H, d, d)")
        H, d, _ = W.shape
        A = np.asarray(self.A, dtype=dt)
        if A.ndim == 2:
            A = A[None]
        A = _arr(A, dt, lambda s: len(s) == 3 and s[:2] == (H, d), f"A must be ({d}, m) or ({H}, {d}, m) to match W")
        m = A.shape[2]
        w_o = _arr(np.reshape(self.w_o, -1), dt, lambda s: s == (m,), f"w_o must have shape ({m},) to match A")
        object.__setattr__(self, "W", W)
        object.__setattr__(self, "A", A)
        object.__setattr__(self, "w_o", w_o)
        if self.b1 is not None:
            object.__setattr__(self, "b1", _arr(np.reshape(self.b1, -1), dt, lambda s: s == (m,),
                                                f"b1 must have shape ({m},)"))
        if self.b2 is not None:
            object.__setattr__(self, "b2", float(dt.type(self.b2)))
        for name in ("C", "lin"):
            x = getattr(self, name)
            if x is not None:
                x = np.asarray(x, dtype=dt)
                if x.ndim == 1:
                    x = x[None]
                object.__setattr__(self, name, _arr(x, dt, lambda s: s == (H, d),
                                                    f"{name} must be ({d},) or ({H}, {d})"))

    # ------------------------------------------------------------------ shapes
    @property
    def d(self) -> int:
        return int(self.W.shape[1])

    @property
    def m(self) -> int:
        return int(self.A.shape[2])

    @property
    def heads(self) -> int:
        return int(self.W.shape[0])

    @property
    def has_ffn_bias(self) -> bool:
        return self.b1 is not None or self.b2 is not None

    @property
    def has_bias(self) -> bool:
        return self.has_ffn_bias or self.C is not None

    def dense_W(self) -> np.ndarray:
        """The score matrices as float64: (d, d) for one head, (H, d, d) otherwise."""
        W = self.W.astype(np.float64)
        return W[0] if self.heads == 1 else W

    # ------------------------------------------------------------------ the parts
    def values(self) -> np.ndarray:
        """``v_h = A_h w_o (+ 2 lin_h)``: the readouts of the antisymmetric part, (H, d) float64."""
        V = np.einsum("hdm,m->hd", self.A.astype(np.float64), self.w_o.astype(np.float64))
        if self.lin is not None:
            V = V + 2.0 * self.lin.astype(np.float64)
        return V

    def attention_part(self) -> MultiHeadAttention:
        """The multi-head attention layer that ``TF(X) - TF(-X)`` equals when the FFN has no bias."""
        C = None if self.C is None else self.C.astype(np.float64)
        return MultiHeadAttention(V=self.values(), W=self.W.astype(np.float64), C=C)

    def attention_head(self) -> AttentionHead:
        """One head: the :class:`AttentionHead` ``(W, v = A w_o, c)`` of the antisymmetric part."""
        if self.heads != 1:
            raise ValueError(f"attention_head is for one head; this transformer has {self.heads}")
        return AttentionHead(v=self.values()[0], W=self.W[0].astype(np.float64),
                             c=None if self.C is None else self.C[0].astype(np.float64))

    def ffn_params(self) -> dict:
        """What one-token queries see: ``x -> w_o^T ReLU(A^T x + b1) + b2 + lin^T x`` with ``A = sum_h A_h``."""
        return {"A": self.A.astype(np.float64).sum(axis=0), "w": self.w_o.astype(np.float64),
                "b1": None if self.b1 is None else self.b1.astype(np.float64), "b2": self.b2,
                "linear": None if self.lin is None else self.lin.astype(np.float64).sum(axis=0)}

    def ffn(self, Z: np.ndarray) -> np.ndarray:
        """The FFN on attended tokens: ``Z`` (n, d) -> (n,) float64 (one head's view: ``A = sum_h A_h``)."""
        Z = np.asarray(Z, dtype=self.dtype)
        if Z.ndim != 2 or Z.shape[1] != self.d:
            raise InvalidQuery(f"FFN points must be (n, {self.d}), got shape {Z.shape}")
        return self.evaluate(Z[:, None, :])

    # ------------------------------------------------------------------ evaluation
    def __call__(self, batch) -> np.ndarray:
        return self.evaluate(batch)

    def evaluate(self, batch: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
        """Evaluate a batch: a list of (N_i, d) arrays or an (n, N, d) array; float64 values (n,)."""
        return evaluate_by_length(self._evaluate_group, batch)

    def _evaluate_group(self, X: np.ndarray) -> np.ndarray:
        dt = self.dtype
        X = group_array(X, self.d, dt)
        n, N, d = X.shape
        q = X[:, -1, :]
        Wq = np.einsum("hij,nj->nhi", self.W, q)                  # (n, H, d): W_h x_N
        scores = np.einsum("nkd,nhd->nhk", X, Wq)                 # (n, H, N)
        if self.C is not None:
            scores = scores + np.einsum("nkd,hd->nhk", X, self.C)
        scores = scores - scores.max(axis=2, keepdims=True)
        a = np.exp(scores)
        a /= a.sum(axis=2, keepdims=True)
        att = np.einsum("nhk,nkd->nhd", a, X)                    # (n, H, d): each head's attended token
        pre = np.einsum("nhd,hdm->nm", att, self.A)              # (n, m)
        if self.b1 is not None:
            pre = pre + self.b1
        out = np.maximum(pre, dt(0)) @ self.w_o
        if self.b2 is not None:
            out = out + dt(self.b2)
        if self.lin is not None:
            out = out + np.einsum("nhd,hd->n", att, self.lin)
        return np.asarray(out, dtype=dt).astype(np.float64)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_unmerged(cls, Q, K, V, W1, w2, *, b1=None, b2=None, dtype=np.float64) -> "Transformer":
        """From ``Q_h, K_h`` (r x d, or (H, r, d)), ``V_h`` (d x d, or (H, d, d)), ``W_1`` (m x d), ``w_2``:
        ``W_h = K_h^T Q_h`` and ``A_h = V_h^T W_1^T`` (paper, Section 4.1)."""
        Q, K, V = (np.asarray(x, dtype=np.float64) for x in (Q, K, V))
        if Q.ndim == 2:
            Q, K, V = Q[None], K[None], V[None]
        if Q.shape != K.shape or Q.ndim != 3 or V.ndim != 3 or V.shape[0] != Q.shape[0] \
                or V.shape[1] != V.shape[2] or V.shape[2] != Q.shape[2]:
            raise ValueError(f"Q and K must be (H, r, d) and V (H, d, d); got {Q.shape}, {K.shape}, {V.shape}")
        W1 = np.asarray(W1, dtype=np.float64)
        if W1.ndim != 2 or W1.shape[1] != Q.shape[2]:
            raise ValueError(f"W_1 must be (m, {Q.shape[2]}), got {W1.shape}")
        W = np.einsum("hrd,hre->hde", K, Q)
        A = np.einsum("hed,me->hdm", V, W1)
        return cls(W=W, A=A, w_o=w2, b1=b1, b2=b2, dtype=dtype)


def random_transformer(d: int, m: int, rng: np.random.Generator | int, *, bias: bool = False, heads: int = 1,
                       dtype=np.float64) -> Transformer:
    """A seeded random one-layer transformer.

    ``Q_h, K_h`` are (d, d) Gaussian with entries of variance 1/d (so W_h = K_h^T Q_h has entries of
    variance about 1/d, like :func:`~headthief.models.attention.random_head`), ``V_h`` Gaussian with
    variance 1/d, ``W_1`` Gaussian (m, d) with variance 1/d, ``w_2`` standard normal. With ``bias`` the
    FFN gets ``b_1 ~ N(0, I/4)`` and ``b_2 ~ N(0, 1/4)`` (the attention keeps the paper's form).
    """
    rng = np.random.default_rng(rng)
    if int(d) < 1 or int(m) < 1 or int(heads) < 1:
        raise ValueError(f"d, m and heads must be >= 1, got d={d}, m={m}, heads={heads}")
    d, m, H = int(d), int(m), int(heads)
    s = 1.0 / np.sqrt(d)
    Q = rng.standard_normal((H, d, d)) * s
    K = rng.standard_normal((H, d, d)) * s
    V = rng.standard_normal((H, d, d)) * s
    W1 = rng.standard_normal((m, d)) * s
    w2 = rng.standard_normal(m)
    b1 = b2 = None
    if bias:
        b1 = 0.5 * rng.standard_normal(m)
        b2 = 0.5 * rng.standard_normal()
    # K^T Q with (d, d) Gaussian factors of variance 1/d has entries of variance 1/d
    return Transformer.from_unmerged(Q, K, V, W1, w2, b1=b1, b2=b2, dtype=dtype)


__all__ = ["Transformer", "random_transformer"]
