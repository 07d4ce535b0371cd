"""Recovery of a single head from sign-only (membership) answers by bisection: ours (Appendix B setting).

The oracle answers one bit, ``1 if f(X) > 0 else 0``. Every step below locates where that bit flips
along a one-parameter family of queries, by bisection, so each query buys one bit of one parameter:
``O(d log(1/eps))`` queries for v's direction and ``O(d^2 log(1/eps))`` for W, against the paper's
``O(d / eps_v^2 log(d^2/delta))`` random queries for v (Theorem B.1, see :mod:`.membership_paper`).
All tokens respect the oracle's input-norm bound R (``||x_i|| <= R``; R = 1 when the oracle has none).

**What is identifiable.** The bit does not change when v and the output bias beta are multiplied by the
same positive number, so only the *direction* of v (and ``beta / ||v||``) can be recovered, never
``||v||``: the result has ``v_scale_known=False``, a unit-norm ``v``, ``beta`` in units of ``||v||``, and
its errors are reported as ``v_dir_err``. W and the score bias c act only through the softmax weights,
which do not depend on that scale: the logit recovered at each flip is scale-free, so W (and c) are
identifiable exactly, and are recovered to float precision. With biases, ``|beta| >= R ||v||`` makes
every answer equal (``f`` then never changes sign inside the ball): nothing is identifiable.

**1. v's direction (single-token queries, ``sign(x^T v + beta)``).**

- signs: ``[R e_i]`` for every i (and ``[-R e_i]`` if none is positive; with biases ``[0]`` and both
  ``[+-R e_i]`` at once) give a coordinate p0 whose sign of ``v_p0`` is known (v = 0: NotIdentifiable).
- with biases, a point z0 on the hyperplane ``x^T v + beta = 0`` by bisection on the segment from 0 to
  the probe that flipped (unbiased: z0 = 0).
- for each i != p: on the circle ``z0 + rho (cos t * sign(v_p) e_p + sin t * e_i)`` the answer is
  ``sign(|v_p| cos t + v_i sin t)``, which flips exactly once on ``t in (0, pi)``, at ``t*`` with
  ``v_i / |v_p| = -cot t*``. This holds for ``v_i = 0`` too (``t* = pi/2``): zeros of v need no special
  case. A coarse pass (``coarse_steps`` bisections against p0) finds the largest coordinate p, so the
  fine pass (to angle ``tol``) is well conditioned; with biases z0 is then moved to the point of the
  hyperplane closest to 0 (the largest circle fits the ball), and ``beta / ||v|| = -z0^T v_hat``.

**2. W (and c) (two-token queries).** With an orthonormal basis ``u_1..u_d`` that has
``u_l^T v_hat = 1/sqrt(d)`` for every l (a Householder reflection of the standard basis), each
measurement uses a query token ``y = z0 + rho u_k`` (with biases also ``y = z0 - rho v_hat / sqrt(d)``)
and the first token ``y + s u`` with ``u = -+u_l``. The answer is the sign of

    q + sigma(s m) s w,   q = beta' + y^T v' (= +-rho/sqrt(d)),   w = u^T v' (= -+1/sqrt(d)),
    m = u^T (W y + c),

which is ``sign(q)`` as ``s -> 0``; a sign change at any ``s*`` gives ``sigma(s* m) = |q| / (s* |w|)``, so
``m = logit(|q| / (s* |w|)) / s*`` exactly, whichever flip is found (``s sigma(s m)`` is increasing or
unimodal in s). The flip is bracketed by doubling s from ``s0 = |q|/|w|`` (where the answer is still
``sign(q)``) and bisected to relative width ``tol``. The token scale rho is learned from the answers so
that the logit at the flip stays near ``logit_target`` (a flip at ``|logit| > 9`` is re-asked at a smaller
rho; no flip within the norm bound is re-asked at rho / 4), as :class:`~.probes.ProbeScaler` does for
value queries. Each measurement is linear in ``(W, c)``; per basis vector ``u_l`` the ``d`` (``d + 1`` with
biases) measurements are solved for ``W^T u_l`` (and ``c^T u_l``), and
``W = sum_l u_l (W^T u_l)^T`` (U is orthogonal).

**Query count** (no re-asked measurement, ``tol = 1e-12``): v's direction at most
``d + 8 (d-1) + 42 (d-1)`` (``+ d`` when v has no positive entry; with biases ``+ d + 1`` and two
~42-step bisections for z0), i.e. at most ``2d + 50 (d - 1)`` without biases; W ``d^2 (n + 1..2)`` with
``n = ceil(log2(1/tol))`` = 40, i.e. about ``42 d^2`` (``42 (d^2 + d)`` with biases). Re-asked
measurements are counted in ``diagnostics["requeried"]``. All bisections run in lockstep, one oracle
call per round and chunk.

Every loop is bounded: a bisection stops at ``max_iter`` rounds (or when float64 cannot halve its
bracket any more) with :class:`ConvergenceError`; a measurement is re-asked at most ``max_retries``
times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ...errors import ConvergenceError, NotIdentifiable
from ...oracles.base import Oracle
from ..probes import Progress, chunk_for, logit
from ..check import SINGLE, checked
from ..result import Extraction


def membership_query_bound(d: int, *, bias: bool = False, tol: float = 1e-12, coarse_steps: int = 8) -> int:
    """An upper bound on the queries of :func:`extract_membership` when no measurement is re-asked."""
    n_theta = int(np.ceil(np.log2(np.pi / tol)))
    n_s = int(np.ceil(np.log2(1.0 / tol)))
    v = 2 * d + (d - 1) * (coarse_steps + n_theta)
    if bias:
        v += 1 + 2 * (n_s + 2)
    m = d * d + (d if bias else 0)
    return v + m * (n_s + 3)


# ----------------------------------------------------------------------------------------------------
# oracle access: one call per chunk, only the bit y > 0 is used


class _Asker:
    def __init__(self, oracle: Oracle, progress: Progress):
        self.oracle = oracle
        self.progress = progress
        self.chunk = {1: chunk_for(oracle.d, 1), 2: chunk_for(oracle.d, 2)}

    def __call__(self, X: np.ndarray) -> np.ndarray:
        """Answer an (n, N, d) batch; returns the bits ``f(X) > 0`` as a bool array."""
        n = X.shape[0]
        out = np.empty(n, dtype=bool)
        step = self.chunk.get(X.shape[1], chunk_for(self.oracle.d, X.shape[1]))
        for a in range(0, n, step):
            b = min(n, a + step)
            out[a:b] = self.oracle.query(X[a:b]) > 0
            if self.progress is not None:
                self.progress(b - a)
        return out


def bisect(ask: _Asker, build, lo: np.ndarray, hi: np.ndarray, lo_bit: np.ndarray, *, width: np.ndarray,
           max_iter: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Lockstep bisection of many brackets: the bit is ``lo_bit[k]`` at ``lo[k]`` and the opposite at ``hi[k]``.

    ``build(idx, t)`` returns the (n, N, d) queries for parameters ``t`` of the items ``idx``. Item k
    stops when ``|hi[k] - lo[k]| <= width[k]``. Raises :class:`ConvergenceError` after ``max_iter``
    rounds, or as soon as float64 cannot split a bracket that is still too wide.
    """
    lo = np.array(lo, dtype=np.float64)
    hi = np.array(hi, dtype=np.float64)
    active = np.flatnonzero(np.abs(hi - lo) > width)
    for _ in range(max_iter):
        if active.size == 0:
            return lo, hi
        mid = 0.5 * (lo[active] + hi[active])
        stuck = (mid == lo[active]) | (mid == hi[active])
        if stuck.any():
            k = int(active[np.flatnonzero(stuck)[0]])
            raise ConvergenceError(
                f"{what}: float64 cannot halve the bracket [{lo[k]!r}, {hi[k]!r}] any further, but the "
                f"requested width is {width[k]:.3g}; ask for a larger tolerance")
        bit = ask(build(active, mid))
        same = bit == lo_bit[active]
        lo[active[same]] = mid[same]
        hi[active[~same]] = mid[~same]
        active = active[np.abs(hi[active] - lo[active]) > width[active]]
    if active.size:
        raise ConvergenceError(
            f"{what}: {active.size} bisection(s) still wider than the tolerance after max_iter = {max_iter} "
            "rounds (raise max_iter or the tolerance)")
    return lo, hi


