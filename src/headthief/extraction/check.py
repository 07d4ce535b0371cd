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
   raises :class:`ModelMismatch` with the figure and the threshold (:func:`fidelity_threshold`, plus 10x
   the effect of the method's own estimate of its error in W where it states one: lowrank's oversampled
   core, :func:`~headthief.extraction.precision.propagated_fidelity`).
   Sign-only answers: the share of fresh sequences whose bit the recovered model gets wrong although
   its output is clear of zero by more than its own resolution.

The result records the check (:class:`ModelCheck`) in ``res.check``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import numpy as np

from ..errors import BudgetExceeded, ModelMismatch, NotIdentifiable
from ..oracles.base import Oracle, oracle_stack
# the pieces every check shares live in .precision (so that the FFN's check, transformer/ffn_check.py, needs
# nothing from here); they are re-exported under their old names
from .precision import (CHECK_SEED, CLASS_CHECKS, FFN, INCONCLUSIVE_THRESHOLD, MULTI, NOT_AFFINE, SINGLE,  # noqa: F401
                        TRANSFORMER, AnswerKind, Identity, ModelCheck, answer_kind, answer_noise,
                        fidelity_threshold, fidelity_verdict, inconclusive_detail, method_resolution,
                        NOISE_POINTS, PROPAGATION_MARGIN, noise_sequences, propagated_fidelity, register_class_check,
                        threshold_source)

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
    if model in CLASS_CHECKS:
        return CLASS_CHECKS[model][0](oracle, bias=bias, rng=rng)
    if model == FFN:
        raise ValueError("the FFN's check lives in headthief.extraction.transformer.ffn_check: import it (it "
                         "registers itself) or decorate with checked(FFN, preflight=..., verdict=...)")
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


def verdict(res, oracle: Oracle, *, model: str, n: int = 256, rng: np.random.Generator | int = 10_000,
            preflight_result=None, signs: bool = False) -> ModelCheck:
    """Compare ``res`` with ``oracle`` on ``n`` fresh sequences and decide; raises :class:`ModelMismatch`
    (carrying the :class:`ModelCheck` as ``.model_check`` and the result as ``.result``)."""
    if model in CLASS_CHECKS:
        return CLASS_CHECKS[model][1](res, oracle, n=n, rng=rng, preflight_result=preflight_result)
    if model == FFN:
        raise ValueError("the FFN's check lives in headthief.extraction.transformer.ffn_check: import it")
    ids, cq, kind0 = preflight_result if preflight_result is not None else ((), 0, None)
    resolution = method_resolution(res)
    if n <= 0:
        return ModelCheck("unchecked", model, kind0.describe() if kind0 else "", ids, cq,
                          detail="no fresh sequences asked (verify n = 0)")
    g = np.random.default_rng(rng)
    batch, k_noise = noise_sequences(res.d, n, g, input_norm=oracle.input_norm)
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
    src, noise = f"{kind.describe()} answers", None
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
        noise = answer_noise(y[len(y) - k_noise * NOISE_POINTS:]) if k_noise else None
        threshold = fidelity_threshold(kind, res.d, rms, resolution=resolution, noise=noise)
        src = threshold_source(kind, noise, rms)
        moved = propagated_fidelity(res, batch, y_hat, rms, g)
        if moved > 0:       # the method's own estimate of its error in W, through the recovered model
            threshold += PROPAGATION_MARGIN * moved
            src += (f" and W's error as the method estimated it ({res.diagnostics['W_rel_err_estimate']:.2g}, "
                    f"fidelity {moved:.2g} through the model, x{PROPAGATION_MARGIN:g})")
        what = f"fidelity {figure:.3g}"
        if fidelity_verdict(figure, threshold) == "inconclusive":
            return ModelCheck("inconclusive", model, kind.describe(), ids, cq, figure, threshold, vq,
                              detail=inconclusive_detail(what, threshold, kind), noise=noise)
    ok = figure <= threshold
    mc = ModelCheck("pass" if ok else "fail", model, kind.describe(), ids, cq, figure, threshold, vq,
                    detail=f"{what}; threshold {threshold:.3g} from {src}"
                    + (f" and the method's resolution {resolution:.3g}" if resolution else ""), noise=noise)
    if not ok:
        err = ModelMismatch(
            f"the target does not behave like {model}: on {n} fresh sequences the recovered model's "
            f"{what} exceeds {threshold:.3g}, the most that {src} explains; either the "
            f"target is not {model} or the method fell short of its precision"
            + (f" (it warned: {res.diagnostics['warning']})" if res.diagnostics.get("warning") else "")
            + " (--no-check skips the check)", check="fidelity", figure=figure, threshold=threshold,
            hint=_hints("one softmax", model))
        err.model_check = mc
        err.result = dataclasses.replace(res, check=mc)
        raise err
    return mc


