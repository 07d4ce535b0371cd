"""Multi-head extraction by switching and head isolation (our method; issue 9, item 5).

Model (paper, Section 7 and Appendix C, with the biases of real layers):
``f(X) = sum_h softmax(X W_h x_N + X c_h)^T (X v_h) + beta``. For a two-token query
``[b + delta ; b]`` the answer minus the one-token answer ``f([b])`` is

    g(delta; b) = sum_h sigma(delta^T m_h(b)) v_h^T delta,        m_h(b) = W_h b + c_h,

so every head is a single-head regressor in ``delta`` with its own score vector ``m_h(b)``.

Algorithm:

1. *One-token answers* ``f([e_j])`` (and ``f([0]) = beta``): the sum of the v_h and the baseline of
   every later query (d queries, d + 1 with biases).
2. *Switch search.* On a random token b0, walk ``delta = t z(s)`` along a half circle
   ``z(s) = cos(pi s) z0 + sin(pi s) z1`` with t large: every head is saturated (attention 0 or 1) except
   near the one point s_h where ``z(s_h) ⊥ m_h(b0)``, so ``G(s) = g(t z(s)) / t`` is, between switches,
   exactly a sinusoid ``a_A^T z(s)`` with ``a_A`` the sum of the v_h of the heads switched on. A
   bisection keeps every interval whose midpoint breaks the sinusoid through its ends; the isolated
   breaks are the switches: their number is H (heads with equal W_h, c_h switch together and merge,
   Proposition 7.1; heads with v_h = 0 never show). Two planes are searched; the larger count wins.
3. *Rough values.* ``a_A`` on each plateau from d + 1 queries ``delta = t z + lam e_i``; consecutive
   differences are ``± v_h``, the signs from the one binary solve ``sum_k x_k (a_k - a_{k-1}) = -a_0``.
4. *Isolation* (with the v_h known): let ``w_h`` be the dual basis (``v_g^T w_h = delta_gh``) and
   ``psi_i`` an orthonormal basis of ``V^perp``. A probe ``delta = s (alpha w_h + psi_i)`` has
   ``v_g^T delta = 0`` for every ``g != h``: the answer is ``sigma(delta^T m_h) s alpha``, one sigmoid
   inversion reads ``psi_i^T m_h(b)`` exactly (``w_h^T m_h`` from ``delta = s alpha w_h``). The cross
   coordinates ``w_g^T m_h(b)`` use ``delta = s (alpha_h w_h + alpha_g w_g) + T y`` with ``y`` in
   ``V^perp``, ``y^T m_h = 0`` and ``T y^T m_g <= -40``: head g is switched off exactly, the other heads
   see no value, one query reads ``w_g^T m_h(b)``. So every query reads one coordinate of one head.
5. *Exact values.* With every ``m_h(b0)`` known, a direction ``z_h`` with ``z_h^T m_h(b0) = 1`` and
   ``z_h^T m_g(b0) = -1`` puts head h alone in the saturated pattern at a *known* margin (logit 48):
   d + 1 queries then read v_h to the answers' precision (no large t, no cancellation).
6. *Scores* ``W_h`` (and ``c_h``): step 4 on the tokens ``e_1..e_d`` (and 0 for the biases). Rows
   ``psi_i^T W_h`` are taken one at a time for every head until a row falls in the span of the
   previous ones (rank detection; a dense head simply runs out of rows). A low-rank head then needs
   only ``W_h R_h`` on its r row-space directions for the remaining rows (the sketch of
   :mod:`headthief.extraction.single.lowrank`, split by head).

Query count (no probe re-asked, dense heads): ``H d^2 + H (H + 2) d + 2 H + d`` plus the switch
search (a few hundred queries, reported as ``diagnostics["switch_search_queries"]``): one-token ``d``,
rough values ``H (d + 1)``, anchor isolation ``H d``, exact values ``H (d + 1)``, and per head
``d (d - H + 1)`` direct plus ``2 d (H - 1)`` cross coordinates (read twice: the second reading, see
:func:`_read_cross_tight`, takes them from ~1e-10 to the answers' precision). Biases add
``H (d + H - 1) + 1`` plus ``H (1 + min(16, ell))`` for the mirror token ``-e_1`` (see :func:`_cross_with_bias`); float32 answers a second anchor and value pass, ``H (2 d + 1)``. Low-rank heads
of rank r read ``ell = r`` sketch rows (``r + 9`` on float32; with the rank detected, the w_h row is the
extra row that shows the rank has stopped growing) and ``(d - H - ell) r`` completion coordinates instead of ``d - H`` rows. See
:func:`multihead_query_count`.

Limits: needs ``d - H >= 2`` and linearly independent v_h; heads whose score vectors are positive or
negative multiples of each other on every token (``W_g = k W_h``, ``c_g = k c_h``, ``k != 1``) share
their switches and are reported as a :class:`ModelMismatch`, not split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ...errors import ConvergenceError, ModelMismatch, NotIdentifiable
from ...oracles.base import Oracle
from ..probes import ProbeScaler, Progress, _invert, all_float32, chunk_for
from .result import MultiHeadExtraction
from ...linalg import lstsq, pinv, svd

L_SAT = {False: 40.0, True: 24.0}
"""Logit that switches a head off in the cross-coordinate probes (float64, float32 answers)."""

L_PATTERN = {False: 48.0, True: 32.0}
"""Margin logit of the exact value pass (step 5); shifts keep at least 3/4 of it."""

T_TARGET = {False: 1.0, True: 3.0}
"""Target logit of the isolation probes (float32 answers read larger logits more precisely)."""

FLOAT32_OVERSAMPLE = 10
"""Extra sketch rows per low-rank head on float32 answers."""

CROSS_ROWS = 16
"""psi rows read on the mirror token ``-e_1`` (they steer the switch-off direction of the cross probes)."""


PROPOSITION_7_1 = (
    "heads with equal (W_h, c_h) are one head in canonical form (Proposition 7.1): if the target has such "
    "heads they are returned merged, with their v_h summed; how v splits among them is not identifiable "
    "from value queries")


def multihead_query_count(d: int, heads: int, rank: int | None = None, bias: bool = False, *,
                          float32: bool = False, detect: bool | None = None) -> int:
    """Queries :func:`extract_multihead` plans for H heads, not counting the switch search and
    re-asked probes (both reported in ``diagnostics``).

    ``rank``: every head's rank (None: dense heads). ``detect``: the rank is detected (the default
    when ``rank`` is None; a dense head costs no more, it runs out of rows). ``float32``: the answers are
    float32 numbers (oversampled low-rank sketches, a second cross-coordinate pass and value pass).
    """
    if d < 1 or heads < 1:
        raise ValueError(f"d and heads must be >= 1, got d={d}, heads={heads}")
    if heads > d - 2:
        raise ValueError(f"this method needs d - heads >= 2, got d={d}, heads={heads}")
    H = heads
    detect = rank is None if detect is None else detect
    k = FLOAT32_OVERSAMPLE if float32 else 0
    ell = _rows_planned(d, H, rank, k, detect)
    n_tok = d + (1 if bias else 0)
    count = d + (1 if bias else 0)              # one-token answers
    count += H * (d + 1)                        # rough values on H plateaus (step 3)
    count += (H * d + H * (d + 1)) * (2 if float32 else 1)   # anchor isolation, exact values (4-5)
    per_head = n_tok * (1 + ell + 2 * (H - 1))
    if ell < d - H:
        r = rank
        per_head += (d - H - ell) * r + (d - H - ell if bias else 0)
    return count + H * per_head + _mirror(d, H, ell, bias)


def _mirror(d: int, H: int, ell_min: int, bias: bool) -> int:
    """Queries of the mirror token ``-e_1`` (own coordinates; see :func:`_cross_with_bias`)."""
    if not bias or H < 2:
        return 0
    return H * (1 + int(min(d - H, max(2, min(CROSS_ROWS, ell_min)))))


def _planned(d, H, rank, bias, single, ranks, ell) -> int:
    """The planned count for the ranks found (heads of unequal ranks: summed head by head)."""
    free = d - H
    shared = _shared(d, H, bias, single)
    total = shared
    for h in range(H):
        r = None if ell[h] >= free else int(ranks[h])
        one = multihead_query_count(d, H, r if rank is None else rank, bias, float32=single,
                                    detect=rank is None)
        one -= _mirror(d, H, _rows_planned(d, H, r if rank is None else rank,
                                           FLOAT32_OVERSAMPLE if single else 0, rank is None), bias)
        total += (one - shared) // H
    return int(total + _mirror(d, H, int(np.min(ell)), bias))


def _shared(d, H, bias, single) -> int:
    """The part of :func:`multihead_query_count` that does not depend on the heads' ranks."""
    return d + (1 if bias else 0) + H * (d + 1) + (H * d + H * (d + 1)) * (2 if single else 1)