# ----------------------------------------------------------------------------------------------------
# 1. v's direction


@dataclass(frozen=True)
class Direction:
    """v's direction (unit ``v``), ``beta / ||v||``, and the point ``z0`` of the hyperplane used."""

    v: np.ndarray
    beta: float
    z0: np.ndarray
    p: int
    queries: int


def _one_token(points: np.ndarray) -> np.ndarray:
    return points[:, None, :]


def _pair_probe(ask: _Asker, d: int, R: float, b0: bool) -> np.ndarray:
    """With biases, when no [+-R e_i] crosses: try the 2d(d-1) probes R (+-e_i +-e_j)/sqrt(2)."""
    if d >= 2:
        i, j = np.triu_indices(d, 1)
        dirs = []
        for a, b in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
            D = np.zeros((i.size, d))
            D[np.arange(i.size), i] = a / np.sqrt(2)
            D[np.arange(i.size), j] = b / np.sqrt(2)
            dirs.append(D)
        dirs = np.concatenate(dirs)
        flipped = np.flatnonzero(ask(_one_token(R * dirs)) != b0)
        if flipped.size:
            return dirs[int(flipped[0])]
    raise NotIdentifiable(
        "with the output bias, no single-token probe R e_i or R (e_i +- e_j)/sqrt(2) answers differently "
        f"from [0] (R = {R:g}): |beta| is at least about R max_i |v_i|; if |beta| >= R ||v|| every answer "
        "is the same inside the ball and nothing is identifiable")


