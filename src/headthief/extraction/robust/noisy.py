"""Our estimator for answers within +-tau under an input-norm bound R (Section 6's setting).

Same oracle, same bound ``||x_i|| <= R`` and the same ``d + d^2`` queries as Theorem 6.1
(:mod:`~headthief.extraction.robust.noisy_paper`); far smaller errors, because the probes are chosen to
minimise the error amplification of the sigmoid inversion instead of being fixed from the worst case.

Why the paper's probes lose signal. A two-row probe ``[x1; x2]`` answers
``y = x2^T v + alpha (x1 - x2)^T v`` with ``alpha = sigma(t)``, ``t = (x1 - x2)^T W x2``. An answer error
``eta`` becomes an error ``eta / (|(x1 - x2)^T v| alpha (1 - alpha))`` in ``t``, and dividing ``t`` by the
scale of ``x2`` and ``x1 - x2`` multiplies it again. The paper's ``x2 = e_j / 2``, ``x1 - x2 = e_i / W``
(``b = 1/W``, from the worst case ``|W_ij| <= ||W||_F``) gives a per-entry error of about
``8 W^2 tau / |v_i|``: at ``||W||_F = 32`` the signal is a thousandth of what the norm bound allows.

Our probes (column j, row k, scale ``rho <= R``):

- query token ``x2 = rho e_j`` and first token ``x1 = rho u_k`` with ``u_k = +-e_k`` (``k != j``) and
  ``u_j = -e_j``: ``x1 - x2 = rho (u_k - e_j)`` has norm ``sqrt(2) rho`` (``2 rho`` on the diagonal) while
  both tokens stay within R, and the sign of ``u_k`` is chosen so that ``v_k`` and ``v_j`` add:
  ``|(u_k - e_j)^T v| = |v_k| + |v_j|`` (the paper's ``|v_i|``). Each answer gives
  ``g_k = (u_k - e_j)^T w_j`` (``w_j`` = column j) and the d answers of a column are solved for ``w_j``
  (``W_jj = -g_j / 2``, ``W_kj = +-(g_k + W_jj)``).
- zeros (or tiny entries) of v: a row whose coefficient ``|v_k| + |v_j|`` is small gets
  ``u_k = (+-e_k +- e_p) / sqrt(2)`` (``p`` the largest ``|v|``), where that lowers the predicted error;
  the column's square system stays invertible.
- the operating point: the error of an entry is about
  ``tau (1/rho + 1.5/R) / (|coefficient| rho^2 sigma'(rho^2 g))``, so ``rho`` is chosen per oracle call by
  minimising its mean square over the ``|g|`` measured so far (the oracle's own answers tell us the scale
  of W) plus a hedge above the largest one; when ``tau`` is given the model is not first-order but
  the exact logit error of an attention weight off by its bound (near saturation the inversion is far
  from linear, and high noise keeps the operating point near alpha = 1/2). Columns
  are measured in order of decreasing ``|v_j|``, the first in calls of 1, 1, 2, 4, ... queries, later
  ones in two calls: a pilot of ``d/8`` rows, then the rest at a scale re-fitted to that column's
  pilot. Within a column, the rows with the largest coefficients go first.
- biases (``bias=True``): ``beta = f([0])`` and ``c^T u_k`` from ``[rho u_k; 0]`` (``d + 1`` more
  queries), subtracted from the logits.
- rounding (``round:K``) is not symmetric noise: it is a deterministic function of the value, so no
  averaging is assumed anywhere; only its bound ``tau = 0.5 10^-K`` is used (for the margin).
- saturation: a probe whose answer shows a logit beyond twice the largest expected (more than the
  answer's error can explain) is asked again at half the scale (``reask``, counted in
  ``diagnostics["requeried"]``). That happens on heads whose W has a column or an entry far larger
  than the rest (a few re-asks save those entries); on the benchmark's random heads it never does.
- ``W_bound`` (optional): the first probe's scale is the one that bound makes safe (then the scale
  grows at most 2x per call), and the estimate is projected onto ``||W||_F <= W_bound`` (a convex set
  that holds the truth, so the projection never adds error).
- ``extra`` > 0 spends ``extra`` more probes per column (``u = (+-e_a +- e_b)/sqrt(2)``, random pairs)
  and solves each column by weighted least squares.

Query count: ``d + d^2`` (``d^2 + 2d + 1`` with biases), plus ``extra * d``, plus re-asks of saturated
probes (``diagnostics["requeried"]``, 0 unless W has outlying columns).
"""

