"""Theorem 6.1 exactly as stated: (v, W) from approximate value queries, answers within +-tau.

Algorithm (paper, Section 6, proof of Theorem 6.1; the paper's model, c = 0 and beta = 0):

1. ``v_hat_i = AVQ([e_i])`` (d one-token queries). ``|v_hat_i| <= mu/2`` means ``v_i = 0`` (needs
   ``tau <= mu/2``); the returned v has those entries set to 0 (the proof's conclusion; it only lowers
   the v error). ``p`` = the index of the largest ``|v_hat|`` (any p with ``|v_p| >= mu`` will do).
   The estimates below use the raw ``v_hat``, as the proof does.
2. For every (i, j) one two-row probe ``X = [(b u + a e_j); a e_j]`` with ``a = 1/2``, ``b = 1/W``
   (W the known bound on ``||W||_F``, ``W >= 2``), ``u = e_i`` where ``v_i != 0`` and ``u = e_i + e_p``
   where ``v_i = 0``. The logit is ``ab u^T W e_j`` (``|ab W_ij| <= 1/2``), and
   ``alpha_hat = (f_hat - a v_hat_j) / (b v_hat_i)`` (``v_hat_p`` for a zero row),
   ``W_hat_ij = sigma^{-1}(clip(alpha_hat; tau_clip, 1 - tau_clip)) / (ab)`` with
   ``tau_clip = sigma(-1/2)`` (Lemma A.1: the clipped inverse is ``L = 1/(tau_clip (1-tau_clip))
   = 4.26 <= 5``-Lipschitz), minus ``W_hat_pj`` for a zero row.

Query count: exactly ``d + d^2``.

Prescribed tolerance (:func:`theorem_tolerance`; constants from the proof): the proof takes
``tau_f, tau_v <= mu eps_W / (80 W^2 d)`` and ``tau_v <= mu / 2`` for the non-zero rows, which gives
``|W_hat_ij - W_ij| <= eps_W / d``; a zero row adds the error of ``W_hat_pj`` (``2 eps_W / d``), so
"dividing the tolerance values for the first case by 2" gives ``eps_W / d`` everywhere and
``||W_hat - W||_F <= eps_W``. With ``eps_v``, also ``tau_v <= eps_v / sqrt(d)``. We use one tolerance
for every query::

    tau = min(mu / 2, mu eps_W / (160 W^2 d), eps_v / sqrt(d)).

Input-norm bound R (the oracle's ``input_norm``; None reads as R = 1). The paper's probes have norms
``||a e_j|| = 1/2`` and ``||b e_i + a e_j|| <= 1/W + 1/2 <= 1``; the zero-row probe ``b (e_i + e_p) +
a e_j`` has norm ``sqrt(b^2 + (a + b)^2)`` when ``j`` is ``i`` or ``p``, which is above 1 for
``W < 2.43``. A probe whose largest token is above R is shrunk as a whole, ``(a, b) -> gamma (a, b)``
with ``gamma = R / max norm`` (the logit shrinks by ``gamma^2``, so it stays in ``[-1/2, 1/2]`` and the
clip stays valid; that entry's error bound grows by ``1 / gamma^2``); the value probes are ``[r e_i]``
with ``r = min(1, R)``, read as ``v_hat_i = AVQ([r e_i]) / r``. ``diagnostics["shrunk_probes"]``
counts the shrunk probes (0 at R = 1 with W >= 2.43 or without zeros in v).

A gap in the proof: for a zero row, the logit is ``ab (W_ij + W_pj)``, and ``|W_ij + W_pj|`` can reach
``sqrt(2) W``, not W, so the attention weight can leave ``[tau_clip, 1 - tau_clip]`` (then the clip
biases that entry). This needs ``|W_ij + W_pj| > W``, i.e. a column whose Frobenius mass sits on two
entries; ``diagnostics["clipped"]`` counts the probes whose estimate was clipped.
"""

from __future__ import annotations

import time

import numpy as np

from ...errors import NotIdentifiable
from ...oracles.base import Oracle
from ..probes import Progress, chunk_for, logit
from ..check import SINGLE, checked
from ..result import Extraction

A = 0.5                                   # the paper's a
TAU_CLIP = 1.0 / (1.0 + np.exp(0.5))      # sigma(-1/2)
L_CLIP = 1.0 / (TAU_CLIP * (1.0 - TAU_CLIP))


def noisy_paper_query_count(d: int) -> int:
    """The query count of Theorem 6.1: ``d + d^2``."""
    return d + d * d


def theorem_tolerance(d: int, W: float, mu: float, eps_W: float, eps_v: float | None = None, *,
                      zeros: bool = True) -> float:
    """The tolerance Theorem 6.1 prescribes, with the constants of its proof.

    ``min(mu/2, mu eps_W / (80 W^2 d) / 2, eps_v / sqrt(d))``; ``zeros=False`` drops the ``/2`` that
    only the zero-entry case of v needs; ``eps_v=None`` drops the v term.
    """
    _check_setting(W, mu)
    tau_W = mu * eps_W / (80.0 * W * W * d) / (2.0 if zeros else 1.0)
    taus = [mu / 2.0, tau_W]
    if eps_v is not None:
        taus.append(eps_v / np.sqrt(d))
    return float(min(taus))


