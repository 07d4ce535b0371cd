"""Low-rank recovery from non-adaptive rank-one measurements (the paper's Theorem 5.1).

Algorithm (paper, Section 5, proof of Theorem 5.1, extended to the biases of real heads):

1. ``v`` (and ``beta``, ``c`` with biases) as in Theorem 4.1: d queries (+ d + 1).
2. Draw m i.i.d. Gaussian pairs ``(a_k, b_k)`` in advance and query ``X = [(a_k + b_k); b_k]``: the
   sigmoid inversion gives the rank-one measurement ``t_k = a_k^T W b_k = <a_k b_k^T, W>``. With
   ``scales="unit"`` the probes are exactly the paper's; the default scales each pair as
   ``[s a + lam b ; lam b]`` from the answers so that the softmax never saturates (a d = 400 head
   has logits ``a^T W b`` in the tens at unit scale), which measures the same ``t_k``.
3. Solve for the rank-r W: ``solver="convex"`` is the paper's nuclear-norm program (2) with cvxpy
   (:mod:`.sensing_convex`, d <= 60); ``solver="als"`` is alternating least squares on ``W = U V^T``
   with a spectral start (:mod:`.sensing_als`), which scales to d in the thousands.

Query count: ``d + m`` (``2d + 1 + m`` with biases), plus re-asked saturated probes
(``diagnostics["requeried"]``). ``m = ceil(C r(2d - r))``. Measured on exact oracles
(``experiments/phase_transition.py``, d = 20, r = 2, 16 trials): the convex program recovers W in
0% of trials at C = 1.75, 19% at 2, 94% at 2.25 and all from 2.5, so the default is C = 3; ALS in
94% at C = 1.5 and all from 1.75 (all from 1.5 at d = 100, r = 4), default C = 1.5.

Rank: m depends on r, so r is needed before the batch is sent. Given, it is used as is. Rank
``None`` (``--rank auto``) runs a small adaptive preamble first: a core ``Psi^T W Omega`` of Gaussian
rank-one measurements ``psi_i^T W omega_j`` grown by one row and column at a time until it has
``p`` more rows than its numerical rank (singular values above ``sqrt(u) sigma_1``, u the unit
roundoff of the answers; p = 2, or 10 on float32 oracles). That costs ``(r + p)^2`` queries, and its
measurements join the m others in the solve.

Float32 answers (every answer a float32 number; float64 runs are unchanged, bit for bit): probes aim
at logit 3 (:data:`~.lowrank.FLOAT32_LOGIT`), the default m doubles (:data:`FLOAT32_OVERSAMPLING`), the
equations are weighted by the inverse of their rounding error (:func:`measurement_weights`), ALS
accepts a stall below ``sqrt(u) = 2.4e-4`` as the rounding floor (:func:`.sensing_als.als_stall_tol`),
and measurements 30x above the median residual are dropped before one warm refit (:func:`_inliers`).
Measured (d = 32, r = 2, 20 targets): W_rel_err 3e-7 to 2e-6, where before 7 of 20 raised at a stall.

Because the probes are fixed in advance (one batch, or a defence that only answers pre-registered
inputs), this is the method for non-adaptive settings; with adaptive queries :mod:`.lowrank`
reaches ``d + r(2d - r)`` exactly.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import scipy.linalg

from ...errors import NotIdentifiable
from ...oracles.base import Oracle
from ..probes import (AnswerPrecision, Known, ProbeScaler, Progress, basis_design, bilinear_measurements,
                     chunk_for, linear_measurements, looks_float32, value_phase)
from ..check import SINGLE, checked
from ..result import Extraction
from .lowrank import FLOAT32_LOGIT
from .sensing_als import als_stall_tol, solve_als
from .sensing_convex import CONVEX_MAX_D, check_convex_size, solve_nuclear
from ...linalg import svd

DEFAULT_OVERSAMPLING = {"convex": 3.0, "als": 1.5}
"""Measurements as a multiple of r(2d - r) when neither ``measurements`` nor ``oversampling`` is given."""

FLOAT32_OVERSAMPLING = 2.0
"""Factor on :data:`DEFAULT_OVERSAMPLING` when the answers are float32 (see the module docstring)."""

MAX_PROBE_BYTES = 4 * 2**30
"""The probe pairs are kept for the solver (2 m d float64): refuse runs that would need more."""


class _Watched:
    """Passes queries to the oracle and shows every answer to ``watch`` (counts stay on the oracle)."""

    def __init__(self, oracle: Oracle, watch: AnswerPrecision):
        self.oracle = oracle
        self.d = oracle.d
        self.watch = watch

    def query(self, X):
        y = self.oracle.query(X)
        self.watch(y)
        return y


def _detect_rank(oracle, known, scaler, rng, *, chunk, progress, watch):
    """Grow the core ``C = Psi^T W Omega`` until it has ``p`` more rows than its numerical rank.

    Returns ``(rank, A_rows, B_rows, t, tol)``: the core's measurements as rank-one data.
    """
    d = oracle.d
    Psi = np.empty((0, d))
    Om = np.empty((0, d))
    C = np.zeros((0, 0))
    rows_a, rows_b, vals = [], [], []
    rank, tol = 0, 1.0
    while Psi.shape[0] < d:
        ell = Psi.shape[0]
        psi, om = rng.standard_normal(d), rng.standard_normal(d)
        # the new row psi^T W [Omega, om] and the new column Psi^T W om
        Ua = np.vstack([np.broadcast_to(psi, (ell + 1, d)), Psi])
        Ub = np.vstack([Om, om[None, :], np.broadcast_to(om, (ell, d))])
        g = bilinear_measurements(oracle, Ua, Ub, known, scaler, max_chunk=chunk, progress=progress)
        C2 = np.zeros((ell + 1, ell + 1))
        C2[:ell, :ell] = C
        C2[ell, :] = g[:ell + 1]
        C2[:ell, ell] = g[ell + 1:]
        C = C2
        Psi = np.vstack([Psi, psi])
        Om = np.vstack([Om, om])
        rows_a.append(Ua)
        rows_b.append(Ub)
        vals.append(g)
        tol = float(np.sqrt(watch.unit_roundoff))
        margin = 10 if watch.name == "float32" else 2
        sv = svd(C, compute_uv=False)
        rank = int(np.sum(sv > tol * sv[0])) if sv[0] > 0 else 0
        if ell + 1 - rank >= margin:
            break
    return rank, np.vstack(rows_a), np.vstack(rows_b), np.concatenate(vals), tol


def measurement_weights(A: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``|a_k^T v| / (||a_k|| ||v||)``: the weight of measurement k in the float32 least squares.

    The probe ``[s a + lam b ; lam b]`` answers ``y = beta + lam b^T v + alpha s a^T v``, so the attention
    ``alpha`` read from it carries the answer's rounding divided by ``s a^T v``; at the logit the
    scaler keeps every probe at (``s``, ``lam`` and ``alpha (1 - alpha)`` alike across probes), the
    measurement's error is that of the answer times ``||a|| ||v|| / |a^T v|``. Weighting each
    equation by the inverse of that factor is the Gauss-Markov choice. Measured on float32 answers
    (d = 32, r = 2): the unweighted errors spread over four decades (99th percentile 1.6e-6, largest
    2e-4 of ``||a|| ||b||``, the few probes with ``a^T v`` near 0 carrying all the residual), the weighted
    ones over one.
    """
    nv = float(np.linalg.norm(v))
    na = np.linalg.norm(A, axis=1)
    if nv == 0.0:
        return np.ones(A.shape[0])
    return np.abs(A @ v) / np.maximum(na * nv, 1e-300)