def _rows_planned(d: int, H: int, rank: int | None, k: int, detect: bool) -> int:
    if rank is None or rank >= d - H:
        return d - H
    if detect:
        return min(d - H, max(2, rank + max(1, k) - 1))
    return min(d - H, max(2, rank + k))


@dataclass
class _Asker:
    """The oracle with its bookkeeping: chunking, progress, per-phase counts, answer precision."""

    oracle: Oracle
    progress: Progress
    chunk: int
    phase: str = "start"
    by_phase: dict = field(default_factory=dict)
    float32: bool = True
    seen: int = 0

    def __call__(self, X: np.ndarray) -> np.ndarray:
        out = np.empty(X.shape[0])
        for start in range(0, X.shape[0], self.chunk):
            stop = min(X.shape[0], start + self.chunk)
            y = self.oracle.query(X[start:stop])
            out[start:stop] = y
            self.by_phase[self.phase] = self.by_phase.get(self.phase, 0) + (stop - start)
            self.seen += stop - start
            if self.float32 and not all_float32(y):
                self.float32 = False
            if self.progress is not None:
                self.progress(stop - start)
        return out


def _two_token(B: np.ndarray, D: np.ndarray) -> np.ndarray:
    """Queries ``[B_k + D_k ; B_k]`` as an (n, 2, d) array."""
    X = np.empty((B.shape[0], 2, B.shape[1]))
    X[:, 0] = B + D
    X[:, 1] = B
    return X


# --------------------------------------------------------------------------------------------------
# Steps 2-3: switch search along half circles
# --------------------------------------------------------------------------------------------------

@dataclass
class _Circle:
    """One searched half circle: plateaus between the switches, and what it cost."""

    Z: np.ndarray            # (2, d): z0, z1
    t: float
    switches: list           # [(lo, hi)] brackets of the switches, in order of s
    plateaus: list           # [(lo, hi)] the H plateaus measured: interior ones, then the wrap one
    evals: int


def _z(Z: np.ndarray, s: np.ndarray) -> np.ndarray:
    s = np.asarray(s, dtype=np.float64)
    return np.cos(np.pi * s)[:, None] * Z[0] + np.sin(np.pi * s)[:, None] * Z[1]


