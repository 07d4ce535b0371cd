"""A crash-proof journal of every answer a black box gave (SQLite in WAL mode, from the standard library).

Every answered batch is one row, committed (and, with ``synchronous=FULL``, fsync'ed) *before* the
answers reach the algorithm, so a ``kill -9``, an OOM kill or a power loss after the commit loses
nothing. Extractions are deterministic for their settings, so re-running the same command with the
same journal asks the same batches: those are answered from the journal (free), the rest from the
black box.

Format (a SQLite database; read it with any SQLite client):

- ``meta(key TEXT PRIMARY KEY, value TEXT)``: ``format`` (``headthief-journal-2``; files of the first format,
  ``headthief-journal-1``, are read and resumed as they are), ``fingerprint`` (a
  JSON object: target, method, seed and every setting that changes which queries are asked), ``created``.
- ``answers(id INTEGER PRIMARY KEY, key BLOB UNIQUE, n INTEGER, answers BLOB, checksum BLOB, dtype TEXT)``:
  ``key`` is the 16-byte BLAKE2b hash of the batch's shapes and float64 bytes
  (:func:`headthief.oracles.base.batch_key`), ``answers`` the answers (little-endian): n numbers, or for vector
  answers n rows of d_out numbers (one row per answered vector, :mod:`headthief.oracles.answers`), as float64
  (``dtype`` ``f8``) or, where every number of the batch is a float32 number (a float32 model's answers: a
  MiniLM block's journal is tens of GB), as float32 (``f4``), which reads back to the same float64 numbers bit
  for bit; ``checksum`` an 8-byte BLAKE2b of (key, n, answers, and the dtype of an ``f4`` record). The first
  format has no ``dtype`` column: every record ``f8``.
- ``checkpoints(name TEXT PRIMARY KEY, code TEXT, meta TEXT, blob BLOB, checksum BLOB)``: what a long method
  computed after each stage (:mod:`headthief.oracles.checkpoints`), so a resumed run skips the computation too;
  ``meta`` (JSON) says which stage, for ``headthief journal show``.

Failure modes and what they do:

- a torn last write (the process died inside a commit): SQLite's write-ahead log drops the incomplete
  transaction when the file is next opened; :class:`Journal` notices the partial WAL frame first and
  says so (``torn`` attribute, a message on stderr from the CLI);
- a damaged file (not a database, a malformed page, a row whose checksum fails): :class:`JournalError`
  with a message naming the file and what is wrong; never a traceback;
- a journal of another command (target, method, seed or setting): :class:`JournalMismatch` naming every
  setting that differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import struct
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import HeadthiefError, SpecError
from .transcript import Transcript, has_rows

FORMAT = "headthief-journal-2"
FORMATS = ("headthief-journal-1", FORMAT)    # read and resumed; a file keeps the format it was created with


class JournalError(HeadthiefError):
    """A journal file cannot be used: damaged, not a journal, or unreadable."""


class JournalMismatch(SpecError):
    """A journal written by another command (target, method, seed or setting)."""


def _checksum(key: bytes, n: int, blob: bytes, dtype: str = "f8") -> bytes:
    h = hashlib.blake2b(digest_size=8)
    h.update(key)
    h.update(struct.pack("<q", n))
    h.update(blob)
    if dtype != "f8":                  # float64 records keep the first format's checksum
        h.update(dtype.encode())
    return h.digest()


def _packed(y: np.ndarray, narrow: bool) -> tuple[bytes, str]:
    """The bytes a record stores and their dtype: float32 where ``narrow`` and every number of ``y`` is a
    float32 number, i.e. reads back to the same float64 bytes (-0.0, infinities and NaNs too), else float64
    (``y``: contiguous little-endian float64)."""
    if narrow:
        with np.errstate(over="ignore", invalid="ignore"):
            y4 = y.astype("<f4")
        if y4.astype("<f8").tobytes() == y.tobytes():
            return y4.tobytes(), "f4"
    return y.tobytes(), "f8"


def _wal_tail(path: Path) -> int:
    """Bytes of a partial frame at the end of ``path``'s WAL file (0 when it ends on a frame boundary)."""
    wal = path.with_name(path.name + "-wal")
    try:
        size = wal.stat().st_size
        if size <= 32:
            return 0
        with open(wal, "rb") as f:
            header = f.read(32)
    except OSError:
        return 0
    if len(header) < 32 or header[:4] not in (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83"):
        return 0
    page = struct.unpack(">I", header[8:12])[0]
    frame = 24 + page
    return (size - 32) % frame if page else 0


class Journal(Transcript):
    """A :class:`~headthief.oracles.Transcript` whose records live in SQLite: each written durably before it is
    used, every one checked when the file is opened, and read back from the file when asked for (never all
    held in memory: a whole MiniLM block's answers are tens of GB).

    Args:
        path: the journal file (created when missing).
        fingerprint: what the run is (target, method, seed, settings). A new journal records it; an
            existing one must have been written with the same, else :class:`JournalMismatch`.
        check_records: check every record's checksum now (False: only as each is read back; ``journal show``
            on a MiniLM run's journal of tens of GB).
    """

    def __init__(self, path: str | os.PathLike, fingerprint: Mapping[str, Any] | None = None,
                 check_records: bool = True):
        super().__init__()
        self.path = Path(path)
        self.fingerprint = dict(fingerprint or {})
        self.torn = _wal_tail(self.path) if self.path.exists() else 0
        existed = self.path.exists() and self.path.stat().st_size > 0
        if existed:
            with open(self.path, "rb") as f:
                magic = f.read(16)
            if magic != b"SQLite format 3\x00":
                raise JournalError(f"journal {self.path} is not a headthief journal (not a SQLite database); "
                                   "an old .npz transcript? Use a new file name")
        try:
            self._db = sqlite3.connect(str(self.path), isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            # a new file's records say their dtype (float32 where exact); a file of the first format stays as it is
            self._db.execute("CREATE TABLE IF NOT EXISTS answers (id INTEGER PRIMARY KEY, key BLOB UNIQUE, "
                             "n INTEGER NOT NULL, answers BLOB NOT NULL, checksum BLOB NOT NULL, "
                             "dtype TEXT NOT NULL DEFAULT 'f8')")
            self._db.execute("CREATE TABLE IF NOT EXISTS checkpoints (name TEXT PRIMARY KEY, code TEXT NOT NULL, "
                             "meta TEXT NOT NULL, blob BLOB NOT NULL, checksum BLOB NOT NULL)")
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as e:
            raise JournalError(f"journal {self.path} is damaged ({e}); move it aside to start afresh") from None
        if meta:
            if meta.get("format") not in FORMATS:
                raise JournalError(f"journal {self.path} has format {meta.get('format')!r}, expected one of "
                                   f"{', '.join(map(repr, FORMATS))}")
            old = json.loads(meta.get("fingerprint", "{}"))
            if self.fingerprint and old != self.fingerprint:
                diff = [f"{k}: journal has {old.get(k)!r}, this run {self.fingerprint.get(k)!r}"
                        for k in sorted(set(old) | set(self.fingerprint)) if old.get(k) != self.fingerprint.get(k)]
                raise JournalMismatch(f"journal {self.path} was written by another command ({'; '.join(diff)}); "
                                      "a journal resumes only the command that wrote it: use another file")
            if not self.fingerprint:
                self.fingerprint = old
        else:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [
                    ("format", FORMAT), ("fingerprint", json.dumps(self.fingerprint, sort_keys=True)),
                    ("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))])
        try:
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(answers)")}
        except sqlite3.DatabaseError as e:
            raise JournalError(f"journal {self.path} is damaged ({e}); move it aside to start afresh") from None
        # a file of the first format stores float64 only (it has no dtype column) and keeps its format
        self.narrow = "dtype" in columns
        self._select = ("SELECT id, key, n, answers, checksum, " + ("dtype" if self.narrow else "'f8'") +
                        " FROM answers")
        self._insert = ("INSERT OR REPLACE INTO answers (key, n, answers, checksum" +
                        (", dtype) VALUES (?, ?, ?, ?, ?)" if self.narrow else ") VALUES (?, ?, ?, ?)"))
        # every record is checked now, row by row, and none is kept in memory: answers are read back from the
        # file when asked for (a MiniLM block's stage A alone answers 5.4 million queries, 33 GB as float64)
        try:
            for row in (self._db.execute(self._select) if check_records else ()):
                self._unpack(*row)
        except sqlite3.DatabaseError as e:
            raise JournalError(f"journal {self.path} is damaged ({e}); move it aside to start afresh") from None

    def _unpack(self, rid, key, n, blob, chk, dtype="f8") -> np.ndarray:
        """One record's answers (n numbers, or n rows for vector answers) as float64, after its checksum."""
        size = {"f8": 8, "f4": 4}.get(dtype)
        if (size is None or _checksum(key, n, blob, dtype) != chk or n < 0 or (n and len(blob) % (size * n))
                or (not n and blob)):
            raise JournalError(f"journal {self.path} is damaged: record {rid} fails its checksum; "
                               "move it aside to start afresh")
        y = np.frombuffer(blob, dtype="<" + dtype).astype(np.float64)
        return y if len(blob) == size * n else y.reshape(n, -1)           # vector answers: rows

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM answers").fetchone()[0])

    @property
    def queries(self) -> int:
        """Answered rows (sequences for value answers), over every record."""
        return int(self._db.execute("SELECT COALESCE(SUM(n), 0) FROM answers").fetchone()[0])

    def lookup(self, key: bytes, n: int) -> np.ndarray | None:
        """The answers recorded under ``key``, read from the file (checksum checked), if they have ``n`` rows
        (as :meth:`Transcript.lookup`)."""
        try:
            row = self._db.execute(self._select + " WHERE key = ?", (key,)).fetchone()
        except sqlite3.DatabaseError as e:
            raise JournalError(f"journal {self.path}: reading failed ({e})") from None
        if row is None:
            return None
        y = self._unpack(*row)
        return y if has_rows(y, n) else None

    def __repr__(self) -> str:
        return f"Journal({str(self.path)!r}, batches={len(self)})"

    def record(self, key: bytes, y: np.ndarray) -> None:
        """Write one answered batch durably (committed and fsync'ed) before it is used."""
        y = np.ascontiguousarray(y, dtype="<f8")
        blob, dtype = _packed(y, self.narrow)
        n = int(y.shape[0])
        row = (key, n, blob, _checksum(key, n, blob, dtype)) + ((dtype,) if self.narrow else ())
        try:
            self._db.execute(self._insert, row)
        except sqlite3.DatabaseError as e:
            raise JournalError(f"journal {self.path}: writing failed ({e})") from None

    def restore(self, name: str, code: str):
        """The stage checkpoint ``name`` (:mod:`.checkpoints`) if one was written by the code ``code``, else
        None. :class:`JournalError` if it is damaged or names anything but plain data."""
        from .checkpoints import CheckpointError, checkpoint_blob_checksum, loads
        try:
            row = self._db.execute("SELECT code, blob, checksum FROM checkpoints WHERE name = ?", (name,)).fetchone()
        except sqlite3.DatabaseError as e:
            raise JournalError(f"journal {self.path}: reading failed ({e})") from None
        if row is None or row[0] != code:
            return None
        if checkpoint_blob_checksum(name, row[0], row[1]) != row[2]:
            raise JournalError(f"journal {self.path} is damaged: checkpoint {name!r} fails its checksum; "
                               "move it aside to start afresh")
        try:
            return loads(row[1])
        except CheckpointError as e:
            raise JournalError(f"journal {self.path}: checkpoint {name!r}: {e}") from None

    def checkpoint(self, name: str, code: str, obj, meta: Mapping[str, Any] | None = None) -> None:
        """Write the stage checkpoint ``name`` durably (replacing an older one of that name); ``meta``: what
        :meth:`summary` shows of it without reading the blob (JSON)."""
        from .checkpoints import checkpoint_blob_checksum, dumps
        blob = dumps(obj)
        try:
            self._db.execute("INSERT OR REPLACE INTO checkpoints (name, code, meta, blob, checksum) "
                             "VALUES (?, ?, ?, ?, ?)", (name, code, json.dumps(dict(meta or {}), sort_keys=True), blob,
                                                        checkpoint_blob_checksum(name, code, blob)))
        except sqlite3.DatabaseError as e:
            raise JournalError(f"journal {self.path}: writing failed ({e})") from None

    def summary(self) -> dict[str, Any]:
        """What the journal holds, read without the answers: format, created, fingerprint, batches, answered
        rows, and each checkpoint's name, code, size and ``meta``."""
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        rows = [{"name": n, "code": c, "bytes": int(b), **json.loads(m or "{}")} for n, c, m, b in self._db.execute(
            "SELECT name, code, meta, LENGTH(blob) FROM checkpoints ORDER BY name")]
        return {"path": str(self.path), "format": meta.get("format"), "created": meta.get("created"),
                "fingerprint": json.loads(meta.get("fingerprint", "{}")), "batches": len(self),
                "answered": self.queries, "bytes": self.path.stat().st_size, "checkpoints": rows}

    def close(self) -> None:
        try:
            self._db.close()
        except sqlite3.Error:
            pass

    def save(self, path=None) -> None:
        """Nothing to do: every record is already on disk (kept for the Transcript interface)."""
