"""Two-layer ReLU feed-forward networks on one token (the FFN of Section 4.1), and their symmetries.

    FFN(x) = w^T ReLU(A^T x + b1) + b2 + linear^T x,     x in R^d, A (d, m).

The paper's FFN has no biases (``b1 = b2 = None``, ``linear = None``): ``w_o^T ReLU(A^T x)``. ``linear``
is not part of any architecture: it is the extra linear term of the canonical form a learner returns
when it cannot tell which way each neuron faces (``w ReLU(a^T x) = w ReLU(-a^T x) + w a^T x``), and it
costs two neurons (``l^T x = ReLU(l^T x) - ReLU(-l^T x)``).

The network is identifiable only up to permuting the neurons, rescaling a neuron by ``t > 0``
(``a, b -> t a, t b`` and ``w -> w / t``), and, with a linear term, flipping a neuron. :func:`canonical`
fixes the first two (every ``|a_i| = 1``, neurons sorted); :func:`compare_ffn` measures two networks
against each other up to all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InvalidQuery


@dataclass(frozen=True, eq=False)
class ReLUFFN:
    """``w^T ReLU(A^T x + b1) + b2 (+ linear^T x)``.

    Args:
        A: (d, m); column i holds neuron i's input weights a_i.
        w: (m,) output weights.
        b1: (m,) hidden biases, or None.
        b2: output bias, or None.
        linear: (d,) an extra linear term (the canonical form of unresolved flips), or None.
        dtype: the precision it computes in (float64 or float32).
    """

    A: np.ndarray
    w: np.ndarray
    b1: np.ndarray | None = None
    b2: float | None = None
    linear: np.ndarray | None = None
    dtype: type = np.float64

    def __post_init__(self):
        dt = np.dtype(self.dtype)
        if dt not in (np.dtype(np.float64), np.dtype(np.float32)):
            raise ValueError(f"dtype must be float64 or float32, got {dt}")
        object.__setattr__(self, "dtype", dt.type)
        A = np.array(self.A, dtype=dt, ndmin=2)
        if A.ndim != 2:
            raise ValueError(f"A must be (d, m), got shape {A.shape}")
        d, m = A.shape
        w = np.array(self.w, dtype=dt).reshape(-1)
        if w.shape != (m,):
            raise ValueError(f"w must have shape ({m},) to match A {A.shape}, got {w.shape}")
        for name, arr in (("A", A), ("w", w)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        if self.b1 is not None:
            b1 = np.array(self.b1, dtype=dt).reshape(-1)
            if b1.shape != (m,):
                raise ValueError(f"b1 must have shape ({m},), got {b1.shape}")
            b1.setflags(write=False)
            object.__setattr__(self, "b1", b1)
        if self.b2 is not None:
            object.__setattr__(self, "b2", float(dt.type(self.b2)))
        if self.linear is not None:
            lin = np.array(self.linear, dtype=dt).reshape(-1)
            if lin.shape != (d,):
                raise ValueError(f"linear must have shape ({d},), got {lin.shape}")
            lin.setflags(write=False)
            object.__setattr__(self, "linear", lin)

    @property
    def d(self) -> int:
        return int(self.A.shape[0])

    @property
    def m(self) -> int:
        """Hidden neurons (the linear term, when present, is not counted; see :attr:`neurons`)."""
        return int(self.A.shape[1])

    @property
    def neurons(self) -> int:
        """ReLU units needed to write this network: m, plus 2 for a non-zero linear term."""
        return self.m + (2 if self.linear is not None and np.any(self.linear != 0) else 0)

    @property
    def has_bias(self) -> bool:
        return self.b1 is not None or self.b2 is not None

    def __repr__(self) -> str:
        return (f"ReLUFFN(d={self.d}, m={self.m}, bias={self.has_bias}, linear={self.linear is not None}, "
                f"dtype={np.dtype(self.dtype).name})")

    def __call__(self, Z) -> np.ndarray:
        """Values at (n, d) points (a single (d,) point gives shape (1,)); float64."""
        dt = self.dtype
        Z = np.asarray(Z, dtype=dt)
        if Z.ndim == 1:
            Z = Z[None, :]
        if Z.ndim != 2 or Z.shape[1] != self.d:
            raise InvalidQuery(f"points must be (n, {self.d}), got shape {Z.shape}")
        H = Z @ self.A
        if self.b1 is not None:
            H = H + self.b1
        out = np.maximum(H, dt(0)) @ self.w
        if self.b2 is not None:
            out = out + dt(self.b2)
        if self.linear is not None:
            out = out + Z @ self.linear
        return np.asarray(out, dtype=np.float64)

    def evaluate(self, batch: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
        """Oracle view: one-token sequences only (an (n, 1, d) array or a list of (1, d) arrays)."""
        if isinstance(batch, np.ndarray):
            if batch.ndim != 3 or batch.shape[1] != 1:
                raise InvalidQuery(f"the FFN answers one-token queries only: an (n, 1, d) batch, got shape "
                                   f"{batch.shape}")
            return self(batch[:, 0, :])
        rows = []
        for i, X in enumerate(batch):
            X = np.asarray(X)
            if X.ndim != 2 or X.shape[0] != 1:
                raise InvalidQuery(f"the FFN answers one-token queries only: query {i} has shape {X.shape}")
            rows.append(X[0])
        return self(np.array(rows).reshape(len(rows), self.d)) if rows else np.zeros(0)

    def neuron_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """``(w_i a_i)`` as a (d, m) array and ``(w_i b_i)`` (zeros without b1): what a neuron's gradient
        jump shows, invariant under positive rescaling."""
        A = self.A.astype(np.float64)
        w = self.w.astype(np.float64)
        b = self.b1.astype(np.float64) if self.b1 is not None else np.zeros(self.m)
        return A * w, b * w


def random_ffn(d: int, m: int, rng: np.random.Generator | int, *, bias: bool = False, dtype=np.float64,
               sparse: float = 0.0) -> ReLUFFN:
    """A seeded random FFN: ``A ~ N(0, 1/d)``, ``w ~ N(0, 1/m)``; with ``bias``, ``b1 ~ N(0, 1/4)`` and
    ``b2 ~ N(0, 1/4)``.

    ``sparse`` (in [0, 1]): that share of the neurons is made hard to see. With biases they are rarely
    active: the bias puts their hyperplane at distance 3 (in units of the typical ``|a_i^T x|`` on
    Gaussian inputs), so they fire on about 0.1 % of Gaussian inputs, the neurons a public reference
    attack silently missed. Without biases every neuron fires on half of the space, so they get output
    weights 1e-3 times smaller instead (small kinks).
    """
    rng = np.random.default_rng(rng)
    if d < 1 or m < 1:
        raise ValueError(f"d and m must be >= 1, got d={d}, m={m}")
    if not 0.0 <= sparse <= 1.0:
        raise ValueError(f"sparse must be in [0, 1], got {sparse}")
    A = rng.standard_normal((d, m)) / np.sqrt(d)
    w = rng.standard_normal(m) / np.sqrt(m)
    b1 = 0.5 * rng.standard_normal(m) if bias else None
    b2 = 0.5 * float(rng.standard_normal()) if bias else None
    k = int(round(sparse * m))
    if k:
        idx = rng.choice(m, size=k, replace=False)
        if bias:
            # a_i^T x ~ N(0, |a_i|^2) on x ~ N(0, I): bias -3 |a_i| leaves it active on ~0.13 % of inputs
            b1[idx] = -3.0 * np.linalg.norm(A[:, idx], axis=0)
        else:
            w[idx] *= 1e-3
    return ReLUFFN(A=A, w=w, b1=b1, b2=b2, dtype=dtype)


def canonical(ffn: ReLUFFN) -> ReLUFFN:
    """The canonical form: every ``|a_i| = 1`` (``w_i`` and ``b_i`` scaled by ``|a_i|``), neurons with
    ``w_i a_i = 0`` dropped, the rest sorted by ``(a_i[0], a_i[1], ...)``. Function unchanged (float64)."""
    A = ffn.A.astype(np.float64)
    w = ffn.w.astype(np.float64)
    b = ffn.b1.astype(np.float64) if ffn.b1 is not None else None
    norms = np.linalg.norm(A, axis=0)
    keep = (norms > 0) & (w != 0)
    A, w, norms = A[:, keep], w[keep], norms[keep]
    An = A / norms
    wn = w * norms
    bn = b[keep] / norms if b is not None else None
    order = np.lexsort(An[::-1]) if An.shape[1] else np.zeros(0, dtype=int)
    return ReLUFFN(A=An[:, order], w=wn[order], b1=bn[order] if bn is not None else None, b2=ffn.b2,
                   linear=None if ffn.linear is None else ffn.linear.astype(np.float64))


def _neuron_keys(ffn: ReLUFFN) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unit hyperplane normals (in R^{d+1} with the bias), their w_i |(a_i, b_i)|, and w_i a_i."""
    A = ffn.A.astype(np.float64)
    b = ffn.b1.astype(np.float64) if ffn.b1 is not None else np.zeros(ffn.m)
    H = np.vstack([A, b[None, :]])
    n = np.linalg.norm(H, axis=0)
    n = np.where(n > 0, n, 1.0)
    return H / n, ffn.w.astype(np.float64) * n, A * ffn.w.astype(np.float64)


