"""What the answers are and how precise they are: the pieces the model checks share.

:mod:`headthief.extraction.check` (attention heads, transformers) and
:mod:`headthief.extraction.transformer.ffn_check` (ReLU FFNs) both import from here, and neither imports
the other: the model classes' names, :class:`AnswerKind` (float64, float32, a tolerance, bits), the records
of a check (:class:`Identity`, :class:`ModelCheck`), and the fidelity threshold.

**The fidelity threshold follows the precision measured on the answers** (float32 answers). A fixed
worst-case bound (``2000 d eps``: 1.9e-3 at d = 16, 0.046 at d = 384) let runs ten times worse than their
method's precision pass. Instead the check measures the answers' own noise, ``sigma``, from the answers
(:func:`noise_sequences`, :func:`answer_noise`): along a few short segments ``x_N + t h u`` of the last
token (``h = 1e-4 |x_N|``, six points each) the exact answer is smooth (analytic for attention, linear
between the kinks of a ReLU network), so a quadratic fits it to far below float32 rounding (the cubic
term is ``~1e-12`` relative), and the residual of that fit is the rounding the black box put into its
answers: how far they are from what exact arithmetic would give. The median over the segments ignores
a segment that crosses a kink. Measured ``sigma / rms``: 9.8e-8 (``ffn:d=16,m=32,dtype=float32``),
3.8e-8 (``torch-transformer:d=16,m=32``), 1.3e-7 (``torch-mha:d=64,heads=4``), 1.9e-7 (MiniLM layer 2
head 5, d = 384), 2.6e-16 on float64 answers.

The threshold is then ``K sigma / rms`` with ``K =`` :data:`NOISE_AMPLIFICATION` (1000), see
:func:`fidelity_threshold` for the argument. The segments' points are among the ``verify`` fresh
sequences (the fidelity is measured on them too), so the check costs no extra query.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import BudgetExceeded, ModelMismatch, NotIdentifiable
from ..oracles.base import Oracle, oracle_stack
from ..linalg import pinv

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
        return {"name": self.name, "ok": self.ok, "violation": finite_or_none(self.violation), "allowed": finite_or_none(self.allowed)}


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
        noise: the answers' noise measured on the fresh sequences (absolute; :func:`answer_noise`), when
            the threshold was derived from it.
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
    noise: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "model": self.model, "answers": self.answers,
                "figure": finite_or_none(self.figure), "threshold": finite_or_none(self.threshold),
                "check_queries": self.check_queries, "verify_queries": self.verify_queries,
                "identities": [i.as_dict() for i in self.identities], "detail": self.detail,
                "noise": finite_or_none(self.noise)}


def finite_or_none(x):
    """``float(x)``, or None for None, NaN and infinities (JSON has no such numbers)."""
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


NOISE_AMPLIFICATION = 1000.0
"""``K``: the most a float32 method's answers' noise ``sigma`` may grow into the fidelity figure."""

NOISE_SEGMENTS = 12
"""Segments the answers' noise is measured on (out of the ``verify`` fresh sequences)."""

NOISE_POINTS = 6
"""Points per segment (a quadratic fit leaves 3 degrees of freedom for the residual)."""

NOISE_STEP = 1e-4
"""Half-length of a segment relative to the moved token's norm."""


