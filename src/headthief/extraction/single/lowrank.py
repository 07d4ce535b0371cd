"""Adaptive low-rank extraction at the information limit (beyond the paper's Theorem 5.1).

A rank-r d x d matrix has ``r(2d - r)`` degrees of freedom. Theorem 5.1 reaches ``O(rd)`` queries with
non-adaptive Gaussian rank-one measurements and a convex program (see :mod:`.rop`); because value
queries can be chosen *adaptively*, this module reaches the floor itself with O(d r^2) arithmetic.

Algorithm (each bilinear entry ``u^T W b`` is one two-row query ``[s u + lam b ; lam b]``, inverted
through the sigmoid as in Theorem 4.1, eq. (1)):

1. ``v`` (and ``beta``, ``c`` with biases) as in Theorem 4.1: d queries (+ d + 1).
2. Right sketch ``Y = W Omega`` for Gaussian columns ``omega_j``: column j costs d queries
   (``u = e_l`` or ``e_l +- e_p``, the paper's basis probes, against ``b = omega_j``). With the rank
   unknown the sketch grows column by column and stops when a new column lies in the span of the
   previous ones: the sketch's numerical rank (singular values above ``sqrt(u) sigma_1``, u the unit
   roundoff of the oracle's answers: 1e-8 for float64, 2.4e-4 for float32) stops growing.
3. Left sketch ``Z = Psi^T W`` for Gaussian rows ``psi_i`` (``u = psi_i``, ``b = e_j``). The columns
   ``Z[:, S]`` on a set S of ``|Omega|`` coordinates where ``Omega[S]`` is well conditioned (pivoted
   QR) are *not* measured: ``Z Omega = Psi^T Y`` is already known, so they follow from a small
   solve. The core ``Psi^T W Omega`` is therefore never measured twice.
4. ``W = Y (Psi^T Y)_r^+ Z``, with the core's pseudo-inverse truncated to rank r.

Query count (no probe re-asked): exactly ``d + r(2d - r)`` for a known rank r, ``+ (d + 1)`` with
biases. Rank auto: ``+ (d - r)`` (the one column found in the span; at most d). Oversampling by k
columns and rows (a rank-truncated core; picked automatically, k = 10, for float32 oracles):
``+ k(2d - 2r - k)``, reported as ``diagnostics["oversample_queries"]``. A full-rank target ends with
rank d after ``d^2 + d`` queries and ``W = Y Omega^{-1}``.

Precision: an oracle whose answers are all float32 numbers is treated as float32 (the answers
decide, never the target's parameters): rank tolerance 2.4e-4, k = 10 oversampling and a target
logit of 3 for the probe scales (see :data:`FLOAT32_LOGIT`). A noisy float64 oracle needs ``rank``
(or ``rank_tol``) and ``oversample`` from the caller. With oversampling the core's singular values past
the rank are the answers' noise: the first of them over the last one kept, W's relative error along its
weakest direction, is reported as ``diagnostics["W_rel_err_estimate"]``, and the model check allows for it
(:func:`headthief.extraction.precision.propagated_fidelity`). On the 72 MiniLM heads (float32, seed 0) the
true ``||W_hat - W||_F / ||W||_F`` was 0.12 - 0.51 times it.

Cost: O(d r^2) arithmetic besides forming the dense output (O(d^2 r)); memory O(d r) plus one chunk
of queries at a time (and the dense d x d output). Queries are built straight into each chunk
(:func:`_structured_measurements`), never as (m, d) probe matrices.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.linalg

from ...errors import ConvergenceError, NotIdentifiable
from ...oracles.base import Oracle
from ..probes import (AnswerPrecision, Known, ProbeScaler, Progress, _invert, basis_design, chunk_for,
                     gaussian_design, linear_measurements, looks_float32, value_phase)
from ..check import SINGLE, checked
from ..result import Extraction
from ...linalg import svd

FLOAT32_OVERSAMPLE = 10
"""Extra sketch columns and rows used when the oracle's answers are float32 (``oversample=None``)."""

FLOAT32_LOGIT = 3.0
"""Target logit of the probe scaler on float32 oracles (1 on float64 ones): a float32 head's score
arithmetic leaves an absolute error on each logit, so larger logits measure W to 2-3x more digits;
3 keeps the softmax far from saturation (re-asks start at 9)."""


