"""The model check: does the target behave like the model class the extraction assumed?

Every extraction goes through :func:`checked`, which wraps the method in two checks:

1. **Before** (:func:`preflight`, at most 16 queries, counted as ``check_queries``): identities that
   every member of the assumed class satisfies, tested on a handful of random tokens. For one
   attention head ``f(X) = softmax(X W x_N + X c)^T X v + beta``:

   - *zero token* (no output bias assumed): ``f([0]) = 0``;
   - *one-token affinity*: ``f([a + b]) - f([a]) - f([b]) + f([0]) = 0`` (one token gets all the
     attention, so ``f([x]) = v^T x + beta``);
   - *key order*: ``f([a; c; b]) = f([c; a; b])`` (only the last token is the query; no positions);
   - *repetition*: ``f([a; a; b; b]) = f([a; b])`` (repeating every token alike leaves the softmax);
   - *convexity*: ``f([a; b])`` lies between ``f([a])`` and ``f([b])`` (it is a convex combination);
   - *one softmax*: the two-token answers ``[a; b]``, ``[c; b]`` fix ``exp(s_a - s_b)`` and
     ``exp(s_c - s_b)``, and with them predict ``f([a; c; b])`` exactly (Luce's choice axiom). A sum
     of heads, or an FFN after the head, breaks it.

   Multi-head attention keeps the first four (its heads' softmaxes differ, so not the last two).
   Sign-only answers keep the bit versions (the zero token, key order, repetition, convexity, and
   ``bit(a) = bit(b) => bit((a + b) / 2) = bit(a)`` for a half-space). Every comparison allows the
   answers' own error: ``tau`` for a noisy oracle, a float32 or float64 rounding error scaled by the
   answers' size, propagated through the prediction. A failure raises :class:`ModelMismatch` naming
   the identity and what the target might be instead.

2. **After** (:func:`verdict`): the recovered model is compared with the target on fresh random
   sequences (the fidelity, ``verify_queries``); a fidelity worse than the answers' precision explains
   raises :class:`ModelMismatch` with the figure and the threshold (:func:`fidelity_threshold`).
   Sign-only answers: the share of fresh sequences whose bit the recovered model gets wrong although
   its output is clear of zero by more than its own resolution.

The result records the check (:class:`ModelCheck`) in ``res.check``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import BudgetExceeded, ModelMismatch, NotIdentifiable
from ..oracles.base import Oracle, oracle_stack
from .result import random_sequences

SINGLE = "single-head attention"
MULTI = "multi-head attention"
FFN = "ReLU feed-forward network"   # one-token queries; its identities and verdict: transformer/ffn_check.py
TRANSFORMER = "one-layer transformer"
# classes with a nonlinearity after the attention: one-token answers are not affine in the token
NOT_AFFINE = {TRANSFORMER}
CHECK_SEED = 0x5EED


@dataclass(frozen=True)
class Identity:
    """One identity tested before the extraction: its name, the worst violation and the allowance."""

    name: str
    ok: bool | None          # None: inconclusive (the answers were too imprecise to tell)
    violation: float
    allowed: float

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "violation": _num(self.violation), "allowed": _num(self.allowed)}


@dataclass(frozen=True)
class ModelCheck:
    """What the model check found.

    Attributes:
        verdict: ``"pass"``, ``"fail"``, ``"inconclusive"`` (the answers or the method's resolution cannot
            tell), or ``"unchecked"`` (skipped, or the budget ran out first).
        model: the assumed class.
        answers: what the answers were read as (``float64``, ``float32``, ``tolerance 1e-06``, ``sign-only``).
        identities: the identities tested before the extraction.
        check_queries: queries the identities cost (apart from the method's ``queries``).
        figure, threshold: the fidelity on fresh sequences and the largest the answers' precision explains.
        verify_queries: queries the fidelity cost.
        detail: a sentence for people.
    """

    verdict: str
    model: str
    answers: str = ""
    identities: tuple[Identity, ...] = ()
    check_queries: int = 0
    figure: float | None = None
    threshold: float | None = None
    verify_queries: int = 0
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "model": self.model, "answers": self.answers,
                "figure": _num(self.figure), "threshold": _num(self.threshold),
                "check_queries": self.check_queries, "verify_queries": self.verify_queries,
                "identities": [i.as_dict() for i in self.identities], "detail": self.detail}


def _num(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


# ---------------------------------------------------------------------------------------------------
# what the answers are


@dataclass(frozen=True)
class AnswerKind:
    """How precise the oracle's answers are: ``sign`` (bits), ``tau`` (a tolerance), or floats."""

    sign: bool = False
    tau: float = 0.0
    float32: bool = False

    @property
    def eps(self) -> float:
        return 2.0 ** -24 if self.float32 else 2.0 ** -53

    def describe(self) -> str:
        if self.sign:
            return "sign-only"
        base = "float32" if self.float32 else "float64"
        return f"{base}, tolerance {self.tau:g}" if self.tau > 0 else base


def answer_kind(oracle: Oracle, answers: np.ndarray | None = None) -> AnswerKind:
    """Read the oracle stack (SignOnly, Tolerance wrappers) and, from answers, float32 or not."""
    from ..oracles.sign_only import SignOnly
    from ..oracles.tolerance import Tolerance
    from .probes import looks_float32
    sign, tau = False, 0.0
    for o in oracle_stack(oracle):
        if isinstance(o, SignOnly):
            sign = True
        elif isinstance(o, Tolerance):
            tau += o.tau
        else:       # a model API says what its answers are (HTTPOracle: noisy:TAU, rounded:K, sign)
            sign = sign or bool(getattr(o, "answer_sign", False))
            tau += float(getattr(o, "answer_tau", 0.0))
    f32 = bool(answers is not None and not sign and looks_float32(answers))
    return AnswerKind(sign=sign, tau=tau, float32=f32)


# ---------------------------------------------------------------------------------------------------
# before: identities


def _tokens(d: int, rng: np.random.Generator, k: int, norm: float) -> list[np.ndarray]:
    out = []
    for _ in range(k):
        x = rng.standard_normal(d)
        out.append(x * (norm / np.linalg.norm(x)))
    return out


def _hints(name: str, model: str) -> str:
    return {
        "zero token": "the target has an output bias (pass --bias / bias=True), or it is not an attention "
                      "head without biases",
        "one-token affinity": "one-token answers are not affine in the token: a nonlinearity (an FFN, "
                              "LayerNorm, a tanh/ReLU readout) after the attention, or not attention at all",
        "key order": "the answer depends on the order of the non-query tokens: positional encodings, causal "
                     "masking, or a query position other than the last token",
        "repetition": "repeating every token alike changes the answer: positional encodings, a length "
                      "normalisation, or attention that is not a softmax over the tokens",
        "convexity": "a two-token answer is not between the one-token answers: several heads (try --method "
                     "multihead), or an FFN after the head",
        "one softmax": "the attention weights are not one softmax over the tokens: several heads (try --method "
                       "multihead), or an FFN after the head",
        "half-space": "one-token bits are not a half-space: a nonlinearity after the attention",
    }.get(name, f"the target is not {model}") if model not in _MODEL_HINTS else _MODEL_HINTS[model].get(
        name, f"the target is not {model}")


_MODEL_HINTS = {
    TRANSFORMER: {
        "zero token": "f([0]) != 0: the FFN has biases (w_2^T ReLU(W_1 z + b_1) + b_2), and then the "
                      "antisymmetric reduction of Section 4.1 does not hold: ReLU(z + b) - ReLU(-z + b) != z, "
                      "so VQ(X) - VQ(-X) is not attention; use --method transformer (it learns the FFN with "
                      "its biases and reads the attention through it)",
        "key order": "the answer depends on the order of the non-query tokens: positional encodings, causal "
                     "masking, or a query position other than the last token",
        "repetition": "repeating every token alike changes the answer: positional encodings, a length "
                      "normalisation, or attention that is not a softmax over the tokens",
        "one softmax": "the recovered transformer does not reproduce the answers: several heads before the FFN "
                       "(pass --heads H), FFN biases (--method transformer), or not a one-layer transformer",
    },
}


def preflight(oracle: Oracle, *, model: str = SINGLE, bias: bool = False,
              rng: np.random.Generator | int = CHECK_SEED, signs: bool = False) -> tuple[tuple[Identity, ...], int, AnswerKind]:
    """Test the identities of ``model`` on at most 16 queries; raise :class:`ModelMismatch` on failure.

    Returns ``(identities, queries spent, answer kind)``. A target whose answers do not depend on the
    tokens at all (a constant) raises :class:`NotIdentifiable`: nothing of W is visible.
    """
    if model == FFN:
        from .transformer.ffn_check import ffn_preflight
        return ffn_preflight(oracle, bias=bias, rng=rng)
    rng = np.random.default_rng(rng)
    d = oracle.d
    R = oracle.input_norm
    s1 = 0.5 * R if R is not None else 1.0
    s2 = 0.5 * R if R is not None else max(1.0, math.sqrt(d))
    a, b, c = _tokens(d, rng, 3, s1)
    A, B, C = _tokens(d, rng, 3, s2)
    z = np.zeros(d)
    seqs = [[z], [a], [b], [a + b], [c], [a, b], [c, b], [a, c, b], [c, a, b], [a, a, b, b],
            [A], [B], [C], [A, B], [C, B], [A, C, B]]
    ab = float(np.linalg.norm(a + b))
    ab_scaled = R is not None and ab > R
    if ab_scaled:         # a + b must stay inside the bound (the affinity identity is then not tested)
        seqs[3] = [(a + b) * (R / ab)]
    q0 = oracle.queries
    y = oracle.query([np.asarray(s) for s in seqs])
    spent = oracle.queries - q0
    kind = answer_kind(oracle, y)
    if signs and not kind.sign:
        kind = AnswerKind(sign=True)
        y = (y > 0).astype(np.float64)
    single = model == SINGLE
    ids: list[Identity] = []
    if kind.sign:
        ids += _sign_identities(y, bias=bias, single=single)
    else:
        ids += _value_identities(y, kind, d, bias=bias, single=single,
                                 ab_scaled=ab_scaled or model in NOT_AFFINE)
    # a constant target: nothing depends on the tokens
    if not kind.sign:
        M = float(np.max(np.abs(y)))
        spread = float(np.max(y) - np.min(y))
        tol = 4 * kind.tau + 64 * math.sqrt(d) * kind.eps * max(M, 1e-300)
        if spread <= tol and (bias or M <= tol):
            raise NotIdentifiable(
                "the answers do not depend on the tokens (every check answer is the same): v = 0, so W "
                "(and the score bias c) is not identifiable from value queries")
    for i in ids:
        if i.ok is False:
            raise ModelMismatch(
                f"the target does not behave like {model}: the {i.name} identity fails (violation "
                f"{i.violation:.3g} > allowed {i.allowed:.3g}, answers read as {kind.describe()}); "
                f"{_hints(i.name, model)}. {spent} check queries spent (--no-check skips the check)",
                check=i.name, figure=i.violation, threshold=i.allowed, hint=_hints(i.name, model))
    return tuple(ids), spent, kind


def _value_identities(y, kind: AnswerKind, d: int, *, bias: bool, single: bool, ab_scaled: bool) -> list[Identity]:
    (f0, fa, fb, fab1, fc, fab, fcb, facb, fcab, faabb, fA, fB, fC, fAB, fCB, fACB) = (float(v) for v in y)
    M = float(np.max(np.abs(y)))
    # each answer is within delta of the model's value: the tolerance, and a rounding error that grows
    # with the answers' size and with d (dot products of d terms)
    delta = kind.tau + 32 * math.sqrt(d) * kind.eps * max(M, 1e-300)
    out = []
    if not bias:
        out.append(Identity("zero token", abs(f0) <= 2 * delta, abs(f0), 2 * delta))
    if not ab_scaled:
        viol = abs(fab1 - fa - fb + f0)
        out.append(Identity("one-token affinity", viol <= 8 * delta, viol, 8 * delta))
    viol = abs(facb - fcab)
    out.append(Identity("key order", viol <= 4 * delta, viol, 4 * delta))
    viol = abs(faabb - fab)
    out.append(Identity("repetition", viol <= 4 * delta, viol, 4 * delta))
    if single:
        worst, allowed = 0.0, 4 * delta
        for two, one1, one2 in ((fab, fa, fb), (fcb, fc, fb), (fAB, fA, fB), (fCB, fC, fB)):
            lo, hi = min(one1, one2), max(one1, one2)
            worst = max(worst, lo - two, two - hi)
        out.append(Identity("convexity", worst <= allowed, max(worst, 0.0), allowed))
        res = [_luce(fa, fb, fc, fab, fcb, facb, delta), _luce(fA, fB, fC, fAB, fCB, fACB, delta)]
        conclusive = [r for r in res if r is not None]
        if conclusive:
            viol = max(v for v, _ in conclusive)
            ok = all(v <= al for v, al in conclusive)
            allowed = max(al for v, al in conclusive if (v > al) == (not ok)) if conclusive else 0.0
            out.append(Identity("one softmax", ok, viol, allowed))
        else:
            out.append(Identity("one softmax", None, float("nan"), float("nan")))
    return out


def _luce(fa, fb, fc, fab, fcb, facb, delta) -> tuple[float, float] | None:
    """Predict f([a; c; b]) from the one- and two-token answers; (violation, allowance) or None when the
    answers cannot tell (a weight too close to 0 or 1, or one-token answers too close together)."""

    def predict(x):
        fa_, fb_, fc_, fab_, fcb_ = x
        ra = (fab_ - fb_) / (fa_ - fab_)       # exp(s_a - s_b)
        rc = (fcb_ - fb_) / (fc_ - fcb_)       # exp(s_c - s_b)
        return (ra * fa_ + rc * fc_ + fb_) / (ra + rc + 1.0)

    x = np.array([fa, fb, fc, fab, fcb])
    with np.errstate(all="ignore"):
        p = predict(x)
        if not np.isfinite(p):
            return None
        ra = (fab - fb) / (fa - fab)
        rc = (fcb - fb) / (fc - fcb)
        if not (ra > 0 and rc > 0 and np.isfinite(ra) and np.isfinite(rc)):
            # a weight outside (0, 1): convexity says so when it is beyond the answers' error
            return None
        # first-order error propagation, each answer off by delta, and the 3-token answer's own delta
        sens = 0.0
        for i in range(5):
            h = max(delta, 1e-12 * max(abs(x[i]), 1e-300))
            xp, xm = x.copy(), x.copy()
            xp[i] += h
            xm[i] -= h
            sens += abs(predict(xp) - predict(xm)) / (2 * h)
    allowed = 3.0 * (sens + 1.0) * delta
    if not np.isfinite(allowed) or allowed > 0.1 * max(abs(fa - fb), abs(fc - fb), 1e-300):
        return None
    return abs(facb - p), allowed


def _sign_identities(y, *, bias: bool, single: bool) -> list[Identity]:
    bits = [bool(v > 0.5) for v in y]
    (b0, ba, bb, bab1, bc, bab, bcb, bacb, bcab, baabb, bA, bB, bC, bAB, bCB, bACB) = bits
    out = []
    if not bias:
        out.append(Identity("zero token", not b0, float(b0), 0.0))
    # half-space: bit(a) = bit(b) = 1 => bit(a + b) = 1 (a + b = 2 * midpoint; without bias the sign of
    # v^T x is scale-free); with a bias only the "both 1 at the midpoint" direction is safe to test
    if not bias and ba == bb:
        out.append(Identity("half-space", bab1 == ba, float(bab1 != ba), 0.0))
    out.append(Identity("key order", bacb == bcab, float(bacb != bcab), 0.0))
    out.append(Identity("repetition", baabb == bab, float(baabb != bab), 0.0))
    if single:
        bad = 0
        for two, one1, one2 in ((bab, ba, bb), (bcb, bc, bb), (bAB, bA, bB), (bCB, bC, bB)):
            if one1 == one2 and two != one1:
                bad += 1
        out.append(Identity("convexity", bad == 0, float(bad), 0.0))
    return out


# ---------------------------------------------------------------------------------------------------
# after: fidelity against what the precision explains


INCONCLUSIVE_THRESHOLD = 1.0
"""A fidelity threshold at least this large (relative to the output RMS) makes the verdict inconclusive."""


def fidelity_verdict(figure: float, threshold: float) -> str:
    """``"fail"`` above the threshold; ``"inconclusive"`` when the threshold is at least
    :data:`INCONCLUSIVE_THRESHOLD` (the answers' imprecision explains errors as large as the outputs
    themselves, so the test cannot tell a right model class from a wrong one); else ``"pass"``."""
    if figure > threshold:
        return "fail"
    return "inconclusive" if threshold >= INCONCLUSIVE_THRESHOLD else "pass"


def inconclusive_detail(what: str, threshold: float, kind) -> str:
    return (f"{what}; threshold {threshold:.3g} from {kind.describe()} answers is at least "
            f"{INCONCLUSIVE_THRESHOLD:g} of the output RMS, too loose to tell the model class")


def fidelity_threshold(kind: AnswerKind, d: int, rms: float, *, resolution: float = 0.0) -> float:
    """The largest fidelity (max abs error / RMS of the answers) that the answers' precision explains.

    - rounding: ``2000 * d * eps`` (eps = 2^-53 or 2^-24) and, for float64, a floor of ``1e-9`` for the
      solvers' own stopping rules: the extraction's error from rounded answers, amplified by the fresh
      sequences' size (Gaussian tokens of norm ~sqrt(d): a relative parameter error e moves the output
      by about ``e * d``). Measured: 1e-13 on float64 exact heads at d = 64, 6e-11 with the ALS solver,
      4.9e-4 on the float32 MiniLM heads at d = 384, where this gives 1e-9 and 4.6e-2;
    - a tolerance tau: ``(2 + 1e4 sqrt(d)) tau / rms``: the answers' own ``2 tau`` and the estimators'
      amplification of tau into parameter errors under an input-norm bound (measured up to ~3e3 sqrt(d)
      for Theorem 6.1's estimator at ``||W||_F = 8``);
    - the method's own resolution (a relative parameter error it reaches with exact answers, e.g. a
      convex solver's tolerance, :func:`method_resolution`): ``10 * d * resolution``.
    """
    thr = 2000.0 * d * kind.eps + (1e-9 if not kind.float32 else 0.0)
    if kind.tau > 0:
        thr += (2.0 + 1e4 * math.sqrt(d)) * kind.tau / max(rms, 1e-300)
    thr += 10.0 * d * resolution
    return float(thr)


def method_resolution(res) -> float:
    """The relative parameter error a method reaches with exact answers (0 for the exact algorithms).

    ``diagnostics["resolution"]`` where a method states it; else the convex program's solver tolerance
    (1e-6) for ``rop --solver convex``, and for Theorem B.1's sphere estimator its Hoeffding error
    ``sqrt(2 log(2 d / 0.1) / k)`` with k sphere queries.
    """
    diag = res.diagnostics
    if "resolution" in diag:
        return float(diag["resolution"])
    if res.method == "rop" and diag.get("solver") == "convex":
        return 1e-6
    if res.method == "membership-paper" and diag.get("k"):
        return math.sqrt(2 * math.log(2 * res.d / 0.1) / float(diag["k"])) + float(diag.get("eps_W", 0.0))
    return 0.0


def verdict(res, oracle: Oracle, *, model: str, n: int = 256, rng: np.random.Generator | int = 10_000,
            preflight_result=None, signs: bool = False) -> ModelCheck:
    """Compare ``res`` with ``oracle`` on ``n`` fresh sequences and decide; raises :class:`ModelMismatch`
    (carrying the :class:`ModelCheck` as ``.model_check`` and the result as ``.result``)."""
    if model == FFN:
        from .transformer.ffn_check import ffn_verdict
        return ffn_verdict(res, oracle, n=n, rng=rng, preflight_result=preflight_result)
    ids, cq, kind0 = preflight_result if preflight_result is not None else ((), 0, None)
    resolution = method_resolution(res)
    if n <= 0:
        return ModelCheck("unchecked", model, kind0.describe() if kind0 else "", ids, cq,
                          detail="no fresh sequences asked (verify n = 0)")
    batch = random_sequences(res.d, n, rng=rng, input_norm=oracle.input_norm)
    before = oracle.queries
    try:
        y = oracle.query(batch)
    except BudgetExceeded as e:
        return ModelCheck("unchecked", model, kind0.describe() if kind0 else "", ids, cq,
                          detail=f"the query budget ran out before the check ({e})")
    vq = oracle.queries - before
    kind = answer_kind(oracle, y)
    kind = dataclasses.replace(kind, float32=kind.float32 or bool(kind0 and kind0.float32))
    if signs and not kind.sign:
        kind = AnswerKind(sign=True)
        y = (y > 0).astype(np.float64)
    y_hat = np.asarray(res.predict(batch), dtype=np.float64)
    if kind.sign:
        # bits: how often the recovered model's sign is wrong where it is clear of zero
        scale = float(np.sqrt(np.mean(y_hat ** 2))) or 1e-300
        margin = (resolution + 1e-9) * 10 * res.d * scale
        clear = np.abs(y_hat) > margin
        wrong = ((y_hat > 0) != (y > 0.5)) & clear
        figure = float(wrong.sum()) / max(int(clear.sum()), 1)
        threshold = 0.02
        what = f"{int(wrong.sum())} of {int(clear.sum())} clear sign predictions wrong"
        if clear.sum() < n // 4:
            return ModelCheck("inconclusive", model, kind.describe(), ids, cq, figure, threshold, vq,
                              detail=f"{what}: the method's resolution {resolution:.3g} leaves too few "
                                     "sequences whose sign it predicts clearly")
    else:
        rms = float(np.sqrt(np.mean(y ** 2)))
        figure = float(np.max(np.abs(y_hat - y)) / max(rms, 1e-300))
        threshold = fidelity_threshold(kind, res.d, rms, resolution=resolution)
        what = f"fidelity {figure:.3g}"
        if fidelity_verdict(figure, threshold) == "inconclusive":
            return ModelCheck("inconclusive", model, kind.describe(), ids, cq, figure, threshold, vq,
                              detail=inconclusive_detail(what, threshold, kind))
    ok = figure <= threshold
    mc = ModelCheck("pass" if ok else "fail", model, kind.describe(), ids, cq, figure, threshold, vq,
                    detail=f"{what}; threshold {threshold:.3g} from {kind.describe()} answers"
                    + (f" and the method's resolution {resolution:.3g}" if resolution else ""))
    if not ok:
        err = ModelMismatch(
            f"the target does not behave like {model}: on {n} fresh sequences the recovered model's "
            f"{what} exceeds {threshold:.3g}, the most that {kind.describe()} answers explain; either the "
            f"target is not {model} or the method fell short of its precision"
            + (f" (it warned: {res.diagnostics['warning']})" if res.diagnostics.get("warning") else "")
            + " (--no-check skips the check)", check="fidelity", figure=figure, threshold=threshold,
            hint=_hints("one softmax", model))
        err.model_check = mc
        err.result = dataclasses.replace(res, check=mc)
        raise err
    return mc


def counters(oracle: Oracle) -> dict[str, float]:
    """The oracle stack's counters: queries, calls, seconds inside the black box, replayed answers."""
    st = oracle_stack(oracle)
    return {"queries": oracle.queries, "calls": oracle.calls, "seconds": st[-1].seconds,
            "replayed": sum(o.replayed for o in st)}


def cost(oracle: Oracle, before: dict[str, float]) -> dict[str, Any]:
    """What the oracle was asked since ``before``: the same cost keys for every method."""
    now = counters(oracle)
    q = int(now["queries"] - before["queries"])
    rep = int(now["replayed"] - before["replayed"])
    return {"oracle_calls": int(now["calls"] - before["calls"]), "oracle_seconds": float(now["seconds"] - before["seconds"]),
            "queries_fresh": q - rep, "queries_replayed": rep}


def checked(model: str = SINGLE, *, reads: str = "values") -> Callable:
    """Decorate an extraction method ``fn(oracle, *, bias=..., ...)`` with the model check.

    Adds three keyword arguments: ``check`` (default True; False skips both checks), ``verify`` (fresh
    sequences for the final check, default 256) and ``check_rng`` (seed of the fresh sequences). The
    result's ``check`` field records what was found, and its diagnostics get the cost keys every method
    shares: ``oracle_calls``, ``oracle_seconds`` (time inside the black box), ``queries_fresh`` and
    ``queries_replayed`` (answered from a journal). ``reads="signs"``: the method uses only the sign of
    each answer (the membership methods), so the check reads the answers as bits too.
    """

    def deco(fn):
        @functools.wraps(fn)
        def run(oracle: Oracle, *args, check: bool = True, verify: int = 256,
                check_rng: int | np.random.Generator = 10_000, **kw):
            pre: list = []
            if check:
                # the identities run just before the method's first query: a method that refuses its
                # settings does so before anything is spent
                def hook():
                    pre.append(preflight(oracle, model=model, bias=bool(kw.get("bias", False)),
                                         rng=np.random.default_rng(CHECK_SEED), signs=reads == "signs"))
                oracle.before_first_query = hook
            before = counters(oracle)
            try:
                res = fn(oracle, *args, **kw)
            finally:
                oracle.before_first_query = None
            spent = pre[0][1] if pre else 0
            c = cost(oracle, before)
            if pre:   # the identities' queries are not the method's
                c["oracle_calls"] -= 1
                c["queries_fresh"] -= spent
            res = dataclasses.replace(res, queries=res.queries - spent, diagnostics={**res.diagnostics, **c})
            if not check:
                mc = ModelCheck("unchecked", model, detail="the model check was skipped (--no-check)")
            else:
                mc = verdict(res, oracle, model=model, n=verify, rng=check_rng,
                             preflight_result=pre[0] if pre else None, signs=reads == "signs")
            return dataclasses.replace(res, check=mc)

        run.model_class = model
        return run

    return deco
