"""Answer kinds: what one query (one sequence) returns.

The paper's value oracle answers one number per sequence; the APIs people deploy answer with vectors.
An :class:`Output` is part of every oracle's contract (``oracle.output``, with ``oracle.d_out`` for
vectors); the journal, the budgets, the model check and the HTTP server carry it, and a method says
which kinds it accepts (and is refused before its first query when given another).

=========  ======================================  =================================================
kind       one sequence X of N tokens answers       ``Oracle.query`` returns for a batch of n
=========  ======================================  =================================================
value      one number ``f(X)``                      ``(n,)``
sign       one bit ``f(X) > 0`` as 0.0 / 1.0        ``(n,)``
last       the vector at the last position          ``(n, d_out)``
all        one vector per position ``(N, d_out)``   ``(n, N, d_out)`` for an array batch; a list of
                                                    ``(N_i, d_out)`` arrays for a list batch
=========  ======================================  =================================================

Inside, answers travel *packed*: one row per answered vector (``last``: n rows; ``all``: sum of N_i
rows; ``value``/``sign``: a flat array of n). :func:`pack` and :func:`unpack` convert.
"""

from __future__ import annotations

import enum

import numpy as np


class Output(str, enum.Enum):
    """The kind of answer an oracle gives (a ``str`` enum: ``Output("all") is Output.ALL``)."""

    VALUE = "value"
    SIGN = "sign"
    LAST = "last"
    ALL = "all"

    @property
    def vector(self) -> bool:
        return self in (Output.LAST, Output.ALL)

    @classmethod
    def parse(cls, text) -> "Output":
        if isinstance(text, Output):
            return text
        t = str(text).strip().lower()
        aliases = {"scalar": "value", "vector": "last", "hidden": "all", "bit": "sign"}
        t = aliases.get(t, t)
        try:
            return cls(t)
        except ValueError:
            raise ValueError(f"unknown answer kind {text!r}: use value, sign, last (a vector at the last "
                             "position) or all (a vector at every position)") from None

    def describe(self, d_out: int | None = None) -> str:
        return {Output.VALUE: "one number per sequence", Output.SIGN: "one bit per sequence",
                Output.LAST: f"a {d_out}-vector at the last position",
                Output.ALL: f"a {d_out}-vector at every position"}[self]


def lengths_of(X) -> np.ndarray:
    """Sequence lengths of a validated batch (an (n, N, d) array or a list of (N_i, d) arrays)."""
    if isinstance(X, np.ndarray):
        return np.full(X.shape[0], X.shape[1], dtype=np.int64)
    return np.array([x.shape[0] for x in X], dtype=np.int64)


def rows_of(output: Output, X) -> int:
    """How many packed rows the answers to batch ``X`` have."""
    n = int(X.shape[0]) if isinstance(X, np.ndarray) else len(X)
    return int(lengths_of(X).sum()) if output is Output.ALL else n


def numbers_of(output: Output, X, d_out: int | None) -> int:
    """How many numbers the answers to batch ``X`` hold (``numbers_received`` in reports)."""
    rows = rows_of(output, X)
    return rows * int(d_out) if output.vector else rows


def pack(output: Output, raw, X, d_out: int) -> np.ndarray:
    """A black box's vector answers to batch ``X`` as the packed (rows, d_out) float64 array.

    Accepts for ``last`` an (n, d_out) array (or a list of n vectors); for ``all`` an (n, N, d_out)
    array or a list of (N_i, d_out) arrays. Raises ValueError naming what is wrong.
    """
    lens = lengths_of(X)
    n = len(lens)
    if output is Output.LAST:
        y = np.asarray(raw, dtype=np.float64)
        if y.ndim == 3 and y.shape[0] == n and y.shape[2] == d_out and np.all(lens == y.shape[1]):
            y = y[:, -1, :]           # a black box that answers every position, read at the last one
        if y.shape != (n, d_out):
            raise ValueError(f"expected one {d_out}-vector per sequence, shape ({n}, {d_out}); got {y.shape}")
        return y
    if isinstance(raw, np.ndarray) and raw.ndim == 2 and raw.shape == (int(lens.sum()), d_out):
        # already packed (a wrapper's transformed rows); with one-token sequences only, the rows are the
        # sequences' single positions either way (a noise wrapper over --method block's one-token queries
        # was refused here before)
        return np.asarray(raw, dtype=np.float64)
    if isinstance(raw, np.ndarray) and raw.ndim == 3:
        if raw.shape[0] != n or raw.shape[2] != d_out or not np.all(lens == raw.shape[1]):
            raise ValueError(f"expected one (N_i, {d_out}) array per sequence for {n} sequences of lengths "
                             f"{sorted(set(lens.tolist()))}; got an array of shape {raw.shape}")
        return np.asarray(raw, dtype=np.float64).reshape(-1, d_out)
    try:
        parts = [np.asarray(r, dtype=np.float64) for r in raw]
    except TypeError:
        raise ValueError(f"expected a list of {n} (N_i, {d_out}) arrays, got {type(raw).__name__}") from None
    if len(parts) != n:
        raise ValueError(f"expected {n} answers (one (N_i, {d_out}) array per sequence), got {len(parts)}")
    for i, (p, N) in enumerate(zip(parts, lens)):
        if p.shape != (N, d_out):
            raise ValueError(f"answer {i} has shape {p.shape}; its sequence has {N} tokens, so it must be ({N}, {d_out})")
    return np.concatenate(parts, axis=0) if parts else np.zeros((0, d_out))


def unpack(output: Output, packed: np.ndarray, X):
    """The packed answers as :meth:`Oracle.query` returns them (see the module's table)."""
    if output is not Output.ALL:
        return packed
    if isinstance(X, np.ndarray):
        return packed.reshape(X.shape[0], X.shape[1], -1)
    lens = lengths_of(X)
    return np.split(packed, np.cumsum(lens)[:-1], axis=0) if len(lens) else []


__all__ = ["Output", "pack", "unpack", "rows_of", "numbers_of", "lengths_of"]
