"""The block method's planned arithmetic, stage by stage: what ``--method block`` will compute after stage V,
known from d, the FFN's width, the route of stage F and the answers' kind before the long stages start.

At all-MiniLM-L6-v2's size (d = 384, FFN 1536) with float32 answers the stages after V are several thousand
TFLOP (a few minutes of an H200, days of a 2-core CPU: docs/block.md, "Not reached"), so a run there stops
after stage V with what it recovered and these figures (``--max-tflop``, :func:`over_limit`), instead of
going on for days.

Counted (a multiply-add is two operations; the leading terms of the code's own loops):

* **F, span** (:func:`.ffn.span`): ``SPAN_STEPS`` steps (measured 40 - 130 with Anderson mixing as first built;
  30 - 64 since the probe route iterates on its points orthogonal to the probes, d = 32 and 64) over
  ``T = max(5 (ffn + 1), 2 d)`` points. Probe route (:mod:`.ffn_probes`, ``p`` probes, the span in ``D = d p``
  dimensions, rank ``r = ffn + 1``): per point orthogonal to the probes its p-wide nuisance against the span
  (``4 d p r + 2 p^2 r + 2 D r``), and the span's top subspace (:func:`.ffn.top_subspace`: the Gram matrix
  ``2 T D^2``, its eigenvectors ``4 D^3``, one subspace step ``4 T D r + 4 D r^2``). As first built every
  point carried a ``(p + d - 1)``-wide nuisance, and a thin SVD took the subspace: 10.3 TFLOP a step at
  MiniLM's size against 1.2 now (measured: 641 s against 28.6 s on one core, ``benchmarks/bench_span_step.py``).
  Full route: per point the normal equations of its nuisance against the span, formed from contractions with
  its basis and refined once (:func:`.ffn._full`, ``28 d^2 r + 11 d^3``), and the SVD. As first built every
  point's stored ``d^2 x 2 (d - 1)`` basis was projected (``8 d^3 r``) and solved by its own least squares
  (``8 d^4``): 32 GFLOP a step at d = 32 against 6.8 now, most of it the SVD.
* **F+, one-token refit** (coarse answers, :mod:`.one_token_refit`): ``REFIT_ITERATIONS`` L-BFGS iterations
  (the most measured: 4,500), each a forward and backward pass (3 forward's operations) over its random tokens,
  ``2 d^2 + 4 d ffn`` a forward. Measured at MiniLM's block 2 (float32, scaled coordinates): 6.5 s an
  evaluation on one core, and 300 iterations took the one-token fidelity from 3.1e-2 to 4.2e-4, 450 to 2.2e-4
  (about 650 would reach 1e-4 at the last rate), so the plan's 4,500 is an upper bound there.
* **R, block refit** (coarse answers, :mod:`.block_refit`): the same over its sequences' positions,
  ``8 d^2 + 4 d ffn + 4 L d`` a position's forward in a sequence of L tokens.
* **A, the reads' fit** (:mod:`.read_fit`): ``FIT_ITERATIONS`` conjugate-gradient steps, each ``8 K P d^2``
  (the Jacobians and base tokens applied forward and back to every read, K = 2 d + 1 reads, P = 2 d + 8 base
  tokens) and ``4 K d^3`` (the preconditioner). Measured at MiniLM's block 2: 50 - 75 steps; 26 TFLOP at 75.
* **A, polish** (:func:`.heads._polish`): ``POLISH_SWEEPS`` sweeps, each two products of the reads against the
  factors (``10 K d^2 (d + 1)``, K = 2 d + 1 reads) and two Q steps by conjugate gradients (``POLISH_CG`` steps of
  ``12 K d^2``).

Not counted: the target's own evaluation of the queries (the oracle's side; its cost is the queries, which
the budget bounds).
"""

from __future__ import annotations

SPAN_STEPS = 100          # Anderson-mixed span steps (measured 40 - 130 at d = 16, 32, 64 as first built; 30 - 64 on
                          # the probe route's orthogonal points, d = 32 and 64: kept at 100, not measured at d = 384)
REFIT_ITERATIONS = 4500   # L-BFGS iterations of either refit (the most measured, d = 16 and 32, float32)
POLISH_SWEEPS = 150       # stage A's alternating least squares sweeps (measured: 122 at d = 64, float64)
FIT_ITERATIONS = 100      # the reads' output-space fit's steps (measured 50 - 75 at MiniLM's block 2, float32 and 64)
POLISH_CG = 30            # conjugate-gradient steps of its Q step beyond d = 45 (heads._inner_cg; assumed)
MAX_TFLOP = 100.0         # the default limit (--max-tflop): hours at most on a 2-core machine


def _svd(m: int, n: int) -> float:
    k = min(m, n)
    return 4.0 * m * n * k + 10.0 * k ** 3


def _full_span_step(T: int, d: int, r: int) -> float:
    """One step of stage F's full-route span over T points (rank r): the nuisances' normal equations and the SVD."""
    return T * (28.0 * d * d * r + 11.0 * d ** 3) + _svd(T, d * d)


def _positions(d: int, ffn: int, counts, lengths=None) -> float:
    """A refit's forward and backward pass over ``counts`` sequences per length in ``lengths`` (REFIT_LENGTHS)."""
    from .block_refit import REFIT_LENGTHS
    return sum(n * L * 3.0 * (8 * d * d + 4 * d * ffn + 4 * L * d)
               for L, n in zip(REFIT_LENGTHS if lengths is None else lengths, counts))


