"""API keys, budgets, rate limits and the ledger of every charge, in one SQLite file (WAL mode).

One database holds everything a provider must not lose in a crash:

- ``keys``: one row per API key. Only a SHA-256 hash of the key is stored (keys are 256-bit random
  strings, so a fast hash is enough, as GitHub and Stripe do); the key itself is shown once, when it
  is made. ``budget`` (queries, NULL for no limit), ``rate`` (requests per second, NULL for none),
  ``used`` (queries charged so far), the token bucket of the rate limit (``tokens``, ``tokens_at``), an
  optional per-key defence (a JSON object, see :mod:`headthief.server.defences`) and ``flagged_at``
  (the query count at which the query-distribution detector flagged the key, NULL if never).
- ``ledger``: one row per charged request: the key, the request's ``Idempotency-Key``, a hash of the
  decoded payload, the number of queries charged (``n``: sequences), the answers sent (float64
  little-endian; for a vector target one row of ``d_out`` numbers per answered vector, packed as
  :mod:`headthief.oracles.answers` does) and how many numbers they are (``numbers``; NULL in rows
  written before vector answers, which hold ``n``). It is also the idempotency store: a retry with
  the same key is answered from its row, free.
- ``meta``: the format and the server's secret (the key of the keyed-hash noise defences).

Exactly-once charging: a charge is one transaction that inserts the ledger row (with the answers)
and adds ``n`` to ``keys.used``; it commits (``synchronous=FULL``: fsync'ed) before the response is
sent. So after any crash ``keys.used == SUM(ledger.n)`` for every key, every answer a client received
is in the ledger, and a retry of a request whose answer was lost in flight finds its row.
:meth:`Accounts.audit` checks the first of these.

Reservations (queries in flight, counted against the budget before they are computed) and the set of
idempotency keys in flight live in memory: a crash ends every request in flight, so both are rightly
empty after a restart. One server process per database (uvicorn with one worker).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import HeadthiefError, SpecError

FORMAT = "headthief-server-1"
KEY_PREFIX = "ht_"


class AccountsError(HeadthiefError):
    """The accounts database cannot be used (damaged, another format, unwritable)."""


def hash_key(key: str) -> bytes:
    """The stored form of an API key: SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class KeyRecord:
    """One API key as the server sees it (never the key itself)."""

    id: int
    name: str
    prefix: str
    budget: int | None
    rate: float | None
    used: int
    defence: dict[str, Any]
    flagged_at: int | None
    created: str
    revoked: str | None = None        # when ``keys revoke`` revoked it (then every request is 401)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "prefix": self.prefix, "budget": self.budget, "rate": self.rate,
                "used": self.used, "defence": self.defence or None, "flagged_at": self.flagged_at,
                "created": self.created, "revoked": self.revoked}


@dataclass(frozen=True)
class Stored:
    """A ledger row found under an idempotency key: the first response, to send again."""

    payload_hash: bytes
    n: int
    answers: np.ndarray
    flagged: bool