def _search_circle(ask: _Asker, b0: np.ndarray, base0: float, Z: np.ndarray, t: float, *,
                   tol_rel: float, w_min: float, max_evals: int, grid: int = 16) -> _Circle | None:
    """Bisect the half circle for the switches; None when ``t`` is too small to saturate the heads
    (transitions wider than a few ``w_min``) or the search needs more than ``max_evals`` queries."""
    d = b0.shape[0]
    values: dict[float, float] = {}

    def evaluate(s_list):
        s_arr = np.asarray(s_list, dtype=np.float64)
        y = ask(_two_token(np.broadcast_to(b0, (s_arr.size, d)), t * _z(Z, s_arr)))
        for s, v in zip(s_arr, (y - base0) / t):
            values[float(s)] = float(v)

    evaluate(np.linspace(0.0, 1.0, grid + 1))
    scale = max(abs(v) for v in values.values())
    if scale == 0.0:
        return None
    tol = tol_rel * scale
    work = [(k / grid, (k + 1) / grid) for k in range(grid)]
    clean, flagged = [], []
    while work:
        if len(values) + len(work) > max_evals:
            return None
        mids = [0.5 * (a + b) for a, b in work]
        evaluate(mids)
        nxt = []
        for (a, b), m in zip(work, mids):
            sab = np.sin(np.pi * (b - a))
            pred = (values[a] * np.sin(np.pi * (b - m)) + values[b] * np.sin(np.pi * (m - a))) / sab
            if abs(values[m] - pred) <= tol:
                clean.append((a, b))
            elif b - a <= 2 * w_min:
                flagged += [(a, m), (m, b)]
            else:
                nxt += [(a, m), (m, b)]
        work = nxt
    leaves = sorted([(a, b, False) for a, b in clean] + [(a, b, True) for a, b in flagged])
    groups: list[list] = []        # runs of leaves of one kind: [kind, lo, hi, n_leaves]
    for a, b, f in leaves:
        if groups and groups[-1][0] == f:
            groups[-1][2] = b
            groups[-1][3] += 1
        else:
            groups.append([f, a, b, 1])
    if groups[0][0] or groups[-1][0]:
        return None                # a switch at the ends of the half circle: draw another plane
    switches = [(g[1], g[2]) for g in groups if g[0]]
    if any(n > 8 for f, _, _, n in groups if f):
        return None                # transitions wider than the resolution: t too small
    plain = [(g[1], g[2]) for g in groups if not g[0]]
    if not switches:
        return _Circle(Z=Z, t=t, switches=[], plateaus=[], evals=len(values))
    # plateau H continues past s = 1 into plateau 0 (z(1 + u) = -z(u)): one plateau of the pattern A_H
    wrap = (plain[-1][0], 1.0 + plain[0][1])
    plateaus = plain[1:-1] + [wrap]
    return _Circle(Z=Z, t=t, switches=switches, plateaus=plateaus, evals=len(values))


def _find_switches(ask: _Asker, b0, base0, rng, *, single: bool, max_heads: int, planes: int = 2,
                   max_planes: int = 5) -> tuple[_Circle, list[int]]:
    """Search ``planes`` random half circles (more while they disagree, at most ``max_planes``);
    return the circle with the most switches (ties: the widest narrowest plateau) and every count."""
    d = b0.shape[0]
    tol_rel = 3e-5 if single else 1e-9
    w_min = 1e-5
    max_evals = 200 + 80 * (max_heads + 1)
    found: list[_Circle] = []
    counts: list[int] = []
    attempts = 0
    while len(found) < max_planes and attempts < 3 * max_planes:
        attempts += 1
        Z = np.linalg.qr(rng.standard_normal((d, 2)))[0].T
        circle = None
        for t in (1e7, 1e9, 1e11):
            circle = _search_circle(ask, b0, base0, Z, t / max(np.linalg.norm(b0), 1e-300),
                                    tol_rel=tol_rel, w_min=w_min, max_evals=max_evals)
            if circle is not None:
                break
        if circle is None:
            continue
        found.append(circle)
        counts.append(len(circle.switches))
        if len(found) >= planes and len(set(counts)) == 1:
            break
    if not found:
        raise ConvergenceError(
            "the switch search found no half circle along which every head saturates (tried "
            f"{attempts} planes with t up to 1e11); the target may not be softmax attention")

    def key(c):
        widths = [hi - lo for lo, hi in c.plateaus] or [1.0]
        return (len(c.switches), min(widths))
    return max(found, key=key), counts


def _rough_values(ask: _Asker, b0, base0, circle: _Circle, v_sum: np.ndarray) -> np.ndarray:
    """``v_h`` (rows, in switch order) from the plateau gradients of one searched circle."""
    d = b0.shape[0]
    H = len(circle.switches)
    t = circle.t
    A = np.empty((H, d))
    eye = np.eye(d)
    for p, (lo, hi) in enumerate(circle.plateaus):
        s = 0.5 * (lo + hi)
        lam = 0.02 * t * (hi - lo)
        tz = t * _z(circle.Z, [s])[0]
        D = np.vstack([tz[None, :], tz[None, :] + lam * eye])
        y = ask(_two_token(np.broadcast_to(b0, D.shape), D))
        A[p] = (y[1:] - y[0]) / lam
    # plateaus in order of s: a_1 .. a_{H-1} (interior), a_H (wrap); a_0 = v_sum - a_H
    a = np.vstack([v_sum - A[H - 1], A])          # (H + 1, d): a_0 .. a_H
    Delta = np.diff(a, axis=0)                    # (H, d): +v (head switched on) or -v (off)
    x, *_ = lstsq(Delta.T, -a[0], rcond=None)
    xr = np.round(x)
    if np.any(np.abs(x - xr) > 0.25) or np.any((xr != 0) & (xr != 1)):
        raise ModelMismatch(
            "the plateau values along the half circle do not split into heads that each switch once "
            f"(binary solve off by {float(np.max(np.abs(x - xr))):.3g})", check="switch signs",
            figure=float(np.max(np.abs(x - xr))), threshold=0.25,
            hint="heads whose score matrices are multiples of each other (W_g = k W_h, k != 1) switch "
                 "together and cannot be split this way")
    return np.where(xr[:, None] == 1, -Delta, Delta)


