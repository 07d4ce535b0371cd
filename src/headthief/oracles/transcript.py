"""Answers already paid for, kept so that an interrupted extraction wastes nothing.

Every answered batch is stored under a content hash of its inputs. Algorithms are deterministic for a
given seed, so re-running an interrupted extraction with the same settings and the saved transcript
re-asks the same batches: those are answered from the transcript, free of charge, and only the part
never asked reaches the black box.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def has_rows(y: np.ndarray, n: int) -> bool:
    """Whether recorded answers ``y`` answer a batch of ``n`` rows: n rows, or (as saved flat) n numbers or n
    vectors flattened."""
    return y.shape[0] == n or (y.ndim == 1 and n > 0 and y.size % n == 0)


class Transcript:
    """Records (batch hash -> answers); saved and loaded as ``.npz``."""

    def __init__(self):
        self._answers: dict[bytes, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._answers)

    @property
    def queries(self) -> int:
        """Answered rows (sequences for value answers)."""
        return int(sum(a.shape[0] for a in self._answers.values()))

    def lookup(self, key: bytes, n: int) -> np.ndarray | None:
        """The answers recorded under ``key`` if they have ``n`` rows (or, as saved to .npz, n numbers
        or n vectors flattened; the oracle reshapes them)."""
        y = self._answers.get(key)
        if y is None or not has_rows(y, n):
            return None
        return y.copy()

    def record(self, key: bytes, y: np.ndarray) -> None:
        self._answers[key] = np.asarray(y, dtype=np.float64).copy()

    def restore(self, name: str, code: str):
        """A stage checkpoint (:mod:`.checkpoints`): an in-memory transcript keeps none."""
        return None

    def checkpoint(self, name: str, code: str, obj, meta=None) -> None:
        """Keep a stage checkpoint: only a journal (:class:`~.journal.Journal`) does."""

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        keys = list(self._answers)
        lengths = np.array([self._answers[k].size for k in keys], dtype=np.int64)
        data = np.concatenate([self._answers[k].ravel() for k in keys]) if keys else np.zeros(0)
        hashes = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1) if keys else np.zeros((0, 16), np.uint8)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, hashes=hashes, lengths=lengths, answers=data)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Transcript":
        t = cls()
        with np.load(path) as z:
            hashes, lengths, data = z["hashes"], z["lengths"], z["answers"]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i in range(len(lengths)):
            t._answers[hashes[i].tobytes()] = data[offsets[i]:offsets[i + 1]].copy()
        return t