class Accounts:
    """The server's SQLite database. Thread-safe (one connection behind a lock).

    Args:
        path: the database file (created when missing, unless ``create=False``: then a missing file is an
            :class:`AccountsError` naming it, so a typo in ``keys list --db`` does not make an empty database).
        sync: ``"full"`` (default): every charge is fsync'ed before its answer is sent, so it survives a
            power loss or an OS crash; ``"normal"`` (opt-in, ``headthief serve --sync normal``): SQLite's
            ``synchronous=NORMAL`` in WAL mode: a charge survives a crash of the server process but the
            last ones before a power loss or OS crash may be lost (the database stays consistent:
            ``used == SUM(ledger.n)`` still holds; an answer sent but lost that way is charged again if
            retried).
    """

    def __init__(self, path: str | os.PathLike, *, sync: str = "full", create: bool = True):
        if sync not in ("full", "normal"):
            raise SpecError(f"sync={sync!r}: use full or normal")
        if not create and not Path(path).is_file():
            raise AccountsError(f"no server database at {path} (`headthief keys add NAME --db {path}` or "
                                f"`headthief serve --db {path}` makes one)")
        self.sync = sync
        self.path = Path(path)
        self._lock = threading.RLock()
        self._reserved: dict[int, int] = {}         # key id -> queries in flight
        self._inflight: set[tuple[int, str]] = set()  # (key id, idempotency key) being computed
        self._buckets: dict[int, tuple[float, float]] = {}  # key id -> (tokens, at), newer than the DB's
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                if f.read(16) != b"SQLite format 3\x00":
                    raise AccountsError(f"{self.path} is not a headthief server database (not SQLite)")
        try:
            self._db = sqlite3.connect(str(self.path), isolation_level=None, timeout=30, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL" if sync == "full" else "PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=30000")
            self._db.executescript("""
                CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
                CREATE TABLE IF NOT EXISTS keys (
                    id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, key_hash BLOB UNIQUE NOT NULL,
                    prefix TEXT NOT NULL, budget INTEGER, rate REAL, used INTEGER NOT NULL DEFAULT 0,
                    tokens REAL, tokens_at REAL, defence TEXT, flagged_at INTEGER, created TEXT NOT NULL);
                CREATE TABLE IF NOT EXISTS ledger (
                    id INTEGER PRIMARY KEY, key_id INTEGER NOT NULL REFERENCES keys(id),
                    idem_key TEXT NOT NULL, payload_hash BLOB NOT NULL, n INTEGER NOT NULL,
                    answers BLOB NOT NULL, flagged INTEGER NOT NULL DEFAULT 0, at REAL NOT NULL,
                    UNIQUE (key_id, idem_key));
                CREATE TABLE IF NOT EXISTS prada_points (
                    id INTEGER PRIMARY KEY, key_id INTEGER NOT NULL REFERENCES keys(id), length INTEGER NOT NULL,
                    x BLOB NOT NULL);
                CREATE TABLE IF NOT EXISTS prada_distances (
                    id INTEGER PRIMARY KEY, key_id INTEGER NOT NULL REFERENCES keys(id), d REAL NOT NULL);
                CREATE INDEX IF NOT EXISTS prada_points_key ON prada_points (key_id, id);
                CREATE INDEX IF NOT EXISTS prada_distances_key ON prada_distances (key_id, id);
            """)
            if "revoked" not in {r[1] for r in self._db.execute("PRAGMA table_info(keys)").fetchall()}:
                self._db.execute("ALTER TABLE keys ADD COLUMN revoked TEXT")     # databases made before revocation
            if "numbers" not in {r[1] for r in self._db.execute("PRAGMA table_info(ledger)").fetchall()}:
                try:
                    self._db.execute("ALTER TABLE ledger ADD COLUMN numbers INTEGER")   # made before vector answers
                except sqlite3.OperationalError as e:      # another process (keys, serve) added it just now
                    if "duplicate column" not in str(e):
                        raise
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
            if not meta:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)", [
                    ("format", FORMAT), ("secret", secrets.token_hex(32)),
                    ("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))])
                self._db.execute("COMMIT")
                meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as e:
            raise AccountsError(f"server database {self.path} cannot be used ({e})") from None
        if meta.get("format") != FORMAT:
            raise AccountsError(f"{self.path} has format {meta.get('format')!r}, expected {FORMAT!r}")
        self.secret = bytes.fromhex(meta["secret"])

    def __repr__(self) -> str:
        return f"Accounts({str(self.path)!r})"

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                pass

    # -- keys -----------------------------------------------------------------------------------

    def add_key(self, name: str, *, budget: int | None = None, rate: float | None = None,
                defence: dict[str, Any] | None = None) -> str:
        """Make a new key; return it (the only time it is seen: only its hash is stored)."""
        if not name or len(name) > 100:
            raise SpecError("a key name must have 1 to 100 characters")
        if budget is not None and budget < 0:
            raise SpecError(f"--budget must be >= 0, got {budget}")
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise SpecError(f"--rate must be a positive number of requests per second, got {rate}")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO keys (name, key_hash, prefix, budget, rate, used, tokens, tokens_at, defence, "
                    "created) VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?)",
                    (name, hash_key(key), key[:7], budget, rate, _capacity(rate), time.time(),
                     json.dumps(defence) if defence else None, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
            except sqlite3.IntegrityError:
                raise SpecError(f"a key named {name!r} exists already in {self.path}") from None
        return key

    def _record(self, row) -> KeyRecord:
        kid, name, prefix, budget, rate, used, defence, flagged_at, created, revoked = row
        return KeyRecord(kid, name, prefix, budget, rate, used, json.loads(defence) if defence else {},
                         flagged_at, created, revoked)

    _COLS = "id, name, prefix, budget, rate, used, defence, flagged_at, created, revoked"

    def _by_name(self, name: str) -> KeyRecord:
        row = self._db.execute(f"SELECT {self._COLS} FROM keys WHERE name = ?", (name,)).fetchone()
        if row is None:
            names = [r[0] for r in self._db.execute("SELECT name FROM keys ORDER BY id").fetchall()]
            raise SpecError(f"no key named {name!r} in {self.path} (keys: {', '.join(names) or 'none'})")
        return self._record(row)

    def revoke(self, name: str) -> KeyRecord:
        """Revoke a key: from now on every request with it is answered 401 (a running server sees it at
        its next request). Its ledger and usage are kept."""
        with self._lock:
            rec = self._by_name(name)
            if rec.revoked is None:
                self._db.execute("UPDATE keys SET revoked = ? WHERE id = ?",
                                 (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rec.id))
            return self._by_name(name)

    _UNSET: Any = object()

    def update(self, name: str, *, budget: Any = _UNSET, rate: Any = _UNSET) -> KeyRecord:
        """Change a key's budget (queries; None: no limit) and/or rate (requests per second; None: no limit).
        A budget below what the key has used is allowed: the key is then refused further queries."""
        if budget is not self._UNSET and budget is not None and budget < 0:
            raise SpecError(f"--budget must be >= 0, got {budget}")
        if rate is not self._UNSET and rate is not None and not (math.isfinite(rate) and rate > 0):
            raise SpecError(f"--rate must be a positive number of requests per second, got {rate}")
        with self._lock:
            rec = self._by_name(name)
            if budget is not self._UNSET:
                self._db.execute("UPDATE keys SET budget = ? WHERE id = ?", (budget, rec.id))
            if rate is not self._UNSET:
                self._db.execute("UPDATE keys SET rate = ?, tokens = ?, tokens_at = ? WHERE id = ?",
                                 (rate, _capacity(rate), time.time(), rec.id))
                self._buckets.pop(rec.id, None)
            return self._by_name(name)

    def list_keys(self) -> list[KeyRecord]:
        with self._lock:
            rows = self._db.execute(f"SELECT {self._COLS} FROM keys ORDER BY id").fetchall()
        return [self._record(r) for r in rows]

    def lookup(self, key: str) -> KeyRecord | None:
        """The key's record, or None for an unknown key."""
        with self._lock:
            row = self._db.execute(f"SELECT {self._COLS} FROM keys WHERE key_hash = ?", (hash_key(key),)).fetchone()
        return self._record(row) if row else None

    def get(self, key_id: int) -> KeyRecord:
        with self._lock:
            row = self._db.execute(f"SELECT {self._COLS} FROM keys WHERE id = ?", (key_id,)).fetchone()
        return self._record(row)

    # -- rate limit ---------------------------------------------------------------------------------

    def take_token(self, rec: KeyRecord, now: float | None = None) -> float:
        """Spend one request of ``rec``'s rate; return 0.0, or the seconds to wait when none is left.

        A token bucket of capacity ``max(1, rate)`` refilled at ``rate`` per second. Its state is written
        to the database with every charge, so a restart keeps it (as of the last charge).
        """
        if rec.rate is None:
            return 0.0
        now = time.time() if now is None else now
        cap = _capacity(rec.rate)
        with self._lock:
            state = self._buckets.get(rec.id)
            if state is None:
                row = self._db.execute("SELECT tokens, tokens_at FROM keys WHERE id = ?", (rec.id,)).fetchone()
                state = (cap if row[0] is None else row[0], now if row[1] is None else row[1])
            tokens, at = state
            tokens = min(cap, tokens + max(0.0, now - at) * rec.rate)
            if tokens >= 1.0:
                self._buckets[rec.id] = (tokens - 1.0, now)
                return 0.0
            self._buckets[rec.id] = (tokens, now)
            return (1.0 - tokens) / rec.rate

    # -- idempotency, budget, charge ------------------------------------------------------------

    def find(self, key_id: int, idem_key: str) -> Stored | None:
        with self._lock:
            row = self._db.execute("SELECT payload_hash, n, answers, flagged FROM ledger WHERE key_id = ? AND "
                                   "idem_key = ?", (key_id, idem_key)).fetchone()
        if row is None:
            return None
        return Stored(bytes(row[0]), int(row[1]), np.frombuffer(row[2], dtype="<f8").astype(np.float64), bool(row[3]))

    def begin(self, rec: KeyRecord, idem_key: str, n: int) -> tuple[str, Any]:
        """Start a request: ``("replay", Stored)``, ``("inflight", None)``, ``("budget", (used, budget))``
        or ``("go", None)`` (then the queries are reserved and the key is in flight until
        :meth:`charge` or :meth:`abandon`)."""
        with self._lock:
            stored = self.find(rec.id, idem_key)
            if stored is not None:
                return "replay", stored
            if (rec.id, idem_key) in self._inflight:
                return "inflight", None
            used = int(self._db.execute("SELECT used FROM keys WHERE id = ?", (rec.id,)).fetchone()[0])
            reserved = self._reserved.get(rec.id, 0)
            if rec.budget is not None and used + reserved + n > rec.budget:
                return "budget", (used, rec.budget, reserved)
            self._reserved[rec.id] = reserved + n
            self._inflight.add((rec.id, idem_key))
            return "go", None

    def abandon(self, rec: KeyRecord, idem_key: str, n: int) -> None:
        """Release a reservation whose request failed before it was charged."""
        with self._lock:
            self._inflight.discard((rec.id, idem_key))
            self._reserved[rec.id] = max(0, self._reserved.get(rec.id, 0) - n)

    def prada_state(self, key_id: int, max_distances: int) -> tuple[list, list]:
        """The stored PRADA detector state of a key: its points ``[(N, bytes)]`` in the order they joined,
        and its last ``max_distances`` minimum distances, oldest first."""
        with self._lock:
            points = self._db.execute("SELECT length, x FROM prada_points WHERE key_id = ? ORDER BY id",
                                      (key_id,)).fetchall()
            dists = self._db.execute("SELECT d FROM prada_distances WHERE key_id = ? ORDER BY id DESC LIMIT ?",
                                     (key_id, max_distances)).fetchall()
        return [(int(n), bytes(x)) for n, x in points], [float(d) for (d,) in reversed(dists)]

    def charge(self, rec: KeyRecord, idem_key: str, payload_hash: bytes, answers: np.ndarray, *,
               n: int | None = None, flagged: bool = False, flag_at: int | None = None,
               prada: dict | None = None) -> int:
        """Charge ``n`` queries (default ``len(answers)``: one value per sequence) and store the response
        (any float64 array: vector answers are packed rows, more numbers than queries), in one transaction;
        return ``used``. ``prada``: what the request added to the key's detector (``Prada.observe``),
        stored with it."""
        y = np.ascontiguousarray(answers, dtype="<f8")
        n = int(y.shape[0]) if n is None else int(n)
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("INSERT INTO ledger (key_id, idem_key, payload_hash, n, answers, flagged, at, numbers) "
                                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                 (rec.id, idem_key, payload_hash, n, y.tobytes(), int(flagged), time.time(),
                                  int(y.size)))
                tokens, at = self._buckets.get(rec.id, (None, None))
                self._db.execute("UPDATE keys SET used = used + ?, tokens = COALESCE(?, tokens), "
                                 "tokens_at = COALESCE(?, tokens_at), flagged_at = COALESCE(flagged_at, ?) "
                                 "WHERE id = ?", (n, tokens, at, flag_at, rec.id))
                if prada:
                    self._store_prada(rec.id, prada)
                self._db.execute("COMMIT")
            except sqlite3.Error:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            finally:
                self._inflight.discard((rec.id, idem_key))
                self._reserved[rec.id] = max(0, self._reserved.get(rec.id, 0) - n)
            return int(self._db.execute("SELECT used FROM keys WHERE id = ?", (rec.id,)).fetchone()[0])

    def _store_prada(self, key_id: int, added: dict) -> None:
        from .defences import D_MAX
        if added.get("points"):
            self._db.executemany("INSERT INTO prada_points (key_id, length, x) VALUES (?, ?, ?)",
                                 [(key_id, n, x) for n, x in added["points"]])
        if added.get("distances"):
            self._db.executemany("INSERT INTO prada_distances (key_id, d) VALUES (?, ?)",
                                 [(key_id, d) for d in added["distances"]])
            last = int(self._db.execute("SELECT last_insert_rowid()").fetchone()[0])
            # keep the last D_MAX of the key (what the detector uses): pruned about every D_MAX rows
            if last % D_MAX < len(added["distances"]):
                self._db.execute("DELETE FROM prada_distances WHERE key_id = ? AND id NOT IN (SELECT id FROM "
                                 "prada_distances WHERE key_id = ? ORDER BY id DESC LIMIT ?)", (key_id, key_id, D_MAX))

    def audit(self) -> list[str]:
        """Every disagreement between budgets, ledger and answers (empty when all agree)."""
        problems = []
        with self._lock:
            rows = self._db.execute(
                "SELECT k.name, k.used, k.budget, COALESCE(SUM(l.n), 0), COUNT(l.id) FROM keys k "
                "LEFT JOIN ledger l ON l.key_id = k.id GROUP BY k.id").fetchall()
            bad = self._db.execute("SELECT COUNT(*) FROM ledger WHERE length(answers) != 8 * COALESCE(numbers, n) "
                                   "OR COALESCE(numbers, n) < n").fetchone()[0]
        for name, used, budget, total, _ in rows:
            if used != total:
                problems.append(f"key {name!r}: used {used} but the ledger charges {total}")
            if budget is not None and used > budget:
                problems.append(f"key {name!r}: used {used} exceeds its budget {budget}")
        if bad:
            problems.append(f"{bad} ledger rows whose answers do not match their charge")
        return problems

    def ledger_totals(self) -> dict[str, tuple[int, int]]:
        """Per key name: (requests charged, queries charged) according to the ledger."""
        with self._lock:
            rows = self._db.execute("SELECT k.name, COUNT(l.id), COALESCE(SUM(l.n), 0) FROM keys k "
                                    "LEFT JOIN ledger l ON l.key_id = k.id GROUP BY k.id").fetchall()
        return {name: (int(c), int(s)) for name, c, s in rows}


def _capacity(rate: float | None) -> float | None:
    return None if rate is None else max(1.0, float(rate))


class DatabaseLock:
    """One server per database: an exclusive ``flock`` on ``PATH.lock`` (the file holds the server's pid),
    held until :meth:`release` or the process ends (a crash or SIGKILL releases it too, so a stale file
    never blocks a restart). ``headthief keys`` does not take it: keys can be made and changed while the
    server runs.

    Raises:
        AccountsError: another process holds the lock (naming its pid), or the lock file cannot be made.
    """

    def __init__(self, db: str | os.PathLike):
        self.path = Path(str(db) + ".lock")
        try:
            import fcntl
        except ImportError:         # no flock (Windows): one server per database is then the user's to keep
            self._f = None
            return
        try:
            f = open(self.path, "a+")
        except OSError as e:
            raise AccountsError(f"cannot make the lock file {self.path} ({e.strerror})") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            pid = f.read().strip() or "?"
            f.close()
            raise AccountsError(f"the database {db} is in use by another headthief serve (pid {pid}; lock "
                                f"{self.path}): one server per database. Stop it first, or serve another "
                                "--db") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._f = f

    def release(self) -> None:
        if self._f is not None:
            self._f.close()         # closing the descriptor releases the flock
            self._f = None

    def __repr__(self) -> str:
        return f"DatabaseLock({str(self.path)!r})"
