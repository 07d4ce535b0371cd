"""The oracle protocol: a black box that answers one value per query sequence.

The public :meth:`Oracle.query` is the only door. It validates the batch, enforces the optional
input-norm bound and query budget, replays answers already paid for (see :class:`Transcript`),
calls the subclass's :meth:`Oracle._query`, validates what comes back and counts. Subclasses write
only ``_query``; wrappers (threat models, defences) are oracles that hold another oracle.
"""

from __future__ import annotations

import hashlib
import time
from typing import Callable, Sequence

import numpy as np

from ..errors import BudgetExceeded, HeadthiefError, InvalidQuery, OracleError
from .answers import Output, numbers_of, pack, rows_of, unpack
from .transcript import Transcript

Batch = Sequence[np.ndarray] | np.ndarray


def as_batch(batch, d: int) -> list[np.ndarray] | np.ndarray:
    """Check a batch and return it as float64: an (n, N, d) array stays an array, a list stays a list."""
    if isinstance(batch, np.ndarray):
        if batch.ndim != 3:
            raise InvalidQuery(
                f"a batch is a list of (N, d) arrays or one (n, N, d) array; got an array of shape {batch.shape}"
                + (" (wrap a single sequence in a list)" if batch.ndim == 2 else "")
            )
        X = np.asarray(batch, dtype=np.float64)
        if X.shape[2] != d:
            raise InvalidQuery(f"tokens must have dimension d = {d}, got {X.shape[2]}")
        if X.shape[1] < 1 and X.shape[0] > 0:
            raise InvalidQuery("empty sequence: every query needs at least one token (N >= 1)")
        if not np.isfinite(X).all():
            bad = int(np.flatnonzero(~np.isfinite(X).reshape(X.shape[0], -1).all(axis=1))[0])
            raise InvalidQuery(f"query {bad} has a non-finite entry (NaN or inf)")
        return X
    if isinstance(batch, (str, bytes)) or not hasattr(batch, "__len__"):
        raise InvalidQuery(f"a batch is a list of (N, d) arrays, got {type(batch).__name__}")
    out = []
    for i, X in enumerate(batch):
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2:
            raise InvalidQuery(f"query {i} must be a 2-D (N, d) array, got shape {X.shape}")
        if X.shape[0] < 1:
            raise InvalidQuery(f"query {i} is an empty sequence: every query needs at least one token (N >= 1)")
        if X.shape[1] != d:
            raise InvalidQuery(f"query {i}: tokens must have dimension d = {d}, got {X.shape[1]}")
        if not np.isfinite(X).all():
            raise InvalidQuery(f"query {i} has a non-finite entry (NaN or inf)")
        out.append(X)
    return out