# --------------------------------------------------------------------------------------------------
# Step 4: head isolation
# --------------------------------------------------------------------------------------------------

@dataclass
class _Basis:
    """The dual basis of the values and an orthonormal basis of their complement."""

    V: np.ndarray        # (H, d)
    Wd: np.ndarray       # (d, H): V Wd = I, columns in span(V)
    alpha: np.ndarray    # (H,): 1 / ||w_h||
    Q: np.ndarray        # (d, d - H): orthonormal basis of V^perp, random directions
    Phi_inv_T: np.ndarray  # (d, d): maps coordinates (w_g^T m, psi_i^T m) back to m

    @classmethod
    def of(cls, V: np.ndarray, rng: np.random.Generator) -> "_Basis":
        H, d = V.shape
        _, sv, Vt = svd(V)
        if sv[-1] <= 1e-10 * sv[0]:
            raise NotIdentifiable(
                f"the {H} value vectors v_h are (nearly) linearly dependent (condition {sv[0] / max(sv[-1], 1e-300):.3g}); "
                "head isolation needs independent v_h")
        Wd = pinv(V)
        G = rng.standard_normal((d - H, d - H))
        Q = Vt[H:].T @ np.linalg.qr(G)[0]
        Phi = np.hstack([Wd, Q])
        return cls(V=V, Wd=Wd, alpha=1.0 / np.linalg.norm(Wd, axis=0), Q=Q,
                   Phi_inv_T=np.linalg.inv(Phi.T))


class _Reader:
    """Reads ``u^T m_h(b)`` from two-token queries whose only live head is h (step 4)."""

    def __init__(self, ask: _Asker, single: bool):
        self.ask = ask
        self.single = single
        self.scaler = ProbeScaler(T=T_TARGET[single])
        self.fallbacks = 0

    def read(self, B, base, U, a, sat=None, extra=None, fallback=None) -> np.ndarray:
        """Query ``[B_k + s_k U_k + T_k Y_k ; B_k]``; the answer minus ``base_k`` is
        ``sigma(s u^T m_h + T yh) s a``. ``sat = (Y, yg, yh, bound)``: the switched-off head has
        ``y^T m_g = yg < 0`` and ``|u^T m_g| <= bound``; ``T`` is chosen so its logit is below ``-L_SAT``.
        Returns ``u_k^T m_h(B_k)``; probes that saturate are asked again at smaller scales.
        ``extra(k, s) -> (D, offset, gain)``: a probe part chosen once ``s`` is known; the reading is
        then ``(logit - offset) / gain``. ``fallback``: readings kept (and counted in ``fallbacks``)
        for probes still saturated after the last re-ask, instead of a :class:`ConvergenceError`."""
        n = U.shape[0]
        norms = np.linalg.norm(U, axis=1)
        out = np.empty(n)
        sc = self.scaler
        start = 0
        while start < n:
            stop = min(n, start + sc.chunk_size(self.ask.chunk))
            idx = np.arange(start, stop)
            kappa = sc.kappa(norms[idx])
            todo = np.arange(idx.size)
            for _ in range(sc.max_retries + 1):
                k = idx[todo]
                s = kappa[todo]
                D = s[:, None] * U[k]
                offset = np.zeros(k.size)
                gain = s
                if sat is not None:
                    Y, yg, yh, bound = sat
                    T = (L_SAT[self.single] + s * bound[k]) / np.abs(yg[k])
                    D += T[:, None] * Y[k]
                    offset = T * yh[k]
                if extra is not None:
                    De, offset, gain = extra(k, s)
                    D += De
                y = self.ask(_two_token(B[k], D))
                g, bad, tl = _invert(y, base[k], s * a[k], offset, gain, sc.t_max)
                out[k[~bad]] = g[~bad]
                if not bad.any():
                    break
                todo = sc.reask(kappa, todo, bad, tl)
            else:
                if fallback is None:
                    raise ConvergenceError(
                        f"{todo.size} isolation probe(s) still saturated after {sc.max_retries} re-asks")
                out[idx[todo]] = fallback[idx[todo]]
                self.fallbacks += int(todo.size)
            if extra is None:
                sc.update(out[idx], norms[idx])
            start = stop
        return out


def _isolate_full(reader: _Reader, basis: _Basis, B: np.ndarray, base: np.ndarray, *,
                  rows: int | None = None, mu: np.ndarray | None = None, cross: bool = True,
                  tight: bool = False) -> np.ndarray:
    """Coordinates ``mu[h, k] = (w_1..w_H, psi_1..psi_{d-H})^T m_h(B_k)`` of every head on every token
    (H, n, d). ``rows``: only the first ``rows`` psi coordinates (the rest NaN). ``mu``: fill in
    (coordinates already known are kept; cross coordinates are (re)read when ``cross``)."""
    H, d = basis.V.shape
    n = B.shape[0]
    rows = d - H if rows is None else rows
    if mu is None:
        mu = np.full((H, n, d), np.nan)
    # w_h^T m_h
    need = np.isnan(mu[np.arange(H), :, np.arange(H)])         # (H, n)
    if need.any():
        hh, kk = np.nonzero(need)
        U = (basis.alpha[hh, None] * basis.Wd[:, hh].T)
        val = reader.read(B[kk], base[kk], U, basis.alpha[hh])
        mu[hh, kk, hh] = val / basis.alpha[hh]
    # psi_i^T m_h
    hs, ks, is_ = [], [], []
    for i in range(rows):
        need = np.isnan(mu[:, :, H + i])
        hh, kk = np.nonzero(need)
        hs.append(hh), ks.append(kk), is_.append(np.full(hh.size, i))
    if hs and sum(x.size for x in hs):
        hh, kk, ii = np.concatenate(hs), np.concatenate(ks), np.concatenate(is_)
        U = basis.alpha[hh, None] * basis.Wd[:, hh].T + basis.Q[:, ii].T
        val = reader.read(B[kk], base[kk], U, basis.alpha[hh])
        mu[hh, kk, H + ii] = val - basis.alpha[hh] * mu[hh, kk, hh]
    if cross and H > 1:
        _read_cross(reader, basis, B, base, mu, tight=tight)
    return mu


