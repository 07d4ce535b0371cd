"""Multi-head attention as a scalar regressor (paper, Section 7), with the biases real layers have.

    f(X) = sum_h softmax(X W_h x_N + X c_h)^T (X v_h) + beta,        h = 1..H,

for a sequence X of N >= 1 tokens x_1..x_N in R^d (the last token is the query token). Each head has
its own bilinear score matrix W_h (dense, or factored ``W_h = L_h R_h^T``), score bias c_h (or none) and
value-readout vector v_h; the output bias beta is counted once. ``H = 1`` is exactly
:class:`~headthief.models.attention.AttentionHead`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .attention import AttentionHead, as_float_array, evaluate_by_length, group_array


@dataclass(frozen=True, eq=False)
class MultiHeadAttention:
    """H attention heads read out along one vector and summed.

    Args:
        V: value-readout vectors, shape (H, d) (row h is v_h).
        W: score matrices, shape (H, d, d); or None when ``left``/``right`` are given.
        left, right: factors with ``W_h = left[h] @ right[h].T``, each (H, d, r).
        C: score biases, shape (H, d), or None.
        beta: output bias (once for the whole layer), or None.
        dtype: float64 or float32, the precision the layer computes in.
    """

    V: np.ndarray
    W: np.ndarray | None = None
    left: np.ndarray | None = None
    right: np.ndarray | None = None
    C: np.ndarray | None = None
    beta: float | None = None
    dtype: type = np.float64
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        dt = np.dtype(self.dtype)
        if dt not in (np.dtype(np.float64), np.dtype(np.float32)):
            raise ValueError(f"dtype must be float64 or float32, got {dt}")
        object.__setattr__(self, "dtype", dt.type)
        V = as_float_array(self.V, dt)
        if V.ndim != 2 or V.shape[0] < 1:
            raise ValueError(f"V must be (H, d) with H >= 1, got shape {V.shape}")
        object.__setattr__(self, "V", V)
        H, d = V.shape
        if self.W is None and (self.left is None or self.right is None):
            raise ValueError("give W, or both factors left and right")
        if self.W is not None:
            W = as_float_array(self.W, dt)
            if W.shape != (H, d, d):
                raise ValueError(f"W must be ({H}, {d}, {d}) to match V, got {W.shape}")
            object.__setattr__(self, "W", W)
        else:
            L = as_float_array(self.left, dt)
            R = as_float_array(self.right, dt)
            if L.ndim != 3 or L.shape[:2] != (H, d) or L.shape != R.shape:
                raise ValueError(f"left and right must both be ({H}, {d}, r), got {L.shape}, {R.shape}")
            object.__setattr__(self, "left", L)
            object.__setattr__(self, "right", R)
        if self.C is not None:
            C = as_float_array(self.C, dt)
            if C.shape != (H, d):
                raise ValueError(f"C must be ({H}, {d}), got {C.shape}")
            object.__setattr__(self, "C", C)
        if self.beta is not None:
            object.__setattr__(self, "beta", float(dt.type(self.beta)))

    @property
    def d(self) -> int:
        return int(self.V.shape[1])

    @property
    def heads(self) -> int:
        return int(self.V.shape[0])

    @property
    def has_bias(self) -> bool:
        return self.C is not None or self.beta is not None

    @property
    def factored(self) -> bool:
        return self.W is None

    def dense_W(self) -> np.ndarray:
        """All W_h as one dense float64 (H, d, d) array."""
        if self.W is not None:
            return self.W.astype(np.float64)
        if "W" not in self._cache:
            L, R = self.left.astype(np.float64), self.right.astype(np.float64)
            self._cache["W"] = np.einsum("hir,hjr->hij", L, R)
        return self._cache["W"]

    def head(self, h: int) -> AttentionHead:
        """Head h alone as an :class:`AttentionHead` (the output bias is left out: it is the layer's)."""
        kw = {"W": self.W[h]} if self.W is not None else {"left": self.left[h], "right": self.right[h]}
        return AttentionHead(v=self.V[h], c=None if self.C is None else self.C[h], dtype=self.dtype, **kw)

    def __call__(self, batch) -> np.ndarray:
        return self.evaluate(batch)

    def evaluate(self, batch: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
        """Evaluate a batch: a list of (N_i, d) arrays or an (n, N, d) array; float64 values (n,)."""
        return evaluate_by_length(self._evaluate_group, batch)

    def _evaluate_group(self, X: np.ndarray) -> np.ndarray:
        dt = self.dtype
        X = group_array(X, self.d, dt)
        n, N, d = X.shape
        flat = X.reshape(n * N, d)
        q = X[:, -1, :]                                            # (n, d)
        if self.W is not None:
            Wq = np.einsum("hij,nj->nhi", self.W, q)               # (n, H, d): W_h x_N
            scores = np.einsum("nkd,nhd->nhk", X, Wq)              # (n, H, N)
        else:
            H, _, r = self.left.shape
            Kx = (flat @ self.left.transpose(1, 0, 2).reshape(d, H * r)).reshape(n, N, H, r)
            Qx = (q @ self.right.transpose(1, 0, 2).reshape(d, H * r)).reshape(n, H, r)
            scores = np.einsum("nkhr,nhr->nhk", Kx, Qx)
        if self.C is not None:
            scores = scores + (flat @ self.C.T).reshape(n, N, -1).transpose(0, 2, 1)
        scores = scores - scores.max(axis=2, keepdims=True)
        w = np.exp(scores)
        w /= w.sum(axis=2, keepdims=True)
        vals = (flat @ self.V.T).reshape(n, N, -1).transpose(0, 2, 1)   # (n, H, N)
        out = (w * vals).sum(axis=(1, 2), dtype=dt)
        if self.beta is not None:
            out = out + dt(self.beta)
        return out.astype(np.float64)


def random_multihead(
    d: int,
    heads: int,
    *,
    rng: np.random.Generator | int,
    rank: int | None = None,
    bias: bool = False,
    dtype=np.float64,
    subspaces: str | None = None,
    identical: bool = False,
) -> MultiHeadAttention:
    """A seeded random multi-head target.

    Each W_h has i.i.d. entries of variance 1/d (or is ``L_h R_h^T`` with Gaussian (d, rank) factors of
    the same entry variance), each v_h standard normal; with ``bias`` each head gets ``c_h ~ N(0, I/d)``
    and the layer ``beta ~ N(0, 1/4)``.

    ``subspaces="orthogonal"`` is the paper's Assumption C.1: head h lives in the h-th block of
    ``d // heads`` coordinates of a random orthonormal basis (``W_h = P_h W_h P_h``, ``v_h`` and ``c_h``
    in that block); the basis is stored in the model's cache as ``"bases"`` (H, d, d_h).
    ``identical=True`` is Proposition 7.1's family: every head has the same W_h (and c_h).
    """
    rng = np.random.default_rng(rng)
    if d < 1 or heads < 1:
        raise ValueError(f"d and heads must be >= 1, got d={d}, heads={heads}")
    if subspaces not in (None, "orthogonal"):
        raise ValueError(f"subspaces must be 'orthogonal' or None, got {subspaces!r}")
    if subspaces and identical:
        raise ValueError("identical heads share one W: they cannot live in different orthogonal subspaces")
    if subspaces and d // heads < 1:
        raise ValueError(f"orthogonal subspaces need d >= heads, got d={d}, heads={heads}")
    dh = d // heads if subspaces else d
    if rank is not None and not 1 <= rank <= dh:
        raise ValueError(f"rank must be in 1..{dh}, got {rank}")
    H = heads
    bases = None
    if subspaces:
        Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
        bases = np.stack([Q[:, h * dh:(h + 1) * dh] for h in range(H)])          # (H, d, dh)
    kw: dict = {}
    n_draw = 1 if identical else H
    if rank is None or rank == dh:
        Wl = rng.standard_normal((n_draw, dh, dh)) / np.sqrt(dh)
        if bases is not None:
            Wl = np.einsum("hia,hab,hjb->hij", bases[:n_draw] if not identical else bases[:1], Wl,
                           bases[:n_draw] if not identical else bases[:1])
        kw["W"] = np.repeat(Wl, H, axis=0) if identical else Wl
    else:
        s = (rank * dh) ** -0.25
        L = rng.standard_normal((n_draw, dh, rank)) * s
        R = rng.standard_normal((n_draw, dh, rank)) * s
        if bases is not None:
            B = bases[:1] if identical else bases
            L, R = np.einsum("hia,har->hir", B, L), np.einsum("hia,har->hir", B, R)
        kw["left"] = np.repeat(L, H, axis=0) if identical else L
        kw["right"] = np.repeat(R, H, axis=0) if identical else R
    V = rng.standard_normal((H, dh))
    if bases is not None:
        V = np.einsum("hia,ha->hi", bases, V)
    if bias:
        C = rng.standard_normal((n_draw, dh)) / np.sqrt(dh)
        if bases is not None:
            C = np.einsum("hia,ha->hi", bases[:1] if identical else bases, C)
        kw["C"] = np.repeat(C, H, axis=0) if identical else C
        kw["beta"] = 0.5 * rng.standard_normal()
    model = MultiHeadAttention(V=V, dtype=dtype, **kw)
    if bases is not None:
        model._cache["bases"] = bases
    return model