def _pair_reference(ask: _Asker, r: np.ndarray, sign_r: float, z0: np.ndarray, R: float,
                    coarse_steps: int, max_iter: int) -> tuple[int, float]:
    """A coordinate with a known sign of v, from a pair probe ``r = (a e_i + b e_j)/sqrt(2)`` whose sign
    of ``v^T r`` is known: one coarse bisection on the circle spanned by r and ``r_perp`` around z0."""
    i, j = np.flatnonzero(r)
    r_perp = r.copy()
    r_perp[j] = -r_perp[j]
    rho = (R - np.linalg.norm(z0)) * (1 - 1e-12)

    def build(idx, t):
        return _one_token(z0[None, :] + rho * (np.cos(t)[:, None] * (sign_r * r)[None, :]
                                               + np.sin(t)[:, None] * r_perp[None, :]))

    lo, hi = bisect(ask, build, np.zeros(1), np.full(1, np.pi), np.ones(1, dtype=bool),
                    width=np.full(1, np.pi / 2 ** coarse_steps), max_iter=max_iter, what="v direction")
    B = -1.0 / np.tan(0.5 * (lo[0] + hi[0]))      # v^T r_perp / |v^T r|
    vi = np.sign(r[i]) * (sign_r + B)             # v_i, v_j in units of |v^T r| / sqrt(2)
    vj = np.sign(r[j]) * (sign_r - B)
    return (int(i), float(np.sign(vi))) if abs(vi) >= abs(vj) else (int(j), float(np.sign(vj)))