def _known_rows(mu: np.ndarray, H: int) -> np.ndarray:
    """Number of leading psi coordinates known for every head and token (H, n)."""
    known = ~np.isnan(mu[:, :, H:])
    return np.where(known.all(axis=2), known.shape[2], np.argmin(known, axis=2))


def _read_cross(reader: _Reader, basis: _Basis, B, base, mu, *, tight: bool) -> None:
    """Cross coordinates ``w_g^T m_h(b)`` for every ordered pair g != h, one query each (step 4)."""
    H, d = basis.V.shape
    n = B.shape[0]
    ell = _known_rows(mu, H)
    if H < 2:
        return
    pairs = [(h, g) for h in range(H) for g in range(H) if g != h]
    hh = np.repeat([p[0] for p in pairs], n)
    gg = np.repeat([p[1] for p in pairs], n)
    kk = np.tile(np.arange(n), len(pairs))
    m = hh.size
    rr = np.minimum(ell[hh, kk], ell[gg, kk]).astype(int)
    if np.any(rr < 2):
        raise NotIdentifiable("isolating two heads needs at least 2 directions of V^perp on which both "
                              "are known")
    # the first reading's saturation guard (the tight reading builds its own probes, so only the checks)
    Y, yg, yh = (None, None, None) if tight else (np.empty((m, d)), np.empty(m), np.empty(m))
    for r in np.unique(rr):                    # every probe with r known directions at once
        j = np.flatnonzero(rr == r)
        ph, pg = mu[hh[j], kk[j], H:H + r], mu[gg[j], kk[j], H:H + r]
        nh2 = np.einsum("ij,ij->i", ph, ph)
        along = np.where(nh2 > 0, np.einsum("ij,ij->i", pg, ph) / np.where(nh2 > 0, nh2, 1.0), 0.0)
        eta = pg - along[:, None] * ph
        ne = np.linalg.norm(eta, axis=1)
        if np.any(ne == 0):
            raise NotIdentifiable("two heads have parallel score vectors on V^perp; cannot switch one off")
        if tight:
            continue
        eta /= ne[:, None]
        Y[j] = -(eta @ basis.Q[:, :r].T)
        yg[j] = -np.einsum("ij,ij->i", eta, pg)
        yh[j] = -np.einsum("ij,ij->i", eta, ph)
    if tight:
        _read_cross_tight(reader, basis, B, base, mu, hh, gg, kk, rr)
        return
    U = basis.alpha[hh, None] * basis.Wd[:, hh].T + basis.alpha[gg, None] * basis.Wd[:, gg].T
    bound = np.abs(mu[gg, kk, gg] * basis.alpha[gg]) + 2.0 * np.sqrt(d) * max(reader.scaler.m, 1e-300)
    val = reader.read(B[kk], base[kk], U, basis.alpha[hh], sat=(Y, yg, yh, bound))
    mu[hh, kk, gg] = (val - basis.alpha[hh] * mu[hh, kk, hh]) / basis.alpha[gg]


def _read_cross_tight(reader: _Reader, basis: _Basis, B, base, mu, hh, gg, kk, rr) -> None:
    """Second reading of the cross coordinates, with the first reading known to ~1e-8.

    ``delta = s w^_h + A w^_g + p`` (``w^ = alpha w``, ``p`` in V^perp): head g is switched off
    (its value ``A alpha_g`` is then irrelevant), head h's logit stays where the first probe put it, and
    ``(A, p)`` has the least ``|p|`` for that: along ``w_g`` head g can be switched off even where
    its and head h's score vectors are nearly parallel on V^perp (which made ``T |y|``, and the
    black box's own rounding of ``x^T v_k``, large). The reading ``(logit - known) / A`` is precise
    in proportion to ``A``."""
    H, d = basis.V.shape
    L = L_SAT[reader.single]
    ah, ag = basis.alpha[hh], basis.alpha[gg]
    hh_self = mu[hh, kk, hh] * ah              # w^_h^T m_h
    X0 = mu[hh, kk, gg] * ag                   # w^_g^T m_h (first reading)
    gg_self = mu[gg, kk, gg] * ag              # w^_g^T m_g
    gh = mu[gg, kk, hh] * ah                   # w^_h^T m_g (first reading)

    def extra(k, s):
        k, s = np.asarray(k), np.asarray(s, dtype=np.float64)
        D = np.empty((k.size, d))
        offset = np.empty(k.size)
        gain = np.empty(k.size)
        for r in np.unique(rr[k]):                              # every probe with r known directions at once
            q = np.flatnonzero(rr[k] == r)
            j, sq = k[q], s[q]
            Ph, Pg = mu[hh[j], kk[j], H:H + r], mu[gg[j], kk[j], H:H + r]
            P = np.stack([Pg, Ph], axis=1)                      # (n, 2, r): p^T m_g, p^T m_h
            tau = sq * (hh_self[j] + X0[j])                     # head h's logit: as the first probe
            Lg = L + np.log(np.maximum(1.0, 64.0 * np.abs(sq * gh[j]) + 1.0))
            r0 = np.stack([-Lg - sq * gh[j], tau - sq * hh_self[j]], axis=1)
            r1 = np.stack([gg_self[j], X0[j]], axis=1)
            G = pinv(P @ P.transpose(0, 2, 1))
            den = np.einsum("ni,nij,nj->n", r1, G, r1)
            A = np.where(den > 0, np.einsum("ni,nij,nj->n", r1, G, r0) / np.where(den > 0, den, 1.0), 0.0)
            A = np.where(np.abs(A) < sq, np.where(A >= 0, sq, -sq), A)      # keep the reading sensitive
            # min-norm least squares (lstsq's cut-off: eps times the larger side)
            pc = (pinv(P, rcond=np.finfo(float).eps * max(2, int(r)))
                  @ (r0 - A[:, None] * r1)[..., None])[..., 0]
            D[q] = (A * ag[j])[:, None] * basis.Wd[:, gg[j]].T + pc @ basis.Q[:, :r].T
            offset[q] = sq * hh_self[j] + np.einsum("ni,ni->n", pc, Ph)
            gain[q] = A
        return D, offset, gain

    U = ah[:, None] * basis.Wd[:, hh].T
    # a pair whose head g barely scores along w_g needs a huge A; if that probe never reads, the first
    # reading (~1e-8 on float64 answers) is kept: counted in diagnostics["tight_fallbacks"]
    val = reader.read(B[kk], base[kk], U, ah, extra=extra, fallback=X0)
    mu[hh, kk, gg] = val / ag