OUTLIER = 30.0
"""A float32 measurement whose weighted residual is this many times the median one is dropped (see
:func:`_inliers`)."""


def _inliers(A: np.ndarray, B: np.ndarray, t: np.ndarray, W: np.ndarray, *, floor: int) -> np.ndarray:
    """Mask of the measurements kept for the refit: residual at most :data:`OUTLIER` times the median.

    The weights of :func:`measurement_weights` leave the rounding errors of float32 measurements within
    about a factor 20 of their median (measured, d = 32, r = 2: largest / median 10 to 20 on the
    measurements that are read at the scaler's settled scale). Measurements read before the scaler
    has settled (its first, geometrically growing chunks start at unit scale and may reach logits near
    the re-ask limit, where ``1 / (alpha (1 - alpha))`` is in the thousands) sit 100 to 2000 times
    above it and, though a handful, decide the fit's error. Dropping them costs nothing the rest
    cannot give; at most ``m - floor`` are dropped (the largest first), so the refit keeps the
    measurements ALS needs (``floor`` = 1.5 r(2d - r)).
    """
    r = np.abs(np.einsum("ij,ij->i", A @ W, B) - t)
    med = float(np.median(r))
    keep = np.ones(r.shape[0], dtype=bool)
    if med == 0.0 or r.shape[0] <= floor:
        return keep
    bad = np.flatnonzero(r > OUTLIER * med)
    bad = bad[np.argsort(-r[bad])][:r.shape[0] - floor]
    keep[bad] = False
    return keep


def rop_measurement_count(d: int, rank: int, oversampling: float) -> int:
    """``ceil(C r(2d - r))``: the number of rank-one measurements for oversampling C."""
    return int(math.ceil(oversampling * rank * (2 * d - rank)))


