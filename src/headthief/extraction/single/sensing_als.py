"""Alternating least squares for rank-one-projection (ROP) sensing: a scalable solver for Theorem 5.1.

The measurements are ``t_k = a_k^T W b_k`` (k = 1..m) for a rank-r W. Write ``W = U V^T`` (U, V d x r):

* Spectral start: the top-r SVD of ``M0 = (1/m) sum_k t_k a_k b_k^T``; for standard Gaussian a, b its
  expectation is W.
* Each half-step solves the linear least-squares problem in one factor with the other fixed,
  ``min_U sum_k (a_k^T U c_k - t_k)^2`` with ``c_k = V^T b_k``, by conjugate gradients on the normal
  equations, preconditioned by ``(sum_k c_k c_k^T)^{-1}`` (their expectation over Gaussian a) and
  warm-started at the current factor, and stopped early (inexact half-steps: a residual reduction
  of ``inner_tol``); matrix-free, two products with an (m, d) matrix per CG step.
* The factors are rebalanced (equal singular values) after every sweep.

Stopping (every loop is bounded): the relative residual ``||A(U V^T) - t|| / ||t||`` falls to ``tol``
(``converged``), or stops decreasing (less than a factor 2 over ``patience`` sweeps) while below
``stall_tol`` (``noise floor``: measurements from a float32 or noisy oracle). A start that stalls
above ``stall_tol`` (at small d the spectral start is sometimes poor and ALS settles in a spurious
fit) is followed by up to ``restarts`` random starts. Hitting ``max_iter`` sweeps in all, or
stalling on every start (too few measurements, or a wrong rank), raises
:class:`~headthief.errors.ConvergenceError`.

Measured (exact float64 measurements): about 180 sweeps from 1.5 x the r(2d - r) degrees of freedom
(d = 150, r = 4 and d = 400, r = 8; 4.5 s at d = 400 on 2 cores), about 40 from 3 x (d = 150).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ConvergenceError
from ...linalg import pinv, svd


STALL_TOL = 1e-5
"""Default ``stall_tol``: the floor accepted for float64 answers (noisy float64 oracles)."""


def als_stall_tol(unit_roundoff: float) -> float:
    """The ``stall_tol`` for measurements read from answers with this unit roundoff: ``max(STALL_TOL, sqrt(u))``.

    ``sqrt(u)`` relative is what the rank tests read as the noise of rank-one measurements (a singular
    value below ``sqrt(u) sigma_1`` is noise, see :mod:`.rop` and :mod:`.lowrank`), so a residual below
    it is what the answers' rounding explains: 2.4e-4 for float32 answers. A float32 measurement is a
    logit inverted from an answer rounded to 6e-8 relative, amplified by ``1 / (alpha (1 - alpha))``
    and by the cancellation of the known part of the answer; measured (d = 32, r = 2, 20 targets), the
    true W leaves residuals of 1.4e-6 to 9e-5 on its own measurements, and ALS stops improving a little
    below the true W's residual, as a least-squares fit does. A spurious ALS fit (a wrong basin) is far
    above it: measured on exact measurements from 1.5x the degrees of freedom, every stalled start was
    at 0.11 or more (d = 8..32, r = 1..3). The factor between the two, over 400, is the margin. For
    float64 answers ``sqrt(u) = 1e-8`` is below :data:`STALL_TOL`, which is kept (bit-for-bit runs).
    """
    return max(STALL_TOL, float(np.sqrt(unit_roundoff)))


@dataclass(frozen=True)
class ALSResult:
    """What :func:`solve_als` found: ``W = U @ V.T``, the sweeps it took and why it stopped."""

    U: np.ndarray
    V: np.ndarray
    iterations: int
    residual: float
    reason: str
    cg_steps: int
    spectral_residual: float



def as_measurements(A, B, t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank-one measurements ``t_k = a_k^T W b_k`` as float64 arrays, shapes checked: A, B (m, d), t (m,)."""
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    t = np.asarray(t, dtype=np.float64)
    if A.ndim != 2 or B.shape != A.shape or t.shape != (A.shape[0],):
        raise ValueError(f"A, B must be (m, d) and t (m,), got {A.shape}, {B.shape}, {t.shape}")
    return A, B, t