def batch_key(X) -> bytes:
    """A content hash of a validated batch (used to replay answers already paid for)."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(X, np.ndarray):
        h.update(np.asarray(X.shape, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(X).tobytes())
    else:
        for x in X:
            h.update(np.asarray(x.shape, dtype=np.int64).tobytes())
            h.update(np.ascontiguousarray(x).tobytes())
    return h.digest()


class Oracle:
    """Base class of every oracle.

    Args:
        d: token dimension.
        budget: the most queries this oracle answers (one query = one sequence); None for no limit.
            A batch that would cross it is refused whole with :class:`BudgetExceeded`.
        input_norm: if set, every token must satisfy ``||x_i||_2 <= input_norm``; a query that breaks
            it is refused (never clipped) with :class:`InvalidQuery`.
        transcript: a :class:`Transcript` that records every answered batch; batches already in it
            are answered from it without touching the black box or the budget.
        output: the answer kind (:class:`~headthief.oracles.answers.Output`: ``value`` (default),
            ``sign``, ``last`` or ``all``); ``d_out``: the answer vectors' dimension (vector kinds).
            One query is one sequence whatever the kind.
    """

    def __init__(self, d: int, *, budget: int | None = None, input_norm: float | None = None,
                 transcript: Transcript | None = None, output: Output | str = Output.VALUE,
                 d_out: int | None = None):
        if int(d) < 1:
            raise ValueError(f"d must be >= 1, got {d}")
        if budget is not None and budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if input_norm is not None and not input_norm > 0:
            raise ValueError(f"input_norm must be > 0, got {input_norm}")
        self.d = int(d)
        self.output = Output.parse(output)
        if self.output.vector:
            d_out = self.d if d_out is None else int(d_out)
            if d_out < 1:
                raise ValueError(f"d_out must be >= 1, got {d_out}")
        self.d_out = int(d_out) if self.output.vector else None
        self.budget = budget
        self.input_norm = input_norm
        self.transcript = transcript
        self.queries = 0       # sequences answered (fresh + replayed)
        self.fresh = 0         # sequences sent to the black box (what the budget limits)
        self.replayed = 0      # sequences answered from the transcript
        self.calls = 0
        self.numbers = 0       # numbers received in answers (fresh + replayed): n for value answers
        self.seconds = 0.0     # wall time spent inside the black box (_query)
        self.before_first_query = None   # a one-shot hook (the model check's identities) run before the next query

    def _settings(self) -> str:
        parts = [f"d={self.d}"]
        if self.output is not Output.VALUE:
            parts.append(f"output={self.output.value}" + (f", d_out={self.d_out}" if self.d_out else ""))
        if self.budget is not None:
            parts.append(f"budget={self.budget}")
        if self.input_norm is not None:
            parts.append(f"input_norm={self.input_norm:g}")
        return ", ".join(parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._settings()})"

    def reset(self) -> None:
        """Reset the counters (the budget then applies afresh)."""
        self.queries = self.fresh = self.replayed = self.calls = self.numbers = 0
        self.seconds = 0.0

    def query(self, batch: Batch):
        """Answer a batch: one float64 value per sequence (``value``, ``sign``), or vectors (``last``:
        ``(n, d_out)``; ``all``: ``(n, N, d_out)``, or a list of ``(N_i, d_out)`` for a list batch)."""
        X = as_batch(batch, self.d)
        return unpack(self.output, self._answer(X), X)

    def query_packed(self, batch: Batch) -> np.ndarray:
        """:meth:`query`, with vector answers packed one row per answered vector (see :mod:`.answers`)."""
        return self._answer(as_batch(batch, self.d))

    def _answer(self, X) -> np.ndarray:
        n = int(X.shape[0]) if isinstance(X, np.ndarray) else len(X)
        if n == 0:
            return np.zeros((0, self.d_out)) if self.output.vector else np.zeros(0)
        if self.input_norm is not None:
            self._check_norm(X)
        if self.before_first_query is not None:
            hook, self.before_first_query = self.before_first_query, None
            hook()
        key = batch_key(X) if self.transcript is not None else None
        if key is not None:
            hit = self.transcript.lookup(key, rows_of(self.output, X))
            if hit is not None and self.output.vector:
                hit = hit.reshape(hit.shape[0], -1) if hit.size == rows_of(self.output, X) * self.d_out else None
            if hit is not None:
                self.queries += n
                self.replayed += n
                self.calls += 1
                self.numbers += numbers_of(self.output, X, self.d_out)
                return hit
        if self.budget is not None and self.fresh + n > self.budget:
            raise BudgetExceeded(self.fresh, self.budget, n)
        t0 = time.perf_counter()
        try:
            raw = self._query(X)
        except HeadthiefError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of user code becomes a typed error
            raise OracleError(f"the oracle raised {type(e).__name__}: {e}") from e
        finally:
            self.seconds += time.perf_counter() - t0
        y = self._check_vectors(raw, X) if self.output.vector else self._check_answers(raw, n)
        self.queries += n
        self.fresh += n
        self.calls += 1
        self.numbers += int(y.size)
        if key is not None:
            self.transcript.record(key, y)
        return y

    def _check_norm(self, X) -> None:
        R = self.input_norm
        if isinstance(X, np.ndarray):
            norms = np.linalg.norm(X, axis=2)
            worst = float(norms.max())
        else:
            worst = max(float(np.linalg.norm(x, axis=1).max()) for x in X)
        if worst > R * (1 + 1e-9):
            raise InvalidQuery(
                f"input-norm bound violated: a token has norm {worst:.6g} > R = {R:g} "
                "(this oracle refuses tokens with ||x_i|| > R; it does not clip)"
            )

    @staticmethod
    def _check_answers(raw, n: int) -> np.ndarray:
        try:
            y = np.asarray(raw, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise OracleError(f"the oracle returned something that is not numbers: {e}") from e
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.ndim != 1 or y.shape[0] != n:
            raise OracleError(f"the oracle returned {y.size} values (shape {y.shape}) for {n} sequences; "
                              "it must return exactly one value per sequence")
        bad = ~np.isfinite(y)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise OracleError(f"the oracle returned a non-finite value ({y[i]}) for sequence {i} "
                              f"({int(bad.sum())} of {n} answers are non-finite)")
        return y

    def _check_vectors(self, raw, X) -> np.ndarray:
        try:
            y = pack(self.output, raw, X, self.d_out)
        except (TypeError, ValueError) as e:
            raise OracleError(f"the oracle's answers do not fit {self.output.describe(self.d_out)}: {e}") from e
        bad = ~np.isfinite(y)
        if bad.any():
            r = int(np.flatnonzero(bad.any(axis=1))[0])
            raise OracleError(f"the oracle returned a non-finite number in answer row {r} "
                              f"({int(bad.sum())} of {y.size} numbers are non-finite)")
        return y

    def _query(self, X) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError


class ModelOracle(Oracle):
    """Exact value queries to a model that has an ``evaluate(batch)`` method (e.g. AttentionHead)."""

    def __init__(self, model, **kw):
        d = kw.pop("d", None) or model.d
        out = getattr(model, "output", None)
        if out is not None and "output" not in kw:
            kw["output"], kw["d_out"] = out, getattr(model, "d_out", None)
        super().__init__(d, **kw)
        self.model = model

    def _query(self, X):
        return self.model.evaluate(X)


class CallableOracle(Oracle):
    """Wrap any Python callable that maps a list of (N_i, d) arrays to one float per array."""

    def __init__(self, fn: Callable[[list[np.ndarray]], Sequence[float]], d: int, **kw):
        super().__init__(d, **kw)
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self.fn = fn

    def __repr__(self) -> str:
        return f"CallableOracle({getattr(self.fn, '__name__', repr(self.fn))}, {self._settings()})"

    def _query(self, X):
        seqs = list(X) if isinstance(X, np.ndarray) else X
        try:
            return self.fn(seqs)
        except HeadthiefError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: name what it was given
            name = getattr(self.fn, "__name__", repr(self.fn))
            shapes = sorted({tuple(np.shape(x)) for x in seqs})
            shown = ", ".join(str(s) for s in shapes[:3]) + (", ..." if len(shapes) > 3 else "")
            raise OracleError(
                f"{name} raised {type(e).__name__}: {e}; it was given a list of {len(seqs)} arrays of shape "
                f"{shown} (N tokens of dimension d = {self.d}). If {name} expects tokens of another dimension, "
                f"the token dimension is wrong (--d {self.d} on the command line)") from e


class WrappedOracle(Oracle):
    """Base of oracle wrappers (threat models, defences): answers come from ``inner``, transformed.

    The wrapper does its own validation, budget and counting; the inner oracle counts too.
    """

    def __init__(self, inner: Oracle, **kw):
        kw.setdefault("input_norm", inner.input_norm)
        kw.setdefault("output", inner.output)
        kw.setdefault("d_out", inner.d_out)
        super().__init__(inner.d, **kw)
        self.inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r}, {self._settings()})"

    def _query(self, X):
        return self._transform(X, self.inner.query_packed(X))

    def _transform(self, X, y: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        """``y``: the inner answers, packed (value kinds: (n,); vector kinds: one row per vector)."""
        raise NotImplementedError


def oracle_stack(oracle: Oracle) -> list[Oracle]:
    """The oracle and every oracle it wraps, outermost first (the last one is the black box itself)."""
    out = [oracle]
    while isinstance(out[-1], WrappedOracle):
        out.append(out[-1].inner)
    return out
