"""The HTTP API (FastAPI): ``GET /v1/info``, ``POST /v1/query``, ``GET /v1/usage``; OpenAPI at ``/openapi.json``.

``POST /v1/query`` handles a request in this order, answering the first problem it finds:

1. a body above ``max_body_bytes`` (by its ``Content-Length``, or as soon as it grows past it): not
   held. A binary one: **413** at once, unread. A JSON one from a known key (else **401**) is counted as
   it streams by, in constant memory (:class:`~headthief.server.framing.BatchScan`): **422** as soon as
   it shows more than ``max_batch`` sequences (or, at its end, a sequence of more than ``max_len``
   tokens), else **413** (at most ``SCAN_FACTOR * max_body_bytes`` bytes are read: past that, **413**);
2. ``Authorization: Bearer KEY`` names a known, unrevoked key, else **401**;
3. an ``Idempotency-Key`` header, if sent, has 1 to 255 characters, else **400**; without one the
   request is answered and charged every time it is sent (``--require-idempotency``: **400**);
4. the content type is JSON, ``application/x-npy`` or ``application/x-headthief-sparse``, else **415**;
   a JSON body above ``max_json_bytes`` is not parsed: **422** if its brackets and commas show more
   than ``max_batch`` elements or ``max_len`` in one (:class:`~headthief.server.framing.BatchScan`),
   else **413**; the body decodes into sequences of the published dimension, every entry finite and
   every token within the input-norm bound, at most ``max_batch`` sequences of at most ``max_len``
   tokens, else **422** naming the problem; its answer fits one answer body (``max_answer_numbers``
   numbers as ``.npy``, ``max_json_answer_numbers`` as JSON; never fewer than ``max_batch``), else
   **422** (``error: answer_too_large``): a vector target's answers are ``d_out`` numbers per sequence
   (``last``) or per token (``all``); a key whose own defences ask for sign-only answers from a vector
   target: **403** (``error: defence_unsupported``);
5. the key's rate limit has a request left, else **429** with ``Retry-After``;
6. the key is not refused by the query-distribution detector, else **403** (``error: flagged``);
7. the idempotency key: already charged with the same payload: the stored response again, free;
   with another payload: **409** (``error: idempotency_key_reused``); still being computed: **409**
   (``error: in_flight``, with ``Retry-After``);
8. the budget covers the batch, else **403** (``error: budget_exceeded``, with ``spent`` and ``budget``);
9. the answers are computed, charged and stored in one transaction (see
   :mod:`headthief.server.accounts`), then sent.

Answers: ``/v1/info`` publishes their kind (``answer_kind``: ``value``, one number per sequence, or
``last`` / ``all``, a ``d_out``-vector at the last / every position) and ``d_out``; ``output`` says
what the defences leave of them (``value``, ``noisy:TAU`` and ``rounded:K``, per coordinate for
vectors, or ``sign``, refused at start for a vector target). One query is one sequence whatever the
kind: budgets, the ledger and idempotency count sequences.

The published (and enforced) ``max_batch`` and ``max_len`` are fitted to the byte limit
(:func:`fit_limits`: a full batch, and its answer, fits ``max_body_bytes`` as float64), so a batch just beyond them in
any framing is small enough to read and is answered 422, never 413; 413 is left for bodies that are
merely too many bytes (long decimals, whitespace, or a JSON batch within the limits above
``max_json_bytes``: send it as ``.npy``).

Memory: a request holds its body (at most ``max_body_bytes``; an ``.npy`` body is decoded in place),
and parsing a JSON body costs about ten times its size in Python objects, so JSON bodies are parsed
only up to ``max_json_bytes`` (8 MiB), and those over :data:`LARGE_JSON` one at a time; at most
:data:`LARGE_BODIES` bodies over :data:`LARGE_BODY` are held at once (the others wait, unread, in
their sockets).
"""


import math
import secrets
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from .. import __version__
from ..errors import InvalidQuery, OracleError
from ..oracles.answers import Output, lengths_of, numbers_of
from ..oracles.http import payload_hash
from .accounts import Accounts, KeyRecord
from .defences import D_MAX, Defence, Prada, parse_defence
from .framing import (ANSWERS, FRAMINGS, JSON, NPY, SPARSE, BatchScan, FramingError, decode, encode_json,
                      encode_npy, json_batch_excess, media_type)