def lowrank_query_count(d: int, rank: int, *, bias: bool = False, oversample: int = 0,
                        auto: bool = False) -> int:
    """Queries :func:`extract_lowrank` spends when no probe is re-asked.

    ``auto`` is the rank-unknown mode (with ``oversample = 0`` it measures one more right-sketch
    column, found in the span of the others).
    """
    if not 0 <= rank <= d:
        raise ValueError(f"rank must be in 0..{d}, got {rank}")
    base = d + (d + 1 if bias else 0)
    ell, ell_a = _sketch_sizes(d, rank, oversample, auto)
    if ell >= d:
        return base + d * d
    return base + d * ell + ell_a * (d - ell)


def _sketch_sizes(d: int, r: int, k: int, auto: bool) -> tuple[int, int]:
    """(right-sketch columns, left-sketch rows) for rank r and oversampling k."""
    if k > 0:
        ell = min(d, r + k)
        return ell, ell
    ell = min(d, r + 1) if auto else r
    return ell, r


class _SketchRank:
    """Numerical rank of the right sketch, grown one column at a time (incremental QR).

    A column whose residual against the previous ones is above ``screen`` adds one to the rank at
    O(d j) cost. Otherwise the rank is recounted from the singular values of the sketch (those of its
    j x j triangular factor): ``#{sigma_i > tol * sigma_1}``. Counting on the whole sketch, not on the
    last residual, keeps the decision right on float32 oracles, where the residual of a column in
    the span is the measurement noise amplified by the conditioning of the columns before it.
    """

    def __init__(self, d: int, tol: float, rng: np.random.Generator):
        self.tol = tol
        self.screen = min(0.5, 100.0 * tol)
        self.rng = rng
        self.Q = np.empty((d, 16))
        self.R = np.zeros((16, 16))
        self.j = 0
        self.rank = 0
        self.svd_checks = 0
        self.sv: np.ndarray | None = None

    def add(self, y: np.ndarray) -> None:
        j = self.j
        if j == self.Q.shape[1]:
            cap = min(self.Q.shape[0], 2 * j)
            self.Q = np.concatenate([self.Q, np.empty((self.Q.shape[0], cap - j))], axis=1)
            R = np.zeros((cap, cap))
            R[:j, :j] = self.R[:j, :j]
            self.R = R
        Qj = self.Q[:, :j]
        h = Qj.T @ y
        w = y - Qj @ h
        h2 = Qj.T @ w                      # classical Gram-Schmidt, twice
        w -= Qj @ h2
        h += h2
        rho = float(np.linalg.norm(w))
        ny = float(np.linalg.norm(y))
        if rho == 0.0:                     # exactly dependent (or zero): any orthonormal completion
            w = self.rng.standard_normal(y.shape[0])
            for _ in range(2):
                w -= Qj @ (Qj.T @ w)
        self.Q[:, j] = w / np.linalg.norm(w)
        self.R[:j, j] = h
        self.R[j, j] = rho
        self.j = j + 1
        if ny > 0 and rho / ny > self.screen:
            self.rank += 1
            return
        sv = svd(self.R[:j + 1, :j + 1], compute_uv=False)
        self.svd_checks += 1
        self.sv = sv
        self.rank = int(np.sum(sv > self.tol * sv[0])) if sv[0] > 0 else 0

    def summary(self) -> dict:
        out = {"rank_tol": float(self.tol), "rank_svd_checks": self.svd_checks}
        if self.sv is not None and self.sv[0] > 0 and self.sv.shape[0] == self.j:
            r = self.rank
            out["sketch_sv_last_kept"] = float(self.sv[r - 1] / self.sv[0]) if r >= 1 else None
            out["sketch_sv_first_dropped"] = float(self.sv[r] / self.sv[0]) if r < self.j else None
        return out