def recover_direction(oracle: Oracle, *, bias: bool = False, tol: float = 1e-12, coarse_steps: int = 8,
                      max_iter: int = 64, progress: Progress = None) -> Direction:
    """v's direction (and ``beta / ||v||`` with ``bias``) from single-token sign queries (step 1 above)."""
    d = oracle.d
    R = float(oracle.input_norm) if oracle.input_norm is not None else 1.0
    ask = _Asker(oracle, progress)
    q0 = oracle.queries
    I = np.eye(d)

    # signs: find p0 with a known sign of v_p0
    z0 = np.zeros(d)          # a point of the hyperplane x^T v + beta = 0 (unbiased: the origin)
    if bias:
        pts = np.concatenate([np.zeros((1, d)), R * I, -R * I])
        bits = ask(_one_token(pts))
        b0 = bool(bits[0])                       # [beta > 0]
        flipped = np.flatnonzero(bits[1:] != b0)
        if flipped.size:
            k = int(flipped[0])
            p0, s0 = (k, 1.0) if k < d else (k - d, -1.0)
            direction = s0 * I[p0]
        else:
            p0, s0, direction = -1, 1.0, _pair_probe(ask, d, R, b0)
        lo, hi = bisect(ask, lambda idx, t: _one_token(t[:, None] * direction[None, :]),
                        np.zeros(1), np.full(1, R), np.array([b0]), width=np.full(1, tol * R),
                        max_iter=max_iter, what="hyperplane point")
        z0 = 0.5 * (lo[0] + hi[0]) * direction
        # the probe R*direction answered (not b0): v^T direction > 0 if beta <= 0, < 0 otherwise
        sign_dir = -1.0 if b0 else 1.0
        if p0 < 0:
            p0, sign_p0 = _pair_reference(ask, direction, sign_dir, z0, R, coarse_steps, max_iter)
        else:
            sign_p0 = sign_dir * s0
    else:
        b0 = False
        bits = ask(_one_token(R * I))
        pos = np.flatnonzero(bits)
        if pos.size:
            p0, sign_p0 = int(pos[0]), 1.0
        else:
            bits = ask(_one_token(-R * I))
            neg = np.flatnonzero(bits)
            if neg.size == 0:
                raise NotIdentifiable(
                    "v = 0: every answer is 0 (f(X) = 0 for all X), whatever W is, so nothing is "
                    "identifiable from sign-only answers")
            p0, sign_p0 = int(neg[0]), -1.0

    def circle_pass(p, sign_p, z0, lo, hi, others, steps_width):
        rho = (R - np.linalg.norm(z0)) * (1 - 1e-12)
        ep = sign_p * I[p]

        def build(idx, t):
            i = others[idx]
            pts = z0[None, :] + rho * np.cos(t)[:, None] * ep[None, :]
            pts[np.arange(len(idx)), i] += rho * np.sin(t)
            return _one_token(pts)

        return bisect(ask, build, lo, hi, np.ones(len(others), dtype=bool),
                      width=np.full(len(others), steps_width), max_iter=max_iter, what="v direction")

    def assemble(p, sign_p, others, lo, hi):
        t = 0.5 * (lo + hi)
        v = np.empty(d)
        v[p] = sign_p
        v[others] = -1.0 / np.tan(t)
        return v / np.linalg.norm(v)

    # coarse pass against p0
    others = np.delete(np.arange(d), p0)
    lo = np.zeros(len(others))
    hi = np.full(len(others), np.pi)
    if len(others):
        lo, hi = circle_pass(p0, sign_p0, z0, lo, hi, others, np.pi / 2 ** coarse_steps)
    v_coarse = assemble(p0, sign_p0, others, lo, hi)
    p = int(np.argmax(np.abs(v_coarse)))
    sign_p = float(np.sign(v_coarse[p]))

    if bias:
        # move z0 to (nearly) the closest point of the hyperplane to 0: bisect along -+v_coarse
        direction = (-1.0 if b0 else 1.0) * v_coarse
        end = R * (1 - 1e-12)
        if ask(_one_token((end * direction)[None, :]))[0] != b0:
            lo_t, hi_t = bisect(ask, lambda idx, t: _one_token(t[:, None] * direction[None, :]),
                                np.zeros(1), np.full(1, end), np.array([b0]), width=np.full(1, tol * R),
                                max_iter=max_iter, what="hyperplane point")
            z0 = 0.5 * (lo_t[0] + hi_t[0]) * direction

    if p != p0:
        others = np.delete(np.arange(d), p)
        lo = np.zeros(len(others))
        hi = np.full(len(others), np.pi)
    # fine pass (the flip angle does not depend on which point of the hyperplane is the centre)
    if len(others):
        lo, hi = circle_pass(p, sign_p, z0, lo, hi, others, tol)
    v = assemble(p, sign_p, others, lo, hi)
    beta = float(-z0 @ v) if bias else 0.0
    return Direction(v=v, beta=beta, z0=z0, p=p, queries=oracle.queries - q0)


