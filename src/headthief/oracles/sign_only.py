"""The membership oracle of Appendix B: the answer is only whether the head's output is positive.

    MQ(X) = 1 if f(X) > 0 else 0        (paper, eq. (8))

:class:`SignOnly` wraps any oracle (a model, a user's callable, a noisy oracle): it asks the inner
oracle and keeps one bit of each answer. An output of exactly 0 reads as 0, as in the paper.

What it leaves identifiable: the sign of ``f`` does not change when v and the output bias beta are
multiplied by the same positive number, so only their direction is identifiable; W and the score bias
c enter only through the attention weights, which do not depend on that scale, so they remain
identifiable exactly (see :mod:`headthief.extraction.robust.membership`).

Composition: ``SignOnly(ModelOracle(head, input_norm=1.0))`` or
``SignOnly(Tolerance(ModelOracle(head), tau=1e-4))``; the wrapper inherits the inner oracle's
input-norm bound and refuses a token that breaks it with :class:`~headthief.errors.InvalidQuery`.
"""

from __future__ import annotations

import numpy as np

from .base import WrappedOracle


class SignOnly(WrappedOracle):
    """Answers ``1.0`` where the inner oracle's answer is ``> 0``, else ``0.0`` (Appendix B, eq. (8)).

    Args:
        inner: the oracle whose answers are thresholded.
        **kw: budget / transcript / input_norm of the wrapper itself (input_norm defaults to inner's).
    """

    def __init__(self, inner, **kw):
        if inner.output.vector:
            raise ValueError(f"sign-only answers are one bit per sequence; this target answers "
                             f"{inner.output.describe(inner.d_out)}")
        kw.setdefault("output", "sign")
        super().__init__(inner, **kw)

    def _transform(self, X, y: np.ndarray) -> np.ndarray:
        return (y > 0).astype(np.float64)
