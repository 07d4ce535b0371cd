"""Resuming a long run after its stages: the stage checkpoints of one run, kept in its journal.

At MiniLM's size the block method computes for hours (stage F's Jacobians, the one-token refit F+, stage A's
reads and fits, the block refit R): the journal alone would spare the answers of an interrupted run but
not that computation. :class:`StageCheckpoints` keeps one row in the journal
(:mod:`headthief.oracles.checkpoints`), replaced after each stage: every part computed so far, the figures,
the random generator's state and the queries spent. A run given the same journal restores it and starts
after the last stage it holds; its queries are the ones an uninterrupted run asks from there (answers
already journaled are replayed, not paid), and its result is the uninterrupted run's, except where a refit
(the one-token refit F+ or the block refit R) was cut between two of its checkpoints (every ``EVERY`` = 60
seconds, or ``HEADTHIEF_CHECKPOINT_SECONDS``): it then goes on from the parameters it had reached, with its
L-BFGS memory and scaling drawn afresh, but its losses so far kept (``*_history``), so its iteration cap and
its stopping rule's window count the iterations before the cut (``resumed_from`` in the run's figures says
after which stage, ``one_token_resumed_from_evaluation`` and ``block_refit_resumed_from_evaluation`` from
which evaluation).
The block method's stages: ``V`` (stages L, activation and V), ``F-search`` (stage F's neuron search on the
probe route, cut between two of its checkpoints: stage F is read again from its start, its answers replayed, and
the search goes on from the kept state where the span is the same bit for bit), ``F-span`` (stage F's algebra,
before F+),
``F+partial``, ``F``, ``A``, ``R-partial``, ``R``; ``--method encoder``'s: ``E``, ``block 0``, ``block 1``, ...
"""
from __future__ import annotations

import os
import time

import numpy as np

from ...errors import SpecError
from ...oracles.base import Oracle, oracle_stack
from ...oracles.checkpoints import code_fingerprint

NAME = "block"                        # the one checkpoint row of a block run
STAGES = ("V", "F-search", "F-span", "F+partial", "F", "A", "R-partial", "R")
EVERY = 60.0                          # seconds between checkpoints inside a refit (HEADTHIEF_CHECKPOINT_SECONDS)
ENV = "HEADTHIEF_CHECKPOINT_SECONDS"


def _every() -> float:
    """Seconds between a refit's checkpoints: ``HEADTHIEF_CHECKPOINT_SECONDS`` if set, else :data:`EVERY`."""
    raw = os.environ.get(ENV)
    if raw is None:
        return EVERY
    try:
        every = float(raw)
    except ValueError:
        every = float("nan")
    if not every >= 0:
        raise SpecError(f"{ENV} must be a number of seconds >= 0, got {raw!r}")
    return every


ENTRIES = {"block": "extraction.block.extract", "encoder": "extraction.block.encoder"}


def current_code(name: str = NAME) -> str:
    """The code fingerprint this version writes the checkpoint ``name`` (``block`` or ``encoder``) with, and
    uses only those of: the method's module and every headthief module it imports (docstrings and comments
    aside, :func:`~headthief.oracles.checkpoints.code_fingerprint`)."""
    if name not in ENTRIES:
        raise ValueError(f"no checkpointing method {name!r} (known: {', '.join(ENTRIES)})")
    return code_fingerprint(ENTRIES[name])


def _store(oracle: Oracle):
    """The transcript (journal) under ``oracle``, or None."""
    for o in oracle_stack(oracle):
        t = getattr(o, "transcript", None)
        if t is not None:
            return t
    return None


class StageCheckpoints:
    """A run's checkpoint: ``save(stage, state)`` after each stage, ``load()`` at the start. ``name``: the
    journal row (``block``, or ``encoder`` with the stages ``E``, ``block 0``, ``block 1``, ...); ``stages``
    their order."""

    def __init__(self, oracle: Oracle, rng: np.random.Generator, queries_before: int, every: float | None = None,
                 name: str = NAME, stages: tuple[str, ...] = STAGES):
        self.oracle, self.rng, self.q0 = oracle, rng, int(queries_before)
        self.name, self.stages = name, tuple(stages)
        self.store = _store(oracle)
        self.code = current_code(self.name) if self.store is not None else ""
        self.offset = 0                   # queries of the restored stages (asked by the run that wrote them)
        self.every = float(every) if every is not None else _every()
        self._last = time.monotonic()

    def spent(self) -> int:
        """Queries of this extraction so far, the restored stages' included."""
        return int(self.oracle.queries - self.q0) + self.offset

    def save(self, stage: str, state: dict, *, rng_state=None, spent: int | None = None) -> None:
        """Keep ``state`` as the checkpoint after ``stage`` (with the generator's state, or ``rng_state``,
        and the queries spent, or ``spent``)."""
        if self.store is None:
            return
        if stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r}")
        spent = self.spent() if spent is None else int(spent)
        evaluation = state.get("partial_calls", state.get("fplus_calls")) if stage.endswith("partial") else None
        search = state.get("search") if stage == "F-search" else None     # (key, the neuron search's state)
        self.store.checkpoint(self.name, self.code, {
            "stage": stage, "state": state, "rng": rng_state if rng_state is not None else self.rng.bit_generator.state,
            "spent": spent}, meta={"stage": stage, "spent": spent, "evaluation": evaluation,
                                   **({"neurons_found": len(search[1]["found"]), "search_starts": int(search[1]["starts"])}
                                      if search is not None else {}),
                                   "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        self._last = time.monotonic()

    def to_run(self, stage: str, done: str | None) -> bool:
        """Whether ``stage`` (or part of it) is still to run after the checkpoint ``done`` (None: none)."""
        return done is None or self.stages.index(done) < self.stages.index(stage)

    def due(self) -> bool:
        """Whether ``every`` seconds have passed since the last save (for checkpoints inside a long fit)."""
        return time.monotonic() - self._last >= self.every

    def load(self) -> tuple[str | None, dict]:
        """``(stage, state)`` of the journal's checkpoint, the generator set to its state; ``(None, {})``
        when there is none (no journal, a new one, or one written by other code)."""
        if self.store is None:
            return None, {}
        got = self.store.restore(self.name, self.code)
        if got is None or got["stage"] not in self.stages:
            return None, {}
        self.rng.bit_generator.state = got["rng"]
        self.offset = int(got["spent"]) - int(self.oracle.queries - self.q0)
        return got["stage"], got["state"]


__all__ = ["StageCheckpoints", "STAGES", "current_code"]