MAX_BODY_BYTES = 64 * 2**20     # binary bodies (.npy, sparse): viewed in place, about their own size in memory
MAX_JSON_BYTES = 8 * 2**20      # JSON bodies: parsing costs about 10x the text in Python objects
LARGE_BODY = 2**20              # a body above this many bytes takes one of LARGE_BODIES slots while it is held
LARGE_BODIES = 4
LARGE_JSON = 2**20              # JSON bodies above this size are parsed one at a time
SCAN_FACTOR = 8                 # JSON above max_body_bytes: counted as it streams by, for at most this many limits
QUERY_THREADS = 40          # query requests computed at once (as many as Starlette's default thread pool)
MAX_IDEM_KEY = 255
AUTO_KEY_PREFIX = "auto:"      # + 128 random bits: the ledger key of a request sent without an Idempotency-Key
MAX_ABS_ENTRY = 1e100     # larger entries overflow the head's scores (x^T W x) in float64: refused, 422
MIN_FIT_LEN = 32          # fit_limits shortens max_len first, but not below this (verification probes: 1..32 tokens)
JSON_NUMBER_BYTES = 24    # a float64 in JSON: up to 17 digits, sign, point, exponent, separator ("-1.2345678901234567e-05,")


def fit_limits(max_batch: int, max_len: int, d: int, max_body_bytes: int, *, d_out: int | None = None,
               output: str = "value") -> tuple[int, int]:
    """The batch limits a server publishes and enforces: ``max_batch`` sequences of ``max_len`` tokens,
    lowered where needed so that a full batch fits the byte limit as float64
    (``max_batch * max_len * d * 8 <= max_body_bytes``, what an ``.npy`` or sparse body may hold).

    Vector answers (``output`` ``last`` or ``all``, of dimension ``d_out``) must fit it too, as an
    ``.npy`` answer: ``all`` answers ``d_out`` numbers per token, so a token counts ``max(d, d_out)``
    float64s; ``last`` answers ``d_out`` numbers per sequence, so ``max_batch * d_out * 8 <=
    max_body_bytes`` as well.

    Without this the published limits are promises the server cannot keep together (the defaults, 4096
    sequences of 4096 tokens at d = 64, are 8.6 GB as ``.npy``), and a batch one sequence beyond them
    is hundreds of MB to GB that the server refuses unread (413) instead of naming the excess (422):
    Schemathesis builds such a batch from the schema's ``maxItems``. Fitted, a batch of ``max_batch
    + 1`` sequences of up to ``max_len`` tokens is at most about one byte limit of JSON (~5 bytes a
    number, against 8 for float64), so it is read and answered 422. ``max_len`` is lowered first (to
    ``max(MIN_FIT_LEN, fit)``: extraction sends many short sequences), then ``max_batch``; limits that
    already fit are kept as given."""
    width = int(d)
    if output == "all" and d_out:
        width = max(width, int(d_out))                      # the answer holds a d_out-vector per token
    if output == "last" and d_out:
        max_batch = max(1, min(max_batch, int(max_body_bytes) // (8 * int(d_out))))    # a d_out-vector per sequence
    cap = max(1, int(max_body_bytes) // (8 * width))      # tokens a body (and its answer) of max_body_bytes holds
    if max_batch * max_len <= cap:
        return max_batch, max_len
    max_len = max(1, min(max_len, max(MIN_FIT_LEN, cap // max_batch), cap))
    return max(1, min(max_batch, cap // max_len)), max_len


def check_defence(target, defence: Defence, whose: str = "the server's") -> None:
    """Refuse defences that do not fit the target's answer kind (SpecError): sign-only output keeps one
    bit of one number per sequence, which a vector answer does not have (noise and rounding apply per
    coordinate)."""
    kind = Output.parse(getattr(target, "output", None) or "value")
    if defence.sign and kind.vector:
        from ..errors import SpecError
        d_out = int(getattr(target, "d_out", None) or target.d)
        raise SpecError(f"{whose} defences ask for sign-only answers (one bit per sequence), but the target "
                        f"{target.spec} answers {kind.describe(d_out)}: sign-only output is refused for vector "
                        "targets (noise and rounding apply per coordinate)")


class _Oversized(Exception):
    """A body without a Content-Length grew past ``max_body_bytes``: what was read of it (``head``, buffers in
    order, not copied)."""

    def __init__(self, *head):
        super().__init__(sum(len(b) for b in head))
        self.head = head


class Problem(Exception):
    """An HTTP error answer: status, a machine-readable code, a message naming the problem, extras."""

    def __init__(self, status: int, error: str, detail: str, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra


class Service:
    """Everything the API does, without HTTP: the target, the accounts, the defences, the detectors.

    Args:
        target: the target to serve: a spec (``random:d=64,seed=1``, ...; see ``headthief targets``) or a
            resolved :class:`~headthief.targets.Target` (``py:`` targets need ``d``:
            :func:`headthief.cli.target_options.target_from_args`).
        db: the accounts database (see :class:`~headthief.server.accounts.Accounts`).
        defence: the server-wide defence; a key's own defence is laid over it.
        max_body_bytes: the largest binary (``.npy``, sparse) request body accepted.
        max_json_bytes: the largest JSON request body accepted (parsing JSON costs about ten times its
            size in memory; default 8 MiB).
        sync: the ledger's durability, ``"full"`` (default) or ``"normal"`` (see
            :class:`~headthief.server.accounts.Accounts`).
        require_idempotency: refuse (400) a query without an ``Idempotency-Key``; by default such a
            query is answered and charged every time it is sent.
    """

    def __init__(self, target, db, *, defence: Defence | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 max_json_bytes: int = MAX_JSON_BYTES, sync: str = "full", require_idempotency: bool = False):
        from ..errors import SpecError
        spec = target if isinstance(target, str) else target.spec
        if spec.startswith(("http://", "https://")):
            raise SpecError("serving an http:// target would proxy another server; serve a local target")
        if isinstance(target, str):
            from ..targets import resolve
            target = resolve(target)
        self.target = target
        # the answer kind: one number per sequence (value), or vectors (last, all) of dimension d_out
        self.kind = Output.parse(getattr(target, "output", None) or "value")
        self.d_out = int(getattr(target, "d_out", None) or target.d) if self.kind.vector else None
        if int(max_body_bytes) < 1 or int(max_json_bytes) < 1:
            raise SpecError(f"the body limits must be >= 1 byte, got max_body_bytes={max_body_bytes}, "
                            f"max_json_bytes={max_json_bytes}")
        self.max_body_bytes = int(max_body_bytes)
        self.max_json_bytes = int(max_json_bytes)
        self.require_idempotency = bool(require_idempotency)
        self.defence = self._fit(defence or Defence())
        self._check_defence(self.defence, "the server's")      # before the database is opened (or made)
        self.accounts = db if isinstance(db, Accounts) else Accounts(db, sync=sync)
        self._oracles: dict[Defence, Any] = {}
        self._prada: dict[int, Prada] = {}
        self._prada_lock = threading.Lock()
        self._pool = None
        self._workers = None
        self._json_gate = threading.Semaphore(1)     # large JSON bodies are parsed one at a time (memory)

    def _hasher(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="headthief-hash")
        return self._pool

    def _detector(self, rec: KeyRecord, defence: Defence) -> Prada:
        """The key's PRADA detector, restored from the database the first time this process sees it."""
        det = self._prada.get(rec.id)
        if det is None:
            with self._prada_lock:
                det = self._prada.get(rec.id)
                if det is None:
                    det = Prada(defence.prada_delta, defence.prada_min)
                    det.restore(*self.accounts.prada_state(rec.id, D_MAX))
                    det.base = self.accounts.get(rec.id).used   # queries paid before this process saw any
                    self._prada[rec.id] = det
        return det

    def workers(self):
        """The threads that answer query requests (blocking work: SQLite, the model) off the event loop."""
        if self._workers is None:
            from concurrent.futures import ThreadPoolExecutor
            self._workers = ThreadPoolExecutor(max_workers=QUERY_THREADS, thread_name_prefix="headthief-query")
        return self._workers

    def __repr__(self) -> str:
        return f"Service({self.target.spec!r}, {self.accounts!r}, defence={self.defence.settings()})"

    def _fit(self, defence: Defence) -> Defence:
        """``defence`` with its batch limits fitted to the byte limit (:func:`fit_limits`), answers included."""
        from dataclasses import replace
        b, n = fit_limits(defence.max_batch, defence.max_len, self.target.d, self.max_body_bytes, d_out=self.d_out,
                          output=self.kind.value)
        return defence if (b, n) == (defence.max_batch, defence.max_len) else replace(defence, max_batch=b, max_len=n)

    def _check_defence(self, defence: Defence, whose: str) -> None:
        check_defence(self.target, defence, whose)

    def answer_limit(self, mt: str, defence: Defence) -> int:
        """The most numbers one answer may hold in the media type ``mt``: what an ``.npy`` of
        ``max_body_bytes`` holds, or for JSON about ``max_json_bytes`` of text
        (:data:`JSON_NUMBER_BYTES` a number; building it costs several times that in Python objects), but
        never fewer than ``max_batch`` (a value answer is always within it)."""
        if mt == NPY:
            return max(defence.max_batch, self.max_body_bytes // 8)
        return max(defence.max_batch, self.max_json_bytes // JSON_NUMBER_BYTES)

    def defence_for(self, rec: KeyRecord) -> Defence:
        return self._fit(parse_defence(rec.defence, self.defence)) if rec.defence else self.defence

    def oracle_for(self, defence: Defence):
        o = self._oracles.get(defence)
        if o is None:
            try:
                self._check_defence(defence, "this key's")
            except Exception as e:  # noqa: BLE001 - a SpecError: a key made for another kind of target
                raise Problem(403, "defence_unsupported", str(e)) from None
            o = defence.wrap(self.target.make_oracle(input_norm=defence.norm), self.accounts.secret)
            self._oracles[defence] = o
        return o

    def info(self) -> dict[str, Any]:
        d = self.defence
        return {"d": self.target.d, "bias": bool(self.target.bias), "output": d.output(), "max_batch": d.max_batch,
                "max_len": d.max_len, "max_body_bytes": self.max_body_bytes, "max_json_bytes": self.max_json_bytes,
                "input_norm": d.norm, "framings": list(FRAMINGS),
                "idempotency": "required" if self.require_idempotency else "optional",
                "max_abs_entry": MAX_ABS_ENTRY, "version": __version__,
                "answer_kind": self.kind.value, "d_out": self.d_out,
                "max_answer_numbers": self.answer_limit(NPY, d),
                "max_json_answer_numbers": self.answer_limit(JSON, d)}


    def authenticate(self, authorization: str | None) -> KeyRecord:
        if not authorization:
            raise Problem(401, "unauthorized", "no API key: send 'Authorization: Bearer KEY'",
                          {"WWW-Authenticate": "Bearer"})
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Problem(401, "unauthorized", "the Authorization header must be 'Bearer KEY'",
                          {"WWW-Authenticate": "Bearer"})
        rec = self.accounts.lookup(key.strip())
        if rec is None:
            raise Problem(401, "unauthorized", "unknown API key", {"WWW-Authenticate": 'Bearer error="invalid_token"'})
        if rec.revoked is not None:
            raise Problem(401, "unauthorized", f"this API key ({rec.name!r}) was revoked at {rec.revoked}",
                          {"WWW-Authenticate": 'Bearer error="invalid_token"'})
        return rec

    def usage(self, authorization: str | None) -> dict[str, Any]:
        rec = self.authenticate(authorization)
        return {"name": rec.name, "used": rec.used, "budget": rec.budget, "rate": rec.rate,
                "flagged_at": rec.flagged_at, "output": self.defence_for(rec).output()}

    def query(self, authorization: str | None, idem_key: str | None, content_type: str | None,
              body: bytes, accept: str | None) -> tuple[bytes, str, dict[str, str]]:
        """Answer one request: (body, media type, headers), or raise :class:`Problem`."""
        rec = self.authenticate(authorization)
        if idem_key is None:
            if self.require_idempotency:
                raise Problem(400, "idempotency_key_missing", "this server requires an Idempotency-Key header "
                              "(1 to 255 characters) on every query request")
            # no key: a request of its own, answered and charged every time it is sent (its ledger row gets a
            # random key, which no client can know, so nothing is ever answered from it)
            idem_key = AUTO_KEY_PREFIX + secrets.token_hex(16)
        elif not 1 <= len(idem_key) <= MAX_IDEM_KEY:
            raise Problem(400, "idempotency_key_invalid", f"the Idempotency-Key has {len(idem_key)} characters; "
                          f"it must have 1 to {MAX_IDEM_KEY}")
        mt = media_type(content_type) or JSON
        if mt not in FRAMINGS:
            raise Problem(415, "unsupported_media_type", f"content type {mt!r} is not accepted; use "
                          f"{' or '.join(FRAMINGS)}")
        out_mt = media_type(accept)
        out_mt = out_mt if out_mt in ANSWERS else NPY if mt == SPARSE else mt
        if len(body) > self.max_body_bytes:
            raise Problem(413, "payload_too_large", f"the body has {len(body)} bytes; the most is {self.max_body_bytes}")
        defence = self.defence_for(rec)
        if mt == JSON and len(body) > self.max_json_bytes:
            # too large to parse (about 10x its size in Python objects): a batch beyond the published limits
            # is still told so (422), counted from its separators; any other is 413
            with self._json_gate:
                excess = json_batch_excess(body, defence.max_batch, defence.max_len)
            if excess is not None:
                raise Problem(422, excess[0], excess[1])
            raise Problem(413, "payload_too_large", f"the JSON body has {len(body)} bytes; the most for JSON is "
                          f"{self.max_json_bytes} (send larger batches as application/x-npy, up to "
                          f"{self.max_body_bytes} bytes, or split them)")
        X, n, ph = self._decode(body, mt, defence)
        numbers = numbers_of(self.kind, X, self.d_out)      # what the answer holds: n, or n * d_out, or sum(N_i) * d_out
        most = self.answer_limit(out_mt, defence)
        if numbers > most:
            raise Problem(422, "answer_too_large", f"the answer to this batch holds {numbers} numbers "
                          f"({self.kind.describe(self.d_out)} for each of {n} sequences); the most in one "
                          f"{'.npy' if out_mt == NPY else 'JSON'} answer is {most}: send fewer sequences per request"
                          + (" or ask for the answer as application/x-npy (Accept)" if out_mt != NPY else ""))
        oracle = self.oracle_for(defence)
        if defence.norm is not None:
            try:
                oracle._check_norm(X)
            except InvalidQuery as e:
                raise Problem(422, "invalid_batch", str(e)) from None
        wait = self.accounts.take_token(rec)
        if wait > 0:
            secs = max(1, math.ceil(wait))
            raise Problem(429, "rate_limited", f"rate limit of {rec.rate:g} requests per second exceeded; retry "
                          f"after {secs} s", {"Retry-After": str(secs)}, retry_after=secs)
        if rec.flagged_at is not None and defence.prada == "refuse":
            raise Problem(403, "flagged", f"this key's queries were flagged as a model-extraction attack (PRADA "
                          f"detector, at query {rec.flagged_at}); it is refused from then on",
                          flagged_at=rec.flagged_at)
        # the payload hash (SHA-256 over the batch, ~0.5 ms a MB) runs on another thread while the model
        # answers (both release the GIL); it is needed only to compare with a stored request and to charge
        if ph is None:
            ph_job = self._hasher().submit(payload_hash, X)
        else:                   # known from a sparse body without work
            ph_job = Future()
            ph_job.set_result(ph)
        state, info = self.accounts.begin(rec, idem_key, n)
        if state == "replay":
            if info.payload_hash != ph_job.result():
                raise Problem(409, "idempotency_key_reused", "this Idempotency-Key was used before with a different "
                              "payload; use a new key for a new batch")
            if info.answers.size != numbers:
                raise Problem(409, "idempotency_key_reused", f"the answer stored under this Idempotency-Key holds "
                              f"{info.answers.size} numbers, but this server answers this batch with {numbers} (the "
                              "served target changed?); use a new key")
            stored = info.answers.reshape(-1, self.d_out) if self.kind.vector else info.answers
            return self._answer(stored, X, out_mt, charged=0, used=self.accounts.get(rec.id).used,
                                budget=rec.budget, replayed=True, flagged=info.flagged)
        if state == "inflight":
            raise Problem(409, "in_flight", "a request with this Idempotency-Key is still being processed; retry "
                          "when it is done", {"Retry-After": "1"})
        if state == "budget":
            used, budget, reserved = info
            raise Problem(403, "budget_exceeded", f"query budget exceeded: {used} queries spent, budget {budget}, "
                          f"this batch needs {n} more" + (f" ({reserved} in flight)" if reserved else ""),
                          spent=used, budget=budget, requested=n)
        try:
            try:
                y = oracle.query_packed(X)      # value kinds: (n,); vectors: one row per answered vector
            except (InvalidQuery, OracleError) as e:
                raise Problem(422, "invalid_batch", f"the model cannot answer this batch: {e}") from None
            flag_at, added = None, None
            if defence.prada != "off":
                det = self._detector(rec, defence)
                added = {}
                flagged_now = det.observe(X, added)
                if flagged_now is not None and rec.flagged_at is None:
                    flag_at = det.base + flagged_now
            used = self.accounts.charge(rec, idem_key, ph_job.result(), y, n=n,
                                        flagged=flag_at is not None or rec.flagged_at is not None,
                                        flag_at=flag_at, prada=added)
        except BaseException:
            self.accounts.abandon(rec, idem_key, n)
            raise
        return self._answer(y, X, out_mt, charged=n, used=used, budget=rec.budget, replayed=False,
                            flagged=flag_at is not None or rec.flagged_at is not None)

    def _decode(self, body: bytes, mt: str, defence: Defence):
        from ..oracles.base import as_batch
        try:
            if mt == JSON and len(body) > LARGE_JSON:
                with self._json_gate:
                    X = decode(body, mt, self.max_body_bytes // 8)
            else:
                X = decode(body, mt, self.max_body_bytes // 8)
        except FramingError as e:
            raise Problem(422, "invalid_batch", str(e)) from None
        ph = None
        if mt == SPARSE:
            X, ph = X
        if (isinstance(X, np.ndarray) and X.dtype == np.float64 and X.ndim == 3 and X.shape[2] == self.target.d
                and X.shape[0] > 0 and X.shape[1] > 0):
            # the common case in two passes without temporaries: every entry within +-MAX_ABS_ENTRY (so
            # finite: a NaN fails both comparisons); anything else takes the checks below, which name it
            if X.max() <= MAX_ABS_ENTRY and X.min() >= -MAX_ABS_ENTRY:
                n = int(X.shape[0])
                if n > defence.max_batch:
                    raise Problem(422, "batch_too_large", f"the batch has {n} sequences; the most is {defence.max_batch}")
                if X.shape[1] > defence.max_len:
                    raise Problem(422, "sequence_too_long", f"a sequence has {X.shape[1]} tokens; the most is "
                                  f"{defence.max_len}")
                return X, n, ph
        try:
            X = as_batch(X, self.target.d)
        except FramingError as e:
            raise Problem(422, "invalid_batch", str(e)) from None
        except InvalidQuery as e:
            raise Problem(422, "invalid_batch", str(e)) from None
        n = int(X.shape[0]) if isinstance(X, np.ndarray) else len(X)
        big = float(np.abs(X).max()) if isinstance(X, np.ndarray) and X.size else max(
            (float(np.abs(x).max()) for x in X), default=0.0) if not isinstance(X, np.ndarray) else 0.0
        if big > MAX_ABS_ENTRY:
            raise Problem(422, "invalid_batch", f"an entry has magnitude {big:.3g}; the most is {MAX_ABS_ENTRY:g} "
                          "(larger ones overflow the model's float64 scores)")
        if n == 0:
            raise Problem(422, "invalid_batch", "the batch is empty: send at least one sequence")
        if n > defence.max_batch:
            raise Problem(422, "batch_too_large", f"the batch has {n} sequences; the most is {defence.max_batch}")
        longest = int(X.shape[1]) if isinstance(X, np.ndarray) else max(x.shape[0] for x in X)
        if longest > defence.max_len:
            raise Problem(422, "sequence_too_long", f"a sequence has {longest} tokens; the most is {defence.max_len}")
        return X, n, ph

    def _answer(self, y: np.ndarray, X, mt: str, **fields: Any) -> tuple[bytes, str, dict[str, str]]:
        """The response body for the packed answers ``y`` to batch ``X`` (see :mod:`.framing`): value kinds
        ``(n,)``; ``last`` ``(n, d_out)``; ``all`` ``(n, N, d_out)`` when every sequence has N tokens, else
        (``.npy`` only) the packed ``(sum N_i, d_out)`` rows with the lengths in ``X-Headthief-Lengths``."""
        y = np.asarray(y, dtype="<f8")
        lens = lengths_of(X) if self.kind is Output.ALL else None
        uniform = lens is not None and (len(lens) == 0 or bool(np.all(lens == lens[0])))
        if mt == NPY:
            headers = {f"X-Headthief-{k.capitalize()}": ("" if v is None else str(v).lower() if isinstance(v, bool) else str(v))
                       for k, v in fields.items()}
            if lens is not None:
                if uniform:
                    y = y.reshape(len(lens), int(lens[0]) if len(lens) else 0, self.d_out)
                else:
                    headers["X-Headthief-Lengths"] = ",".join(map(str, lens.tolist()))
            return encode_npy(y), NPY, headers
        if lens is None:
            values = y.tolist()
        elif uniform:
            values = y.reshape(len(lens), int(lens[0]) if len(lens) else 0, self.d_out).tolist()
        else:
            values = [part.tolist() for part in np.split(y, np.cumsum(lens)[:-1], axis=0)]
        return encode_json({"values": values, **fields}), JSON, {}


def _openapi_extras(d: int, defence: Defence, require_idempotency: bool) -> dict[str, Any]:
    seq = {"type": "array", "minItems": 1, "maxItems": defence.max_len,
           "items": {"type": "array", "minItems": d, "maxItems": d,
                     "items": {"type": "number", "minimum": -MAX_ABS_ENTRY, "maximum": MAX_ABS_ENTRY}}}
    return {
        "parameters": [{"name": "Idempotency-Key", "in": "header", "required": require_idempotency,
                        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_IDEM_KEY},
                        "description": "a unique key per batch; a retry with the same key and payload is answered "
                                       "again, free. Without one, every request is answered and charged"
                                       + (" (this server requires one)" if require_idempotency else "")}],
        "requestBody": {"required": True, "content": {
            JSON: {"schema": {"type": "object", "additionalProperties": False, "required": ["sequences"],
                              "properties": {"sequences": {"type": "array", "minItems": 1,
                                                           "maxItems": defence.max_batch, "items": seq}}}},
            NPY: {"schema": {"type": "string", "format": "binary"}},
            SPARSE: {"schema": {"type": "string", "format": "binary"}}}},
        "security": [{"bearer": []}],
    }


def create_app(service: Service):
    """The FastAPI application of a :class:`Service`."""
    import asyncio
    import functools
    import logging

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel
    from starlette.requests import ClientDisconnect

    class Info(BaseModel):
        d: int
        bias: bool
        output: str
        answer_kind: str
        d_out: int | None
        max_answer_numbers: int
        max_json_answer_numbers: int
        max_batch: int
        max_len: int
        max_body_bytes: int
        max_json_bytes: int
        max_abs_entry: float
        input_norm: float | None
        framings: list[str]
        idempotency: str
        version: str

    if service.kind is Output.ALL:
        Values, per = list[list[list[float]]], f"one (N_i, {service.d_out}) list of vectors per sequence"
    elif service.kind is Output.LAST:
        Values, per = list[list[float]], f"one {service.d_out}-vector per sequence"
    else:
        Values, per = list[float], "one value per sequence"

    class QueryAnswer(BaseModel):
        values: Values
        charged: int
        used: int
        budget: int | None
        replayed: bool
        flagged: bool

    class Usage(BaseModel):
        name: str
        used: int
        budget: int | None
        rate: float | None
        flagged_at: int | None
        output: str

    class Error(BaseModel):
        error: str
        detail: str

    def err(desc: str, headers: dict | None = None) -> dict:
        out: dict[str, Any] = {"model": Error, "description": desc}
        if headers:
            out["headers"] = headers
        return out

    retry_after = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds to wait"}}
    class App(FastAPI):
        """FastAPI with ``POST /v1/query`` answered first, straight from the ASGI server: past the
        middleware stack, the router, the dependency machinery and the per-chunk body wrappers (about a
        millisecond a request on a small machine). The route below documents it in the OpenAPI schema
        (and answers it where this is bypassed, e.g. under a ``root_path``)."""

        async def __call__(self, scope, receive, send):
            if (scope["type"] != "http" or scope["path"] != "/v1/query" or scope["method"] != "POST"
                    or scope.get("root_path")):
                await super().__call__(scope, receive, send)
                return
            h: dict[str, str] = {}
            for k, v in scope["headers"]:
                h.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))

            async def chunks():
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise ClientDisconnect()
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body", False):
                        return

            try:
                response = await answer(h, chunks())
            except ClientDisconnect:
                return          # nobody to answer; nothing was charged (the body never arrived whole)
            except Exception:   # what ServerErrorMiddleware does for the routes: log it, answer 500
                logging.getLogger("uvicorn.error").exception("POST /v1/query failed")
                response = JSONResponse({"error": "internal", "detail": "internal server error"}, status_code=500)
            await response(scope, receive, send)

    app = App(title="headthief model API", version=__version__,
              description="Black-box queries to one attention head, with API keys, budgets, rate limits, "
                          "exactly-once charging (Idempotency-Key) and defences.")
    app.state.service = service

    def problem_response(p: Problem):
        return JSONResponse({"error": p.error, "detail": p.detail, **p.extra}, status_code=p.status, headers=p.headers)

    @app.get("/v1/info", response_model=Info, summary="what the provider publishes (no weights)")
    def info():
        return service.info()

    @app.get("/v1/usage", response_model=Usage, summary="this key's budget and queries used",
             responses={401: err("no or unknown API key")}, openapi_extra={"security": [{"bearer": []}]})
    def usage(request: Request):
        try:
            return service.usage(request.headers.get("authorization"))
        except Problem as p:
            return problem_response(p)

    @app.post("/v1/query", response_model=QueryAnswer, summary=f"answer a batch of sequences: {per}",
              responses={200: {"content": {NPY: {"schema": {"type": "string", "format": "binary"}}},
                               "description": per},
                         400: err("an Idempotency-Key of more than 255 characters (or none, where the server "
                                  "requires one)"),
                         401: err("no, unknown or revoked API key"),
                         403: err("budget spent, the key was flagged by the detector, or its defences do not fit "
                                  "the target's answers (sign-only on vectors)"),
                         409: err("a request with this Idempotency-Key is still in flight (`in_flight`, with "
                                  "Retry-After), or the key was charged before for another payload "
                                  "(`idempotency_key_reused`)", retry_after),
                         413: err(f"a binary body of more than max_body_bytes ({service.max_body_bytes}) bytes, or "
                                  f"a JSON body of more than max_json_bytes ({service.max_json_bytes}) within the "
                                  "batch limits (a JSON batch beyond them is 422 whatever its size: it is counted "
                                  "as it streams by)"),
                         415: err("unsupported content type"),
                         422: err("a malformed batch: it does not decode, a wrong dimension, an empty sequence, "
                                  "a non-finite or too large entry, a token beyond the input-norm bound, more "
                                  "sequences than max_batch or tokens than max_len, or an answer of more numbers "
                                  "than max_answer_numbers (.npy) or max_json_answer_numbers (JSON)"),
                         429: err("rate limit exceeded", retry_after),
                         500: err("an unexpected error of the server (logged)")},
              openapi_extra=_openapi_extras(service.target.d, service.defence, service.require_idempotency))
    async def query(request: Request):
        return await answer(request.headers, request.stream())

    large = asyncio.Semaphore(LARGE_BODIES)     # bodies over LARGE_BODY held at once

    async def answer(h, chunks) -> Response:
        """``POST /v1/query`` from its headers (lower-case names) and its body's chunks."""
        try:
            limit = service.max_body_bytes
            length = h.get("content-length")
            length = int(length) if length is not None and length.isdigit() else None
            if length is not None and length > limit:      # never held: it costs no memory
                await oversized(h, chunks, (), length)
            try:
                if length is not None and length <= LARGE_BODY:
                    body = await read_body(chunks, length, limit)
                else:
                    async with large:       # a large body waits here, unread, while LARGE_BODIES others are held
                        body = await read_body(chunks, length, limit)
            except _Oversized as o:         # no Content-Length, and it grew past the limit
                await oversized(h, chunks, o.head, None)
            return await compute(h, body)
        except Problem as p:
            return problem_response(p)

    async def oversized(h, chunks, head: tuple, length: int | None) -> None:
        """A body above ``max_body_bytes``: always a Problem. A binary one is refused unread (413). A JSON
        one that goes beyond the published batch limits is told so (422), as a parsed batch would be:
        Schemathesis builds such batches from the schema's ``maxItems``, and with long decimals (or
        whitespace) they outgrow the byte limit. It is counted as it streams by (BatchScan: a few MB
        whatever its size), only for a known key, and for at most SCAN_FACTOR byte limits."""
        limit = service.max_body_bytes
        size = f"{length} bytes" if length is not None else f"more than {limit} bytes"
        if (media_type(h.get("content-type")) or JSON) != JSON:
            raise Problem(413, "payload_too_large", f"the body has {size}; the most is {limit}")
        rec = await asyncio.get_running_loop().run_in_executor(
            service.workers(), service.authenticate, h.get("authorization"))        # 401 before reading on
        defence = service.defence_for(rec)
        scan, seen = BatchScan(defence.max_batch, defence.max_len), sum(len(b) for b in head)
        excess = next((e for e in map(scan.feed, head) if e is not None), None)
        if excess is None:
            async for chunk in chunks:
                seen += len(chunk)
                if seen > SCAN_FACTOR * limit:
                    break
                excess = scan.feed(chunk)
                if excess is not None:
                    break
            else:
                excess = scan.finish()
        if excess is not None:
            raise Problem(422, excess[0], excess[1])
        raise Problem(413, "payload_too_large", f"the body has {size}; the most is {limit} (a JSON body within "
                      "the batch limits: send it as application/x-npy, or split it)")

    async def compute(h, body) -> Response:
        # a plain executor: anyio's run_in_threadpool costs several times the hop itself
        try:
            out, mt, headers = await asyncio.get_running_loop().run_in_executor(
                service.workers(), functools.partial(service.query, h.get("authorization"), h.get("idempotency-key"),
                                                     h.get("content-type"), body, h.get("accept")))
        except Problem as p:
            return problem_response(p)
        return Response(out, media_type=mt, headers=headers)

    async def read_body(chunks, length: int | None, limit: int) -> bytearray:
        """The body, into one buffer preallocated from the Content-Length (no joins; the npy decoder
        views it in place), at most ``limit`` bytes (else _Oversized, with what was read)."""
        body, size = bytearray(length if length is not None and length <= limit else 0), 0
        async for chunk in chunks:
            end = size + len(chunk)
            if end > limit:
                raise _Oversized(memoryview(body)[:size], chunk)
            if end <= len(body):
                body[size:end] = chunk          # same length: copied in place
            else:
                del body[size:]
                body += chunk
            size = end
        del body[size:]
        return body


    def openapi():
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
                "type": "http", "scheme": "bearer", "description": "an API key from `headthief keys add`"}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app
