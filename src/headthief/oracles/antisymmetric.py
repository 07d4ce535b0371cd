"""Antisymmetric queries (paper, Section 4.1): ``VQ~(X) = VQ(X) - VQ(-X)``.

Negating every token leaves every attention score ``x_i^T W x_N`` unchanged, and
``ReLU(u) - ReLU(-u) = u``, so for a one-layer transformer without FFN biases

    VQ(X) - VQ(-X) = w_o^T z = alpha(X, W)^T X v,        v = A w_o,

a single-head attention oracle (a multi-head one with H heads before the FFN). :class:`AntiSymmetric`
wraps any oracle and answers that difference. Each answer costs two value queries, and the wrapper
counts both: its ``queries`` / ``fresh`` counters and its ``budget`` are in value queries of the
oracle it wraps, so ``extract_exact`` through it reports ``2 (d^2 + d)``. ``X`` and ``-X`` go to the
inner oracle in one batch, so journals and transcripts on the inner oracle record and replay them.

With FFN biases the identity fails (``ReLU(z + b) - ReLU(-z + b) != z``); the wrapper still answers
the difference, which is then not attention: the model check of the method behind it says so.
"""

from __future__ import annotations

import numpy as np

from ..errors import BudgetExceeded
from .base import Oracle, WrappedOracle


class AntiSymmetric(WrappedOracle):
    """Answers ``inner(X) - inner(-X)``; counts (and budgets) both value queries.

    Args:
        inner: the oracle asked (any :class:`Oracle`; a journal or transcript belongs on it).
        **kw: ``budget`` (in value queries, two per answer) and ``input_norm`` (defaults to inner's;
            ``-X`` has the norms of ``X``). A transcript on the wrapper itself is refused: replayed
            answers would be counted once, not twice; put it on the inner oracle.
    """

    def __init__(self, inner: Oracle, **kw):
        if kw.get("transcript") is not None:
            raise ValueError("AntiSymmetric counts two value queries per answer: put the transcript or "
                             "journal on the inner oracle, not on the wrapper")
        if inner.output.vector:
            raise ValueError("the antisymmetric oracle subtracts one number per sequence; this target answers "
                             f"{inner.output.describe(inner.d_out)}")
        super().__init__(inner, **kw)

    def _query(self, X) -> np.ndarray:
        n = int(X.shape[0]) if isinstance(X, np.ndarray) else len(X)
        if self.budget is not None and self.fresh + 2 * n > self.budget:
            raise BudgetExceeded(self.fresh, self.budget, 2 * n)
        if isinstance(X, np.ndarray):
            both = np.concatenate([X, -X], axis=0)
        else:
            both = list(X) + [-x for x in X]
        y = self.inner.query(both)
        # the base class counts n answers after this returns; the second value query of each is counted here
        self.queries += n
        self.fresh += n
        return y[:n] - y[n:]


__all__ = ["AntiSymmetric"]