# ----------------------------------------------------------------------------------------------------
# 2. W (and c)


def householder_basis(v: np.ndarray) -> np.ndarray:
    """An orthonormal basis (the columns of the returned matrix) with ``u_l^T v = ||v|| / sqrt(d)`` for all l.

    The Householder reflection that maps ``1/sqrt(d)`` (the normalised all-ones vector) onto
    ``v/||v||``, applied to the standard basis.
    """
    d = v.shape[0]
    vhat = v / np.linalg.norm(v)
    e = np.full(d, 1.0 / np.sqrt(d))
    n = e - vhat
    nn = float(n @ n)
    if nn < 1e-30:
        return np.eye(d)
    return np.eye(d) - 2.0 * np.outer(n, n) / nn


@dataclass
class _RhoScale:
    """The query-token scale rho, learned from the logits at the flips (cf. ProbeScaler)."""

    rho_max: float
    T: float = 1.0
    t_sat: float = 9.0
    warmup: int = 16
    r: float = 0.0          # running max of |t*| / rho
    seen: int = 0

    @property
    def rho(self) -> float:
        return self.rho_max if self.r <= 0 else min(self.rho_max, self.T / self.r)

    def chunk_size(self, max_chunk: int) -> int:
        if self.seen >= self.warmup:
            return max_chunk
        return max(1, min(max_chunk, 2 ** int(np.log2(self.seen + 1))))

    def update(self, t: np.ndarray, rho: np.ndarray) -> None:
        if t.size:
            self.r = max(self.r, float(np.max(np.abs(t) / rho)))
        self.seen += t.size


