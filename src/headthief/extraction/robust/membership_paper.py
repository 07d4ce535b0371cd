"""Theorem B.1 (Appendix B) exactly as stated: recovery from membership (sign-only) queries.

Model and assumptions of the theorem: the paper's head (no biases), ``||W||_F <= W`` for a known
``W >= 2``, ``||v|| = 1`` (only v's direction is identifiable: every answer is unchanged when v is
scaled by a positive number) and ``min_i |v_i| >= mu > 0``; the oracle answers ``MQ(X) = 1 if f(X) > 0``.

**v (eq. (12)-(15)).** k single-token queries ``x_1..x_k`` uniform on the unit sphere and the estimator

    v_hat = 1/(R k) sum_i (2 MQ(x_i) - 1) x_i,     R = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2)),

whose coordinates are within ``t`` of ``v/||v||`` with probability ``1 - 2d exp(-t^2 R^2 k / 2)``
(Hoeffding): ``k = 2/(eps_v^2 R^2) log(2d/delta)`` queries for ``||v_hat - v||_inf <= eps_v``, and the
theorem needs ``eps_v = eps_W mu^3 / (40 W d)`` (:func:`prescribed_sphere_queries`; astronomically
large, e.g. about 2.3e18 at d = 8, eps_W = 0.1, mu = 0.1, W = 2, delta = 0.1).

**W (eq. (16)-(29)).** For each entry (i, j), with ``alpha_hat = v_hat_j / v_hat_i`` and
``s = -sign(alpha_hat) / (2W)``, the probe family (a > 0, ``b = s/a`` so that ``ab = s``)

    X(a) = [ (s/a) e_i + a e_j ;  a e_j ],    f(X(a)) = a v_j + sigma(s W_ij) (s/a) v_i,

changes sign exactly once, at ``a^2 = sigma(s W_ij) / (2W |alpha|)``, inside
``[sqrt(mu / (8W)), sqrt(1 / (2W mu))]`` (eq. (22)). Bisection over that interval to accuracy tau
(the midpoint of the final bracket), then ``a_hat`` truncated to ``[0, sqrt(1/(2W mu))]``,
``sigma_hat = 2W |alpha_hat| a_hat^2`` truncated to ``[sigma(-1/2), sigma(1/2)]`` and
``W_ij = logit(sigma_hat) / s``. The appendix sets ``tau = Const * eta_W mu^3 / (8 L W^2)``
(``eta_W = eps_W / d``, L < 5 the Lipschitz constant of logit on ``[sigma(-1/2), sigma(1/2)]``) and leaves
Const open.

Gaps filled here (stated so that the reproduction is honest):

1. ``Const = 1/4``. Our own bound: with ``|a_hat - a| <= tau``, ``|alpha_hat| <= 1.1/mu`` and
   ``|alpha_hat - alpha| <= 4 eps_v / mu^2``, ``|sigma_hat - sigma| <= 2.2 sqrt(2W) tau / mu^1.5 +
   4 eps_v / mu^3``; times ``L / |s| = 2 W L`` this is ``<= L eta_W / 5 (~0.85 eta_W) + 0.149 eta_W``
   whenever ``tau <= 0.149 eta_W mu^1.5 / (4.4 L W sqrt(2W))``, which the paper's tau with Const = 1/4
   satisfies for every ``mu <= 1, W >= 2`` (it is ``<= 0.92`` times that bound). Hence
   ``|W_hat_ij - W_ij| <= eta_W`` and ``||W_hat - W||_F <= eps_W``.
2. ``L = 1 / (sigma(1/2) sigma(-1/2)) = 4.26`` (the exact Lipschitz constant, < 5 as the paper says).
3. The number of bisection steps: ``n = ceil(log2((a_hi - a_lo) / (2 tau)))`` (then the midpoint is within
   tau of the flip); queries ``k + n d^2``, the stated ``O(d/eps_v^2 log(d^2/delta) + d^2 log(d/(eps_W mu)))``.
4. The bisection reads the answer at ``a_lo`` from the theorem (``F(a) -> sign(s) inf`` as ``a -> 0``:
   the answer there is ``[v_j < 0]``) instead of asking it: no query beyond the n per entry.
5. ``i = j`` is the same family (the first token is ``(a + s/a) e_i``); the appendix does not single it out.
6. The probes' tokens have norms up to ``sqrt(s^2/a_lo^2 + a_lo^2)`` = about ``sqrt(2/(W mu))``, above 1
   unless ``W mu >= 2``: the theorem assumes no input-norm bound. :func:`paper_probe_norm` computes it;
   :func:`extract_membership_paper` refuses, before spending a query, an oracle whose input-norm bound
   is smaller (``InvalidQuery``, naming both numbers).
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy.special import expit, gammaln

from ...errors import InvalidQuery, NotIdentifiable
from ...oracles.base import Oracle
from ..probes import Progress, chunk_for, logit
from ..check import SINGLE, checked
from ..result import Extraction

SIGMA_HALF = float(expit(0.5))
#: Lipschitz constant of logit on [sigma(-1/2), sigma(1/2)] (the paper's L < 5)
LIP = 1.0 / (SIGMA_HALF * (1.0 - SIGMA_HALF))
CONST = 0.25


def sphere_constant(d: int) -> float:
    """``R = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2)) = E|x_1|`` for x uniform on the unit sphere in R^d."""
    return float(np.exp(gammaln(d / 2) - gammaln((d + 1) / 2)) / np.sqrt(np.pi))


def eps_v_required(d: int, eps_W: float, mu: float, W: float) -> float:
    """The theorem's ``eps_v = eps_W mu^3 / (40 W d)``."""
    return eps_W * mu ** 3 / (40.0 * W * d)


