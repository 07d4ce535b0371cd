"""The block method's activation check: GELU is smooth, ReLU has kinks.

A block's one-token answers along a great circle of tokens, ``x(t) = s (cos t e_1 + sin t e_2)`` (every
token of the same norm, so any input-norm bound is kept), are an analytic function of t when the FFN's
activation is GELU, and only piecewise smooth when it is ReLU (each neuron whose pre-activation changes
sign along the circle leaves a kink). Fourth differences tell the two apart without any threshold on the
answers' size: for a smooth answer the largest fourth difference at spacing 2 delta is 2^4 = 16 times the
one at spacing delta; at a kink it grows like the spacing itself (ratio ~2). The spacing is the smallest
at which the smooth fourth differences stand above the answers' rounding (``delta^4 ~ eps``), at most 256
points a circle. The ratio is the median over ``CIRCLES`` circles; below ``sqrt(2 * 16)`` it is a kinked
activation and a :class:`ModelMismatch`, where the fine fourth differences stand above what the answers'
rounding alone can give (``16 eps max|y|``, times ``KINK_ABOVE``): a kink's do by orders of magnitude, while a
smooth answer whose fine differences are rounding only (a nearly linear FFN in float32 at the 256-point cap)
has a ratio that says nothing either way, and is not refused here.

Measured at 256 points (``random_block(32, 4, 128)``, seeds 0..3, and all-MiniLM-L6-v2 block 2): GELU
15.4-15.8 (float64), 14.1-15.8 (float32), 14.7-15.7 (MiniLM, float32); ReLU 1.7-2.1 (float32). The spacing
rule was ``delta^4 ~ 1e3 eps`` before (70 points a circle for float32): too coarse for a block behind
another one. Through a d = 8 float32 encoder's first block, block 1's circles gave 3.8-11.4 at 70 points (a
false mismatch on seed 514, float64 answers alike), 10.2-15.1 at 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ModelMismatch
from ...oracles.base import Oracle

CIRCLES = 3
MAX_POINTS = 256
THRESHOLD = float(np.sqrt(2.0 * 16.0))
KINK_ABOVE = 10.0      # a kink's 4th differences stand this far above the rounding's most (16 eps max|y|), or the
                       # ratio is rounding's, not a kink's: a nearly linear FFN (BertModel's init, d = 64, float32)
                       # gave 5.5 at 256 points, its fine differences at the rounding; a ReLU block's stand far above


@dataclass(frozen=True)
class Smoothness:
    ratios: tuple[float, ...]      # per circle: max |4th difference| at 2 delta / at delta
    points: int                    # tokens per circle
    queries: int
    above_rounding: tuple[float, ...] = ()   # per circle: max |4th difference| at delta over the rounding's most

    @property
    def ratio(self) -> float:
        return float(np.median(self.ratios))


def _fourth(Z: np.ndarray) -> np.ndarray:
    r = lambda k: np.roll(Z, k, axis=0)                                # noqa: E731 (periodic: a full circle)
    return r(2) - 4 * r(1) + 6 * Z - 4 * r(-1) + r(-2)


def check_smooth_activation(oracle: Oracle, rng: np.random.Generator, *, precision: float,
                            scale: float | None = None, circles: int = CIRCLES, image=None) -> Smoothness:
    """One-token answers along ``circles`` great circles of tokens of norm ``scale`` (default sqrt(d)), or,
    with ``image`` (a :class:`~.image.LayerNormImage`), of the previous LayerNorm's image (``image.tokens``
    of great circles of mean-zero n, ``|n| = sqrt(d)``); raises :class:`ModelMismatch` when they are kinked
    (a ReLU, or any piecewise-linear activation, where the block method assumes GELU). ``precision``: the
    answers' relative precision."""
    d = oracle.d
    s = float(np.sqrt(d)) if scale is None else float(scale)
    eps = max(float(precision), 1e-16)
    K = int(min(MAX_POINTS, 2 * np.pi / eps ** 0.25))
    K = max(K - K % 2, 16)
    t = 2 * np.pi * np.arange(K) / K
    ratios, above = [], []
    for _ in range(circles):
        if image is None:
            E, _ = np.linalg.qr(rng.standard_normal((d, 2)))
            X = s * (np.cos(t)[:, None] * E[:, 0] + np.sin(t)[:, None] * E[:, 1])
        else:
            E, _ = np.linalg.qr(np.column_stack([np.ones(d), rng.standard_normal((d, 2))]))
            X = image.tokens(np.sqrt(d) * (np.cos(t)[:, None] * E[:, 1] + np.sin(t)[:, None] * E[:, 2]))
        Y = np.asarray(oracle.query_packed(X[:, None, :]))
        fine = float(np.abs(_fourth(Y)).max())
        ratios.append(float(np.abs(_fourth(Y[::2])).max()) / max(fine, 1e-300))
        above.append(fine / max(16.0 * eps * float(np.abs(Y).max()), 1e-300))
    res = Smoothness(ratios=tuple(ratios), points=K, queries=circles * K, above_rounding=tuple(above))
    if res.ratio < THRESHOLD and float(np.median(above)) > KINK_ABOVE:
        raise ModelMismatch(
            f"the one-token answers are kinked along great circles of tokens (4th-difference ratio {res.ratio:.2f} "
            f"< {THRESHOLD:.2f}; a smooth activation gives 16, a kink ~2): the FFN's activation is piecewise linear "
            "(ReLU?), not GELU", check="activation", figure=res.ratio, threshold=THRESHOLD)
    return res