def _measure(ask: _Asker, U, D, vhat, z0, R, items_l, items_k, rho, *, tol, max_iter):
    """One round of measurements ``m = u_l^T (W y + c)`` for ``y = z0 + rho D_k``.

    Returns (m, t, ok, nocross): the measurement, the logit at the flip, whether it is usable, and
    whether no flip was found inside the norm bound.
    """
    n = len(items_l)
    d = U.shape[0]
    Dk = D[:, items_k].T                                   # (n, d)
    y = z0[None, :] + rho[:, None] * Dk
    q = rho * (Dk @ vhat)                                  # beta' + z0^T v_hat = 0 by construction
    sgn = np.where(q > 0, 1.0, -1.0)
    u = -sgn[:, None] * U[:, items_l].T                    # (n, d): w = u^T v_hat has the sign of -q
    w = u @ vhat
    s0 = np.abs(q) / np.abs(w)
    smax = (R - np.linalg.norm(y, axis=1)) * (1 - 1e-12)
    lo_bit = q > 0

    def build(idx, s):
        X = np.empty((len(idx), 2, d))
        X[:, 1, :] = y[idx]
        X[:, 0, :] = y[idx] + s[:, None] * u[idx]
        return X

    # bracket the flip: s0 (answer sign(q), no query needed), then 2 s0, 4 s0, ..., smax
    lo = s0.copy()
    hi = np.full(n, np.nan)
    todo = np.flatnonzero(smax > s0)
    cur = s0.copy()
    for _ in range(64):
        if todo.size == 0:
            break
        nxt = np.minimum(2 * cur[todo], smax[todo])
        bit = ask(build(todo, nxt))
        hit = bit != lo_bit[todo]
        hi[todo[hit]] = nxt[hit]
        lo[todo[~hit]] = nxt[~hit]
        cur[todo] = nxt
        todo = todo[~hit & (nxt < smax[todo])]
    found = np.isfinite(hi)
    m = np.full(n, np.nan)
    t = np.full(n, np.nan)
    if found.any():
        f = np.flatnonzero(found)
        blo, bhi = bisect(ask, lambda idx, s: build(f[idx], s), lo[f], hi[f], lo_bit[f],
                          width=tol * lo[f], max_iter=max_iter, what="W measurement")
        s_star = 0.5 * (blo + bhi)
        alpha = s0[f] / s_star                              # sigma(s* m) = |q| / (s* |w|)
        with np.errstate(divide="ignore", invalid="ignore"):
            tt = logit(np.clip(alpha, 1e-300, 1 - 1e-16))
        t[f] = tt
        m[f] = -sgn[f] * tt / s_star                        # undo the sign flip of u: m = u_l^T (W y + c)
    ok = found & np.isfinite(t)
    return m, t, ok, ~found