def noise_sequences(d: int, n: int, rng: np.random.Generator, *, input_norm: float | None = None,
                    one_token: bool = False) -> tuple[list[np.ndarray], int]:
    """``n`` fresh sequences of which the last ``k * NOISE_POINTS`` lie on ``k`` short segments of the
    last token (``k = NOISE_SEGMENTS``, fewer when ``n`` is small: none below 64). Returns (sequences, k).

    Each segment moves the last token of a random sequence along a random unit direction, ``x_N + t h u``
    with ``t`` in [-1, 1] and ``h = NOISE_STEP |x_N|`` (kept inside ``input_norm``).
    """
    from .result import random_sequences
    k = min(NOISE_SEGMENTS, n // 20) if n >= 64 else 0        # at most ~30 % of the sequences
    n_rand = n - k * NOISE_POINTS
    if one_token:
        Z = rng.standard_normal((n, d))
        if input_norm is not None:
            Z *= 0.999 * input_norm / np.maximum(np.linalg.norm(Z, axis=1, keepdims=True), 1e-300)
        seqs = [z[None, :] for z in Z[:n_rand]]
        bases = [z[None, :] for z in Z[n_rand:n_rand + k]]
    else:
        seqs = [np.asarray(s, dtype=np.float64) for s in
                random_sequences(d, n_rand + k, rng=rng, input_norm=input_norm)]
        bases = seqs[n_rand:]
        seqs = seqs[:n_rand]
    seqs += noise_segments(bases, rng, input_norm=input_norm)
    return seqs, k


def noise_segments(bases, rng: np.random.Generator, *, input_norm: float | None = None) -> list[np.ndarray]:
    """``NOISE_POINTS`` sequences per base sequence (k, L, d): its last token moved along a random unit
    direction, ``x_N + t h u`` with ``t`` in [-1, 1] and ``h = NOISE_STEP |x_N|`` (kept inside
    ``input_norm``). :func:`answer_noise` / :func:`vector_answer_noise` read the noise from their answers."""
    out = []
    ts = np.linspace(-1.0, 1.0, NOISE_POINTS)
    for X in bases:
        X = np.array(X, dtype=np.float64)
        d = X.shape[-1]
        x = X[-1]
        nx = float(np.linalg.norm(x))
        if input_norm is not None and nx > 0:
            x = x * min(1.0, (1.0 - 2.0 * NOISE_STEP) * input_norm / nx)
            nx = float(np.linalg.norm(x))
        u = rng.standard_normal(d)
        u /= max(float(np.linalg.norm(u)), 1e-300)
        h = NOISE_STEP * max(nx, 1e-300)
        for t in ts:
            Y = X.copy()
            Y[-1] = x + t * h * u
            out.append(Y)
    return out


def answer_noise(y_segments: np.ndarray) -> float | None:
    """The answers' noise ``sigma`` from the answers on :func:`noise_sequences`' segments ((k, points)):
    the median over segments of the RMS residual of a quadratic fit (``points - 3`` degrees of freedom).
    None without segments."""
    Y = np.asarray(y_segments, dtype=np.float64).reshape(-1, NOISE_POINTS)
    if Y.shape[0] == 0:
        return None
    ts = np.linspace(-1.0, 1.0, NOISE_POINTS)
    V = np.vander(ts, 3)
    P = V @ pinv(V)
    r = Y - Y @ P.T
    s = np.sqrt(np.sum(r ** 2, axis=1) / (NOISE_POINTS - 3))
    return float(np.median(s))


def vector_answer_noise(answers) -> float | None:
    """:func:`answer_noise` for vector answers (a hidden-state API): ``answers`` holds the answers to
    :func:`noise_segments`' sequences in order (each an array, (L, d_out) or (d_out,)); per segment the RMS
    residual of a quadratic fit in t over every answered number, then the median over segments. None
    without segments. Measured ``sigma / rms`` (float32 rounding ``u = 2^-24``): 1.7 - 2.9 u on random
    float32 blocks (d = 8 - 32) and transformers' float32 ``BertLayer`` (d = 16); 7.2 u on MiniLM's block
    2, as numpy and as ``BertLayer`` (d = 384, FFN 1536); float64 blocks 1.5e-13 (the quadratic's cubic
    term, not rounding)."""
    A = [np.asarray(a, dtype=np.float64).ravel() for a in answers]
    if not A:
        return None
    ts = np.linspace(-1.0, 1.0, NOISE_POINTS)
    V = np.vander(ts, 3)
    P = V @ pinv(V)
    s = []
    for i in range(0, len(A) - NOISE_POINTS + 1, NOISE_POINTS):
        Y = np.stack(A[i:i + NOISE_POINTS])
        r = Y - P @ Y
        s.append(np.sqrt(np.sum(r ** 2) / (r.shape[1] * (NOISE_POINTS - 3))))
    return float(np.median(s)) if s else None


def fidelity_threshold(kind: AnswerKind, d: int, rms: float, *, resolution: float = 0.0,
                       noise: float | None = None) -> float:
    """The largest fidelity (max abs error / RMS of the answers) that the answers' precision explains.

    - float32 answers with a measured noise ``sigma`` (``noise``, :func:`answer_noise`):
      ``K max(sigma, eps rms / 2) / rms`` with ``K = NOISE_AMPLIFICATION = 1000``. The argument: the
      fidelity's points carry the answers' own error (at most ~4 sigma over 256 points); the methods read
      their parameters from differences of answers over steps no shorter than ~1/250 of the tokens' scale
      (finite differences and kink locations with quarter-margin steps in the FFN learner, probe steps of
      Theorem 4.1, an attention weight read through a monotone FFN segment whose slope is at least a
      quarter of its first), each difference dividing the noise by the step, and a final solve whose
      conditioning the methods keep below ~4 (orthogonal designs): 250 * 4 = 1000. Measured by this check,
      in units of its own sigma (medians): 70 (FFN learner, ``ffn:d=16,m=32,dtype=float32``, seeds
      101-120), 170 (``transformer`` on ``torch-transformer:d=16,m=32``, seeds 101-120), 90 and 230
      (``exact`` and ``lowrank`` on MiniLM head (2, 5), d = 384), 70 (``multihead`` on
      ``torch-mha:d=64,heads=4``). So a run ~5x worse than the worst of these, or >10x an FFN's, fails:
      thresholds ~7e-5 on ``ffn:d=16,m=32,dtype=float32``, ~5e-5 on ``torch-transformer:d=16,m=32``,
      1.4e-4 on torch-mha and 1.9e-4 on MiniLM head (2, 5) (lowrank 4.3e-5, exact 1.7e-5), where the bound
      ``2000 d eps`` gave 1.9e-3, 1.9e-3, 7.6e-3 and 4.6e-2. The floor ``eps rms / 2`` is the final
      rounding of an answer of size rms, which
      no black box avoids (it keeps the threshold positive when every segment happened to round alike);
    - float32 answers without a measurement (fewer than 64 fresh sequences): the worst case
      ``2000 d eps`` (eps = 2^-24);
    - float64: ``2000 d eps + 1e-9`` (eps = 2^-53; the 1e-9 floor is the float64 solvers' stopping rules):
      1e-13 measured on float64 exact heads at d = 64, 6e-11 with the ALS solver;
    - a tolerance tau: ``(2 + 1e4 sqrt(d)) tau / rms``: the answers' own ``2 tau`` and the estimators'
      amplification of tau into parameter errors under an input-norm bound (measured up to ~3e3 sqrt(d)
      for Theorem 6.1's estimator at ``||W||_F = 8``);
    - the method's own resolution (a relative parameter error it reaches with exact answers, e.g. a
      convex solver's tolerance, :func:`method_resolution`): ``10 * d * resolution``.
    """
    rms = max(float(rms), 1e-300)
    if kind.float32 and noise is not None and math.isfinite(noise):
        thr = NOISE_AMPLIFICATION * max(float(noise), 0.5 * kind.eps * rms) / rms
    else:
        thr = 2000.0 * d * kind.eps + (1e-9 if not kind.float32 else 0.0)
    if kind.tau > 0:
        thr += (2.0 + 1e4 * math.sqrt(d)) * kind.tau / rms
    thr += 10.0 * d * resolution
    return float(thr)


PROPAGATION_DRAWS = 4
"""Random parameter errors :func:`propagated_fidelity` tries (it keeps the largest effect)."""

PROPAGATION_MARGIN = 10.0
"""How far past the effect of its own estimated parameter error a run may land and still pass: one order of
magnitude (a result an order of magnitude worse than the method's own precision is never a pass)."""


def propagated_fidelity(res, batch, y_hat: np.ndarray, rms: float, rng: np.random.Generator | int) -> float:
    """The fidelity that the method's own estimate of its error in W explains, on ``batch``.

    A method that measured W redundantly states its relative error ``e`` as
    ``diagnostics["W_rel_err_estimate"]`` (lowrank: the sketch core's noise over W's weakest singular
    value). The recovered model is evaluated with ``W + E`` for :data:`PROPAGATION_DRAWS` Gaussian ``E`` of
    Frobenius norm ``e ||W||_F`` (on Gaussian sequences a score error depends on ``E`` through its
    Frobenius norm, not its direction), and the largest ``max |f_{W+E} - f_W| / rms`` is returned. No
    queries are asked. 0 when the method states no estimate.
    """
    e = res.diagnostics.get("W_rel_err_estimate")
    W = getattr(res, "W", None)
    if not e or W is None or not np.isfinite(e):
        return 0.0
    g = np.random.default_rng(rng)
    W = np.asarray(W, dtype=np.float64)
    scale = float(e) * float(np.linalg.norm(W))
    worst = 0.0
    for _ in range(PROPAGATION_DRAWS):
        E = g.standard_normal(W.shape)
        E *= scale / max(float(np.linalg.norm(E)), 1e-300)
        moved = np.asarray(dataclasses.replace(res, W=W + E).predict(batch), dtype=np.float64)
        worst = max(worst, float(np.max(np.abs(moved - y_hat))) / max(rms, 1e-300))
    return worst


def threshold_source(kind: AnswerKind, noise: float | None, rms: float) -> str:
    """Where a fidelity threshold came from, for people: the answer kind and the measured noise."""
    base = f"{kind.describe()} answers"
    if kind.float32 and noise is not None and math.isfinite(noise):
        return f"{base} (noise measured on them: {noise / max(rms, 1e-300):.2g} of the RMS, x{NOISE_AMPLIFICATION:g})"
    return base


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


# ---------------------------------------------------------------------------------------------------
# model classes with their own check


CLASS_CHECKS: dict[str, tuple[Callable, Callable]] = {}
"""``model class -> (preflight, verdict)`` for classes whose check lives beside their method (the FFN's in
:mod:`headthief.extraction.transformer.ffn_check`, which registers itself when imported); the model
check dispatches to them without importing them."""


def register_class_check(model: str, preflight: Callable, verdict: Callable) -> None:
    """Let :func:`headthief.extraction.check.preflight` / ``verdict`` hand ``model`` to these functions."""
    CLASS_CHECKS[model] = (preflight, verdict)


# ---------------------------------------------------------------------------------------------------
# answers a method cannot use: not a function of the input, or half precision


REPEAT_LIMIT = 1e-2       # answers to one query asked thrice may differ by this much (relative rms) at most
REPEAT_QUERIES = 3        # check_repeatable's queries


def check_repeatable(oracle: Oracle, seq: np.ndarray, *, what: str) -> float:
    """Asks the sequence ``seq`` (T, d) three times, once alone and twice in one batch (so that a journal,
    which keys answers by batch, replays none of them as another's): a target whose answers differ by more
    than ``REPEAT_LIMIT`` (relative rms) is not a function of its input (dropout left on: a torch module in
    training mode; measured on transformers' ``BertLayer`` at p = 0.1, which the block method otherwise
    called a ReLU block), a :class:`ModelMismatch` naming that. A defence's fresh noise far below the limit
    passes. Returns the difference (0.0 for a deterministic target). Three queries."""
    seq = np.asarray(seq, np.float64)
    one = np.asarray(oracle.query_packed(seq[None]), np.float64)
    two = np.asarray(oracle.query_packed(np.stack([seq, seq])), np.float64).reshape((2,) + one.shape)
    diff = float(np.sqrt(np.mean((two - one[None]) ** 2)) / max(np.sqrt(np.mean(one ** 2)), 1e-300))
    if diff > REPEAT_LIMIT:
        raise ModelMismatch(f"the target answers the same query differently: asked three times, its answers differ "
                            f"by {diff:.3g} (relative rms, > {REPEAT_LIMIT:g}). {what} needs a deterministic model "
                            "(dropout left on? call .eval() on a torch module)", check="repeatability",
                            figure=diff, threshold=REPEAT_LIMIT)
    return diff


REPEAT_SEED = 0x4E9EA7    # the repeated sequence's own generator: the run's is not touched


def token_scale(oracle: Oracle) -> float:
    """The block methods' token norm: sqrt(d), or half the oracle's input-norm bound where that is smaller."""
    R, d = oracle.input_norm, oracle.d
    return float(np.sqrt(d)) if R is None else min(float(np.sqrt(d)), 0.5 * R)


def refuse_if_random(oracle: Oracle, error: ModelMismatch, *, what: str, length: int = 4) -> None:
    """After a refusal of the model class (``error``): one random sequence of ``length`` tokens (4; fewer for a
    target that answers no longer ones) of norm :func:`token_scale` asked three times (:func:`check_repeatable`);
    answers that differ beyond ``REPEAT_LIMIT`` raise that ModelMismatch instead, from ``error``. Skipped where
    the budget has no room."""
    seq = np.random.default_rng(REPEAT_SEED).standard_normal((max(1, int(length)), oracle.d))
    seq *= token_scale(oracle) / np.linalg.norm(seq, axis=1, keepdims=True)
    try:
        check_repeatable(oracle, seq, what=what)
    except BudgetExceeded:
        return
    except ModelMismatch as m:
        raise m from error


def half_precision(values: np.ndarray) -> str | None:
    """``"bfloat16"`` or ``"float16"`` when every one of at least 16 finite answers is exactly such a number
    (a model served in half precision; float32 and float64 answers almost never all are), else None."""
    v = np.asarray(values, np.float64).ravel()
    if v.size < 16 or not np.all(np.isfinite(v)) or not np.all(v.astype(np.float32) == v):
        return None
    if np.all((v.astype(np.float32).view(np.uint32) & 0xFFFF) == 0):
        return "bfloat16"
    with np.errstate(over="ignore"):
        return "float16" if np.all(v.astype(np.float16).astype(np.float64) == v) else None


def refuse_half_precision(values: np.ndarray, what: str) -> None:
    """:class:`NotIdentifiable` where the answers are half precision (:func:`half_precision`): measured on
    transformers' ``BertLayer`` in float16 / bfloat16, the block method's stage L otherwise refused them as a
    LayerNorm of another eps."""
    kind = half_precision(values)
    if kind is not None:
        raise NotIdentifiable(f"the answers are {kind} numbers (every one exactly representable): {what} is built "
                              "and validated for float32 or float64 answers; half precision rounds to 2^-11 "
                              "(float16) or 2^-8 (bfloat16), 2,000x - 65,000x float32's 2^-24")
