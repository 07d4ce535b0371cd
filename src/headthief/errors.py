"""Typed exceptions. Every failure headthief reports is one of these."""

from __future__ import annotations


class HeadthiefError(Exception):
    """Base class of every error headthief raises on purpose."""


class InvalidQuery(HeadthiefError, ValueError):
    """A query batch is malformed: wrong dimension, empty sequence, non-finite entries, norm bound."""


class OracleError(HeadthiefError):
    """The oracle answered something unusable (NaN, wrong count) or raised while evaluating."""


class BudgetExceeded(HeadthiefError):
    """A batch would take the oracle past its query budget. Nothing of that batch was sent.

    Attributes:
        spent: queries already answered (and paid for) before the refused batch.
        budget: the budget.
        requested: size of the refused batch.
    """

    def __init__(self, spent: int, budget: int, requested: int):
        self.spent = spent
        self.budget = budget
        self.requested = requested
        super().__init__(
            f"query budget exceeded: {spent} queries spent, budget {budget}, "
            f"the next batch needs {requested} more"
        )


class NotIdentifiable(HeadthiefError):
    """The target's parameters cannot be determined from the queries this oracle allows."""


class ComputeLimit(HeadthiefError):
    """A run's planned arithmetic is above the limit it was given (``--max-tflop``): it stops before the
    stages that would exceed it, with what it recovered so far."""


class ConvergenceError(HeadthiefError):
    """A bounded iterative procedure hit its cap without meeting its stopping rule."""


class SpecError(HeadthiefError, ValueError):
    """A target spec or command-line setting is malformed."""


class ModelMismatch(HeadthiefError):
    """The target does not behave like the model class the extraction assumed.

    Raised by the model check (:mod:`headthief.extraction.check`) either early, when an identity the
    assumed class implies fails on a few queries, or at the end, when the recovered model's fidelity on
    fresh sequences is worse than the answers' precision explains.

    Attributes:
        check: the identity or check that failed (e.g. ``"one-token affinity"``, ``"fidelity"``).
        figure: the measured figure, and ``threshold`` the largest the assumed class allows.
        hint: what the target might be instead.
    """

    def __init__(self, message: str, *, check: str = "", figure: float | None = None,
                 threshold: float | None = None, hint: str = ""):
        self.check = check
        self.figure = figure
        self.threshold = threshold
        self.hint = hint
        super().__init__(message)