@checked(SINGLE, reads="signs")
def extract_membership(
    oracle: Oracle,
    *,
    bias: bool = False,
    tol: float = 1e-12,
    coarse_steps: int = 8,
    max_iter: int = 64,
    max_retries: int = 6,
    logit_target: float = 1.0,
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
) -> Extraction:
    """Recover v's direction and W (and ``beta/||v||``, c with ``bias``) from sign-only answers.

    Args:
        oracle: the black box; only the bit ``answer > 0`` is used (pass a
            :class:`~headthief.oracles.SignOnly` oracle to model the threat). Tokens respect its
            ``input_norm`` (R = 1 when it has none).
        bias: the target may have a score bias c and an output bias beta.
        tol: bisection tolerance: flip angles to ``tol`` radians, flip scales to relative ``tol``.
        coarse_steps: bisection steps of the coarse pass that picks the reference coordinate of v.
        max_iter: cap on the rounds of every bisection (then :class:`ConvergenceError`).
        max_retries: cap on the re-asks of one W measurement (then :class:`ConvergenceError`).
        logit_target: the logit at the flip that the token scale aims for.
        rng: unused (the algorithm is deterministic); accepted for a uniform signature.
        progress: called with the number of queries answered after each oracle call.

    Returns:
        An :class:`Extraction` with ``v_scale_known=False``: ``v`` has unit norm (only its direction is
        identifiable), ``beta`` is ``beta/||v||`` (with ``bias``), W and c are on their true scale.
    """
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    if max_iter < 1 or max_retries < 0 or coarse_steps < 1:
        raise ValueError("max_iter and coarse_steps must be >= 1 and max_retries >= 0")
    t0 = time.perf_counter()
    q0, calls0 = oracle.queries, oracle.calls
    d = oracle.d
    R = float(oracle.input_norm) if oracle.input_norm is not None else 1.0
    ask = _Asker(oracle, progress)

    direc = recover_direction(oracle, bias=bias, tol=tol, coarse_steps=coarse_steps, max_iter=max_iter,
                              progress=progress)
    vhat, z0 = direc.v, direc.z0
    v_queries = oracle.queries - q0

    U = householder_basis(vhat)
    D = U.copy()
    if bias:
        D = np.concatenate([(-vhat / np.sqrt(d))[:, None], U], axis=1)   # D_0 = -v_hat/sqrt(d), D_k = u_k
    K = D.shape[1]
    L_idx, K_idx = np.meshgrid(np.arange(d), np.arange(K), indexing="ij")
    L_idx, K_idx = L_idx.ravel(), K_idx.ravel()
    nmeas = L_idx.size
    rho_c = R - float(np.linalg.norm(z0))
    if rho_c <= 0:
        raise NotIdentifiable(f"the hyperplane f = 0 does not meet the ball ||x|| < R = {R:g}")
    scale = _RhoScale(rho_max=rho_c / 4, T=logit_target)
    rho_used = np.full(nmeas, np.nan)
    M = np.full(nmeas, np.nan)
    T_at = np.full(nmeas, np.nan)
    requeried = 0
    max_chunk = max(1, chunk_for(d))
    start = 0
    while start < nmeas:
        idx = np.arange(start, min(nmeas, start + scale.chunk_size(max_chunk)))
        rho = np.full(idx.size, scale.rho)
        todo = np.arange(idx.size)
        for attempt in range(max_retries + 1):
            k = idx[todo]
            m, t, ok, nocross = _measure(ask, U, D, vhat, z0, R, L_idx[k], K_idx[k], rho[todo],
                                         tol=tol, max_iter=max_iter)
            good = ok & (np.abs(np.nan_to_num(t, nan=np.inf)) <= scale.t_sat)
            M[k[good]] = m[good]
            T_at[k[good]] = t[good]
            rho_used[k[good]] = rho[todo[good]]
            bad = ~good
            if not bad.any():
                break
            if attempt == max_retries:
                raise ConvergenceError(
                    f"{int(bad.sum())} W measurement(s) found no usable sign flip inside the norm bound "
                    f"after {max_retries} re-asks at smaller token scales")
            requeried += int(bad.sum())
            tb = t[bad]
            shrink = np.where(nocross[bad] | ~np.isfinite(tb), 0.25,
                              np.minimum(0.5, scale.T / np.maximum(np.abs(tb), 1e-300)))
            rho[todo[bad]] *= shrink
            todo = todo[bad]
        scale.update(T_at[idx], rho_used[idx])
        start = idx[-1] + 1

    # solve, per basis vector u_l: measurements m_lk = [W^T u_l; c^T u_l] . [y_lk; 1]
    M = M.reshape(d, K)
    rho_used = rho_used.reshape(d, K)
    Y = z0[None, :, None] + rho_used[:, None, :] * D[None, :, :]        # (d, d, K): columns y_lk
    if bias:
        Yt = np.concatenate([Y, np.ones((d, 1, K))], axis=1)          # (d, d+1, d+1)
    else:
        Yt = Y
    A = np.linalg.solve(np.transpose(Yt, (0, 2, 1)), M[:, :, None])[:, :, 0]   # rows: [W^T u_l (; c^T u_l)]
    W = U @ A[:, :d]
    c = U @ A[:, d] if bias else None
    conds = np.linalg.cond(Yt)
    diagnostics = {
        "v_scale_known": False,
        "identifiable": "v and beta up to one positive scale (v is returned with unit norm, beta as "
                        "beta/||v||); W and c exactly",
        "v_queries": v_queries,
        "W_queries": oracle.queries - q0 - v_queries,
        "reference_coordinate": direc.p,
        "requeried": requeried,
        "oracle_calls": oracle.calls - calls0,
        "tol": tol,
        "input_norm": R,
        "rho_max": scale.rho_max,
        "rho_min_used": float(np.min(rho_used)),
        "max_abs_logit": float(np.max(np.abs(T_at))),
        "design_cond": float(np.max(conds)),
    }
    return Extraction(
        method="membership", W=W, v=vhat, c=c, beta=direc.beta if bias else None,
        rank=int(np.linalg.matrix_rank(W)), queries=oracle.queries - q0,
        seconds=time.perf_counter() - t0, diagnostics=diagnostics, v_scale_known=False)