def _rowdot(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", X, Y)


def _half_step(A: np.ndarray, C: np.ndarray, t: np.ndarray, X0: np.ndarray, AX0: np.ndarray,
               rel_tol: float, max_inner: int) -> tuple[np.ndarray, np.ndarray, int]:
    """min_X sum_k (a_k^T X c_k - t_k)^2 by preconditioned CG from X0 (``AX0 = A @ X0``).

    Returns ``(X, A @ X, CG steps)``; ``A @ X`` is updated along the way, so a step costs two
    products with A (``A @ D`` and ``A.T @ ...``).
    """
    G = C.T @ C
    try:
        P = np.linalg.inv(G)
    except np.linalg.LinAlgError:
        P = pinv(G)
    X, AX = X0.copy(), AX0.copy()
    R = A.T @ ((t - _rowdot(AX, C))[:, None] * C)
    Z = R @ P
    D = Z.copy()
    rz = float(np.sum(R * Z))
    stop = rel_tol * np.sqrt(abs(rz))
    steps = 0
    while steps < max_inner and np.sqrt(abs(rz)) > stop and rz != 0.0:
        AD = A @ D
        HD = A.T @ (_rowdot(AD, C)[:, None] * C)
        den = float(np.sum(D * HD))
        if den <= 0.0:
            break
        alpha = rz / den
        X += alpha * D
        AX += alpha * AD
        R -= alpha * HD
        Z = R @ P
        rz_new = float(np.sum(R * Z))
        D = Z + (rz_new / rz) * D
        rz = rz_new
        steps += 1
    return X, AX, steps


def _balance(U: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """r x r maps ``(Mu, Mv)`` with ``(U Mu)(V Mv)^T = U V^T`` and equal singular values in both
    factors (keeps the half-steps well conditioned)."""
    _, Ru = np.linalg.qr(U)
    _, Rv = np.linalg.qr(V)
    X, s, Yt = svd(Ru @ Rv.T)
    rs = np.sqrt(s)
    try:
        Mu = np.linalg.solve(Ru, X * rs)
        Mv = np.linalg.solve(Rv, Yt.T * rs)
    except np.linalg.LinAlgError:
        return np.eye(U.shape[1]), np.eye(V.shape[1])
    return Mu, Mv


def spectral_start(A: np.ndarray, B: np.ndarray, t: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Factors of the top-``rank`` SVD of ``(1/m) sum_k t_k a_k b_k^T``."""
    m = A.shape[0]
    M0 = A.T @ (t[:, None] * B) / m
    Us, s, Vt = svd(M0)
    rs = np.sqrt(s[:rank])
    return Us[:, :rank] * rs, Vt[:rank].T * rs


def solve_als(
    A: np.ndarray,
    B: np.ndarray,
    t: np.ndarray,
    rank: int,
    *,
    max_iter: int = 2000,
    tol: float = 1e-12,
    stall_tol: float = STALL_TOL,
    patience: int = 25,
    inner_tol: float = 0.5,
    max_inner: int = 200,
    restarts: int = 3,
    rng: np.random.Generator | int = 0,
    start: tuple[np.ndarray, np.ndarray] | None = None,
) -> ALSResult:
    """Find a rank-``rank`` W with ``a_k^T W b_k = t_k`` (rows a_k of A, b_k of B).

    Args:
        A, B: (m, d) probe matrices (standard Gaussian rows for the spectral start to be right).
        t: (m,) measurements.
        rank: the rank r of the factors.
        max_iter: cap on ALS sweeps (each sweep updates U, then V), over all starts.
        tol: relative residual at which the fit counts as exact.
        stall_tol: a residual that stops decreasing below this is accepted as the noise floor.
        patience: sweeps over which the residual must halve to count as still decreasing.
        inner_tol: relative tolerance of each CG solve (inexact half-steps).
        max_inner: cap on CG steps per half-step.
        restarts: a start that stalls above ``stall_tol`` (a poor spectral start at small d) is
            followed by up to this many random starts.
        rng: generator (or seed) of the random restarts.
        start: factors ``(U, V)`` (d x rank each) to start from instead of the spectral start (a warm
            start, e.g. a refit after some measurements were dropped).
    """
    A, B, t = as_measurements(A, B, t)
    m, d = A.shape
    if not 1 <= rank <= d:
        raise ValueError(f"rank must be in 1..{d}, got {rank}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    nt = float(np.linalg.norm(t))
    if nt == 0.0:
        return ALSResult(np.zeros((d, rank)), np.zeros((d, rank)), 0, 0.0, "zero measurements", 0, 0.0)
    rng = np.random.default_rng(rng)
    if start is None:
        U, V = spectral_start(A, B, t, rank)
    else:
        U, V = (np.array(x, dtype=np.float64) for x in start)
        if U.shape != (d, rank) or V.shape != (d, rank):
            raise ValueError(f"start must be two ({d}, {rank}) factors, got {U.shape}, {V.shape}")
    scale = float(np.linalg.norm(U)) / np.sqrt(d * rank) or 1.0
    sweeps = cg = 0
    res0 = None
    for attempt in range(restarts + 1):
        if attempt:
            U = scale * rng.standard_normal((d, rank))
            V = scale * rng.standard_normal((d, rank))
        AU, BV = A @ U, B @ V
        res = float(np.linalg.norm(_rowdot(AU, BV) - t)) / nt
        res0 = res if res0 is None else res0
        history = [res]
        stalled = False
        while sweeps < max_iter:
            sweeps += 1
            U, AU, s1 = _half_step(A, BV, t, U, AU, inner_tol, max_inner)
            V, BV, s2 = _half_step(B, AU, t, V, BV, inner_tol, max_inner)
            Mu, Mv = _balance(U, V)
            U, AU, V, BV = U @ Mu, AU @ Mu, V @ Mv, BV @ Mv
            cg += s1 + s2
            res = float(np.linalg.norm(_rowdot(AU, BV) - t)) / nt
            history.append(res)
            if res <= tol:
                return ALSResult(U, V, sweeps, res, "converged", cg, res0)
            if len(history) > patience and res > 0.5 * history[-1 - patience]:
                if res <= stall_tol:
                    return ALSResult(U, V, sweeps, res, "noise floor", cg, res0)
                stalled = True
                break
        if not stalled:
            raise ConvergenceError(
                f"ALS hit its cap of {max_iter} sweeps at relative residual {res:.3g} (tol {tol:g}); "
                "more measurements converge faster")
    raise ConvergenceError(
        f"ALS stalled at relative residual {res:.3g} ({restarts + 1} starts, {sweeps} sweeps; no factor-2 "
        f"decrease in {patience} sweeps): too few measurements for rank {rank} (m = {m}, r(2d - r) = "
        f"{rank * (2 * d - rank)}), or a wrong rank")