# --------------------------------------------------------------------------------------------------
# Step 5: exact values at a known margin
# --------------------------------------------------------------------------------------------------

def _exact_values(ask: _Asker, b0, M: np.ndarray, basis: _Basis, single: bool) -> np.ndarray:
    """Each v_h from d + 1 queries with head h alone switched on at logit ``L_PATTERN`` (step 5)."""
    H, d = M.shape
    L = L_PATTERN[single]
    ortho = d - H >= 2 * H
    V = np.empty((H, d))
    colmax = np.max(np.abs(M), axis=0)
    lam = 0.25 * L / np.maximum(colmax, 1e-3 * colmax.max())
    for h in range(H):
        target = -np.ones(H)
        target[h] = 1.0
        if ortho:
            eta, *_ = lstsq(M @ basis.Q, target, rcond=None)
            z = basis.Q @ eta
        else:
            z, *_ = lstsq(M, target, rcond=None)
        res = float(np.max(np.abs(M @ z - target)))
        if res > 1e-3:
            raise NotIdentifiable(f"no direction switches head {h} on and the others off (residual {res:.3g})")
        D = np.vstack([L * z[None, :], L * z[None, :] + np.diag(lam)])
        y = ask(_two_token(np.broadcast_to(b0, D.shape), D))
        V[h] = (y[1:] - y[0]) / lam
    return V


# --------------------------------------------------------------------------------------------------
# Step 6: the score matrices
# --------------------------------------------------------------------------------------------------

def _row_rank(rows: np.ndarray, tol: float) -> int:
    sv = svd(rows, compute_uv=False)
    return int(np.sum(sv > tol * sv[0])) if sv.size and sv[0] > 0 else 0


def _scores(reader: _Reader, ask: _Asker, basis: _Basis, tokens: np.ndarray, base: np.ndarray, *,
            bias: bool, rank: int | None, single: bool, v_sum: np.ndarray, beta: float, rng):
    """W_h (and c_h) for every head: rows on the basis tokens, rank detection, low-rank completion."""
    H, d = basis.V.shape
    n = tokens.shape[0]
    free = d - H
    k = FLOAT32_OVERSAMPLE if single else 0
    tol = float(np.sqrt(2.0 ** -24 if single else 2.0 ** -53))
    mu = np.full((H, n, d), np.nan)
    ask.phase = "score_rows"
    _isolate_full(reader, basis, tokens, base, rows=0, mu=mu, cross=False)
    j0 = 1 if bias else 0

    def gamma_rows(h, upto):     # rows w_h, psi_1..psi_upto of Phi^T W_h (over the basis tokens)
        R = mu[h, j0:, [h] + list(range(H, H + upto))]
        return R - mu[h, 0, [h] + list(range(H, H + upto))][:, None] if bias else R

    ell = np.zeros(H, dtype=int)
    ranks = np.full(H, -1)
    growing = list(range(H))
    if rank is not None:
        target = free if rank >= free else min(free, max(2, rank + k))
        _fill_rows(reader, basis, tokens, base, mu, list(range(H)), 0, target)
        ell[:] = target
        ranks[:] = min(rank, d)
        growing = []
    i = 0
    while growing:
        _fill_rows(reader, basis, tokens, base, mu, growing, i, i + 1)
        i += 1
        still = []
        for h in growing:
            ell[h] = i
            r = _row_rank(gamma_rows(h, i), tol)
            if i >= free:
                ranks[h] = r if r < free else d
            elif (i + 1) - r >= max(1, k) and i >= 2:
                ranks[h] = r
            else:
                still.append(h)
        growing = still
    if bias:     # the score bias is needed in every coordinate
        ask.phase = "score_bias"
        for h in range(H):
            if ell[h] < free:
                _fill_rows(reader, basis, tokens[:1], base[:1], mu[:, :1], [h], int(ell[h]), free)
    if bias and H > 1:
        _cross_with_bias(reader, ask, basis, tokens, base, mu, ell, beta, v_sum)
    else:
        ask.phase = "score_cross"
        _read_cross(reader, basis, tokens, base, mu, tight=False)
        ask.phase = "score_cross_tight"
        _read_cross(reader, basis, tokens, base, mu, tight=True)
    ask.phase = "score_complete"
    W = np.empty((H, d, d))
    C = np.zeros((H, d))
    for h in range(H):
        c_coord = mu[h, 0] if bias else np.zeros(d)
        G = mu[h, j0:].T - c_coord[:, None] if bias else mu[h, j0:].T.copy()   # (d coords, d tokens)
        if ell[h] < free:
            r = int(ranks[h])
            known = list(range(H)) + list(range(H, H + int(ell[h])))
            _, _, Vt = svd(G[known], full_matrices=False)
            R = Vt[:r].T                                                       # (d, r) row space
            unknown = np.arange(H + int(ell[h]), d)
            # w_h^T m_h(R_k) is known from the rows; psi_i^T m_h(R_k) for the unknown rows is read
            Bk = np.repeat(R.T, unknown.size, axis=0)
            ii = np.tile(unknown - H, r)
            wm = np.repeat(G[h] @ R + c_coord[h], unknown.size)
            U = basis.alpha[h] * np.broadcast_to(basis.Wd[:, h], (ii.size, d)) + basis.Q[:, ii].T
            base_k = Bk @ v_sum + beta
            val = reader.read(Bk, base_k, U, np.full(ii.size, basis.alpha[h]))
            Yu = (val - basis.alpha[h] * wm).reshape(r, unknown.size).T - c_coord[unknown][:, None]
            G[unknown] = Yu @ R.T
        W[h] = basis.Phi_inv_T @ G
        C[h] = basis.Phi_inv_T @ c_coord
    return W, C, ranks, ell