from __future__ import annotations

import time

import numpy as np
import scipy.linalg
from scipy.special import expit

from ...errors import ConvergenceError, NotIdentifiable
from ...oracles.base import Oracle
from ..probes import Progress, chunk_for, logit
from ..check import SINGLE, checked
from ..result import Extraction

SQRT1_2 = np.sqrt(0.5)


def noisy_query_count(d: int, *, bias: bool = False, extra: int = 0) -> int:
    """The query count of :func:`extract_noisy`."""
    return d * d + d + (d + 1 if bias else 0) + extra * d


def _log_sigma_prime(t: np.ndarray) -> np.ndarray:
    """log(sigma(t) (1 - sigma(t))), stable for large |t|."""
    a = np.abs(t)
    return -a - 2.0 * np.log1p(np.exp(-a))


class _Scale:
    """Chooses the probe scale rho from the |g| measured so far (see the module docstring)."""

    def __init__(self, *, R: float, q: int, a_f: float, a_v: float, tau: float, prior: float | None):
        self.R, self.q, self.a_f, self.a_v, self.tau, self.prior = R, q, a_f, a_v, tau, prior
        self.samples: list[np.ndarray] = []
        self.grid = R * np.geomspace(1e-4, 1.0, 161)
        self.last: float | None = None     # the previous call's rho: rho grows at most 2x per call

    def history(self) -> np.ndarray:
        return np.abs(np.concatenate(self.samples)) if self.samples else np.zeros(0)

    def choose(self, S: np.ndarray, kappa: float) -> tuple[float, float]:
        """Return (rho, t_cap) for the next call given the samples S of |g| and a small coefficient.

        The predicted error of a measurement ``g`` at scale rho is ``err_t / rho^q`` with ``err_t`` the
        logit error an attention-weight error ``eps = tau (a_f/rho + a_v/R) / kappa`` causes at
        ``t = rho^q g`` (both signs, clipped at ``t_cap``); without a known tau, its first-order form
        ``(a_f/rho + a_v/R) / (rho^q sigma'(t))``. rho minimises the mean square over S and a hedge.
        """
        S = np.abs(S[np.isfinite(S)])
        if S.size == 0 or not S.max() > 0:
            if self.prior is None or self.last is not None:
                # nothing seen (or only zeros): the largest scale, or twice the last one
                rho = self.R if self.last is None else min(self.R, 2.0 * self.last)
                self.last = rho
                return rho, 30.0
            S, h = np.array([self.prior]), self.prior
        else:
            h = float(S.max()) * (1.25 + 2.0 / np.sqrt(S.size))
            if S.size > 128:
                S = np.quantile(S, np.linspace(0.0, 1.0, 128))
        S = np.append(S, h)
        rho = self.grid
        t = rho[:, None] ** self.q * S[None, :]
        t_cap = np.minimum(2.0 * rho ** self.q * h + 2.0, 30.0)
        amp = self.a_f / rho + self.a_v / self.R
        if self.tau > 0 and kappa > 0:
            eps = (self.tau * amp / kappa)[:, None]
            lo, hi = expit(-t_cap)[:, None], expit(t_cap)[:, None]
            a = expit(t)
            up = logit(np.minimum(a + eps, hi)) - t
            down = t - logit(np.maximum(a - eps, lo))
            err = np.maximum(np.maximum(up, down), 0.0) / rho[:, None] ** self.q
            F = np.log(np.sqrt(np.mean(err ** 2, axis=1)) + 1e-300)
        else:
            log_err = (np.log(amp) - self.q * np.log(rho))[:, None] - _log_sigma_prime(t)
            m = log_err.max(axis=1, keepdims=True)
            F = m[:, 0] + np.log(np.mean(np.exp(2 * (log_err - m)), axis=1)) / 2   # log RMS error
        if self.last is not None:
            F = np.where(rho <= 2.0 * self.last * (1 + 1e-12), F, np.inf)
        i = int(np.argmin(F))
        self.last = float(rho[i])
        return float(rho[i]), float(t_cap[i])


def _best_signs(cands: list[np.ndarray], v: np.ndarray, offset: float) -> tuple[np.ndarray, float]:
    """Among candidate u's, the one with the largest |u^T v - offset|."""
    vals = [abs(float(u @ v) - offset) for u in cands]
    i = int(np.argmax(vals))
    return cands[i], vals[i]


