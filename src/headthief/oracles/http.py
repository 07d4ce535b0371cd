"""An oracle behind a model API: ``HTTPOracle("http://127.0.0.1:8000", api_key=...)`` (``headthief serve``).

It reads ``GET /v1/info`` (the dimension, the batch, sequence-length and body limits, the output kind),
splits every batch into requests within those limits and sends each to ``POST /v1/query`` with an
``Idempotency-Key`` derived from the request's content and the run. So:

- the first request (``/v1/info``) waits for a server that is still starting: a refused connection is
  retried with the same backoff for up to ``connect_wait`` seconds (30 by default);
- transport errors and 5xx answers are retried with a bounded exponential backoff (no jitter: the
  waits are a function of the attempt number), a 409 (the same request still in flight) after its
  ``Retry-After``, a 429 (rate limit) after its ``Retry-After``; every wait is bounded and running out
  ends in :class:`~headthief.errors.OracleError` naming the last problem;
- a retry whose first answer was lost (a crash of either side after the server charged) is answered
  by the server from its ledger, free;
- with a journal (``transcript=Journal(...)``, ``headthief extract --journal``) the run id is stored
  in the journal, so a resumed run derives the same keys: batches already journaled are not sent at
  all, and the one that was in flight when the client died is answered again without a charge.

Errors: 401 -> :class:`~headthief.errors.SpecError` (a bad key is bad input); 403 budget ->
:class:`~headthief.errors.BudgetExceeded` with the server's counts; 400 / 413 / 415 / 422 ->
:class:`~headthief.errors.InvalidQuery` with the server's message; 409 ``idempotency_key_reused``, 403
flagged and anything else -> :class:`~headthief.errors.OracleError`. Every request carries an
``Idempotency-Key`` (the server also answers requests without one, charging each).

The transport is one persistent HTTP/1.1 connection (:mod:`http.client`, TCP_NODELAY) reopened after
any transport error: per request it costs a fraction of a general-purpose client's time. Framing
(``framing="auto"``, the default): a batch with at most a quarter of its entries nonzero (Theorem 4.1's
basis probes: ~99% zeros) goes as ``application/x-headthief-sparse`` (its nonzero entries: kilobytes
where the dense array is megabytes), any other as ``.npy``, sent as a small header followed by the
array's own buffer (no copy). The idempotency key hashes the batch once, from its nonzero entries
when it is sparse (:func:`payload_hash`).

Vector answers: a server whose ``/v1/info`` publishes ``answer_kind`` ``last`` or ``all`` (with
``d_out``) makes this oracle one of that kind (``oracle.output``, ``oracle.d_out``): ``query`` returns
what a local oracle of that kind returns, bit for bit, whatever the framing. Requests are split so that
each answer also fits the server's ``max_answer_numbers`` (``.npy``) or ``max_json_answer_numbers``
(JSON). What the server's defences leave of the answers (``value``, ``noisy:TAU``, ``rounded:K``,
``sign``) is ``oracle.server_output``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import sqlite3
import time
from typing import Any

import numpy as np

from ..errors import BudgetExceeded, InvalidQuery, OracleError, SpecError
from .answers import Output, lengths_of
from .base import Oracle

JSON = "application/json"
NPY = "application/x-npy"
FRAMINGS = ("auto", "npy", "sparse", "json")


SPARSE = "application/x-headthief-sparse"
SPARSE_MAGIC = b"HTSPARSE"
SPARSE_HEADER = 40          # magic, then n, N, d and nnz as little-endian uint64
SPARSE_MAX_DENSITY = 0.25   # a batch with at most this fraction of nonzero entries is "sparse"


SMALL_BODY = 1 << 18        # bodies up to this many bytes are joined to their headers and sent at once
_SHORT = {NPY: "npy", SPARSE: "sparse", JSON: "json"}


def sparse_form(A: np.ndarray, max_density: float = SPARSE_MAX_DENSITY) -> "tuple[np.ndarray, np.ndarray] | None":
    """The nonzero entries of a float64 array, ``(flat indices as <u8, values as <f8)`` in row-major
    order, when at most ``max_density`` of its entries are nonzero (1.0: always); else None. "Nonzero"
    means nonzero bits, so ``-0.0`` is kept and the dense array is rebuilt bit for bit."""
    flat = np.ascontiguousarray(A, dtype="<f8").reshape(-1)
    mask = flat.view("<u8") != 0        # (a boolean mask: nonzero() is several times faster on it)
    if np.count_nonzero(mask) > max_density * flat.size:
        return None
    idx = np.flatnonzero(mask).astype("<u8", copy=False)
    return idx, flat[idx]


def sparse_hash(shape, idx: np.ndarray, vals: np.ndarray) -> bytes:
    """:func:`payload_hash` of a sparse batch from its nonzero entries (which must be the
    :func:`sparse_form` of the dense batch: increasing indices, nonzero bits, density at most
    :data:`SPARSE_MAX_DENSITY`)."""
    h = hashlib.sha256(b"S" + np.asarray(shape, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(idx, dtype="<u8"))
    h.update(np.ascontiguousarray(vals, dtype="<f8"))
    return h.digest()[:16]


def payload_hash(X) -> bytes:
    """A hash of a batch that depends only on its sequences' shapes and float64 values (not on how it
    is framed, nor on whether it is one (n, N, d) array or a list of arrays of one shape); the server
    checks an idempotent retry's payload with it too. SHA-256 (hardware-accelerated on most CPUs), the
    first 16 bytes, over the shape and either the nonzero entries (a sparse batch, :func:`sparse_form`:
    a few kilobytes where basis probes fill megabytes) or all the values."""
    if not isinstance(X, np.ndarray):
        shapes = {np.shape(x) for x in X}
        if len(shapes) != 1:        # ragged: every sequence's shape and values
            h = hashlib.sha256(b"R")
            for x in X:
                x = np.ascontiguousarray(x, dtype="<f8")
                h.update(np.asarray(x.shape, dtype="<i8").tobytes())
                h.update(x)
            return h.digest()[:16]
        X = np.stack([np.asarray(x, dtype=np.float64) for x in X])     # one shape: the same as the stacked array
    sp = sparse_form(X)
    if sp is not None:
        return sparse_hash(X.shape, *sp)
    h = hashlib.sha256(b"U" + np.asarray(X.shape, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(X, dtype="<f8"))
    return h.digest()[:16]


def sparse_parts(shape, idx: np.ndarray, vals: np.ndarray) -> tuple:
    """The body of a sparse request as bytes-like parts (no copies of the two arrays):
    ``HTSPARSE``, n, N, d, nnz (little-endian uint64), the nnz flat row-major indices (<u8, increasing)
    and the nnz values (<f8)."""
    head = SPARSE_MAGIC + np.asarray([*shape, len(idx)], dtype="<u8").tobytes()
    return head, memoryview(np.ascontiguousarray(idx, dtype="<u8")).cast("B"), \
        memoryview(np.ascontiguousarray(vals, dtype="<f8")).cast("B")


def output_tolerance(output: str) -> float:
    """The tolerance of answers published as ``noisy:TAU`` (TAU) or ``rounded:K`` (``0.5 * 10**-K``);
    0 for ``value`` and ``sign``."""
    from .tolerance import round_tolerance
    kind, _, arg = output.partition(":")
    try:
        if kind == "noisy":
            return float(arg)
        if kind == "rounded":
            return round_tolerance(int(arg))
    except ValueError:
        raise OracleError(f"the server publishes its answers as {output!r}, which names no tolerance") from None
    return 0.0


def _journal_run_id(transcript) -> str | None:
    """The run id stored in a journal (made and stored on first use), or None if it is not a journal."""
    path = getattr(transcript, "path", None)
    if path is None or not hasattr(transcript, "fingerprint"):
        return None
    try:
        with sqlite3.connect(str(path), timeout=30) as db:
            db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('http_run_id', ?)", (os.urandom(16).hex(),))
            return str(db.execute("SELECT value FROM meta WHERE key = 'http_run_id'").fetchone()[0])
    except sqlite3.Error as e:
        raise OracleError(f"journal {path}: cannot store the run id ({e})") from None


class _Response:
    """What :class:`_Connection` answers: status, headers (lower-case names), body."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status: int, headers: dict[str, str], content: bytes):
        self.status_code, self.headers, self.content = status, headers, content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)