def _structured_measurements(oracle: Oracle, *, side: str, dense: np.ndarray, index: np.ndarray,
                             known: Known, scaler: ProbeScaler, max_chunk: int, progress: Progress,
                             watch: AnswerPrecision, sgn: np.ndarray | None = None,
                             pivot: int = 0) -> np.ndarray:
    """``g_k = u_k^T W b_k`` for structured probes, one two-row query each (a fast path of
    :func:`~headthief.extraction.probes.bilinear_measurements` with the same scaling, re-asks and
    inversion, that never materialises the (m, d) probe matrices).

    ``side == "right"``: ``b_k = dense`` for every k and ``u_k = e_{index_k} + sgn_{index_k} e_pivot``
    (the basis design). ``side == "left"``: ``u_k = dense`` and ``b_k = e_{index_k}``.
    """
    d = oracle.d
    index = np.asarray(index, dtype=np.intp)
    m = index.shape[0]
    v, c = known.v, known.c
    dn = float(np.linalg.norm(dense))
    if side == "right":
        sk = sgn[index]
        unorm = np.sqrt(1.0 + sk * sk)
        uv = v[index] + sk * v[pivot]
        uc = c[index] + sk * c[pivot]
        bnorm = np.full(m, dn)
        bv = np.full(m, float(dense @ v))
    elif side == "left":
        sk = None
        unorm = np.full(m, dn)
        uv = np.full(m, float(dense @ v))
        uc = np.full(m, float(dense @ c))
        bnorm = np.ones(m)
        bv = v[index]
    else:  # pragma: no cover - internal
        raise ValueError(side)
    if np.any(np.abs(uv) <= 1e-300):
        raise NotIdentifiable("a probe u has u^T v = 0; its attention weight cannot be read off the answer")
    norms = unorm * bnorm
    out = np.empty(m)
    start = 0
    while start < m:
        stop = min(m, start + scaler.chunk_size(max_chunk))
        kappa = scaler.kappa(norms[start:stop])
        g = np.full(stop - start, np.nan)
        todo = np.arange(stop - start)
        for _attempt in range(scaler.max_retries + 1):
            k = start + todo
            kap = kappa[todo]
            s, lam = scaler.split(kap, norms[k], unorm[k], uc[k])
            n = len(k)
            rows = np.arange(n)
            X = np.empty((n, 2, d))
            if side == "right":
                np.multiply(lam[:, None, None], dense[None, None, :], out=X)   # both rows lam b
                X[rows, 0, index[k]] += s
                pk = sk[k] != 0
                X[rows[pk], 0, pivot] += s[pk] * sk[k][pk]
            else:
                np.multiply(s[:, None], dense[None, :], out=X[:, 0, :])
                X[:, 1, :] = 0.0
                X[rows, 1, index[k]] = lam
                X[rows, 0, index[k]] += lam
            y = oracle.query(X)
            del X
            watch(y)
            gk, bad, t = _invert(y, known.beta + lam * bv[k], s * uv[k], s * uc[k], kap, scaler.t_max)
            g[todo[~bad]] = gk[~bad]
            if not bad.any():
                break
            todo = scaler.reask(kappa, todo, bad, t)
        else:
            raise ConvergenceError(
                f"{len(todo)} probe(s) still saturated after {scaler.max_retries} re-asks at smaller scales")
        out[start:stop] = g
        scaler.update(g, norms[start:stop])
        start = stop
        if progress is not None:
            progress(len(g))
    return out


def _basis_solve(G: np.ndarray, sgn: np.ndarray, p: int) -> np.ndarray:
    """Solve ``U X = G`` for the basis design ``U = I + sgn e_p^T`` (``sgn[p] = 0``) in O(size)."""
    return G - np.multiply.outer(sgn, G[p]) if G.ndim == 2 else G - sgn * G[p]