def _column_design(v: np.ndarray, j: int, p: int) -> tuple[np.ndarray, int]:
    """Rows u_k of column j's probes (first token rho u_k, query token rho e_j); returns (U, mixed).

    Pure rows ``u_k = s e_k`` (k != j) and ``u_j = -e_j``, with the sign s making
    ``|(u_k - e_j)^T v| = |v_k| + |v_j|``; a row becomes ``(s1 e_k + s2 e_p) / sqrt(2)`` where that
    lowers the predicted error (first-order error propagation through the column's solve).
    """
    d = v.shape[0]
    idx = np.arange(d)
    vj, vp = v[j], v[p]
    # pure rows
    s = np.where(v * vj > 0, -1.0, 1.0)
    s[j] = -1.0
    kap = np.abs(s * v - vj)
    kap[j] = 2.0 * abs(vj)
    kp = kap[p]
    # mixed rows: the best of the four sign pairs (k != j), s1 = -1 for the diagonal row
    s1 = np.array([1.0, 1.0, -1.0, -1.0])[:, None]
    s2 = np.array([1.0, -1.0, 1.0, -1.0])[:, None]
    km_all = np.abs((s1 * v[None, :] + s2 * vp) * SQRT1_2 - vj)     # (4, d)
    km_all[:2, j] = -1.0                                               # diagonal: only s1 = -1
    best = np.argmax(km_all, axis=0)
    km = km_all[best, idx]
    with np.errstate(divide="ignore"):
        pure_err = np.where(kap > 0, 1.0 / kap, np.inf)
        pure_err[j] = 1.0 / (2.0 * kap[j]) if kap[j] > 0 else np.inf
        mixed_err = np.where(km > 0, np.sqrt(2.0) / km + 1.0 / kp, np.inf)
        if km[j] > 0:
            mixed_err[j] = (1.0 / km[j] + SQRT1_2 / kp) / (1.0 + SQRT1_2)
    mix = mixed_err < pure_err
    mix[p] = False
    U = np.zeros((d, d))
    U[idx, idx] = s
    rows = np.flatnonzero(mix)
    U[rows, rows] = s1[best[rows], 0] * SQRT1_2
    U[rows, p] = s2[best[rows], 0] * SQRT1_2
    return U, int(mix.sum())