class TransportError(OSError):
    """The request got no HTTP answer (refused, reset, timed out, closed mid-answer)."""


class _Connection:
    """One keep-alive HTTP/1.1 connection to ``url`` (http:// or https://), reopened when it breaks."""

    def __init__(self, url: str, timeout: float):
        from urllib.parse import urlsplit
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SpecError(f"the server URL must be http://HOST:PORT or https://HOST:PORT, got {url!r}")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.hostport = parts.netloc.rsplit("@", 1)[-1]
        self.timeout = timeout
        self._conn = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _open(self):
        import http.client
        if self._conn is not None:
            sock = self._conn.sock
            if sock is not None:
                import select
                try:    # the server closed an idle keep-alive connection: open a new one before sending
                    if select.select([sock], [], [], 0)[0]:
                        self.close()
                except (OSError, ValueError):
                    self.close()
        if self._conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = cls(self.host, self.port, timeout=self.timeout)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn = conn
        return self._conn

    def request(self, method: str, path: str, headers: dict[str, str], parts=()) -> _Response:
        """Send the request (the body is ``parts``, bytes-like objects sent one after the other) and read
        the whole answer; :class:`TransportError` when no complete answer came."""
        import http.client
        try:
            conn = self._open()
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            conn.putheader("Host", self.hostport)
            for k, v in headers.items():
                conn.putheader(k, v)
            size = sum(memoryview(p).nbytes for p in parts)
            if method == "POST":
                conn.putheader("Content-Length", str(size))
            if size <= SMALL_BODY:      # headers and body in one send (one system call, one packet)
                conn.endheaders(b"".join(parts) if parts else None)
            else:                       # a large body is sent from its own buffers, not copied
                conn.endheaders()
                for p in parts:
                    conn.sock.sendall(p)
            r = conn.getresponse()
            content = r.read()
            status, hdrs = r.status, {k.lower(): v for k, v in r.getheaders()}
            if r.will_close:
                self.close()
            return _Response(status, hdrs, content)
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise TransportError(f"{type(e).__name__}: {e}") from None