def sphere_queries_for(d: int, eps_v: float, delta: float) -> float:
    """Hoeffding (eq. (15)): ``k = 2 / (eps_v^2 R^2) log(2d / delta)`` queries give
    ``||v_hat - v||_inf <= eps_v`` with probability ``1 - delta``."""
    R = sphere_constant(d)
    return 2.0 / (eps_v ** 2 * R ** 2) * math.log(2 * d / delta)


def prescribed_sphere_queries(d: int, eps_W: float, mu: float, W: float, delta: float) -> float:
    """The number of sphere queries Theorem B.1 prescribes for v (through ``eps_v = eps_W mu^3/(40 W d)``)."""
    return sphere_queries_for(d, eps_v_required(d, eps_W, mu, W), delta)


def bisection_interval(W: float, mu: float) -> tuple[float, float]:
    """Eq. (22): the flip ``a`` lies in ``[sqrt(mu/(8W)), sqrt(1/(2W mu))]``."""
    return math.sqrt(mu / (8.0 * W)), math.sqrt(1.0 / (2.0 * W * mu))


def bisection_tau(d: int, eps_W: float, mu: float, W: float) -> float:
    """The accuracy of each flip: ``tau = Const * eta_W mu^3 / (8 L W^2)``, ``eta_W = eps_W / d``, Const = 1/4."""
    return CONST * (eps_W / d) * mu ** 3 / (8.0 * LIP * W ** 2)


def bisection_steps(d: int, eps_W: float, mu: float, W: float) -> int:
    """Queries per entry of W: ``ceil(log2((a_hi - a_lo) / (2 tau)))``."""
    lo, hi = bisection_interval(W, mu)
    return max(1, math.ceil(math.log2((hi - lo) / (2.0 * bisection_tau(d, eps_W, mu, W)))))


def paper_query_count(d: int, k: int, eps_W: float, mu: float, W: float) -> int:
    """Queries of :func:`extract_membership_paper`: ``k`` sphere queries + ``d^2`` bisections."""
    return k + d * d * bisection_steps(d, eps_W, mu, W)


def paper_probe_norm(W: float, mu: float) -> float:
    """The largest token norm of the bisection probes ``X(a)``, ``a`` in the interval of eq. (22)."""
    lo, hi = bisection_interval(W, mu)
    s = 1.0 / (2.0 * W)
    return max(math.sqrt((s / a) ** 2 + a ** 2) for a in (lo, hi))


def sphere_estimate(oracle: Oracle, k: int, *, rng: np.random.Generator, progress: Progress = None) -> np.ndarray:
    """Eq. (14): ``v_hat = 1/(R k) sum (2 MQ(x_i) - 1) x_i`` over k uniform unit vectors (k single-token queries)."""
    d = oracle.d
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    acc = np.zeros(d)
    step = chunk_for(d, 1)
    done = 0
    while done < k:
        n = min(step, k - done)
        x = rng.standard_normal((n, d))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        h = np.where(oracle.query(x[:, None, :]) > 0, 1.0, -1.0)
        acc += h @ x
        done += n
        if progress is not None:
            progress(n)
    return acc / (sphere_constant(d) * k)