def _extra_rows(v: np.ndarray, j: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """``m`` extra rows ``(+-e_a +- e_b) / sqrt(2)`` on random pairs, signs maximising the coefficient."""
    d = v.shape[0]
    e = np.eye(d)
    rows = []
    for _ in range(m):
        a, b = rng.choice(d, size=2, replace=False) if d > 1 else (0, 0)
        cands = [(s1 * e[a] + s2 * e[b]) * SQRT1_2 for s1 in (1.0, -1.0) for s2 in (1.0, -1.0)]
        rows.append(_best_signs(cands, v, v[j])[0])
    return np.array(rows).reshape(m, d)


def _invert(y, base, coef, t_cap, eps):
    """t = logit(alpha), alpha = (y - base) / coef, clipped to |t| <= t_cap.

    Returns (t, clipped, beyond): ``beyond`` marks the answers that no error within ``eps`` (the
    attention weight's error bound) can explain with ``|t| <= t_cap``: the probe saturated.
    """
    alpha = (y - base) / coef
    t_cap = np.minimum(t_cap, 30.0)
    lo, hi = expit(-t_cap), expit(t_cap)
    clipped = (alpha <= lo) | (alpha >= hi)
    beyond = (alpha < lo - eps) | (alpha > hi + eps)
    return logit(np.clip(alpha, lo, hi)), clipped, beyond


@checked(SINGLE)
def extract_noisy(
    oracle: Oracle,
    *,
    tau: float = 0.0,
    W_bound: float | None = None,
    bias: bool = False,
    extra: int = 0,
    reask: bool = True,
    max_retries: int = 8,
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
) -> Extraction:
    """Recover (W, v) (and c, beta with ``bias``) from answers within +-tau (see the module docstring).

    Args:
        oracle: the black box; its ``input_norm`` R bounds every token (None reads as R = 1).
        tau: the answers' tolerance, if known (0: unknown). Used only to keep probes away from
            saturation; the estimator never averages repeated answers.
        W_bound: a known bound on ``||W||_F`` (optional): makes the very first probe's scale safe.
        bias: the target may have a score bias c and an output bias beta (``d + 1`` more queries).
        extra: extra probes per column, solved by weighted least squares.
        reask: re-ask a probe whose attention weight saturated (outside ``sigma(+-t_cap)`` by more than
            the answer's error can explain; ``t_cap`` is twice the largest logit expected from the
            answers so far, plus 2) at half the scale, at most ``max_retries`` times; counted in
            ``diagnostics["requeried"]``. None happen on heads whose columns have similar scales; with
            ``reask=False`` the count is exact and a saturated entry keeps its clipped estimate.
        rng: generator (or seed) for the extra probes' pairs.
        progress: called with the number of queries answered after each oracle call.

    Returns:
        An :class:`Extraction` with ``queries = noisy_query_count(d, bias=bias, extra=extra)`` plus
        ``diagnostics["requeried"]``.

    Raises:
        NotIdentifiable: v = 0 (within the tolerance).
        ConvergenceError: a probe still saturates after ``max_retries`` halvings of its scale.
    """
    if not (np.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be a finite number >= 0, got {tau}")
    if W_bound is not None and not (np.isfinite(W_bound) and W_bound > 0):
        raise ValueError(f"W_bound must be a positive number, got {W_bound}")
    if int(extra) < 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    extra = int(extra)
    rng = np.random.default_rng(rng)
    t0 = time.perf_counter()
    q0, calls0 = oracle.queries, oracle.calls
    d = oracle.d
    R = float(oracle.input_norm) if oracle.input_norm is not None else 1.0
    chunk = chunk_for(d)

    def ask(X):
        y = oracle.query(X)
        if progress:
            progress(X.shape[0])
        return y

    # 1. beta = f([0]); v_i = (f([R e_i]) - beta) / R
    beta = float(ask(np.zeros((1, 1, d)))[0]) if bias else 0.0
    v = np.empty(d)
    for start in range(0, d, chunk):
        stop = min(d, start + chunk)
        X = np.zeros((stop - start, 1, d))
        X[np.arange(stop - start), 0, np.arange(start, stop)] = R
        v[start:stop] = (ask(X) - beta) / R
    tau_v = (2.0 if bias else 1.0) * tau / R
    vmax = float(np.max(np.abs(v)))
    if vmax <= max(tau_v, 1e-12 * max(1.0, abs(beta))):
        raise NotIdentifiable(
            "v = 0 (every |v_hat_i| is within the answers' tolerance): the answer never depends on the "
            "attention weights, so W is not identifiable from value queries")
    p = int(np.argmax(np.abs(v)))
    a_f = 2.0 if bias else 1.0
    stats = {"clipped": 0, "requeried": 0, "mixed_rows": 0}
    rhos: list[float] = []

    def measure(U, kap, rows, rho, t_cap, *, j=None, cD=None):
        """Ask the probes ``rows`` at scale rho; re-ask saturated ones at half the scale.

        W probes (column j): ``[rho u; rho e_j]``, ``g = (t - rho c^T (u - e_j)) / rho^2``.
        c probes (j None): ``[rho u; 0]``, ``g = t / rho``. Returns (g, t, rho per row).
        """
        n = len(rows)
        g, t, rr = np.empty(n), np.empty(n), np.full(n, rho)
        todo = np.arange(n)
        for attempt in range(max_retries + 1):
            k = rows[todo]
            r = rr[todo]
            X = np.zeros((len(k), 2, d))
            X[:, 0, :] = r[:, None] * U[k]
            if j is not None:
                X[:, 1, j] = r
            y = ask(X)
            base = beta + (r * v[j] if j is not None else 0.0)
            eps = tau * (a_f / r + 1.5 / R) / np.abs(kap[k])
            cap = t_cap + (np.abs(r * cD[k]) if j is not None else 0.0)   # the score bias shifts t
            tk, clipped, sat = _invert(y, base, r * kap[k], cap, eps)
            t[todo] = tk
            g[todo] = (tk - r * cD[k]) / r ** 2 if j is not None else tk / r
            rhos.extend(np.unique(r).tolist())
            stats["clipped"] += int(clipped.sum())
            if not (sat.any() and reask):
                return g, t, rr
            todo = todo[sat]
            if attempt == max_retries:
                raise ConvergenceError(
                    f"{todo.size} probe(s) still saturated after {max_retries} re-asks at halved scales")
            rr[todo] *= 0.5
            if tau > 0:   # noise-limited: a smaller scale would only add noise
                todo = todo[tau * (a_f / rr[todo] + 1.5 / R) / np.abs(kap[rows[todo]]) <= 0.25]
            if todo.size == 0:
                return g, t, rr
            stats["requeried"] += int(todo.size)
        raise AssertionError("unreachable")  # pragma: no cover

    # 2. score bias c: c^T u_k from [rho u_k; 0]
    c = np.zeros(d)
    if bias:
        Uc = np.empty((d, d))
        kc = np.empty(d)
        e = np.eye(d)
        for k in range(d):
            pure, kp_ = e[k], abs(v[k])
            if k != p:
                u, km = _best_signs([(e[k] + s * e[p]) * SQRT1_2 for s in (1.0, -1.0)], v, 0.0)
                if km > 0 and (kp_ == 0 or np.sqrt(2.0) / km + 1.0 / abs(v[p]) < 1.0 / kp_):
                    pure = u
                    stats["mixed_rows"] += 1
            Uc[k], kc[k] = pure, float(pure @ v)
        order = np.argsort(-np.abs(kc), kind="stable")
        sc = _Scale(R=R, q=1, a_f=2.0, a_v=1.0, tau=tau, prior=None)
        gc = np.empty(d)
        done = 0
        while done < d:
            n = min(d - done, max(1, done), chunk)
            rows = order[done:done + n]
            rho, t_cap = sc.choose(sc.history(), float(np.quantile(np.abs(kc[order[done:]]), 0.2)))
            gc[rows], _, _ = measure(Uc, kc, rows, rho, t_cap)
            sc.samples.append(gc[rows])
            done += n
        c = scipy.linalg.solve(Uc, gc)

    # 3. W, column by column (largest |v_j| first)
    prior = 2.0 * W_bound if W_bound is not None else None
    scale = _Scale(R=R, q=2, a_f=a_f, a_v=1.5, tau=tau, prior=prior)
    W = np.empty((d, d))
    pilot = max(1, -(-d // 8))
    for n_col, j in enumerate(np.argsort(-np.abs(v), kind="stable")):
        U, mixed = _column_design(v, j, p)
        stats["mixed_rows"] += mixed
        if extra:
            U = np.vstack([U, _extra_rows(v, j, extra, rng)])
        m = U.shape[0]
        D = U.copy()
        D[:, j] -= 1.0                                     # rows (u_k - e_j)
        kap = D @ v                                        # coefficient of alpha (per unit rho)
        cD = D @ c
        order = np.argsort(-np.abs(kap), kind="stable")
        g = np.empty(m)
        wts = np.empty(m)
        hist = scale.history()
        done = 0
        while done < m:
            if n_col == 0:
                n = min(m - done, max(1, done))
            elif done == 0:
                n = min(m, pilot)
            else:
                n = m - done
            n = min(n, chunk)
            rows = order[done:done + n]
            S = hist
            if n_col > 0 and done > 0:
                here = np.abs(g[order[:done]])
                if hist.size:
                    f = np.sqrt(np.mean(here ** 2)) / max(np.sqrt(np.mean(hist ** 2)), 1e-300)
                    S = np.concatenate([hist * (f if (f < 0.5 or f > 2.0) else 1.0), here])
                else:
                    S = here
            elif n_col == 0:
                S = np.abs(g[order[:done]])
            rho, t_cap = scale.choose(S, float(np.quantile(np.abs(kap[order[done:]]), 0.2)))
            g[rows], t, rr = measure(U, kap, rows, rho, t_cap, j=j, cD=cD)
            wts[rows] = np.abs(kap[rows]) * rr ** 3 * np.exp(_log_sigma_prime(t)) / (1 + 1.5 * rr / R)
            done += n
        scale.samples.append(g)
        if extra:
            W[:, j] = scipy.linalg.lstsq(D * wts[:, None], g * wts)[0]
        else:
            W[:, j] = scipy.linalg.solve(D, g)

    projected = False
    if W_bound is not None and np.linalg.norm(W) > W_bound:
        # the truth lies in the convex ball ||W||_F <= W_bound: projecting onto it never adds error
        W *= W_bound / np.linalg.norm(W)
        projected = True
    rh = np.array(rhos)
    diagnostics = {
        "tau": float(tau), "input_norm": R, "W_bound": W_bound, "extra": extra,
        **stats, "projected": projected,
        "rho_min": float(rh.min()), "rho_median": float(np.median(rh)), "rho_max": float(rh.max()),
        "oracle_calls": oracle.calls - calls0,
    }
    return Extraction(method="noisy", W=W, v=v, c=c if bias else None, beta=beta if bias else None,
                      rank=int(np.linalg.matrix_rank(W)), queries=oracle.queries - q0,
                      seconds=time.perf_counter() - t0, diagnostics=diagnostics)