def _cross_with_bias(reader, ask, basis, tokens, base, mu, ell, beta, v_sum) -> None:
    """Cross coordinates with score biases: on the tokens ``e_j`` as usual; for the bias, whose score
    vector ``m_h(0) = c_h`` may be tiny or zero (torch's default ``in_proj_bias`` is zero), no head can
    be switched off at the zero token. ``m_h`` is affine, so ``c_h = (m_h(e_1) + m_h(-e_1)) / 2``: the
    cross coordinates are read on the mirror token ``-e_1`` instead (its one-token answer
    ``beta - (sum_h v_h)_1`` is known) and averaged with those of ``e_1``. Costs ``H (1 + rows)`` queries
    for the mirror token's own coordinates; the cross readings replace those of the zero token."""
    H, d = basis.V.shape
    n = tokens.shape[0]
    mirror = -tokens[1:2]
    mbase = np.array([beta - float(v_sum[0])])
    mm = np.full((H, 1, d), np.nan)
    ask.phase = "score_cross"
    _isolate_full(reader, basis, mirror, mbase, rows=0, mu=mm, cross=False)
    rows = int(min(d - H, max(2, min(CROSS_ROWS, int(ell.min())))))
    _fill_rows(reader, basis, mirror, mbase, mm, list(range(H)), 0, rows)
    toks = np.vstack([tokens[1:], mirror])
    bases = np.concatenate([base[1:], mbase])
    mx = np.concatenate([mu[:, 1:], mm], axis=1)
    _read_cross(reader, basis, toks, bases, mx, tight=False)
    ask.phase = "score_cross_tight"
    _read_cross(reader, basis, toks, bases, mx, tight=True)
    mu[:, 1:] = mx[:, :n - 1]
    for h in range(H):
        for g in range(H):
            if g != h:
                mu[h, 0, g] = 0.5 * (mx[h, 0, g] + mx[h, n - 1, g])


def _fill_rows(reader, basis, tokens, base, mu, heads, lo, hi):
    """Read psi rows lo..hi-1 of the listed heads on every token (one batch)."""
    H = basis.V.shape[0]
    n = tokens.shape[0]
    hh = np.repeat(np.asarray(heads), n * (hi - lo))
    ii = np.tile(np.repeat(np.arange(lo, hi), n), len(heads))
    kk = np.tile(np.arange(n), len(heads) * (hi - lo))
    if hh.size == 0:
        return
    U = basis.alpha[hh, None] * basis.Wd[:, hh].T + basis.Q[:, ii].T
    val = reader.read(tokens[kk], base[kk], U, basis.alpha[hh])
    mu[hh, kk, H + ii] = val - basis.alpha[hh] * mu[hh, kk, hh]


# --------------------------------------------------------------------------------------------------
# The method
# --------------------------------------------------------------------------------------------------