def compare_ffn(est: ReLUFFN, truth: ReLUFFN, *, n: int = 2000, rng: np.random.Generator | int = 0) -> dict:
    """Compare two FFNs up to permutation, positive rescaling and flips.

    Neurons are matched on their hyperplanes (unit normals of ``(a_i, b_i)``, up to sign) by an optimal
    assignment. Returns:

    - ``neurons_est``, ``neurons_true``: hidden neurons of each (``est.neurons`` counts a linear term as 2);
    - ``matched``: pairs whose hyperplanes agree to 1e-6;
    - ``flips``: matched pairs that face opposite ways (the estimate moved their mass into the linear term);
    - ``neuron_rel_err``: the largest ``|| w^ a^ - (+-) w a || / || w a ||`` over matched pairs, the sign
      being the pair's orientation (``b`` is compared the same way with biases, in ``bias_rel_err``);
    - ``function_rel_err``: the largest |difference| on ``n`` Gaussian points over the RMS of the truth.
    """
    from scipy.optimize import linear_sum_assignment
    if est.d != truth.d:
        raise ValueError(f"dimensions differ: {est.d} vs {truth.d}")
    He, ge, _ = _neuron_keys(est)
    Ht, gt, _ = _neuron_keys(truth)
    out: dict = {"neurons_est": est.neurons, "neurons_true": truth.neurons}
    if est.m and truth.m:
        C = 1.0 - np.abs(He.T @ Ht)          # 0 when the hyperplanes agree (either orientation)
        r, c = linear_sum_assignment(C)
        good = C[r, c] < 1e-6
        r, c = r[good], c[good]
        sgn = np.sign(np.sum(He[:, r] * Ht[:, c], axis=0))
        out["matched"] = int(good.sum())
        out["flips"] = int(np.sum(sgn < 0))
        we = est.w.astype(np.float64)[r]
        wt = truth.w.astype(np.float64)[c]
        ae = est.A.astype(np.float64)[:, r] * we
        at = truth.A.astype(np.float64)[:, c] * wt
        den = np.maximum(np.linalg.norm(at, axis=0), 1e-300)
        errs = np.linalg.norm(ae - sgn * at, axis=0) / den
        out["neuron_rel_err"] = float(errs.max()) if errs.size else None
        if est.b1 is not None and truth.b1 is not None:
            be = est.b1.astype(np.float64)[r] * we
            bt = truth.b1.astype(np.float64)[c] * wt
            out["bias_rel_err"] = float(np.max(np.abs(be - sgn * bt) / den)) if errs.size else None
    else:
        out.update(matched=0, flips=0, neuron_rel_err=None)
    g = np.random.default_rng(rng)
    Z = g.standard_normal((n, est.d))
    yt = truth(Z)
    ye = est(Z)
    rms = float(np.sqrt(np.mean(yt ** 2)))
    out["function_rel_err"] = float(np.max(np.abs(ye - yt)) / max(rms, 1e-300))
    return out