def rop_query_count(d: int, rank: int, *, measurements: int | None = None,
                    oversampling: float | None = None, solver: str = "als", bias: bool = False,
                    float32: bool = False) -> int:
    """Queries :func:`extract_rop` spends when no probe is re-asked (rank given).

    ``float32``: the oracle's answers are float32 numbers, so the default oversampling is
    :data:`FLOAT32_OVERSAMPLING` times larger (when neither ``measurements`` nor ``oversampling`` is given).
    """
    m = _measurements(d, rank, measurements, oversampling, solver, float32=float32)
    return d + (d + 1 if bias else 0) + m


def _measurements(d, rank, measurements, oversampling, solver, float32=False) -> int:
    if measurements is not None and oversampling is not None:
        raise ValueError("give the number of measurements or the oversampling factor, not both")
    if measurements is not None:
        if isinstance(measurements, bool) or int(measurements) != measurements or measurements < 1:
            raise ValueError(f"measurements must be a positive integer, got {measurements!r}")
        return int(measurements)
    if oversampling is None:
        C = DEFAULT_OVERSAMPLING[solver] * (FLOAT32_OVERSAMPLING if float32 else 1.0)
    else:
        C = float(oversampling)
    if not (math.isfinite(C) and C > 0):
        raise ValueError(f"oversampling must be a positive number, got {oversampling!r}")
    return rop_measurement_count(d, rank, C)


def _check_size(d: int, m: int) -> None:
    if 2 * m * d * 8 > MAX_PROBE_BYTES:
        raise ValueError(
            f"{m} rank-one measurements at d = {d} need {2 * m * d * 8 / 2**30:.1f} GiB of probe pairs "
            f"(limit {MAX_PROBE_BYTES / 2**30:.0f} GiB); use --method lowrank (adaptive, "
            "d + r(2d - r) queries, O(d r) memory)")


