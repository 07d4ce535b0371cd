"""The model check for ReLU FFNs on one-token queries (the ``FFN`` class of :mod:`..check`).

The FFN learner hands these functions to :func:`~headthief.extraction.check.checked`; this module needs
only :mod:`..precision` (no import of :mod:`..check`, which would be a circle), and registers itself so
that ``check.preflight(oracle, model=FFN)`` finds it once imported.

**Before** (at most 16 one-token queries): identities every member of the class satisfies.

- Without biases (``w^T ReLU(A^T x)``): *zero token* ``f(0) = 0``; *homogeneity* ``f(2a) = 2 f(a)`` and
  ``2 f(b / 2) = f(b)``; *odd part linear*: ``L(a + b) = L(a) + L(b)`` for ``L(x) = f(x) - f(-x)``
  (``ReLU(z) - ReLU(-z) = z``). A tanh or sigmoid network fails homogeneity; an output bias fails the
  zero token.
- With biases: *piecewise linear*: second differences ``f(p) - 2 f(p + h u) + f(p + 2 h u)`` vanish unless
  a kink lies in the short stretch; four stretches are tested and the identity fails only when at least
  three of them bend (a smooth network bends everywhere, a ReLU network almost nowhere).

A target whose one-token answers are linear (an attention head read on one token) passes these and is
stopped by the method itself: it finds no kink (:class:`ModelMismatch`, check ``kinks``).

**After**: the fidelity on fresh Gaussian one-token points *and* on points next to every recovered kink
(a quarter of its isolation margin away, on both sides), where a missed or imprecise neuron shows first.
Some of the Gaussian points lie on short segments that measure the answers' noise, and the threshold
follows it (:func:`~headthief.extraction.precision.fidelity_threshold`).
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import BudgetExceeded, ModelMismatch, NotIdentifiable
from ...oracles.base import Oracle
from ..precision import (FFN, NOISE_POINTS, AnswerKind, Identity, ModelCheck, answer_kind, answer_noise,
                         fidelity_threshold, fidelity_verdict, inconclusive_detail, method_resolution,
                         noise_sequences, register_class_check, threshold_source)

HINTS = {
    "zero token": "f(0) != 0: the FFN has an output bias (pass --bias / bias=True, or use an ffn:...,bias=1 target)",
    "homogeneity": "f(2x) != 2 f(x): not a bias-free ReLU network (a smooth activation such as tanh, biases "
                   "(pass bias=True), or not an FFN)",
    "odd part linear": "f(x) - f(-x) is not linear: not a bias-free ReLU network",
    "piecewise linear": "the answers bend everywhere along short segments: a smooth activation (tanh, GELU, "
                        "sigmoid), not a ReLU network",
}


def ffn_preflight(oracle: Oracle, *, bias: bool = False,
                  rng: np.random.Generator | int = 0) -> tuple[tuple[Identity, ...], int, AnswerKind]:
    """Test the FFN identities on at most 16 one-token queries; raise :class:`ModelMismatch` on failure."""
    rng = np.random.default_rng(rng)
    d = oracle.d
    R = oracle.input_norm
    r = 0.2 * R if R is not None else math.sqrt(d)

    def tok():
        x = rng.standard_normal(d)
        return x * (r / np.linalg.norm(x))

    if not bias:
        a, b, c = tok(), tok(), tok()
        pts = [np.zeros(d), a, 2 * a, -a, b, 0.5 * b, -b, a + b, -(a + b), c, 2 * c]
    else:
        pts = []
        for _ in range(4):
            p, u = tok(), tok()
            h = 1e-3
            pts += [p, p + h * u, p + 2 * h * u]
        pts += [np.zeros(d), tok()]
    X = np.array(pts)[:, None, :]
    q0 = oracle.queries
    y = oracle.query(X)
    spent = oracle.queries - q0
    kind = answer_kind(oracle, y)
    M = float(np.max(np.abs(y)))
    delta = kind.tau + 64 * math.sqrt(d) * kind.eps * max(M, 1e-300)
    spread = float(np.max(y) - np.min(y))
    if not bias and spread <= 4 * delta and M <= 4 * delta:
        # (with biases a neuron may be inactive on every check point: the method searches whole lines)
        raise NotIdentifiable("the one-token answers do not depend on the token: no FFN is visible")
    ids: list[Identity] = []
    if not bias:
        f0, fa, f2a, fma, fb, fhb, fmb, fab, fmab, fc, f2c = (float(v) for v in y)
        ids.append(Identity("zero token", abs(f0) <= 2 * delta, abs(f0), 2 * delta))
        viol = max(abs(f2a - 2 * fa), abs(2 * fhb - fb), abs(f2c - 2 * fc))
        ids.append(Identity("homogeneity", viol <= 6 * delta, viol, 6 * delta))
        viol = abs((fab - fmab) - (fa - fma) - (fb - fmb))
        ids.append(Identity("odd part linear", viol <= 12 * delta, viol, 12 * delta))
    else:
        bends = []
        for i in range(4):
            y0, y1, y2 = (float(v) for v in y[3 * i: 3 * i + 3])
            bends.append(abs(y0 - 2 * y1 + y2))
        third = sorted(bends)[1]          # fails only when three of the four stretches bend
        ids.append(Identity("piecewise linear", third <= 8 * delta, third, 8 * delta))
    for i in ids:
        if i.ok is False:
            raise ModelMismatch(
                f"the target does not behave like a {FFN}: the {i.name} identity fails (violation "
                f"{i.violation:.3g} > allowed {i.allowed:.3g}, answers read as {kind.describe()}); "
                f"{HINTS[i.name]}. {spent} check queries spent (--no-check skips the check)",
                check=i.name, figure=i.violation, threshold=i.allowed, hint=HINTS[i.name])
    return tuple(ids), spent, kind


def ffn_verdict(res, oracle: Oracle, *, n: int = 256, rng: np.random.Generator | int = 10_000,
                preflight_result=None) -> ModelCheck:
    """Fidelity on ``n`` fresh Gaussian one-token points and next to every recovered kink; raises
    :class:`ModelMismatch` (with ``.model_check`` and ``.result``) when it exceeds what the answers'
    precision explains."""
    import dataclasses
    ids, cq, kind0 = preflight_result if preflight_result is not None else ((), 0, None)
    if n <= 0:
        return ModelCheck("unchecked", FFN, kind0.describe() if kind0 else "", ids, cq,
                          detail="no fresh points asked (verify n = 0)")
    g = np.random.default_rng(rng)
    R = oracle.input_norm
    seqs, k_noise = noise_sequences(res.d, n, g, input_norm=R, one_token=True)
    Z = np.array([s[-1] for s in seqs]).reshape(n, res.d)
    near = res.near_kink_points(rng=g) if hasattr(res, "near_kink_points") else np.zeros((0, res.d))
    if R is not None and near.size:
        near = near[np.linalg.norm(near, axis=1) <= R]
    allZ = np.vstack([Z, near])
    before = oracle.queries
    try:
        y = oracle.query(allZ[:, None, :])
    except BudgetExceeded as e:
        return ModelCheck("unchecked", FFN, kind0.describe() if kind0 else "", ids, cq,
                          detail=f"the query budget ran out before the check ({e})")
    vq = oracle.queries - before
    kind = answer_kind(oracle, y)
    kind = dataclasses.replace(kind, float32=kind.float32 or bool(kind0 and kind0.float32))
    yh = np.asarray(res.predict(allZ), dtype=np.float64)
    rms = float(np.sqrt(np.mean(y[:n] ** 2)))
    err = np.abs(yh - y)
    fig_rand = float(err[:n].max() / max(rms, 1e-300))
    fig_kink = float(err[n:].max() / max(rms, 1e-300)) if err.size > n else 0.0
    figure = max(fig_rand, fig_kink)
    resolution = method_resolution(res)
    noise = answer_noise(y[n - k_noise * NOISE_POINTS:n]) if k_noise else None
    threshold = fidelity_threshold(kind, res.d, rms, resolution=resolution, noise=noise)
    src = threshold_source(kind, noise, rms)
    what = (f"fidelity {fig_rand:.3g} on {n} random points, {fig_kink:.3g} on {err.size - n} points next to "
            f"the {len(res.kinks)} recovered kinks")
    if fidelity_verdict(figure, threshold) == "inconclusive":
        return ModelCheck("inconclusive", FFN, kind.describe(), ids, cq, figure, threshold, vq,
                          detail=inconclusive_detail(what, threshold, kind), noise=noise)
    ok = figure <= threshold
    mc = ModelCheck("pass" if ok else "fail", FFN, kind.describe(), ids, cq, figure, threshold, vq,
                    detail=f"{what}; threshold {threshold:.3g} from {src}", noise=noise)
    if not ok:
        err_ = ModelMismatch(
            f"the target does not behave like a {FFN}: the recovered network's {what}; the worst exceeds "
            f"{threshold:.3g}, the most that {src} explains (a neuron missed or recovered "
            "imprecisely, or the target is not a ReLU network) (--no-check skips the check)",
            check="fidelity", figure=figure, threshold=threshold,
            hint="not a ReLU network, or a neuron missed (a rarely active one)")
        err_.model_check = mc
        err_.result = dataclasses.replace(res, check=mc)
        raise err_
    return mc


register_class_check(FFN, ffn_preflight, ffn_verdict)
