"""Two-row probes shared by every value-query algorithm: scaling and sigmoid inversion.

The key identity (Theorem 4.1, eq. (1); Theorem 5.1): for the two-token query
``X = [s u + lam b ; lam b]`` the head's two scores differ by

    t = s1 - s2 = s lam u^T W b + s c^T u,

so the attention on the first token is ``alpha = sigma(t)`` and the answer is

    y = beta + lam b^T v + alpha * s u^T v.

Knowing v, c, beta, one query gives ``alpha``, hence ``t = logit(alpha)``, hence one bilinear
measurement ``g = u^T W b``.  Likewise ``X = [s u ; 0]`` gives ``t = s c^T u`` (the score bias).

Choosing the scales.  The paper uses s = lam = 1.  In float64 any moderate scale is exact, but a
float32 head rounds its answer to ~6e-8 relative, and the logit amplifies that error by
``1 / (alpha (1 - alpha))`` while dividing by ``s lam``: unit probes on a head with small scores
leave ``alpha ~ 1/2 + tiny`` and lose most digits.  :class:`ProbeScaler` therefore chooses, per
probe, ``s lam = T / m`` where ``m`` is the largest normalised measurement seen so far (so the logit
stays within a few units), learned from the oracle's own answers: the first measurements of a run are
taken in geometrically growing chunks (1, 2, 4, ...) so the scale settles after a handful of queries.
``s`` is capped so that the score-bias part ``s c^T u`` stays below ``Tc``; the remaining factor goes
to ``lam``.  A probe whose answer still saturates (``|t|`` above ``t_max`` or alpha outside (0, 1)) is
asked again at a smaller scale, at most ``max_retries`` times, and the extra queries are reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import ConvergenceError, NotIdentifiable
from ..oracles.base import Oracle
from ..linalg import svd

Progress = Callable[[int], None] | None


def logit(p: np.ndarray) -> np.ndarray:
    """sigma^{-1}(p) = log(p / (1 - p))."""
    return np.log(p) - np.log1p(-p)


@dataclass(frozen=True)
class Known:
    """What is already recovered when W is measured: v, and the biases (zeros/0 for the paper's model)."""

    v: np.ndarray
    c: np.ndarray
    beta: float


@dataclass
class ProbeScaler:
    """Chooses probe scales from the answers seen so far (see the module docstring)."""

    T: float = 1.0          # target |logit| of the largest measurement seen so far
    Tc: float = 1.0         # cap on |s c^T u|
    rho: float = 4.0        # preferred ratio of the first token's scale to the second's
    t_max: float = 9.0      # re-ask a probe whose |logit| is above this
    max_retries: int = 8
    warmup: int = 16        # measurements taken in growing chunks before full-size chunks
    fixed: bool = False     # True: the paper's unit probes, no adaptation
    growth: float = 4.0     # the scale grows at most this factor per chunk (shrinking is immediate)
    m: float = 0.0          # running max of |g| / (||u|| ||b||)
    level: float = 1.0      # current s*lam for unit-norm probes (starts at the paper's unit scale)
    seen: int = 0
    requeried: int = 0

    def chunk_size(self, max_chunk: int) -> int:
        if self.fixed or self.seen >= self.warmup:
            return max_chunk
        return max(1, min(max_chunk, 2 ** int(np.log2(self.seen + 1))))

    def update(self, g: np.ndarray, norms: np.ndarray) -> None:
        ok = norms > 0
        if ok.any():
            self.m = max(self.m, float(np.max(np.abs(g[ok]) / norms[ok])))
        self.seen += g.shape[0]
        if not self.fixed and self.m > 0:
            self.level = min(self.T / self.m, self.growth * self.level)

    def kappa(self, norms: np.ndarray) -> np.ndarray:
        """The product s*lam for probes with ||u|| ||b|| = norms."""
        if self.fixed:
            return np.ones_like(norms)
        return self.level / norms

    def split(self, kappa: np.ndarray, norms: np.ndarray, unorm: np.ndarray,
              uc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Split ``kappa = s * lam`` into the two token scales of ``[s u + lam b; lam b]``:
        ``s ||u|| : lam ||b|| = rho : 1`` (``norms = ||u|| ||b||``), with ``|s c^T u| <= Tc``.
        Unit-scale (``fixed``) probes: ``s = 1``. Returns ``(s, lam)``."""
        if self.fixed:
            s = np.ones_like(kappa)
        else:
            s = np.sqrt(kappa * norms * self.rho) / unorm
            with np.errstate(divide="ignore"):
                cap = np.where(np.abs(uc) > 0, self.Tc / np.abs(uc), np.inf)
            s = np.minimum(s, cap)
        return s, kappa / s

    def reask(self, kappa: np.ndarray, todo: np.ndarray, bad: np.ndarray, t: np.ndarray,
              what: str = "probe") -> np.ndarray:
        """Count the saturated probes ``todo[bad]`` as re-asked and shrink their scales in ``kappa``:
        by the measured overshoot where the logit ``t`` is known, by 32x where it is not.
        Returns the indices still to ask. Unit-scale (``fixed``) probes cannot shrink: raises."""
        if self.fixed:
            raise NotIdentifiable(
                f"{int(bad.sum())} unit-scale {what}(s) saturated the softmax (|logit| > {self.t_max:g} "
                "or the attention weight fell outside (0, 1)); use adaptive probe scales")
        self.requeried += int(bad.sum())
        tb = t[bad]
        shrink = np.where(np.isfinite(tb), self.T / np.maximum(np.abs(tb), 1e-300), 1 / 32)
        kappa[todo[bad]] *= np.minimum(shrink, 0.5)
        return todo[bad]


def _invert(y, base, coef, offset, kappa, t_max):
    """Return (g, bad): g = (logit((y-base)/coef) - offset) / kappa, bad where saturated."""
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = (y - base) / coef
        inside = (alpha > 0) & (alpha < 1)
        t = np.where(inside, logit(np.clip(alpha, 1e-300, 1 - 1e-16)), np.nan)
        bad = ~inside | (np.abs(t) > t_max)
        g = (t - offset) / kappa
    return g, bad, t


def bilinear_measurements(
    oracle: Oracle,
    U: np.ndarray,
    B: np.ndarray,
    known: Known,
    scaler: ProbeScaler,
    *,
    max_chunk: int,
    progress: Progress = None,
    design: "ProbeDesign | None" = None,
    pilot: int | None = None,
    pilot_factor: float = 1 / 16,
) -> np.ndarray:
    """Measure ``g_k = u_k^T W b_k`` for the rows of U and B (each (m, d), or B one (d,) vector).

    One two-row query per measurement (plus re-asks of saturated probes, counted in
    ``scaler.requeried``). Queries are sent in chunks of at most ``max_chunk`` sequences.
    ``design`` caches what depends only on U and ``known`` (pass it when U is reused across calls).

    ``pilot``: the index of one measurement to take first, alone and at ``pilot_factor`` times the
    current scale, so that a new direction ``b`` whose measurements are far larger than all before it
    (common for low-rank W: one column of W can be hundreds of times larger than the previous ones)
    sets the scale for the rest without saturating them. It costs one oracle call, not one query.
    """
    if design is None:
        design = ProbeDesign(U, known)
    U = design.U
    m, d = U.shape
    B = np.asarray(B, dtype=np.float64)
    shared_b = B.ndim == 1
    v = known.v
    unorm = design.unorm
    if shared_b:
        bnorm = np.full(m, np.linalg.norm(B))
        bv = np.full(m, B @ v)
    else:
        bnorm = np.linalg.norm(B, axis=1)
        bv = B @ v
    out = np.empty(m)
    order = np.arange(m)
    if pilot is not None and not scaler.fixed and m > 1:
        idx = np.array([pilot])
        g = _measure_chunk(oracle, design, B, shared_b, idx, bnorm, bv, known, scaler, boost=pilot_factor)
        out[idx] = g
        scaler.update(g, unorm[idx] * bnorm[idx])
        if progress is not None:
            progress(1)
        order = np.delete(order, pilot)
    start = 0
    while start < order.size:
        n = scaler.chunk_size(max_chunk)
        idx = order[start:start + n]
        g = _measure_chunk(oracle, design, B, shared_b, idx, bnorm, bv, known, scaler)
        out[idx] = g
        scaler.update(g, unorm[idx] * bnorm[idx])
        start += idx.size
        if progress is not None:
            progress(len(idx))
    return out


class ProbeDesign:
    """A probe matrix U (rows u_k) with what every chunk needs: norms, u^T v, u^T c, and a sparse copy
    when U is sparse (the paper's basis design), so queries are built by scatter in O(nnz)."""

    def __init__(self, U: np.ndarray, known: Known):
        self.U = np.atleast_2d(np.asarray(U, dtype=np.float64))
        self.unorm = np.linalg.norm(self.U, axis=1)
        self.uv = self.U @ known.v
        self.uc = self.U @ known.c
        if np.any(np.abs(self.uv) <= 1e-300):
            raise NotIdentifiable("a probe u has u^T v = 0; its attention weight cannot be read off the answer")
        nnz = np.count_nonzero(self.U)
        self.sparse = None
        if nnz <= 0.05 * self.U.size:
            import scipy.sparse
            self.sparse = scipy.sparse.csr_matrix(self.U)

    def fill(self, X0: np.ndarray, k: np.ndarray, s: np.ndarray) -> None:
        """X0[i] += s[i] * U[k[i]] (X0 is zero where this writes, for the sparse path)."""
        if self.sparse is None:
            X0 += s[:, None] * self.U[k]
            return
        sub = self.sparse[k].tocoo()
        X0[sub.row, sub.col] += s[sub.row] * sub.data


def _measure_chunk(oracle, design, B, shared_b, idx, bnorm, bv, known, scaler, boost=1.0):
    U, unorm, uv, uc = design.U, design.unorm, design.uv, design.uc
    norms = unorm[idx] * bnorm[idx]
    kappa = scaler.kappa(norms) * boost
    g = np.full(len(idx), np.nan)
    todo = np.arange(len(idx))
    for attempt in range(scaler.max_retries + 1):
        k = idx[todo]
        kap = kappa[todo]
        s, lam = scaler.split(kap, norms[todo], unorm[k], uc[k])
        X = np.zeros((len(k), 2, U.shape[1]))
        if shared_b:
            nz = np.flatnonzero(B)
            X[:, 1, nz] = lam[:, None] * B[nz]
            X[:, 0, nz] = X[:, 1, nz]
        else:
            np.multiply(lam[:, None], B[k], out=X[:, 1, :])
            X[:, 0, :] = X[:, 1, :]
        design.fill(X[:, 0, :], k, s)
        y = oracle.query(X)
        base = known.beta + lam * bv[k]
        coef = s * uv[k]
        gk, bad, t = _invert(y, base, coef, s * uc[k], kap, scaler.t_max)
        g[todo[~bad]] = gk[~bad]
        if not bad.any():
            return g
        todo = scaler.reask(kappa, todo, bad, t)
    raise ConvergenceError(
        f"{len(todo)} probe(s) still saturated after {scaler.max_retries} re-asks at smaller scales")


def linear_measurements(
    oracle: Oracle,
    U: np.ndarray,
    known: Known,
    scaler: ProbeScaler,
    *,
    max_chunk: int,
    progress: Progress = None,
) -> np.ndarray:
    """Measure ``g_k = c^T u_k`` (the score bias) with one-token-plus-zero queries ``[s u ; 0]``.

    ``known.c`` is ignored (it is what is measured). The answer is ``beta + sigma(s c^T u) s u^T v``.
    """
    U = np.atleast_2d(np.asarray(U, dtype=np.float64))
    m, d = U.shape
    unorm = np.linalg.norm(U, axis=1)
    uv = U @ known.v
    out = np.empty(m)
    start = 0
    while start < m:
        n = scaler.chunk_size(max_chunk)
        idx = np.arange(start, min(m, start + n))
        kappa = scaler.kappa(unorm[idx])
        g = np.full(len(idx), np.nan)
        todo = np.arange(len(idx))
        for _attempt in range(scaler.max_retries + 1):
            k = idx[todo]
            s = kappa[todo]
            X = np.zeros((len(k), 2, d))
            X[:, 0, :] = s[:, None] * U[k]
            y = oracle.query(X)
            gk, bad, t = _invert(y, known.beta, s * uv[k], 0.0, s, scaler.t_max)
            g[todo[~bad]] = gk[~bad]
            if not bad.any():
                break
            todo = scaler.reask(kappa, todo, bad, t, what="bias probe")
        else:
            raise ConvergenceError(
                f"{len(todo)} bias probe(s) still saturated after {scaler.max_retries} re-asks")
        out[idx] = g
        scaler.update(g, unorm[idx])
        start = idx[-1] + 1
        if progress is not None:
            progress(len(idx))
    return out


def chunk_for(d: int, tokens: int = 2, mbytes: float = 64.0) -> int:
    """Queries per oracle call so that one chunk of (n, tokens, d) float64 stays under ``mbytes``."""
    return max(1, int(mbytes * 2**20 // (8 * tokens * d)))


def value_phase(oracle: Oracle, *, bias: bool, max_chunk: int, progress: Progress = None):
    """Read beta and v (Theorem 4.1 step (i)): ``f([0]) = beta`` and ``f([e_i]) = v_i + beta``.

    Costs d one-token queries (plus one for beta with ``bias``). Raises :class:`NotIdentifiable`
    when v = 0: the answer then never depends on the attention weights, so W (and c) cannot be
    identified from value queries.
    """
    d = oracle.d
    beta = 0.0
    if bias:
        beta = float(oracle.query(np.zeros((1, 1, d)))[0])
        if progress:
            progress(1)
    v = np.empty(d)
    for start in range(0, d, max_chunk):
        stop = min(d, start + max_chunk)
        X = np.zeros((stop - start, 1, d))
        X[np.arange(stop - start), 0, np.arange(start, stop)] = 1.0
        v[start:stop] = oracle.query(X) - beta
        if progress:
            progress(stop - start)
    scale = max(1.0, abs(beta))
    if np.max(np.abs(v)) <= 1e-12 * scale:
        raise NotIdentifiable(
            "v = 0: every answer equals the output bias, whatever the attention weights are, so W "
            "(and the score bias c) is not identifiable from value queries (Theorem 4.1 needs v != 0)")
    return beta, v


def basis_design(v: np.ndarray, zero_tol: float = 1e-2) -> tuple[np.ndarray, int]:
    """The paper's deterministic probes: u_l = e_l if v_l != 0, else e_l + e_p (v_p the largest).

    An entry with ``|v_l| < zero_tol * |v_p|`` counts as zero: the probe e_l + e_p keeps the
    attention weight readable (``u^T v`` far from 0) and the design stays invertible.
    """
    d = v.shape[0]
    p = int(np.argmax(np.abs(v)))
    U = np.eye(d)
    small = np.abs(v) < zero_tol * abs(v[p])
    small[p] = False
    U[small, p] = np.where(v[small] * v[p] < 0, -1.0, 1.0)  # keeps |u^T v| >= |v_p| - |v_l|
    return U, p


def gaussian_design(rng: np.random.Generator, n: int, v: np.ndarray) -> np.ndarray:
    """n Gaussian probes ``u ~ N(0, I_d)``, each shifted by ``±v/||v||`` (the sign of its own ``u^T v``)
    so that ``|u^T v| >= ||v||``: the attention weight read off a probe is divided by ``u^T v``, and an
    unshifted Gaussian probe is now and then nearly orthogonal to v (``|u^T v| / (||u|| ||v||)`` of 3e-6
    happens at d = 17), which costs that probe most of its digits."""
    P = rng.standard_normal((n, v.shape[0]))
    vh = v / np.linalg.norm(v)
    P += np.where(P @ vh >= 0, 1.0, -1.0)[:, None] * vh[None, :]
    return P


def all_float32(values: np.ndarray) -> bool:
    """True when every value is exactly a float32 number."""
    y = np.asarray(values, dtype=np.float64)
    return bool(np.array_equal(y.astype(np.float32).astype(np.float64), y))


def looks_float32(values: np.ndarray) -> bool:
    """True when every answer is exactly a float32 number: the black box computes in float32.

    (Answers of a float64 computation are almost never all float32-representable.)
    """
    return bool(np.size(values) >= 4 and all_float32(values))


class AnswerPrecision:
    """Watches the oracle's answers as they come: float32 if every answer seen is exactly a float32
    number (decided from the answers, never from the target)."""

    def __init__(self):
        self.seen = 0
        self.float32 = True

    def __call__(self, y: np.ndarray) -> None:
        self.seen += np.size(y)
        if self.float32 and not all_float32(y):
            self.float32 = False

    @property
    def name(self) -> str:
        return "float32" if (self.float32 and self.seen) else "float64"

    @property
    def unit_roundoff(self) -> float:
        return 2.0 ** -24 if self.name == "float32" else 2.0 ** -53


def numerical_rank(W: np.ndarray, rtol: float) -> int:
    """Number of singular values above ``rtol`` times the largest."""
    s = svd(W, compute_uv=False)
    return int(np.sum(s > rtol * s[0])) if s.size and s[0] > 0 else 0