def theorem_W_bound(tau: float, d: int, W: float, mu: float, *, zeros: bool = True) -> float:
    """The ``eps_W`` for which ``tau`` is the prescribed tolerance: ``80 (2) W^2 d tau / mu``.

    The guarantee ``||W_hat - W||_F <= eps_W`` holds while ``tau <= mu / 2``; returns inf above it.
    """
    _check_setting(W, mu)
    if tau > mu / 2:
        return float("inf")
    return float(80.0 * W * W * d * tau / mu * (2.0 if zeros else 1.0))


def _check_setting(W: float, mu: float) -> None:
    if not (np.isfinite(W) and W >= 2):
        raise ValueError(f"Theorem 6.1 needs a known bound W >= 2 on ||W||_F, got W = {W}")
    if not (np.isfinite(mu) and 0 < mu <= 1):
        raise ValueError(f"Theorem 6.1 needs a margin 0 < mu <= 1 on the non-zero |v_i|, got mu = {mu}")


@checked(SINGLE)
def extract_noisy_paper(
    oracle: Oracle,
    *,
    W_bound: float,
    mu: float,
    progress: Progress = None,
) -> Extraction:
    """Recover (W, v) from answers within +-tau, as the proof of Theorem 6.1 does.

    Args:
        oracle: the black box (any tolerance; the guarantee needs ``theorem_tolerance(...)``).
        W_bound: the known bound W >= 2 on ``||W||_F``; sets ``b = 1/W``.
        mu: the margin: every non-zero ``|v_i| >= mu``; ``|v_hat_i| <= mu/2`` is read as ``v_i = 0``.
        progress: called with the number of queries answered after each oracle call.

    Returns:
        An :class:`Extraction` with ``queries = d + d^2``. The algorithm is deterministic.
    """
    _check_setting(W_bound, mu)
    t0 = time.perf_counter()
    q0, calls0 = oracle.queries, oracle.calls
    d = oracle.d
    R = oracle.input_norm if oracle.input_norm is not None else 1.0
    chunk = chunk_for(d)

    # 1. v from [r e_i]
    r = min(1.0, R)
    v = np.empty(d)
    for start in range(0, d, chunk):
        stop = min(d, start + chunk)
        X = np.zeros((stop - start, 1, d))
        X[np.arange(stop - start), 0, np.arange(start, stop)] = r
        v[start:stop] = oracle.query(X) / r
        if progress:
            progress(stop - start)
    zero = np.abs(v) <= mu / 2
    if zero.all():
        raise NotIdentifiable(
            f"every |v_hat_i| <= mu/2 = {mu / 2:g}: v = 0 (or the tolerance is above mu/2), so W is not "
            "identifiable from value queries (Theorem 6.1 needs v != 0)")
    p = int(np.argmax(np.abs(v)))
    v_est = np.where(zero, 0.0, v)

    # 2. one probe per (i, j), sent column by column
    a0, b0 = A, 1.0 / W_bound
    U = np.eye(d)
    U[zero, p] = 1.0                       # u = e_i + e_p for the zero rows (p is never a zero row)
    denom_v = np.where(zero, v[p], v)      # b v_hat_i, or b v_hat_p for a zero row (divided by b below)
    logits = np.empty((d, d))              # logits[i, j] = sigma^{-1}(clip(alpha_hat_ij)) / (ab)
    shrunk = clipped = 0
    cols = max(1, chunk // d)
    for j0 in range(0, d, cols):
        js = np.arange(j0, min(d, j0 + cols))
        n = len(js) * d
        jj = np.repeat(js, d)              # column of each probe
        ii = np.tile(np.arange(d), len(js))
        first = b0 * U[ii] + 0.0
        first[np.arange(n), jj] += a0
        norm = np.maximum(np.linalg.norm(first, axis=1), a0)
        gamma = np.minimum(1.0, R / norm)
        shrunk += int((gamma < 1.0).sum())
        a, b = gamma * a0, gamma * b0
        X = np.zeros((n, 2, d))
        X[:, 0, :] = gamma[:, None] * first
        X[np.arange(n), 1, jj] = a
        f = oracle.query(X)
        alpha = (f - a * v[jj]) / (b * denom_v[ii])
        clipped += int(((alpha < TAU_CLIP) | (alpha > 1 - TAU_CLIP)).sum())
        alpha = np.clip(alpha, TAU_CLIP, 1.0 - TAU_CLIP)
        logits[ii, jj] = logit(alpha) / (a * b)
        if progress:
            progress(n)
    W = logits.copy()
    W[zero, :] -= logits[p, :][None, :]     # zero rows: W_ij = logit/(ab) - W_hat_pj

    diagnostics = {
        "W_bound": float(W_bound), "mu": float(mu), "a": A, "b": b0, "tau_clip": float(TAU_CLIP),
        "zero_entries_v": int(zero.sum()), "p": p, "clipped": clipped, "shrunk_probes": shrunk,
        "input_norm": float(R), "oracle_calls": oracle.calls - calls0,
    }
    return Extraction(method="noisy-paper", W=W, v=v_est, c=None, beta=None,
                      rank=int(np.linalg.matrix_rank(W)), queries=oracle.queries - q0,
                      seconds=time.perf_counter() - t0, diagnostics=diagnostics)