def planned(d: int, ffn: int, *, probes: bool, coarse: bool) -> dict[str, float]:
    """Floating-point operations of the stages after V (module docstring), by stage: ``F span``,
    ``F+ one-token refit`` and ``R block refit`` (coarse answers only), ``A reads fit``, ``A polish``."""
    from .block_refit import refit_counts
    from .ffn_probes import inside_count, orthogonal_points, probe_count
    from .one_token_refit import random_queries
    T = max(5 * (ffn + 1), 2 * d)
    r = ffn + 1
    if probes:
        p, S = probe_count(d, ffn), inside_count(d, ffn)
        D, w = d * p, p + d - 1
        # the points orthogonal to the probes (p-wide nuisance) in the iteration, top_subspace's Gram, eigh and
        # subspace step; the S inside points (wide nuisance) lifted once at the end, not counted a step
        top = 2.0 * T * D * D + 4.0 * D ** 3 + 4.0 * T * D * r + 4.0 * D * r * r
        if orthogonal_points(d, p):
            step = (T - S) * (4.0 * d * p * r + 2.0 * p * p * r + 2.0 * D * r) + top
        else:                                                       # small d: every point's nuisance wide
            step = T * (4.0 * d * p * r + 2.0 * w * w * r + 10.0 * w ** 3) + top
    else:
        step = _full_span_step(T, d, r)
    out = {"F span": SPAN_STEPS * step}
    if coarse:
        one = 3.0 * (2 * d * d + 4 * d * ffn)
        out["F+ one-token refit"] = REFIT_ITERATIONS * one * random_queries(d, ffn)
        positions = _positions(d, ffn, refit_counts(d, ffn))
        out["R block refit"] = REFIT_ITERATIONS * (positions + one * random_queries(d, ffn))
    Pn, K = 2 * d + 8, 2 * d + 1
    out["A reads fit"] = FIT_ITERATIONS * (8.0 * K * Pn * d * d + 4.0 * K * d ** 3)
    out["A polish"] = POLISH_SWEEPS * (10.0 * K * d * d * (d + 1) + POLISH_CG * 12.0 * K * d * d)
    return out


IMAGE_FIT_ITERATIONS = 4500   # the image route's fit (heads first, then all): L-BFGS evaluations planned (measured
                              # 394 - 860 at d = 16, 517 - 697 at d = 32, float64: the refits' worst case kept)


def image_planned(d: int, ffn: int, *, points: int, blocks: int = 1, heads: int | None = None,
                  lengths=None) -> dict[str, float]:
    """Floating-point operations of the image route's stages after V (:mod:`.on_image`, ``--method encoder``'s
    blocks): ``F span (full)``, stage F's span from ``points`` full tangent Jacobians (the full route's count
    above: there is no probe route on the image), and ``fit``, the heads' fit and then every parameter's over
    :func:`.block_refit.fit_counts`' sequences (a forward and backward pass, :data:`IMAGE_FIT_ITERATIONS` times);
    for ``blocks`` such blocks (an encoder's). ``heads`` and ``lengths`` (the sequence lengths the fit may ask;
    default REFIT_LENGTHS): the fit's sequences as :func:`.block_refit.fit_counts` draws them with every head's
    scores told (more of the longest length where the lengths are short). Stage F's retries at 2x and 4x the
    points are not counted."""
    from .block_refit import REFIT_LENGTHS, fit_counts
    lengths = REFIT_LENGTHS if lengths is None else lengths
    step = _full_span_step(max(int(points), 2 * d), d, ffn + 1)
    positions = _positions(d, ffn, fit_counts(d, ffn, heads=heads, lengths=lengths), lengths)
    return {"F span (full)": blocks * SPAN_STEPS * step, "fit": blocks * IMAGE_FIT_ITERATIONS * positions}


def image_too_large(d: int, ffn: int, *, points: int, max_tflop: float, blocks: int = 1, heads: int | None = None,
                    lengths=None) -> str:
    """Why the blocks on a LayerNorm's image are not taken apart at width d with FFN ``ffn`` (a sentence
    naming the plan and the limit), or "" when :func:`image_planned` is within ``max_tflop`` TFLOP."""
    plan = image_planned(d, ffn, points=points, blocks=blocks, heads=heads, lengths=lengths)
    if not over_limit(plan, max_tflop):
        return ""
    what = "the block" if blocks == 1 else f"the {blocks} blocks"
    return (f"{what} on a LayerNorm's image at d = {d}, FFN {ffn} plan {sum(plan.values()) / 1e12:.3g} TFLOP "
            f"({describe(plan)}) > --max-tflop {max_tflop:g}: stage F there reads {max(int(points), 2 * d)} full "
            "tangent Jacobians (no probe route on the image)")


def describe(plan: dict[str, float]) -> str:
    """``"F span 930 TFLOP, ..."``: the plan in TFLOP, largest first."""
    return ", ".join(f"{k} {v / 1e12:.3g} TFLOP" for k, v in sorted(plan.items(), key=lambda kv: -kv[1]))


def over_limit(plan: dict[str, float], max_tflop: float) -> bool:
    """Whether the plan's total is above ``max_tflop`` TFLOP."""
    return sum(plan.values()) > float(max_tflop) * 1e12


__all__ = ["FIT_ITERATIONS", "IMAGE_FIT_ITERATIONS", "MAX_TFLOP", "POLISH_CG", "POLISH_SWEEPS", "REFIT_ITERATIONS", "SPAN_STEPS", "describe",
           "image_planned", "image_too_large", "over_limit", "planned"]
