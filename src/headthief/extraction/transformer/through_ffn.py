"""One-layer transformers with FFN biases: learn the FFN, then read the attention through it (ours).

The paper's antisymmetric reduction needs an FFN without biases. This method does not: it works with
any FFN the learner recovers (with or without biases, with a linear part).

1. *FFN.* One-token queries ``VQ([x]) = g(x)`` with ``g(x) = w_o^T ReLU(A^T x + b_1) + b_2``: the FFN
   learner (:func:`~headthief.extraction.transformer.ffn.extract_ffn` with ``bias=True``) returns an
   equivalent network ``g_hat``, piecewise linear with known kinks.
2. *Scores through the FFN.* A two-token answer is ``VQ([b + delta; b]) = g(b + sigma(s) delta)`` with
   ``s = delta^T m(b)``, ``m(b) = W b + c``. Along the segment ``alpha -> g_hat(b + alpha delta)``
   (alpha in [0, 1]) the recovered FFN is piecewise linear with known breakpoints; the probe ``delta``
   is chosen (and shortened) so that the segment is strictly monotone with every slope at least a
   quarter of the first one, so the answer inverts to a unique ``alpha = sigma(s)`` and
   ``delta^T m(b) = logit(alpha)``.
3. *Like Theorem 4.1*: d probes ``delta_l = t_l u_l`` per anchor token b give ``m(b) = U^{-1} g`` (U the
   probe directions: a random orthogonal design shifted along the FFN's gradient at b, so that
   every ``|u^T grad g(b)|`` is large and U stays well conditioned); anchors ``lam e_1..lam e_d`` (and 0 for the score
   bias c with ``bias``, asked last) give ``W`` (and c) from ``m(b) = W b + c``.

Query count: the FFN learner's, plus ``d^2`` (``d^2 + d`` with ``bias``) two-token queries, plus any
probe re-asked because its attention weight came out too close to 0 or 1 (``diagnostics["requeried"]``).
On float32 answers each weight is then read against the true FFN rather than the recovered one
(:func:`_calibrate`: two one-token queries on the probe's linear piece, ``diagnostics["calibration_queries"]``,
at most ``2 (d^2 + d)``), which removes the recovered FFN's error from W (torch-transformer:d=16,m=32:
W_rel_err 1.7e-4 -> see docs/transformer.md).
One head only: with several heads the attended tokens differ per head and a two-token answer is no
longer a function of one weight (bias-free multi-head targets go through the antisymmetric oracle).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ...errors import ConvergenceError, ModelMismatch, NotIdentifiable
from ...oracles.base import Oracle
from ..check import TRANSFORMER, checked
from ..probes import Progress, looks_float32
from .paper import _ffn_diagnostics, run_ffn_learner
from .recovered import TransformerExtraction, ffn_parts
from ...linalg import lstsq

T_LOGIT = 2.0
"""The largest |score| a probe aims at (attention weight in [0.12, 0.88])."""

ALPHA_EDGE = 0.005
"""A probe whose attention weight lands closer than this to 0 or 1 is re-asked shorter."""

MAX_TRIES = 24
"""Bound on the directions tried per probe and on re-asks per probe."""


def through_ffn_query_count(d: int, *, bias: bool = True) -> int:
    """Two-token queries of the attention part (no re-asked probe): ``d^2`` (``d^2 + d`` with ``bias``)."""
    return d * d + (d if bias else 0)


class _Segments:
    """The recovered FFN along segments ``b + t u``: breakpoints, slopes and inversion."""

    def __init__(self, ffn):
        p = ffn_parts(ffn)
        self.g = getattr(ffn, "model", ffn)
        self.A, self.w, self.b1, self.lin = p["A"], p["w"], p["b1"], p["linear"]

    def grad(self, x: np.ndarray) -> np.ndarray:
        act = (x @ self.A + self.b1) > 0
        g = self.A @ (self.w * act)
        return g + self.lin if self.lin is not None else g

    def monotone_length(self, b: np.ndarray, u: np.ndarray, t_cap: float) -> float:
        """The longest t <= t_cap such that t' -> g(b + t' u) on [0, t] is strictly monotone with every slope
        at least a quarter of the first (in the first's sign); 0 when the first slope is ~0."""
        pre0 = b @ self.A + self.b1
        rate = u @ self.A
        slope = float(u @ self.grad(b))
        with np.errstate(divide="ignore", invalid="ignore"):
            tk = -pre0 / rate
        # kinks ahead where the neuron switches: also catch neurons exactly at their kink (pre0 == 0)
        ahead = np.flatnonzero((tk > 0) & (tk < t_cap) & np.isfinite(tk))
        # a neuron at its kink that the direction switches on right away changes the slope at 0+
        at = np.flatnonzero((pre0 == 0) & (rate > 0))
        s0 = slope + float(np.sum(self.w[at] * rate[at]))
        if s0 == 0 or not np.isfinite(s0):
            return 0.0
        cur = s0
        for k in ahead[np.argsort(tk[ahead])]:
            cur += self.w[k] * abs(rate[k])     # switching on (rate > 0) or off (rate < 0): + w_k |rate_k|
            if cur * s0 <= 0 or abs(cur) < 0.25 * abs(s0):
                return float(tk[k])
        return float(t_cap)

    def invert(self, b: np.ndarray, delta: np.ndarray, y: float, tol: float) -> float:
        """alpha in (0, 1) with ``g(b + alpha delta) = y`` on a strictly monotone segment (piecewise linear)."""
        pre0 = b @ self.A + self.b1
        rate = delta @ self.A
        with np.errstate(divide="ignore", invalid="ignore"):
            ak = -pre0 / rate
        ak = ak[(ak > 0) & (ak < 1) & np.isfinite(ak)]
        knots = np.concatenate([[0.0], np.sort(ak), [1.0]])
        vals = np.asarray(self.g(b[None, :] + knots[:, None] * delta[None, :]), dtype=np.float64)
        if vals[-1] < vals[0]:
            knots, vals = knots[::-1], vals[::-1]
        lo, hi = vals[0], vals[-1]
        if not lo - tol <= y <= hi + tol:
            raise ModelMismatch(
                f"a two-token answer {y:.6g} lies outside the recovered FFN's range [{lo:.6g}, {hi:.6g}] on its "
                "segment: the answer is not FFN(b + alpha (a - b)) for any attention weight alpha, so the target "
                "is not a one-head transformer with this FFN", check="segment range", figure=float(
                    max(lo - y, y - hi)), threshold=tol, hint="several heads before the FFN, or not a transformer")
        k = int(np.clip(np.searchsorted(vals, y) - 1, 0, len(vals) - 2))
        dv = vals[k + 1] - vals[k]
        a = knots[k] + (knots[k + 1] - knots[k]) * ((y - vals[k]) / dv if dv != 0 else 0.5)
        return float(a)


@checked(TRANSFORMER)
def extract_transformer(
    oracle: Oracle,
    *,
    bias: bool = True,
    lam: float = 1.0,
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
    ffn_learner: Callable | None = None,
    ffn_max_queries: int | None = None,
) -> TransformerExtraction:
    """Recover a one-head transformer (FFN biases allowed) by reading the attention through the FFN.

    Args:
        oracle: the black box (exact value answers).
        bias: the target may have FFN biases (the FFN learner's ``bias=True``) and a score bias c (one more
            anchor token, 0: d more queries). False: the paper's bias-free model.
        lam: scale of the anchor tokens ``lam e_j``.
        rng: generator or seed (probe directions, the FFN learner).
        progress: called with the number of value queries answered after each oracle call.
        ffn_learner: the FFN learner (default :func:`extract_ffn`), see
            :func:`~headthief.extraction.transformer.paper.run_ffn_learner`.
        ffn_max_queries: a cap handed to the FFN learner.

    Returns:
        A :class:`TransformerExtraction` (``v`` is None: with FFN biases there is no antisymmetric readout).

    Raises:
        ModelMismatch: a two-token answer is outside the recovered FFN's range on its segment.
        NotIdentifiable: the recovered FFN is flat around every anchor tried (the attention is invisible).
        ConvergenceError: no monotone segment, or a probe stayed saturated after its re-asks.
    """
    if not (np.isfinite(lam) and lam > 0):
        raise ValueError(f"lam must be a positive number, got {lam}")
    rng = np.random.default_rng(rng)
    t0 = time.perf_counter()
    q0 = oracle.queries
    d = oracle.d
    ffn, ffn_queries = run_ffn_learner(oracle, bias=bias, rng=rng, progress=progress, learner=ffn_learner,
                                       max_queries=ffn_max_queries)
    seg = _Segments(ffn)
    qa = oracle.queries

    anchors = [lam * np.eye(d)[j] for j in range(d)]
    if bias:
        anchors = anchors + [np.zeros(d)]     # last: m(0) = c may be 0, which says nothing about the scale
    R = oracle.input_norm
    Bm, M = [], []
    requeried = 0
    m_scale = 1.0                # ||m(b)|| / max(lam, ||b||): a guess (W entries ~ 1/sqrt(d)), then the largest seen
    seen: list[float] = []
    f32 = None
    design_cond = 0.0
    calibration = 0              # one-token queries that read the true FFN on the probes' pieces (float32)
    extra_probes = 0             # probes added to ill-conditioned designs (float32)
    f32_hint = bool((getattr(ffn, "diagnostics", None) or {}).get("float32_answers", False))
    for k, b0 in enumerate(anchors):
        b = _anchor(seg, b0, lam, rng)
        gb = seg.grad(b)
        gn = float(np.linalg.norm(gb))
        gh = gb / gn
        t_cap = T_LOGIT / max(m_scale * max(lam, float(np.linalg.norm(b))), 1e-12)
        rows, Ts = [], []
        for block in range(MAX_DESIGN_BLOCKS):
            Qo, _ = np.linalg.qr(rng.standard_normal((d, d)))
            for l in range(d):
                u, t = _probe_direction(seg, b, gh, Qo[:, l], t_cap, rng, R)
                rows.append(u)
                Ts.append(t)
            cond = float(np.linalg.cond(np.array(rows)))
            # float32: a design whose probes fell back to poor directions amplifies the answers' noise by its
            # condition number; more probes (least squares) bring it down. float64 answers keep d probes.
            if cond <= DESIGN_COND_LIMIT or not (f32 or f32_hint):
                break
        U = np.array(rows)
        T = np.array(Ts)
        extra_probes += U.shape[0] - d
        design_cond = max(design_cond, float(np.linalg.cond(U)))
        meas = np.empty(U.shape[0])
        pending = list(range(U.shape[0]))
        for _ in range(MAX_TRIES):
            X = np.stack([np.stack([b + T[l] * U[l], b]) for l in pending])
            y = oracle.query(X)
            if progress:
                progress(len(pending))
            if f32 is None:
                f32 = looks_float32(y)
            tol = (2.0 ** -24 if f32 else 2.0 ** -53) * 64 * max(1.0, float(np.max(np.abs(y))))
            again = []
            read: dict[int, float] = {}
            for l, yl in zip(pending, y):
                a = seg.invert(b, T[l] * U[l], float(yl), tol)
                if not ALPHA_EDGE < a < 1 - ALPHA_EDGE:
                    T[l] *= 0.25
                    again.append(l)
                    continue
                read[l] = a
            if f32 and read:
                read, q = _calibrate(oracle, seg, b, T, U, dict(zip(pending, y)), read, progress)
                calibration += q
            for l, a in read.items():
                meas[l] = np.log(a / (1 - a)) / T[l]       # u_l^T m(b)
            requeried += len(again)
            pending = again
            if not pending:
                break
        else:
            raise ConvergenceError(f"anchor {k}: probes still saturated after {MAX_TRIES} re-asks")
        m = np.linalg.solve(U, meas) if U.shape[0] == d else lstsq(U, meas, rcond=None)[0]
        seen.append(float(np.linalg.norm(m)) / max(lam, float(np.linalg.norm(b))))
        m_scale = max(seen) if max(seen) > 0 else m_scale
        Bm.append(b)
        M.append(m)
    Bm, M = np.asarray(Bm), np.asarray(M)
    if bias:
        G = np.hstack([Bm, np.ones((len(Bm), 1))])
        sol = np.linalg.solve(G, M)
        W, c = sol[:d].T, sol[d]
    else:
        W, c = np.linalg.solve(Bm, M).T, None
    attention_queries = oracle.queries - qa
    diagnostics = {"attention_queries": attention_queries, "ffn_queries": ffn_queries, "requeried": requeried,
                   "calibration_queries": calibration, "extra_probes": extra_probes,
                   "design_cond": design_cond,
                   "ffn_neurons": int(seg.A.shape[1]), "lam": lam, "anchor_cond": float(np.linalg.cond(
                       np.hstack([Bm, np.ones((len(Bm), 1))]) if bias else Bm))}
    diagnostics.update(_ffn_diagnostics(ffn))
    return TransformerExtraction(
        method="transformer", W=W, v=None, c=c, ffn=ffn, queries=oracle.queries - q0,
        attention_queries=attention_queries, ffn_queries=ffn_queries, seconds=time.perf_counter() - t0,
        diagnostics=diagnostics)


DESIGN_COND_LIMIT = 100.0
"""Float32: a probe design (per anchor) with a larger condition number gets another block of d probes
(measured 6 to 30 at d = 16 when every probe takes its first direction; 1.9e3 when some fell back)."""

MAX_DESIGN_BLOCKS = 3
"""Bound on the blocks of d probes per anchor."""

CALIBRATION_MARGIN = 0.2
"""The calibration points sit this share of their piece inside it (kinks are known to ~1e-5 of a piece)."""


def _calibrate(oracle: Oracle, seg: _Segments, b: np.ndarray, T: np.ndarray, U: np.ndarray, answers: dict,
               read: dict, progress: Progress) -> tuple[dict, int]:
    """Float32 answers: read each attention weight against the true FFN instead of the recovered one.

    The recovered FFN is good to its fidelity (~1e-5 relative on float32 answers) and inverting it divides
    that error by the segment's slope: the weights, then W, inherit ~1e-4 (measured W_rel_err 7.6e-5 to
    2.4e-3 on torch-transformer:d=16,m=32, 3e-6 to 1e-5 with the exact FFN). But the FFN is linear on the
    piece of the segment ``b + t delta`` that holds ``alpha`` (its kinks are known from the recovered
    network to far better than the piece's length), so two one-token queries inside that piece,
    ``CALIBRATION_MARGIN`` of it away from its ends, give the true line there, and ``alpha`` is where that
    line meets the two-token answer: only the answers' rounding is left. A piece shorter than 1e-3 of
    the segment, or a calibrated weight that leaves the piece, keeps the recovered FFN's reading.
    Returns (weights, queries spent: 2 per probe calibrated).
    """
    pts, plan = [], []
    for l, a in read.items():
        delta = T[l] * U[l]
        pre0 = b @ seg.A + seg.b1
        rate = delta @ seg.A
        with np.errstate(divide="ignore", invalid="ignore"):
            ak = -pre0 / rate
        ak = np.sort(ak[(ak > 0) & (ak < 1) & np.isfinite(ak)])
        knots = np.concatenate([[0.0], ak, [1.0]])
        k = int(np.clip(np.searchsorted(knots, a) - 1, 0, len(knots) - 2))
        lo, hi = knots[k], knots[k + 1]
        if hi - lo < 1e-3:
            continue
        t1, t2 = lo + CALIBRATION_MARGIN * (hi - lo), hi - CALIBRATION_MARGIN * (hi - lo)
        pts += [b + t1 * delta, b + t2 * delta]
        plan.append((l, lo, hi, t1, t2))
    if not plan:
        return read, 0
    g = oracle.query(np.array(pts)[:, None, :])
    if progress:
        progress(len(pts))
    out = dict(read)
    for i, (l, lo, hi, t1, t2) in enumerate(plan):
        g1, g2 = float(g[2 * i]), float(g[2 * i + 1])
        if g2 == g1:
            continue
        a = t1 + (float(answers[l]) - g1) * (t2 - t1) / (g2 - g1)
        if lo <= a <= hi and ALPHA_EDGE < a < 1 - ALPHA_EDGE:
            out[l] = float(a)
    return out, len(pts)


def _anchor(seg: _Segments, b0: np.ndarray, lam: float, rng: np.random.Generator) -> np.ndarray:
    """``b0``, or a nearby token where the recovered FFN is not flat (bounded tries)."""
    b = b0
    scale = None
    for _ in range(MAX_TRIES):
        gn = float(np.linalg.norm(seg.grad(b)))
        if scale is None:
            scale = max(float(np.linalg.norm(seg.A @ np.abs(seg.w))) / max(np.sqrt(seg.A.shape[1]), 1.0), 1e-300)
        if gn > 1e-6 * scale:
            return b
        b = b0 + 0.5 * lam * rng.standard_normal(b0.shape[0]) / np.sqrt(b0.shape[0])
    raise NotIdentifiable("the recovered FFN is flat (no active neuron, no linear part) around every anchor tried: "
                          "the answers do not depend on the attention there")


def _probe_direction(seg: _Segments, b, gh, q, t_cap, rng, R) -> tuple[np.ndarray, float]:
    """A unit direction u and a length t with a monotone segment from b.

    First ``u = q + sign(q^T g) g / |g|`` with q a column of a random orthogonal matrix: the rows of the
    design are then an orthogonal matrix plus a rank-one term with every ``|u^T g| >= |g|`` and a
    condition number of order d at worst (Gaussian rows reach 1e4 now and then, and the solve for
    ``m(b)`` loses that factor). Then perturbations of q (bounded tries), each also reversed.
    """
    d = b.shape[0]
    best = (None, 0.0)
    for i in range(MAX_TRIES):
        base = q if i == 0 else q + (0.25 + 0.05 * i) * rng.standard_normal(d) / np.sqrt(d)
        u = base + (1.0 if base @ gh >= 0 else -1.0) * gh
        u /= np.linalg.norm(u)
        cap = t_cap
        if R is not None:      # keep b + t u inside the input-norm bound
            bu, bb = float(b @ u), float(b @ b)
            cap = min(cap, 0.999 * (-bu + np.sqrt(max(bu * bu - bb + R * R, 0.0))))
        for sgn in (1.0, -1.0):
            t = seg.monotone_length(b, sgn * u, cap)
            if t >= 0.25 * t_cap:
                return sgn * u, t
            if t > best[1]:
                best = (sgn * u, t)
    if best[0] is None or best[1] <= 1e-3 * t_cap:
        raise ConvergenceError(f"no monotone segment of useful length from this anchor in {MAX_TRIES} directions")
    return best