def bisect_W_paper(oracle: Oracle, v_hat: np.ndarray, *, W_bound: float, mu: float, eps_W: float,
                   progress: Progress = None) -> tuple[np.ndarray, dict]:
    """The W part of Theorem B.1: each W_ij by bisection over X(a), given v's estimate ``v_hat``.

    Returns (W_hat, info) with info["steps"] (queries per entry) and info["at_endpoint"] (entries whose
    bisection ended at an end of the interval of eq. (22): the theorem's assumptions fail there).
    """
    d = oracle.d
    v_hat = np.asarray(v_hat, dtype=np.float64)
    if np.any(v_hat == 0):
        raise NotIdentifiable("Theorem B.1 needs min |v_i| >= mu > 0; v_hat has a zero entry")
    a_lo, a_hi = bisection_interval(W_bound, mu)
    n = bisection_steps(d, eps_W, mu, W_bound)
    I, J = np.meshgrid(np.arange(d), np.arange(d), indexing="ij")
    I, J = I.ravel(), J.ravel()
    alpha = v_hat[J] / v_hat[I]
    s = -np.sign(alpha) / (2.0 * W_bound)
    lo_bit = v_hat[J] < 0            # the answer as a -> 0 (F(a) -> sign(s) inf), not asked
    lo = np.full(I.size, a_lo)
    hi = np.full(I.size, a_hi)
    rows = np.arange(I.size)
    step = chunk_for(d, 2)
    for _ in range(n):
        a = 0.5 * (lo + hi)
        X = np.zeros((I.size, 2, d))
        X[rows, 0, I] += s / a
        X[rows, 0, J] += a
        X[rows, 1, J] = a
        bit = np.empty(I.size, dtype=bool)
        for b0 in range(0, I.size, step):
            b1 = min(I.size, b0 + step)
            bit[b0:b1] = oracle.query(X[b0:b1]) > 0
            if progress is not None:
                progress(b1 - b0)
        same = bit == lo_bit
        lo = np.where(same, a, lo)
        hi = np.where(same, hi, a)
    a_hat = np.clip(0.5 * (lo + hi), 0.0, a_hi)
    sig = np.clip(2.0 * W_bound * np.abs(alpha) * a_hat ** 2, 1.0 - SIGMA_HALF, SIGMA_HALF)
    W_hat = (logit(sig) / s).reshape(d, d)
    eps = 1e-9 * (a_hi - a_lo)
    info = {"steps": n, "tau": bisection_tau(d, eps_W, mu, W_bound), "interval": (a_lo, a_hi),
            "at_endpoint": int(np.sum((lo <= a_lo + eps) | (hi >= a_hi - eps)))}
    return W_hat, info


@checked(SINGLE, reads="signs")
def extract_membership_paper(
    oracle: Oracle,
    *,
    W_bound: float,
    mu: float,
    eps_W: float = 0.1,
    k: int,
    v_hat: np.ndarray | None = None,
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
) -> Extraction:
    """Theorem B.1 as stated: v's direction from k sphere queries, then each W_ij by bisection.

    Args:
        oracle: the membership oracle (only ``answer > 0`` is used).
        W_bound: the known bound ``W >= 2`` on ``||W||_F``.
        mu: the known margin ``min_i |v_i| / ||v||``.
        eps_W: the target Frobenius error of W (sets the bisection accuracy).
        k: sphere queries for v (the theorem's prescribed k, :func:`prescribed_sphere_queries`, is
            astronomically large; any k can be given and the v error falls like ``1/sqrt(k)``).
        v_hat: skip the sphere part and use this estimate of v (k is then ignored): checks the W part
            on its own.
        rng: generator (or seed) for the sphere queries.
        progress: called with the number of queries answered after each oracle call.

    Returns:
        An :class:`Extraction` with ``v_scale_known=False`` (v is eq. (14)'s estimate); ``queries`` is
        ``k + d^2 * bisection_steps(d, eps_W, mu, W_bound)``.
    """
    if not W_bound >= 2:
        raise ValueError(f"Theorem B.1 needs a known bound W >= 2 on ||W||_F, got {W_bound}")
    if not 0 < mu <= 1:
        raise ValueError(f"mu must be in (0, 1], got {mu}")
    if not 0 < eps_W < 1:
        raise ValueError(f"eps_W must be in (0, 1), got {eps_W}")
    need = paper_probe_norm(W_bound, mu)
    if oracle.input_norm is not None and need > oracle.input_norm * (1 + 1e-9):
        raise InvalidQuery(
            f"Theorem B.1's bisection probes need tokens of norm up to {need:.4g} (W = {W_bound:g}, "
            f"mu = {mu:g}) but the oracle refuses ||x|| > R = {oracle.input_norm:g}: the theorem assumes no "
            f"input-norm bound; allow it with --input-norm {math.ceil(need * 1000) / 1000:g} "
            "(or use --method membership, which stays inside R)")
    t0 = time.perf_counter()
    q0, calls0 = oracle.queries, oracle.calls
    d = oracle.d
    rng = np.random.default_rng(rng)
    if v_hat is None:
        v_hat = sphere_estimate(oracle, int(k), rng=rng, progress=progress)
        k_used = int(k)
    else:
        v_hat = np.asarray(v_hat, dtype=np.float64).copy()
        k_used = 0
    v_q = oracle.queries - q0
    W_hat, info = bisect_W_paper(oracle, v_hat, W_bound=W_bound, mu=mu, eps_W=eps_W, progress=progress)
    diagnostics = {
        "v_scale_known": False,
        "k": k_used,
        "v_queries": v_q,
        "W_queries": oracle.queries - q0 - v_q,
        "bisection_steps": info["steps"],
        "tau": info["tau"],
        "W_bound": W_bound,
        "mu": mu,
        "eps_W": eps_W,
        "eps_v_required": eps_v_required(d, eps_W, mu, W_bound),
        "prescribed_k_delta_0.1": prescribed_sphere_queries(d, eps_W, mu, W_bound, 0.1),
        "at_endpoint": info["at_endpoint"],
        "oracle_calls": oracle.calls - calls0,
    }
    return Extraction(
        method="membership-paper", W=W_hat, v=v_hat, c=None, beta=None,
        rank=int(np.linalg.matrix_rank(W_hat)), queries=oracle.queries - q0,
        seconds=time.perf_counter() - t0, diagnostics=diagnostics, v_scale_known=False)
