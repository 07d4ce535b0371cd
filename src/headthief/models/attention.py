"""The single-head attention regressor of Section 3, with the two biases real heads have.

    f(X) = softmax(s)^T (X v) + beta,     s_i = x_i^T W x_N + c^T x_i,

for a sequence X of N >= 1 tokens x_1..x_N in R^d (the last token is the query token). With
``c = 0`` and ``beta = 0`` this is exactly the paper's ``f_{W,v}``. A real head's query/key biases
reduce to ``c`` (the terms that depend only on x_N cancel in the softmax) and its value/output biases
reduce to ``beta`` (the attention weights sum to one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import InvalidQuery


def as_float_array(a, dtype) -> np.ndarray:
    """``a`` as a C-contiguous array of ``dtype`` (the models' parameter storage)."""
    return np.ascontiguousarray(np.asarray(a, dtype=dtype))


@dataclass(frozen=True, eq=False)
class AttentionHead:
    """A single attention head as a scalar regressor.

    Args:
        v: value-readout vector, shape (d,).
        W: bilinear score matrix, shape (d, d); or None when ``left``/``right`` are given.
        left, right: factors with ``W = left @ right.T`` (each (d, r)); a d = 4096, rank-128 head
            stays cheap to store and to evaluate (O(d r) per token instead of O(d^2)).
        c: score bias, shape (d,), or None (the paper's model).
        beta: output bias, or None.
        dtype: the precision the head computes in (float64 or float32).
    """

    v: np.ndarray
    W: np.ndarray | None = None
    left: np.ndarray | None = None
    right: np.ndarray | None = None
    c: np.ndarray | None = None
    beta: float | None = None
    dtype: type = np.float64
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        dt = np.dtype(self.dtype)
        if dt not in (np.dtype(np.float64), np.dtype(np.float32)):
            raise ValueError(f"dtype must be float64 or float32, got {dt}")
        object.__setattr__(self, "dtype", dt.type)
        v = as_float_array(self.v, dt).reshape(-1)
        object.__setattr__(self, "v", v)
        d = v.shape[0]
        if self.W is None and (self.left is None or self.right is None):
            raise ValueError("give W, or both factors left and right")
        if self.W is not None:
            W = as_float_array(self.W, dt)
            if W.shape != (d, d):
                raise ValueError(f"W must be ({d}, {d}) to match v, got {W.shape}")
            object.__setattr__(self, "W", W)
        else:
            L, R = as_float_array(self.left, dt), as_float_array(self.right, dt)
            if L.ndim != 2 or L.shape[0] != d or L.shape != R.shape:
                raise ValueError(f"left and right must both be ({d}, r), got {L.shape}, {R.shape}")
            object.__setattr__(self, "left", L)
            object.__setattr__(self, "right", R)
        if self.c is not None:
            c = as_float_array(self.c, dt).reshape(-1)
            if c.shape != (d,):
                raise ValueError(f"c must have shape ({d},), got {c.shape}")
            object.__setattr__(self, "c", c)
        if self.beta is not None:
            object.__setattr__(self, "beta", float(dt.type(self.beta)))

    @property
    def d(self) -> int:
        return int(self.v.shape[0])

    @property
    def has_bias(self) -> bool:
        return self.c is not None or self.beta is not None

    @property
    def factored(self) -> bool:
        return self.W is None

    def dense_W(self) -> np.ndarray:
        """W as a dense float64 (d, d) array."""
        if self.W is not None:
            return self.W.astype(np.float64)
        if "W" not in self._cache:
            self._cache["W"] = self.left.astype(np.float64) @ self.right.astype(np.float64).T
        return self._cache["W"]

    @property
    def rank(self) -> int:
        if self.W is None:
            return int(np.linalg.matrix_rank(self.left.astype(np.float64) @ self.right.astype(np.float64).T))
        return int(np.linalg.matrix_rank(self.W.astype(np.float64)))

    def __call__(self, batch) -> np.ndarray:
        return self.evaluate(batch)

    def evaluate(self, batch: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
        """Evaluate a batch: a list of (N_i, d) arrays (any lengths N_i >= 1) or an (n, N, d) array.

        Sequences are grouped by length and each group is evaluated in one vectorised pass with a
        max-shifted (numerically stable) softmax. Returns float64 values of shape (n,).
        """
        return evaluate_by_length(self._evaluate_group, batch)

    def _evaluate_group(self, X: np.ndarray) -> np.ndarray:
        dt = self.dtype
        X = group_array(X, self.d, dt)
        n, N, d = X.shape
        q = X[:, -1, :]
        if self.W is not None:
            Wq = q @ self.W.T                                   # (n, d): W x_N for each sequence
            scores = np.einsum("nid,nd->ni", X, Wq)             # (n, N): x_i^T W x_N
        else:
            # one flat GEMM: a batched matmul over n small (N x d) blocks is ~3x slower
            Kx = (X.reshape(n * N, d) @ self.left).reshape(n, N, -1)   # (n, N, r)
            Qx = q @ self.right                                 # (n, r)
            scores = np.einsum("nir,nr->ni", Kx, Qx)
        if self.c is not None:
            scores = scores + (X.reshape(n * N, d) @ self.c).reshape(n, N)
        scores = scores - scores.max(axis=1, keepdims=True)
        w = np.exp(scores)
        w /= w.sum(axis=1, keepdims=True)
        vals = (X.reshape(n * N, d) @ self.v).reshape(n, N)     # (n, N)
        out = (w * vals).sum(axis=1, dtype=dt)
        if self.beta is not None:
            out = out + dt(self.beta)
        return out.astype(np.float64)


def group_array(X, d: int, dtype) -> np.ndarray:
    """One group of equal-length sequences as an (n, N, d) array of ``dtype``, checked."""
    X = np.asarray(X, dtype=dtype)
    n, N, dd = X.shape
    if dd != d:
        raise InvalidQuery(f"tokens must have dimension {d}, got {dd}")
    if N < 1:
        raise InvalidQuery("every sequence needs at least one token")
    return X


def evaluate_by_length(evaluate_group, batch: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """Evaluate a batch with ``evaluate_group((n, N, d) array) -> (n,)``: an array in one pass, a list of
    sequences grouped by length (one vectorised pass per length). Returns float64 values of shape (n,)."""
    if isinstance(batch, np.ndarray):
        if batch.ndim != 3:
            raise InvalidQuery(f"a batch array must be (n, N, d), got shape {batch.shape}")
        return evaluate_group(batch)
    out = np.empty(len(batch), dtype=np.float64)
    groups: dict[int, list[int]] = {}
    for i, X in enumerate(batch):
        groups.setdefault(np.shape(X)[0], []).append(i)
    for idx in groups.values():
        out[idx] = evaluate_group(np.stack([batch[i] for i in idx]))
    return out


def random_head(
    d: int,
    *,
    rng: np.random.Generator | int,
    rank: int | None = None,
    sparse_v: float = 0.0,
    v_zero: bool = False,
    bias: bool = False,
    dtype=np.float64,
    W_norm: float | None = None,
    v_norm: float | None = None,
    v_min: float | None = None,
) -> AttentionHead:
    """A seeded random target.

    W has i.i.d. entries of variance 1/d (full rank) or is a product ``left @ right.T`` of two
    Gaussian (d, rank) factors scaled to the same entry variance (stored as factors). v has standard
    normal entries, of which ``floor(sparse_v * d)`` are set exactly to zero (at least one stays
    non-zero); ``v_zero`` makes v = 0. With ``bias`` the head gets ``c ~ N(0, I/d)`` and
    ``beta ~ N(0, 1/4)``.

    Norm settings (Section 6's assumptions; the random draws are the same, only rescaled): ``W_norm``
    rescales W to that Frobenius norm; ``v_min`` gives every non-zero entry of v a magnitude of at least
    ``v_min`` (magnitudes ``v_min + s |g_i|``, signs kept) and ``v_norm`` rescales v to that 2-norm (with
    both, ``s`` is chosen so that ``||v|| = v_norm``; that needs ``v_min * sqrt(nnz) <= v_norm``).
    """
    rng = np.random.default_rng(rng)
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    if rank is not None and not 1 <= rank <= d:
        raise ValueError(f"rank must be in 1..{d}, got {rank}")
    if not 0.0 <= sparse_v < 1.0:
        raise ValueError(f"sparse_v must be in [0, 1), got {sparse_v}")
    kw: dict = {}
    if rank is None or rank == d:
        kw["W"] = rng.standard_normal((d, d)) / np.sqrt(d)
    else:
        s = (rank * d) ** -0.25
        kw["left"] = rng.standard_normal((d, rank)) * s
        kw["right"] = rng.standard_normal((d, rank)) * s
    v = rng.standard_normal(d)
    if v_zero:
        v[:] = 0.0
    elif sparse_v > 0:
        k = min(int(np.floor(sparse_v * d)), d - 1)
        v[rng.choice(d, size=k, replace=False)] = 0.0
    if bias:
        kw["c"] = rng.standard_normal(d) / np.sqrt(d)
        kw["beta"] = 0.5 * rng.standard_normal()
    if W_norm is not None:
        _rescale_W(kw, W_norm)
    if v_min is not None or v_norm is not None:
        v = _shape_v(v, v_norm, v_min)
    return AttentionHead(v=v, dtype=dtype, **kw)


def _rescale_W(kw: dict, W_norm: float) -> None:
    if not (np.isfinite(W_norm) and W_norm >= 0):
        raise ValueError(f"W_norm must be a finite number >= 0, got {W_norm}")
    if "W" in kw:
        kw["W"] = kw["W"] * (W_norm / np.linalg.norm(kw["W"]))
    else:
        f = np.sqrt(W_norm / np.linalg.norm(kw["left"] @ kw["right"].T))
        kw["left"], kw["right"] = kw["left"] * f, kw["right"] * f


def _shape_v(v: np.ndarray, v_norm: float | None, v_min: float | None) -> np.ndarray:
    nz = v != 0
    if not nz.any():
        return v
    g = np.abs(v[nz])
    if v_min is not None:
        if not (np.isfinite(v_min) and v_min >= 0):
            raise ValueError(f"v_min must be a finite number >= 0, got {v_min}")
        n = int(nz.sum())
        if v_norm is None:
            mag = v_min + g
        else:
            if v_min * np.sqrt(n) > v_norm:
                raise ValueError(f"v_min = {v_min:g} with {n} non-zero entries needs v_norm >= "
                                 f"{v_min * np.sqrt(n):g}, got v_norm = {v_norm:g}")
            # ||v_min + s g||^2 = v_norm^2: a quadratic in s >= 0
            A, B, C = g @ g, 2 * v_min * g.sum(), n * v_min ** 2 - v_norm ** 2
            s = (-B + np.sqrt(B * B - 4 * A * C)) / (2 * A)
            mag = v_min + s * g
        v = v.copy()
        v[nz] = np.sign(v[nz]) * mag
    elif v_norm is not None:
        if not (np.isfinite(v_norm) and v_norm >= 0):
            raise ValueError(f"v_norm must be a finite number >= 0, got {v_norm}")
        v = v * (v_norm / np.linalg.norm(v))
    return v