@checked(SINGLE)
def extract_lowrank(
    oracle: Oracle,
    *,
    rank: int | None = None,
    bias: bool = False,
    oversample: int | None = None,
    rank_tol: float | None = None,
    scales: str = "adaptive",
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
) -> Extraction:
    """Recover a low-rank head (W, v) — and (c, beta) with ``bias`` — with adaptive sketches.

    Args:
        oracle: the black box (value answers).
        rank: the rank of W if known; None detects it (the right sketch stops at the first column
            in the span of the previous ones, at a cost of at most d extra queries; with
            oversampling k, at the k-th such column, which the k extra columns pay for).
        bias: the target may have a score bias c and an output bias beta (+ d + 1 queries).
        oversample: extra sketch columns and rows k, with the core truncated to rank r; it makes the
            reconstruction stable on noisy or float32 oracles (float32, d = 384, r = 32: W error
            about 600x the measurement noise with the square core, 6x with k = 10). None: 10 when
            every answer is a float32 number, else 0.
        rank_tol: singular values of the right sketch below ``rank_tol`` times the largest count
            as noise. None: ``sqrt(u)``, u the unit roundoff of the answers (1e-8 for float64,
            2.4e-4 for float32 oracles). Give it (or the rank) for noisy oracles.
        scales: ``"adaptive"`` probe scales (default) or the paper's ``"unit"`` probes.
        rng: generator (or seed) of the Gaussian sketches.
        progress: called with the number of queries answered after each oracle call.

    Returns:
        An :class:`Extraction` with the detected or given ``rank``; ``queries`` as in the module
        docstring, plus ``diagnostics["requeried"]``.
    """
    if rank is not None:
        if isinstance(rank, bool) or int(rank) != rank:
            raise ValueError(f"rank must be an integer or None (auto), got {rank!r}")
        rank = int(rank)
        if not 1 <= rank <= oracle.d:
            raise ValueError(f"rank must be in 1..d = {oracle.d}, got {rank}")
    if oversample is not None and (isinstance(oversample, bool) or int(oversample) != oversample
                                   or oversample < 0):
        raise ValueError(f"oversample must be a non-negative integer or None (auto), got {oversample!r}")
    if rank_tol is not None and not 0 < rank_tol < 1:
        raise ValueError(f"rank_tol must be in (0, 1), got {rank_tol}")
    if scales not in ("adaptive", "unit"):
        raise ValueError(f"scales must be 'adaptive' or 'unit', got {scales!r}")
    rng = np.random.default_rng(rng)
    t_start = time.perf_counter()
    q0, calls0 = oracle.queries, oracle.calls
    d = oracle.d
    chunk = chunk_for(d, mbytes=8.0)
    fixed = scales == "unit"

    beta, v = value_phase(oracle, bias=bias, max_chunk=chunk, progress=progress)
    # a first guess of the answers' precision (the value answers are v_i + beta); the sketch's
    # own answers decide it below
    logit = FLOAT32_LOGIT if (not fixed and looks_float32(v + beta)) else 1.0
    U, p = basis_design(v, zero_tol=0.5)
    sgn = U[:, p].copy()
    sgn[p] = 0.0
    c = np.zeros(d)
    c_scaler = ProbeScaler(fixed=fixed, T=logit)
    if bias:
        gc = linear_measurements(oracle, U, Known(v=v, c=np.zeros(d), beta=beta), c_scaler,
                                 max_chunk=chunk, progress=progress)
        c = _basis_solve(gc, sgn, p)
    del U
    known = Known(v=v, c=c, beta=beta)
    scaler = ProbeScaler(fixed=fixed, T=logit)
    watch = AnswerPrecision()
    every = np.arange(d)
    s0 = getattr(oracle, "seconds", None)

    def right_column(omega):
        g = _structured_measurements(oracle, side="right", dense=omega, index=every, known=known,
                                     scaler=scaler, max_chunk=chunk, progress=progress, watch=watch,
                                     sgn=sgn, pivot=p)
        return _basis_solve(g, sgn, p)

    # -- right sketch Y = W Omega, column by column ------------------------------------------------
    cols: list[np.ndarray] = []
    omegas: list[np.ndarray] = []
    k = tol = None
    tracker = None
    while len(cols) < d:
        omega = rng.standard_normal(d)
        y = right_column(omega)
        cols.append(y)
        omegas.append(omega)
        if k is None:   # the first column's answers tell the oracle's precision
            k = int(oversample) if oversample is not None else (FLOAT32_OVERSAMPLE if watch.float32 else 0)
            tol = rank_tol if rank_tol is not None else float(np.sqrt(watch.unit_roundoff))
            if not fixed:
                scaler.T = FLOAT32_LOGIT if watch.float32 else 1.0
            if rank is None:
                tracker = _SketchRank(d, tol, rng)
        if rank is not None:
            if len(cols) >= min(d, rank + k):
                break
            continue
        tracker.add(y)
        if len(cols) - tracker.rank >= max(1, k):
            break
    r = rank if rank is not None else tracker.rank
    Y = np.column_stack(cols)
    Om = np.column_stack(omegas)
    del cols, omegas
    ell = Y.shape[1]
    ell_a = r if k == 0 else ell

    # -- left sketch Z = Psi^T W on the coordinates outside S, and the reconstruction -------------
    diag_core: dict = {}
    if r == 0:
        W = np.zeros((d, d))
        ell_a = 0
    elif ell >= d:
        # the right sketch is a basis: W = Y Omega^{-1}. Its rank is W's own (the sketch's singular
        # values also carry Omega's conditioning, which a square Omega makes poor)
        W = scipy.linalg.solve(Om.T, Y.T).T
        diag_core["sketch_cond"] = float(np.linalg.cond(Om))
        ell_a = 0
        Uw, sw, Vtw = svd(W)
        if rank is None:
            r = int(np.sum(sw > tol * sw[0])) if sw[0] > 0 else 0
            diag_core["W_sv_last_kept"] = float(sw[r - 1] / sw[0]) if r >= 1 else None
        if r < d:
            W = (Uw[:, :r] * sw[:r]) @ Vtw[:r]
    else:
        _, piv = scipy.linalg.qr(Om.T, mode="r", pivoting=True)
        S, Sc = np.sort(piv[:ell]), np.sort(piv[ell:])
        Psi = gaussian_design(rng, ell_a, v)
        Zc = np.empty((ell_a, d - ell))
        for i in range(ell_a):
            Zc[i] = _structured_measurements(oracle, side="left", dense=Psi[i], index=Sc, known=known,
                                             scaler=scaler, max_chunk=chunk, progress=progress,
                                             watch=watch)
        C = Psi @ Y                                          # (ell_a, ell) = Psi^T W Omega
        Z = np.empty((ell_a, d))
        Z[:, Sc] = Zc
        Z[:, S] = scipy.linalg.solve(Om[S].T, (C - Zc @ Om[Sc]).T).T
        Uc, sc, Vtc = svd(C, full_matrices=False)
        rk = min(r, sc.shape[0])
        if sc[rk - 1] <= 0:
            raise NotIdentifiable("the sketch core is singular: the rank is lower than assumed")
        diag_core["core_cond"] = float(sc[0] / sc[rk - 1])
        if rk < sc.shape[0]:
            diag_core["core_gap"] = float(sc[rk] / sc[rk - 1])
            if k > 0:         # the discarded core is the answers' noise: W's error along its weakest direction
                diag_core["W_rel_err_estimate"] = float(sc[rk] / sc[rk - 1])
        diag_core["select_cond"] = float(np.linalg.cond(Om[S]))
        left = (Y @ Vtc[:rk].T) / sc[:rk]
        right = Uc[:, :rk].T @ Z
        W = left @ right

    queries = oracle.queries - q0
    base = r * (2 * d - r)
    sketch = d * d if ell >= d else d * ell + ell_a * (d - ell)
    extra = sketch - base
    diagnostics = {
        "rank_mode": "given" if rank is not None else "auto",
        "precision": watch.name,
        "oversample": int(k),
        "sketch_columns": int(ell),
        "sketch_rows": int(ell_a),
        "info_limit_queries": int(d + base + (d + 1 if bias else 0)),
        "oversample_queries": int(extra) if k > 0 else 0,
        "rank_search_queries": int(extra) if k == 0 else 0,
        "requeried": scaler.requeried + c_scaler.requeried,
        "oracle_calls": oracle.calls - calls0,
        "oracle_seconds": round(oracle.seconds - s0, 4) if s0 is not None else None,
        "scales": scales,
        "logit_target": scaler.T,
    }
    if tracker is not None:
        diagnostics.update(tracker.summary())
    diagnostics.update(diag_core)
    return Extraction(
        method="lowrank", W=W, v=v, c=c if bias else None, beta=beta if bias else None, rank=int(r),
        queries=queries, seconds=time.perf_counter() - t_start, diagnostics=diagnostics)