@checked(SINGLE)
def extract_rop(
    oracle: Oracle,
    *,
    rank: int | None,
    measurements: int | None = None,
    oversampling: float | None = None,
    solver: str = "als",
    bias: bool = False,
    scales: str = "adaptive",
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
    max_iter: int = 2000,
) -> Extraction:
    """Recover a rank-r head from m Gaussian rank-one measurements (Theorem 5.1).

    Args:
        oracle: the black box (value answers).
        rank: the rank r of W; None detects it with a small adaptive preamble of about
            ``(r + 2)^2`` queries (see the module docstring) before the m measurements are sent.
        measurements: the number m of rank-one measurements; or
        oversampling: m as a multiple C of r(2d - r) (default 3 for ``convex``, 1.5 for ``als``).
        solver: ``"als"`` (scales to large d) or ``"convex"`` (the paper's nuclear-norm program,
            d <= 60; needs cvxpy).
        bias: the target may have a score bias c and an output bias beta (+ d + 1 queries).
        scales: ``"adaptive"`` probe scales (default) or the paper's ``"unit"`` probes.
        rng: generator (or seed) of the Gaussian probe pairs.
        progress: called with the number of queries answered after each oracle call.
        max_iter: cap on ALS sweeps.

    Returns:
        An :class:`Extraction` with the given or detected ``rank``; ``queries = d + m``
        (``2d + 1 + m`` with ``bias``, plus the preamble with rank auto) plus
        ``diagnostics["requeried"]``.

    Raises:
        ValueError: bad rank or sizes, or d too large for the convex solver (before any query is
        spent). ConvergenceError: the solver did not converge.
    """
    d = oracle.d
    if rank is not None:
        if isinstance(rank, bool) or int(rank) != rank or not 1 <= rank <= d:
            raise ValueError(f"rank must be an integer in 1..d = {d} or None (auto), got {rank!r}")
        rank = int(rank)
    if solver not in DEFAULT_OVERSAMPLING:
        raise ValueError(f"solver must be 'als' or 'convex', got {solver!r}")
    if scales not in ("adaptive", "unit"):
        raise ValueError(f"scales must be 'adaptive' or 'unit', got {scales!r}")
    if solver == "convex":
        check_convex_size(d, CONVEX_MAX_D)
    if rank is not None:
        _check_size(d, _measurements(d, rank, measurements, oversampling, solver))
    else:
        _measurements(d, 1, measurements, oversampling, solver)     # validates the settings early
    rng = np.random.default_rng(rng)
    t_start = time.perf_counter()
    q0, calls0 = oracle.queries, oracle.calls
    chunk = chunk_for(d)
    fixed = scales == "unit"

    beta, v = value_phase(oracle, bias=bias, max_chunk=chunk, progress=progress)
    # the answers' precision (the value answers are v_i + beta; every later answer is watched too)
    single = looks_float32(v + beta)
    logit = FLOAT32_LOGIT if (single and not fixed) else 1.0
    c = np.zeros(d)
    c_scaler = ProbeScaler(fixed=fixed, T=logit)
    if bias:
        U, _ = basis_design(v)
        gc = linear_measurements(oracle, U, Known(v=v, c=np.zeros(d), beta=beta), c_scaler,
                                 max_chunk=chunk, progress=progress)
        c = scipy.linalg.solve(U, gc)
        del U
    known = Known(v=v, c=c, beta=beta)

    scaler = ProbeScaler(fixed=fixed, T=logit)
    rank_info: dict = {"rank_mode": "given" if rank is not None else "auto"}
    watch = AnswerPrecision()
    watched = _Watched(oracle, watch)
    if rank is None:
        q_before = oracle.queries
        rank, A0, B0, t0, tol = _detect_rank(watched, known, scaler, rng, chunk=chunk,
                                             progress=progress, watch=watch)
        rank_info.update({"rank_queries": oracle.queries - q_before, "rank_tol": tol,
                          "precision": watch.name})
        if rank == 0:
            raise NotIdentifiable("every rank-one measurement is zero: W = 0 at the oracle's precision")
        m = _measurements(d, rank, measurements, oversampling, solver, float32=single)
        _check_size(d, m + t0.shape[0])
    else:
        m = _measurements(d, rank, measurements, oversampling, solver, float32=single)
        A0, B0, t0 = np.empty((0, d)), np.empty((0, d)), np.empty(0)

    A = rng.standard_normal((m, d))
    B = rng.standard_normal((m, d))
    t = bilinear_measurements(watched, A, B, known, scaler, max_chunk=chunk, progress=progress)
    if t0.shape[0]:
        A, B, t = np.vstack([A, A0]), np.vstack([B, B0]), np.concatenate([t, t0])
    queries = oracle.queries - q0
    dof = rank * (2 * d - rank)
    diagnostics: dict = {
        "solver": solver,
        **rank_info,
        "measurements": int(t.shape[0]),
        "oversampling": round(t.shape[0] / dof, 4),
        "requeried": scaler.requeried + c_scaler.requeried,
        "oracle_calls": oracle.calls - calls0,
        "scales": scales,
    }
    if t.shape[0] < dof:
        diagnostics["warning"] = (
            f"{t.shape[0]} rank-one measurements are fewer than the {dof} degrees of freedom r(2d - r) of a "
            f"rank-{rank} W at d = {d}: W is not determined by them, expect a large error")
    # an ALS fit that stops improving at a residual the answers' rounding explains has converged
    stall_tol = als_stall_tol(watch.unit_roundoff)
    diagnostics["precision"] = watch.name
    diagnostics["stall_tol"] = stall_tol
    As, ts = A, t
    if watch.float32:
        # weighted least squares: each measurement by the inverse of its rounding error (module docstring)
        w = measurement_weights(A, v)
        As, ts = A * w[:, None], t * w
        diagnostics["weights_min"] = float(w.min())
    t_solve = time.perf_counter()
    if solver == "als":
        fit = solve_als(As, B, ts, rank, max_iter=max_iter, rng=rng, stall_tol=stall_tol)
        if watch.float32:
            keep = _inliers(As, B, ts, fit.U @ fit.V.T, floor=int(math.ceil(DEFAULT_OVERSAMPLING["als"] * dof)))
            diagnostics["outliers"] = int(keep.size - keep.sum())
            if not keep.all():
                first = fit
                fit = solve_als(As[keep], B[keep], ts[keep], rank, max_iter=max(1, max_iter - first.iterations),
                                rng=rng, stall_tol=stall_tol, start=(first.U, first.V))
                fit = dataclasses.replace(fit, iterations=first.iterations + fit.iterations,
                                          cg_steps=first.cg_steps + fit.cg_steps)
        W = fit.U @ fit.V.T
        diagnostics.update({"iterations": fit.iterations, "residual": fit.residual, "stop": fit.reason,
                            "cg_steps": fit.cg_steps})
    else:
        W, info = solve_nuclear(As, B, ts)
        sv = svd(W, compute_uv=False)
        diagnostics.update({"status": info["status"], "cvx_solver": info["solver"], "program": info["program"],
                            "solution_rank": int(np.sum(sv > 1e-6 * sv[0])) if sv[0] > 0 else 0,
                            "residual": float(np.linalg.norm(np.einsum("ij,ij->i", A @ W, B) - t)
                                              / max(np.linalg.norm(t), 1e-300))})
    diagnostics["solver_seconds"] = round(time.perf_counter() - t_solve, 4)
    return Extraction(
        method="rop", W=W, v=v, c=c if bias else None, beta=beta if bias else None, rank=rank,
        queries=queries, seconds=time.perf_counter() - t_start, diagnostics=diagnostics)