def fresh_verdict(res, oracle: Oracle, *, model: str, n: int, seed, judge: Callable, noise: float | None = None,
                  noise_queries: int = 0, **verify_kw) -> ModelCheck:
    """The model check of the vector-answer methods (vector, block, rope): ``res.verify`` on ``n`` fresh
    sequences, then ``judge(fidelity) -> (ok, threshold, detail, message)``; a failure raises
    :class:`ModelMismatch` (``message``) carrying the check as ``.model_check`` and the result as ``.result``.
    No sequences asked, or a budget spent first, is an ``unchecked`` verdict. ``noise``: the answers' noise
    the judge measured (absolute), kept in the record with the ``noise_queries`` it cost."""
    kind = oracle.output.describe(oracle.d_out)
    if n <= 0:
        return ModelCheck("unchecked", model, kind, detail="no fresh sequences asked (verify n = 0)")
    try:
        f = res.verify(oracle, n, rng=seed, **verify_kw)
    except BudgetExceeded as e:
        return ModelCheck("unchecked", model, kind, detail=f"the query budget ran out before the check ({e})")
    ok, threshold, detail, message = judge(f)
    mc = ModelCheck("pass" if ok else "fail", model, kind, (), 0, f.max_rel_err, threshold,
                    f.queries + noise_queries, detail=detail, noise=noise)
    if not ok:
        err = ModelMismatch(message, check="fidelity", figure=f.max_rel_err, threshold=threshold)
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


_PREFLIGHT, _VERDICT = preflight, verdict      # the checks of the attention classes (checked's defaults)


def checked(model: str = SINGLE, *, reads: str = "values", preflight: Callable | None = None,
            verdict: Callable | None = None) -> Callable:
    """Decorate an extraction method ``fn(oracle, *, bias=..., ...)`` with the model check.

    Adds three keyword arguments: ``check`` (default True; False skips both checks), ``verify`` (fresh
    sequences for the final check, default 256) and ``check_rng`` (seed of the fresh sequences). The
    result's ``check`` field records what was found, and its diagnostics get the cost keys every method
    shares: ``oracle_calls``, ``oracle_seconds`` (time inside the black box), ``queries_fresh`` and
    ``queries_replayed`` (answered from a journal). ``reads="signs"``: the method uses only the sign of
    each answer (the membership methods), so the check reads the answers as bits too.

    ``preflight`` / ``verdict``: the model class's own check, for classes whose identities live beside
    their method (the FFN learner passes :mod:`~headthief.extraction.transformer.ffn_check`'s), called as
    ``preflight(oracle, bias=..., rng=...)`` and ``verdict(res, oracle, n=..., rng=..., preflight_result=...)``.
    """
    pre_fn = preflight if preflight is not None else _PREFLIGHT
    ver_fn = verdict if verdict is not None else _VERDICT
    custom = preflight is not None

    def deco(fn):
        @functools.wraps(fn)
        def run(oracle: Oracle, *args, check: bool = True, verify: int = 256,
                check_rng: int | np.random.Generator = 10_000, **kw):
            pre: list = []          # (the identities' result, how many of their answers came from a journal)
            if check:
                # the identities run just before the method's first query: a method that refuses its
                # settings does so before anything is spent
                def hook():
                    r0 = counters(oracle)["replayed"]
                    if custom:
                        found = pre_fn(oracle, bias=bool(kw.get("bias", False)), rng=np.random.default_rng(CHECK_SEED))
                    else:
                        found = pre_fn(oracle, model=model, bias=bool(kw.get("bias", False)),
                                       rng=np.random.default_rng(CHECK_SEED), signs=reads == "signs")
                    pre.append((found, int(counters(oracle)["replayed"] - r0)))
                oracle.before_first_query = hook
            before = counters(oracle)
            try:
                res = fn(oracle, *args, **kw)
            finally:
                oracle.before_first_query = None
            found, replayed = pre[0] if pre else (None, 0)
            spent = found[1] if found else 0
            c = cost(oracle, before)
            if found:   # the identities' queries are not the method's (fresh or answered from a journal)
                c["oracle_calls"] -= 1
                c["queries_fresh"] -= spent - replayed
                c["queries_replayed"] -= replayed
            res = dataclasses.replace(res, queries=res.queries - spent, diagnostics={**res.diagnostics, **c})
            if not check:
                mc = ModelCheck("unchecked", model, detail="the model check was skipped (--no-check)")
            elif verdict is not None:
                mc = ver_fn(res, oracle, n=verify, rng=check_rng, preflight_result=found)
            else:
                mc = ver_fn(res, oracle, model=model, n=verify, rng=check_rng,
                            preflight_result=found, signs=reads == "signs")
            return dataclasses.replace(res, check=mc)

        run.model_class = model
        return run

    return deco