def extract_multihead(
    oracle: Oracle,
    *,
    heads: int | None = None,
    max_heads: int = 16,
    rank: int | None = None,
    bias: bool = False,
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
) -> MultiHeadExtraction:
    """Recover every head (W_h, v_h) — and (c_h, beta) with ``bias`` — of a multi-head layer.

    Args:
        oracle: the black box (exact value answers).
        heads: the number of heads in canonical form if known; the method always counts them and
            raises :class:`ModelMismatch` when its count differs. None: detect, at most ``max_heads``.
        max_heads: the most heads auto-detection accepts (bounds the switch search).
        rank: every head's rank if known (low-rank sketches); None detects each head's rank (a dense
            head costs exactly as much as with ``rank=d``).
        bias: the target may have score biases c_h and an output bias beta.
        rng: generator or seed (half circles, anchor token, sketch directions).
        progress: called with the oracle's query count after each oracle call.

    Returns:
        A :class:`MultiHeadExtraction` in canonical form (equal heads merged, zero heads absent).

    Raises:
        ModelMismatch: the head count differs from ``heads``, exceeds ``max_heads``, or the answers do
            not split into heads (the figures are in the exception).
        NotIdentifiable: ``d - H < 2``, dependent v_h, or no head switches at all.
        ConvergenceError: no searched half circle saturated every head.
    """
    if heads is not None:
        if isinstance(heads, bool) or int(heads) != heads or heads < 1:
            raise ValueError(f"heads must be a positive integer or None (auto), got {heads!r}")
        heads = int(heads)
        if heads > oracle.d:
            raise ValueError(f"heads = {heads} > d = {oracle.d}: more heads than dimensions cannot be "
                             "isolated (their v_h are linearly dependent)")
    if isinstance(max_heads, bool) or int(max_heads) != max_heads or max_heads < 1:
        raise ValueError(f"max_heads must be a positive integer, got {max_heads!r}")
    if rank is not None:
        if isinstance(rank, bool) or int(rank) != rank or not 1 <= rank <= oracle.d:
            raise ValueError(f"rank must be in 1..d = {oracle.d} or None, got {rank!r}")
        rank = int(rank)
    rng = np.random.default_rng(rng)
    t0 = time.perf_counter()
    q0, calls0 = oracle.queries, oracle.calls
    d = oracle.d
    ask = _Asker(oracle, progress, chunk_for(d, mbytes=16.0))

    # 1. one-token answers
    ask.phase = "one_token"
    T1 = np.vstack([np.zeros((1, d)), np.eye(d)]) if bias else np.eye(d)
    y1 = ask(T1[:, None, :].copy())
    beta = float(y1[0]) if bias else 0.0
    v_sum = y1[1:] - beta if bias else y1.copy()
    single = ask.float32

    # 2-3. switch search and rough values on an anchor token
    ask.phase = "switch_search"
    b0 = rng.standard_normal(d)
    b0 /= np.linalg.norm(b0)
    base0 = float(b0 @ v_sum + beta)
    limit = max_heads if heads is None else max(heads, max_heads)
    circle, counts = _find_switches(ask, b0, base0, rng, single=single, max_heads=limit)
    H = len(circle.switches)
    if H == 0:
        raise NotIdentifiable("no head switches: the answers do not depend on the attention weights, so "
                              "no W_h is identifiable (every v_h = 0, or the target is linear)")
    if heads is not None and H != heads:
        raise ModelMismatch(
            f"the target has {H} head(s) in canonical form, not heads = {heads} "
            f"(switch counts on the searched planes: {counts})", check="head count", figure=float(H),
            threshold=float(heads),
            hint=("heads with equal W_h merge into one (Proposition 7.1)" if H < heads else
                  "pass heads=None to detect the count"))
    if H > max_heads and heads is None:
        raise ModelMismatch(f"{H} heads found, more than max_heads = {max_heads}", check="head count",
                            figure=float(H), threshold=float(max_heads), hint="raise max_heads")
    if d - H < 2:
        raise NotIdentifiable(f"{H} heads in d = {d}: head isolation needs d - H >= 2 directions "
                              "orthogonal to every v_h")
    ask.phase = "rough_values"
    V_rough = _rough_values(ask, b0, base0, circle, v_sum)

    # 4-5. isolation on the anchor token, then exact values at a known margin
    passes = 2 if single else 1
    V = V_rough
    reader = _Reader(ask, single)
    for _ in range(passes):
        basis = _Basis.of(V, rng)
        ask.phase = "anchor_isolation"
        mu0 = _isolate_full(reader, basis, b0[None, :], np.array([base0]))
        M = (basis.Phi_inv_T @ mu0[:, 0, :].T).T          # (H, d): m_h(b0)
        ask.phase = "exact_values"
        V = _exact_values(ask, b0, M, basis, single)
    mismatch = float(np.linalg.norm(V.sum(axis=0) - v_sum) / max(np.linalg.norm(v_sum), 1e-300))
    sum_tol = 1e-4 if single else 1e-8
    if mismatch > sum_tol:
        raise ModelMismatch(
            f"the {H} recovered v_h do not add up to the one-token answers (relative gap {mismatch:.3g})",
            check="values sum", figure=mismatch, threshold=sum_tol,
            hint="a head that never switches (m_h = 0), or a target that is not multi-head attention")

    # 6. score matrices
    basis = _Basis.of(V, rng)
    tokens = T1
    base = y1
    W, C, ranks, ell = _scores(reader, ask, basis, tokens, base, bias=bias, rank=rank, single=single,
                               v_sum=v_sum, beta=beta, rng=rng)

    # the switch order is arbitrary: sort heads by their value vectors for a reproducible order
    order = np.lexsort(V.T[::-1])
    diagnostics = {
        "heads_found": H,
        "switch_counts": counts,
        "switch_positions": [round(0.5 * (lo + hi), 7) for lo, hi in circle.switches],
        "saturation_t": circle.t,
        "saturation_logit": L_SAT[single],
        "value_margin_logit": L_PATTERN[single],
        "probe_logit": T_TARGET[single],
        "precision": "float32" if single else "float64",
        "queries_by_phase": dict(ask.by_phase),
        "switch_search_queries": ask.by_phase.get("switch_search", 0),
        "planned_queries": _planned(d, H, rank, bias, single, ranks, ell),
        "ranks": [int(ranks[h]) for h in order],
        "sketch_rows": [int(ell[h]) for h in order],
        "values_sum_gap": mismatch,
        "rough_value_err": float(np.max(np.linalg.norm(V_rough - V, axis=1) / np.linalg.norm(V, axis=1))),
        "v_condition": float(np.linalg.cond(V)),
        "requeried": reader.scaler.requeried,
        "tight_fallbacks": reader.fallbacks,
        "oracle_calls": oracle.calls - calls0,
        "not_identifiable": PROPOSITION_7_1,
    }
    return MultiHeadExtraction(
        method="multihead-isolation", W=W[order], V=V[order], C=C[order] if bias else None,
        beta=beta if bias else None, queries=oracle.queries - q0, seconds=time.perf_counter() - t0,
        diagnostics=diagnostics)
