"""Exact recovery of a single attention head from value queries (Theorem 4.1).

Algorithm (paper, Section 4, proof of Theorem 4.1, extended to the biases of real heads):

1. ``beta = f([0])`` (biased model only; 1 query).
2. ``v_i = f([e_i]) - beta``: d one-token queries. v = 0 stops here with :class:`NotIdentifiable`.
3. Biased model: ``c^T u_l`` from the queries ``[s u_l ; 0]`` (d queries, see
   :func:`~headthief.extraction.probes.linear_measurements`).
4. Column ``w_j`` of W from d two-token queries ``[s u_l + lam e_j ; lam e_j]``, each giving
   ``u_l^T w_j`` by sigmoid inversion; solve ``U w_j = g`` (U invertible by design).

Query count: ``d^2 + d`` for the paper's model, ``d^2 + 2d + 1`` with biases, plus any re-asked
saturated probes (reported as ``diagnostics["requeried"]``; none on well-scaled targets).

Probe designs: ``"basis"`` is the paper's deterministic design (``u_l = e_l``, or ``e_l ± e_p`` where
``v_l = 0``, here also where ``|v_l| < |v_p| / 2`` so that ``|u_l^T v|`` stays large); ``"gaussian"`` draws ``u_l ~ N(0, I_d)`` from ``rng``, each shifted by ``±v/||v||`` so that
``|u_l^T v| >= ||v||`` (see :func:`~headthief.extraction.probes.gaussian_design`).
"""

from __future__ import annotations

import time

import numpy as np
import scipy.linalg

from ...oracles.base import Oracle
from ..probes import (Known, ProbeDesign, ProbeScaler, Progress, basis_design, bilinear_measurements, chunk_for,
                     gaussian_design, linear_measurements, looks_float32, numerical_rank, value_phase)
from ..check import SINGLE, checked
from ..result import Extraction


def exact_query_count(d: int, *, bias: bool = False) -> int:
    """The query count of :func:`extract_exact` when no probe has to be re-asked."""
    return d * d + d + (d + 1 if bias else 0)


@checked(SINGLE)
def extract_exact(
    oracle: Oracle,
    *,
    probes: str = "basis",
    bias: bool = False,
    scales: str = "adaptive",
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
) -> Extraction:
    """Recover (W, v) — and (c, beta) with ``bias`` — exactly from value queries (Theorem 4.1).

    Args:
        oracle: the black box (exact value answers).
        probes: ``"basis"`` (the paper's e_l / e_l + e_p design) or ``"gaussian"``.
        bias: the target may have a score bias c and an output bias beta.
        scales: ``"adaptive"`` chooses probe scales from the answers (keeps float32 heads accurate);
            ``"unit"`` uses the paper's unit probes.
        rng: generator (or seed) for the Gaussian design.
        progress: called with the number of queries answered after each oracle call.

    Returns:
        An :class:`Extraction`; ``queries`` is ``d^2 + d`` (``d^2 + 2d + 1`` with ``bias``) plus
        ``diagnostics["requeried"]``.
    """
    if probes not in ("basis", "gaussian"):
        raise ValueError(f"probes must be 'basis' or 'gaussian', got {probes!r}")
    if scales not in ("adaptive", "unit"):
        raise ValueError(f"scales must be 'adaptive' or 'unit', got {scales!r}")
    t0 = time.perf_counter()
    q0, calls0 = oracle.queries, oracle.calls
    d = oracle.d
    chunk = chunk_for(d)
    beta, v = value_phase(oracle, bias=bias, max_chunk=chunk, progress=progress)
    single = looks_float32(v + beta)

    if probes == "basis":
        U, p = basis_design(v, zero_tol=0.5)
    else:
        U = gaussian_design(np.random.default_rng(rng), d, v)
    lu = scipy.linalg.lu_factor(U)
    fixed = scales == "unit"

    c = np.zeros(d)
    # Float64 answers have digits to spare, so their probe scale grows more slowly (and W's logits aim
    # at 1/2, below): headroom for an entry far larger than those seen so far, which would otherwise
    # cost a re-ask. Float32 answers need logits of order 1 and the default growth to keep their digits.
    roomy = {} if single else {"growth": 2.0}
    c_scaler = ProbeScaler(fixed=fixed, **roomy)
    if bias:
        known0 = Known(v=v, c=np.zeros(d), beta=beta)
        gc = linear_measurements(oracle, U, known0, c_scaler, max_chunk=chunk, progress=progress)
        c = scipy.linalg.lu_solve(lu, gc)
    known = Known(v=v, c=c, beta=beta)

    scaler = ProbeScaler(fixed=fixed, T=1.0 if single else 1 / 2, **roomy)
    design = ProbeDesign(U, known)
    G = np.empty((d, d))
    e = np.zeros(d)
    weight = np.zeros(d)    # how large each measurement row has been, relative to its column
    inv_norm = np.linalg.norm(scipy.linalg.lu_solve(lu, np.eye(d)), axis=0)
    readable = np.abs(U @ v) / np.linalg.norm(U, axis=1)
    for j in range(d):
        e[:] = 0.0
        e[j] = 1.0
        # Float64 answers have digits to spare: open each new column with one low-scale pilot probe, so
        # a column far larger than the ones before it (common for low-rank W) sets the scale without
        # any re-asked query. Float32 answers keep full scale. The pilot row: large in the earlier
        # columns (so it reads this column's scale), with a large |u^T v| and a small column of U^{-1}
        # (so its coarser reading loses, and costs the solve, the least).
        pilot = None if single or j == 0 else int(np.argmax(np.sqrt(weight) * readable / inv_norm))
        G[:, j] = bilinear_measurements(oracle, U, e, known, scaler, max_chunk=chunk, progress=progress,
                                        design=design, pilot=pilot)
        norm = np.linalg.norm(G[:, j])
        if norm > 0:
            weight += (G[:, j] / norm) ** 2
    W = scipy.linalg.lu_solve(lu, G)

    requeried = scaler.requeried + c_scaler.requeried
    diagnostics = {
        "probes": probes,
        "scales": scales,
        "requeried": requeried,
        "oracle_calls": oracle.calls - calls0,
        "design_cond": float(np.linalg.cond(U)),
        "logit_target": scaler.T,
        "float32_answers": single,
    }
    return Extraction(
        method="exact", W=W, v=v, c=c if bias else None, beta=beta if bias else None,
        rank=numerical_rank(W, 1e-4 if single else 1e-9), queries=oracle.queries - q0,
        seconds=time.perf_counter() - t0, diagnostics=diagnostics)