class HTTPOracle(Oracle):
    """Value queries to a ``headthief serve`` API (or any server that speaks its protocol).

    Args:
        url: the server, ``http://HOST:PORT``.
        api_key: the key (``headthief keys add``); default: the ``HEADTHIEF_API_KEY`` environment variable.
        framing: ``"auto"`` (default: per request the sparse binary framing when at most a quarter of
            the batch's entries are nonzero, else ``.npy``), ``"npy"`` (always dense ``.npy``),
            ``"sparse"`` (always sparse) or ``"json"``.
        run_id: names the run in every idempotency key; default: stored in the journal when there is
            one, else random per oracle.
        timeout: seconds for one request.
        retries: the most attempts per request after transport errors, 5xx and 409.
        backoff: the first wait after a failed attempt (doubling up to ``max_backoff`` seconds).
        max_wait: the most seconds in all spent waiting out 429s before giving up.
        connect_wait: the most seconds to wait for the server to answer its first request (``/v1/info``):
            a refused connection or a 5xx is retried with the same backoff (at most 1 s apart) until
            then, so ``headthief serve ... &`` followed at once by ``extract`` works. Default 30; the
            ``HEADTHIEF_CONNECT_WAIT`` environment variable or the target option ``connect_wait=S``
            changes it.
        client: a transport with ``request(method, path, headers, parts)`` (tests); default one
            keep-alive :mod:`http.client` connection.
        **kw: budget / transcript / input_norm of the oracle itself (input_norm defaults to the server's).
    """

    def __init__(self, url: str, *, api_key: str | None = None, framing: str = "auto", run_id: str | None = None,
                 timeout: float = 120.0, retries: int = 12, backoff: float = 0.05, max_backoff: float = 5.0,
                 max_wait: float = 600.0, connect_wait: float | None = None, client=None, **kw):
        if framing not in FRAMINGS:
            raise SpecError(f"framing={framing!r}: use {', '.join(FRAMINGS)}")
        if retries < 1:
            raise ValueError(f"retries must be >= 1, got {retries}")
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("HEADTHIEF_API_KEY")
        self.framing = framing
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.max_wait = float(max_wait)
        if connect_wait is None:
            env = os.environ.get("HEADTHIEF_CONNECT_WAIT")
            try:
                connect_wait = float(env) if env else 30.0
            except ValueError:
                raise SpecError(f"HEADTHIEF_CONNECT_WAIT={env!r} is not a number of seconds") from None
        if not (connect_wait >= 0 and connect_wait < float("inf")):
            raise SpecError(f"connect_wait must be a number of seconds >= 0, got {connect_wait}")
        self.connect_wait = float(connect_wait)
        self._http = client or _Connection(self.url, timeout)
        self.requests = 0          # HTTP query requests answered 200
        self.retried = 0           # attempts repeated after a transport error, 5xx or 409
        self.rate_waits = 0        # 429s waited out
        self.waited = 0.0          # seconds spent waiting (backoff and Retry-After)
        self.server_replays = 0    # requests the server answered from its ledger (free)
        self.sent: dict[str, int] = {}     # requests sent (attempts included) per framing (npy, sparse, json)
        self.sent_bytes = 0        # request body bytes sent (attempts included)
        self.received_bytes = 0    # answer body bytes received (answers 200)
        self.received_numbers = 0  # numbers in the answers received (answers 200, the server's replays included)
        self.info = self._get_info()
        accepted = self.info.get("framings", [JSON, NPY])
        if framing == "auto" and SPARSE not in accepted:
            framing = "npy"         # an older server: dense .npy only
        wanted = {"json": JSON, "npy": NPY, "sparse": SPARSE}.get(framing)
        if wanted is not None and wanted not in accepted:
            raise SpecError(f"{self.url} does not accept framing={framing} ({wanted}); it accepts {', '.join(accepted)}")
        self.framing = framing
        if kw.get("input_norm") is None and self.info.get("input_norm") is not None:
            kw["input_norm"] = float(self.info["input_norm"])
        # what the answers are, as the server publishes them for this key (its defences may be laid over
        # the server's): the model check and the noisy method read the tolerance from here
        published = str(self.info.get("output") or "value")
        if self.api_key:
            try:
                published = str(self.usage().get("output") or published)
            except OracleError:
                pass            # a bad key: the first query says so
        self.server_output = published
        output, d_out = self._answer_kind(published)
        for k, mine in (("output", output), ("d_out", d_out)):
            asked = kw.pop(k, None)
            if asked is not None and (Output.parse(asked) if k == "output" else int(asked)) != mine:
                raise SpecError(f"{self.url} answers {output.describe(d_out)}; {k}={asked} was asked for")
        super().__init__(int(self.info["d"]), output=output, d_out=d_out, **kw)
        self.max_batch = int(self.info.get("max_batch", 1024))
        self.max_len = int(self.info.get("max_len", 4096))
        self.max_body = int(self.info.get("max_body_bytes", 2**26))
        self.max_json = int(self.info.get("max_json_bytes", self.max_body))     # older servers: one limit
        self.max_answer = int(self.info.get("max_answer_numbers") or self.max_body // 8)
        self.max_json_answer = int(self.info.get("max_json_answer_numbers") or self.max_json // 24)
        self.run_id = run_id or _journal_run_id(self.transcript) or os.urandom(16).hex()
        self.answer_tau, self.answer_sign = output_tolerance(published), published == "sign"

    def _answer_kind(self, published: str) -> "tuple[Output, int | None]":
        """This oracle's answer kind and d_out from ``/v1/info`` (``answer_kind``, ``d_out``; a server
        without them answers values) and the key's published output (``sign``: bits)."""
        try:
            kind = Output.parse(self.info.get("answer_kind") or "value")
        except ValueError as e:
            raise OracleError(f"{self.url}/v1/info: {e}") from None
        if not kind.vector:
            return (Output.SIGN if published == "sign" else kind), None
        try:
            d_out = int(self.info.get("d_out") or self.info["d"])
        except (TypeError, ValueError):
            raise OracleError(f"{self.url}/v1/info publishes answer_kind={kind.value} without a valid d_out "
                              f"({self.info.get('d_out')!r})") from None
        if d_out < 1:
            raise OracleError(f"{self.url}/v1/info publishes d_out={d_out}; it must be >= 1")
        if published == "sign":
            raise OracleError(f"{self.url} answers {kind.describe(d_out)}, but publishes sign-only answers for this "
                              "key, which a vector answer cannot be")
        return kind, d_out

    def _settings(self) -> str:
        return f"{self.url!r}, framing={self.framing!r}, " + super()._settings()

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- transport ----------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _sleep(self, seconds: float) -> None:
        self.waited += seconds
        time.sleep(seconds)

    def _get_info(self) -> dict[str, Any]:
        """``GET /v1/info``, waiting up to ``connect_wait`` seconds for a server that is still starting."""
        last = ""
        deadline = time.monotonic() + self.connect_wait
        attempt = 0
        while True:
            try:
                r = self._http.request("GET", "/v1/info", {"Accept": JSON})
            except TransportError as e:
                last = str(e)
            else:
                if r.status_code == 200:
                    try:
                        info = r.json()
                        int(info["d"])
                    except (ValueError, KeyError, TypeError):
                        raise OracleError(f"{self.url}/v1/info did not return a headthief info document") from None
                    return info
                if r.status_code < 500:
                    raise OracleError(f"{self.url}/v1/info answered {r.status_code}: {r.text[:200]}")
                last = f"HTTP {r.status_code}"
            attempt += 1
            left = deadline - time.monotonic()
            if left <= 0 or attempt >= 10_000:
                raise OracleError(f"no answer from {self.url}/v1/info after {attempt} attempts in "
                                  f"{self.connect_wait:g} s ({last}); is `headthief serve` running there? "
                                  "(HEADTHIEF_CONNECT_WAIT=S waits longer)")
            self._sleep(min(left, 1.0, self.max_backoff, self.backoff * 2 ** (attempt - 1)))

    def usage(self) -> dict[str, Any]:
        """This key's budget and queries used, as the server counts them (``GET /v1/usage``)."""
        try:
            r = self._http.request("GET", "/v1/usage", {**self._headers(), "Accept": JSON})
        except TransportError as e:
            raise OracleError(f"{self.url}/v1/usage: no answer ({e})") from None
        if r.status_code != 200:
            raise OracleError(f"{self.url}/v1/usage answered {r.status_code}: {r.text[:200]}")
        return r.json()

    def stats(self) -> dict[str, Any]:
        """What the transport did: requests answered, attempts repeated, 429s waited out, answers the
        server replayed from its ledger, bytes sent, requests sent per framing, and the answers received
        (bytes, and numbers: one per sequence for values, ``d_out`` per answered vector)."""
        return {"requests": self.requests, "retried": self.retried, "rate_waits": self.rate_waits,
                "waited_s": round(self.waited, 3), "server_replays": self.server_replays,
                "sent_bytes": self.sent_bytes, "sent": dict(self.sent), "received_bytes": self.received_bytes,
                "numbers_received": self.received_numbers}

    # -- queries ------------------------------------------------------------------------------------

    def _answer_numbers(self, N: int) -> int:
        """Numbers in the answer to one sequence of N tokens."""
        if not self.output.vector:
            return 1
        return (N if self.output is Output.ALL else 1) * int(self.d_out)

    def _per_request(self, N: int) -> int:
        per_seq = N * self.d * {"json": 26, "sparse": 16}.get(self.framing, 8) + 16
        limit = self.max_json if self.framing == "json" else self.max_body
        step = max(1, min(self.max_batch, (limit - 1024) // per_seq))
        if self.output.vector:      # the answer must fit too: d_out numbers per sequence (last) or token (all)
            most = self.max_json_answer if self.framing == "json" else self.max_answer
            step = max(1, min(step, most // self._answer_numbers(N)))
        return step

    def _query(self, X) -> np.ndarray:
        seqs = X if isinstance(X, np.ndarray) else X
        n = int(X.shape[0]) if isinstance(X, np.ndarray) else len(X)
        lengths = np.array([X.shape[1]] * n if isinstance(X, np.ndarray) else [x.shape[0] for x in X])
        if lengths.max() > self.max_len:
            raise InvalidQuery(f"a sequence has {int(lengths.max())} tokens; the server accepts at most {self.max_len}")
        if self.output.vector:
            most = self.max_json_answer if self.framing == "json" else self.max_answer
            one = self._answer_numbers(int(lengths.max()))
            if one > most:
                raise InvalidQuery(f"the answer to a sequence of {int(lengths.max())} tokens holds {one} numbers; the "
                                   f"server sends at most {most} in one {'JSON' if self.framing == 'json' else '.npy'} "
                                   "answer" + (" (framing=npy sends larger ones)" if self.framing == "json" else ""))
        if self.framing != "json" and not isinstance(X, np.ndarray):
            groups = [np.flatnonzero(lengths == N) for N in sorted(set(lengths.tolist()))]
        else:
            groups = [np.arange(n)]
        # the answers, unpacked as a local oracle of this kind gives them (Oracle.query packs them again)
        if self.output is Output.ALL:
            y = np.empty((n, X.shape[1], self.d_out)) if isinstance(X, np.ndarray) else [None] * n
        elif self.output.vector:
            y = np.empty((n, self.d_out))
        else:
            y = np.empty(n)
        for idx in groups:
            step = self._per_request(int(lengths[idx].max()))
            for s in range(0, len(idx), step):
                part = idx[s:s + step]
                if isinstance(seqs, np.ndarray):
                    chunk = seqs[part[0]:part[-1] + 1] if len(groups) == 1 else seqs[part]
                else:
                    chunk = [seqs[i] for i in part]
                ans = self._send(chunk)
                if self.output is not Output.ALL:
                    y[part] = ans
                elif isinstance(y, np.ndarray):
                    y[part] = ans.reshape(len(part), X.shape[1], self.d_out)
                else:
                    for i, a in zip(part, np.split(ans, np.cumsum(lengths[part])[:-1], axis=0)):
                        y[i] = a
        return y

    def _send(self, chunk) -> np.ndarray:
        n = int(chunk.shape[0]) if isinstance(chunk, np.ndarray) else len(chunk)
        if self.framing != "json":
            A = np.ascontiguousarray(chunk if isinstance(chunk, np.ndarray) else np.stack(chunk), dtype="<f8")
            sp = sparse_form(A) if self.framing != "npy" else None
            # the hash reads the batch once: its nonzero entries when sparse, else all of it
            ph = sparse_hash(A.shape, *sp) if sp is not None else payload_hash(A)
            if sp is None and self.framing == "sparse":      # forced on a dense batch
                sp = sparse_form(A, max_density=1.0)
            if sp is not None:      # a few kilobytes where basis probes fill megabytes
                parts, ctype = sparse_parts(A.shape, *sp), SPARSE
            else:                   # the .npy header and then A's own buffer (not copied)
                parts, ctype = (npy_header(A.shape), memoryview(A).cast("B")), NPY
        else:
            parts = (json.dumps({"sequences": [np.asarray(x).tolist() for x in chunk]},
                                separators=(",", ":")).encode(),)
            ctype = JSON
            ph = payload_hash(chunk)
        idem = hashlib.blake2b(self.run_id.encode() + ph, digest_size=20).hexdigest()
        headers = {**self._headers(), "Idempotency-Key": idem, "Content-Type": ctype,
                   "Accept": JSON if ctype == JSON else NPY}
        name = _SHORT[ctype]
        self.sent[name] = self.sent.get(name, 0) + 1
        self.sent_bytes += sum(memoryview(p).nbytes for p in parts)
        last = ""
        attempt = 0
        rate_waited = 0.0
        while True:
            try:
                r = self._http.request("POST", "/v1/query", headers, parts)
            except TransportError as e:
                last, status = str(e), None
            else:
                status = r.status_code
                if status == 200:
                    self.requests += 1
                    return self._parse(r, chunk)
                last = f"HTTP {status}: {self._detail(r)}"
                if status == 429:
                    wait = self._retry_after(r, 1.0)
                    if rate_waited + wait > self.max_wait:
                        raise OracleError(f"{self.url}: still rate limited after waiting {rate_waited:.0f} s "
                                          f"(the most is {self.max_wait:.0f} s): {last}")
                    rate_waited += wait
                    self.rate_waits += 1
                    self._sleep(wait)
                    continue
                if status < 500 and (status != 409 or self._error_code(r) == "idempotency_key_reused"):
                    self._raise(r, status, n)
            attempt += 1
            if attempt >= self.retries:
                raise OracleError(f"no answer from {self.url} after {attempt} attempts (last: {last}); the answers "
                                  "paid for are kept by the server under this run's idempotency keys")
            self.retried += 1
            wait = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
            if status == 409:
                wait = max(wait, self._retry_after(r, wait))
            self._sleep(wait)

    @staticmethod
    def _retry_after(r, default: float) -> float:
        try:
            return max(0.0, float(r.headers.get("retry-after", default)))
        except ValueError:
            return default

    @staticmethod
    def _error_code(r) -> str:
        try:
            doc = r.json()
        except ValueError:
            return ""
        return str(doc.get("error", "")) if isinstance(doc, dict) else ""

    @staticmethod
    def _detail(r) -> str:
        try:
            doc = r.json()
            return str(doc.get("detail", doc))
        except ValueError:
            return r.text[:300]

    def _parse(self, r, chunk) -> np.ndarray:
        """The answers of a 200 response to ``chunk``, packed (values: (n,); vectors: one row per vector)."""
        n = int(chunk.shape[0]) if isinstance(chunk, np.ndarray) else len(chunk)
        ctype = (r.headers.get("content-type") or "").split(";")[0].strip()
        try:
            if ctype == NPY:
                y = _npy_fast(r.content)
                if y is None:
                    y = np.load(io.BytesIO(r.content), allow_pickle=False)
                y = np.asarray(y, dtype=np.float64)
                replayed = r.headers.get("x-headthief-replayed") == "true"
            else:
                doc = r.json()
                values = doc["values"]
                replayed = bool(doc.get("replayed"))
                y = None if self.output is Output.ALL else np.asarray(values, dtype=np.float64)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise OracleError(f"{self.url} sent an answer that does not decode ({e})") from None
        if replayed:
            self.server_replays += 1
        self.received_bytes += len(r.content)
        if not self.output.vector:
            if y.shape != (n,):
                raise OracleError(f"{self.url} sent {y.size} values for {n} sequences")
        elif self.output is Output.LAST:
            if y.shape != (n, self.d_out):
                raise OracleError(f"{self.url} sent answers of shape {y.shape} for {n} sequences; expected one "
                                  f"{self.d_out}-vector each, ({n}, {self.d_out})")
        else:
            y = self._rows(y if ctype == NPY else values, chunk, r.headers.get("x-headthief-lengths"))
        self.received_numbers += int(y.size)
        return y

    def _rows(self, ans, chunk, lengths_header: str | None) -> np.ndarray:
        """``all`` answers as the packed (sum N_i, d_out) rows, checked against the chunk's lengths: an
        (n, N, d_out) array, packed rows with the ``X-Headthief-Lengths`` header, or (JSON) one list of
        N_i vectors per sequence."""
        lens, d_out = lengths_of(chunk), int(self.d_out)
        n = len(lens)
        bad = f"{self.url} sent answers that do not fit {n} sequences of lengths {sorted(set(lens.tolist()))}"
        if isinstance(ans, np.ndarray):
            if ans.ndim == 3 and ans.shape[0] == n and ans.shape[2] == d_out and np.all(lens == ans.shape[1]):
                return ans.reshape(-1, d_out)
            if ans.ndim == 2 and ans.shape == (int(lens.sum()), d_out):
                sent = None
                if lengths_header is not None:
                    try:
                        sent = [int(k) for k in lengths_header.split(",")]
                    except ValueError:
                        sent = None
                if sent is not None and sent == lens.tolist():
                    return ans
            raise OracleError(f"{bad} (an array of shape {ans.shape}, lengths {lengths_header!r}), "
                              f"each a ({'N_i'}, {d_out}) block")
        try:
            if len(ans) != n:
                raise ValueError(f"{len(ans)} answers")
            A = None
            if n and np.all(lens == lens[0]):
                try:
                    A = np.asarray(ans, dtype=np.float64)
                except ValueError:
                    A = None
            if A is not None:
                if A.shape != (n, int(lens[0]), d_out):
                    raise ValueError(f"shape {A.shape}")
                return A.reshape(-1, d_out)
            parts = [np.asarray(a, dtype=np.float64) for a in ans]
            for i, (p, N) in enumerate(zip(parts, lens)):
                if p.shape != (N, d_out):
                    raise ValueError(f"answer {i} has shape {p.shape}, not ({N}, {d_out})")
            return np.concatenate(parts, axis=0) if parts else np.zeros((0, d_out))
        except (ValueError, TypeError) as e:
            raise OracleError(f"{bad}: {e}") from None

    def _raise(self, r, status: int, n: int):
        try:
            doc = r.json()
        except ValueError:
            doc = {}
        detail = doc.get("detail") or r.text[:300]
        if status == 401:
            raise SpecError(f"{self.url} refused the API key (401: {detail}); give a key with --api-key or "
                            "HEADTHIEF_API_KEY (make one with `headthief keys add`)")
        if status == 403 and doc.get("error") == "budget_exceeded":
            raise BudgetExceeded(int(doc.get("spent", 0)), int(doc.get("budget", 0)), int(doc.get("requested", n)))
        if status in (400, 413, 415, 422):
            raise InvalidQuery(f"{self.url} refused the batch ({status}): {detail}")
        if status == 409:       # idempotency_key_reused: another batch under this run's key (a hash collision?)
            raise OracleError(f"{self.url} refused the batch ({status}): {detail}")
        raise OracleError(f"{self.url} refused the batch ({status}): {detail}")


def npy_header(shape) -> bytes:
    """The ``.npy`` (version 1.0) header of a C-ordered little-endian float64 array of ``shape``:
    ``header + array.data`` is the file :func:`numpy.save` writes, without copying the array."""
    d = "{'descr': '<f8', 'fortran_order': False, 'shape': %r, }" % (tuple(int(k) for k in shape),)
    d += " " * ((-(10 + len(d) + 1)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(d).to_bytes(2, "little") + d.encode("latin1")


def _npy_fast(content: bytes) -> np.ndarray | None:
    """The answer as :func:`encode_npy` writes it (a C-ordered ``<f8`` array of any number of
    dimensions, version 1.0 header), read without a file object; None for anything else (then
    :func:`numpy.load` reads it)."""
    if len(content) < 10 or content[:8] != b"\x93NUMPY\x01\x00":
        return None
    end = 10 + int.from_bytes(content[8:10], "little")
    head = content[10:end]
    if not head.startswith(b"{'descr': '<f8', 'fortran_order': False, 'shape': (") or not head.rstrip().endswith(b"), }"):
        return None
    dims = head[head.index(b"(") + 1:head.rindex(b")")].split(b",")
    if dims and not dims[-1].strip():
        dims = dims[:-1]            # (n,) and (n, N, d,): a trailing comma
    if not dims or not all(k.strip().isdigit() for k in dims):
        return None
    shape = tuple(int(k) for k in dims)
    count = int(np.prod(shape))
    if len(content) - end != 8 * count:
        return None
    return np.frombuffer(content, dtype="<f8", count=count, offset=end).reshape(shape).copy()


def _npy_fast_1d(content: bytes) -> np.ndarray | None:
    """:func:`_npy_fast` for a 1-D answer (one value per sequence) only; None for anything else."""
    y = _npy_fast(content)
    return y if y is not None and y.ndim == 1 else None
