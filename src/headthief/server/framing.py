"""The wire formats of ``POST /v1/query``, chosen by content type.

- ``application/json`` (interoperable): ``{"sequences": [[[x_11, ..., x_1d], ...], ...]}`` in, and
  ``{"values": [...], "charged": n, "used": u, "budget": b, "replayed": false, "flagged": false}`` out.
  Python writes a float64 with the shortest decimal that reads back to the same bits, so JSON loses
  nothing.
- ``application/x-npy`` (fast): the body is one ``.npy`` file (:func:`numpy.save`, no pickles) of a
  float64 (or float32) array of shape (n, N, d): n sequences of N tokens each. The answer is an
  ``.npy`` of the n float64 values; the other fields travel in ``X-Headthief-*`` headers. Sequences of
  different lengths go in separate requests (the client does that).
- ``application/x-headthief-sparse`` (fast for sparse probes): ``HTSPARSE``, then n, N, d and nnz as
  little-endian uint64, then nnz flat row-major indices into the (n, N, d) array (uint64, strictly
  increasing) and nnz float64 values; every other entry is 0. Theorem 4.1's basis probes are ~99%
  zeros: 12 KB instead of 1.2 MB a request at d = 384. The answer is an ``.npy`` as above. Its
  dense size obeys the same limit as an ``.npy`` body (``max_body_bytes / 8`` entries).

Answers of a vector target (``/v1/info``: ``answer_kind`` ``last`` or ``all``, and ``d_out``), in
either answer framing, keep the shape of the request:

- ``last`` (a ``d_out``-vector per sequence): JSON ``"values"`` is a list of n lists of d_out numbers;
  ``.npy``: an (n, d_out) array.
- ``all`` (a ``d_out``-vector per token): JSON ``"values"`` is a list of n lists (one per sequence) of
  N_i lists of d_out numbers; ``.npy``: an (n, N, d_out) array when every sequence has N tokens (always
  so for ``.npy`` and sparse requests), else (a JSON batch of sequences of different lengths answered
  as ``.npy``) the packed (sum N_i, d_out) array, the vectors of sequence 0 first, with the lengths in
  the ``X-Headthief-Lengths`` header (``3,5,2``).

Every framing carries float64 bits exactly (JSON through Python's shortest round-trip decimals).

Both decoders name what is wrong with a malformed body (:class:`FramingError`, answered 422).
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from ..errors import InvalidQuery
from ..oracles.http import (NPY, SPARSE, SPARSE_HEADER, SPARSE_MAGIC, SPARSE_MAX_DENSITY, npy_header, payload_hash,
                            sparse_hash)

JSON = "application/json"
FRAMINGS = (JSON, NPY, SPARSE)      # request bodies
ANSWERS = (JSON, NPY)               # answer bodies


class FramingError(InvalidQuery):
    """A request body that does not decode into a batch of sequences."""


def media_type(content_type: str | None) -> str | None:
    """The bare media type of a Content-Type / Accept value (``None`` for none)."""
    if not content_type:
        return None
    return content_type.split(";", 1)[0].strip().lower() or None


def decode_json(body: bytes) -> "list[np.ndarray] | np.ndarray":
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise FramingError(f"the body is not valid JSON ({e})") from None
    except RecursionError:
        raise FramingError("the body nests lists deeper than a batch does (sequences of tokens of numbers: "
                           "three levels)") from None
    if not isinstance(doc, dict) or "sequences" not in doc:
        raise FramingError('the body must be a JSON object {"sequences": [[[x_11, ..., x_1d], ...], ...]}')
    extra = set(doc) - {"sequences"}
    if extra:
        raise FramingError(f"unknown field(s) in the body: {', '.join(sorted(map(str, extra)))}")
    seqs = doc["sequences"]
    if not isinstance(seqs, list):
        raise FramingError("'sequences' must be a list of sequences (each a list of tokens, each a list of numbers)")
    if seqs and b"true" not in body and b"false" not in body and b"null" not in body:
        try:   # the fast path: every sequence has the same shape and only numbers
            A = np.asarray(seqs)
        except (ValueError, TypeError, OverflowError, RecursionError):
            A = None
        if A is not None and A.ndim == 3 and A.dtype.kind in "fi" and A.shape[1] > 0:
            return A.astype(np.float64)
    out = []
    for i, s in enumerate(seqs):
        if not isinstance(s, list) or not all(isinstance(t, list) for t in s):
            raise FramingError(f"sequence {i} must be a list of tokens, each a list of numbers")
        for j, t in enumerate(s):
            for v in t:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise FramingError(f"sequence {i}, token {j}: {v!r} is not a number")
        try:
            x = np.asarray(s, dtype=np.float64)
        except (ValueError, TypeError, OverflowError):
            raise FramingError(f"sequence {i}: its tokens do not all have the same length") from None
        if x.ndim != 2:
            if x.size == 0:
                raise FramingError(f"sequence {i} is empty: every query needs at least one token")
            raise FramingError(f"sequence {i}: its tokens do not all have the same length")
        out.append(x)
    return out


SCAN_CHUNK = 2**20      # bytes scanned at once by BatchScan (its temporaries: ~8 bytes per byte of a chunk)


class BatchScan:
    """For a JSON body too large to parse, fed as it arrives: whether it has more sequences than
    ``max_batch`` or a sequence of more tokens than ``max_len``, counted without parsing. The bracket
    depth of every byte is a running sum of ``[`` (+1) and ``]`` (-1); the commas at depth 1 separate
    the elements of the batch, those at depth 2 the elements of one of them, whatever the elements are
    (lists, numbers, ``false``: a batch of 4,097 things is too large whatever they are). Scanned in
    pieces of at most :data:`SCAN_CHUNK` bytes with numpy (no Python object per element; a few MB of
    temporaries), so a body of any size is counted in constant memory.

    :meth:`feed` answers ``(error, detail)`` as soon as the batch has too many sequences;
    :meth:`finish` (at the end of the body) a sequence of too many tokens, else None (too many
    sequences is named before too many tokens, as for a parsed batch)."""

    def __init__(self, max_batch: int, max_len: int):
        self.max_batch, self.max_len = int(max_batch), int(max_len)
        self.depth = 0          # the bracket depth before the next byte
        self.n_sep = 0          # commas at depth 1 so far: the batch has n_sep + 1 elements
        self.run = 0            # commas at depth 2 in the current element so far
        self.too_long = None    # the first sequence of more than max_len tokens

    def feed(self, data) -> "tuple[str, str] | None":
        mv = memoryview(data).cast("B")
        for off in range(0, len(mv), SCAN_CHUNK):
            if self._piece(np.frombuffer(mv, dtype=np.uint8, count=min(SCAN_CHUNK, len(mv) - off), offset=off)):
                return "batch_too_large", (f"the batch has more than {self.max_batch} sequences (counted without "
                                           "parsing: the body is too large to parse as JSON); the most is "
                                           f"{self.max_batch}")
        return None

    def finish(self) -> "tuple[str, str] | None":
        if self.too_long is None:
            return None
        return "sequence_too_long", (f"sequence {self.too_long} has more than {self.max_len} tokens (counted "
                                     "without parsing: the body is too large to parse as JSON); the most is "
                                     f"{self.max_len}")

    def _piece(self, a: np.ndarray) -> bool:
        """Count one piece; True once the batch has more than max_batch elements."""
        step = (a == 0x5B).view(np.int8) - (a == 0x5D).view(np.int8)
        after = np.cumsum(step, dtype=np.int64)
        del step
        commas = np.flatnonzero(a == 0x2C)
        dc = after[commas] + self.depth
        self.depth += int(after[-1])
        del after
        c1, c2 = commas[dc == 1], commas[dc == 2]
        del commas, dc
        if self.too_long is None and len(c2):
            # commas at depth 2 per element: those before the piece's first depth-1 comma continue the
            # element in progress
            counts = np.bincount(np.searchsorted(c1, c2), minlength=len(c1) + 1)
            counts[0] += self.run
            over = np.flatnonzero(counts >= self.max_len)        # counts[i] + 1 tokens
            if len(over):
                self.too_long = self.n_sep + int(over[0])
            self.run = int(counts[-1])
        elif len(c1):
            self.run = 0
        self.n_sep += len(c1)
        return self.n_sep >= self.max_batch


def json_batch_excess(body, max_batch: int, max_len: int) -> "tuple[str, str] | None":
    """:class:`BatchScan` over a whole body held in memory: ``(error, detail)`` or None."""
    scan = BatchScan(max_batch, max_len)
    return scan.feed(body) or scan.finish()


def _npy_fast(body) -> "np.ndarray | None":
    """The common case without a copy: a version 1/2/3 ``.npy`` of a C-ordered little-endian float64
    (n, N, d) array whose data fill the rest of the body exactly, viewed in place (``np.frombuffer``).
    None for anything else (then :func:`numpy.load` decodes it, or names what is wrong)."""
    mv = memoryview(body)
    if len(mv) < 12 or bytes(mv[:6]) != b"\x93NUMPY" or mv[6] not in (1, 2, 3):
        return None
    if mv[6] == 1:
        hlen, start = int.from_bytes(mv[8:10], "little"), 10
    else:
        hlen, start = int.from_bytes(mv[8:12], "little"), 12
    if hlen > 4096 or start + hlen > len(mv):
        return None
    try:
        import ast
        h = ast.literal_eval(bytes(mv[start:start + hlen]).decode("latin1"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        return None
    if (not isinstance(h, dict) or set(h) != {"descr", "fortran_order", "shape"} or h["descr"] != "<f8"
            or h["fortran_order"] is not False or not isinstance(h["shape"], tuple) or len(h["shape"]) != 3
            or not all(type(k) is int and k >= 0 for k in h["shape"])):
        return None
    offset = start + hlen
    n, N, d = h["shape"]
    if len(mv) - offset != 8 * n * N * d:
        return None
    return np.frombuffer(body, dtype="<f8", count=n * N * d, offset=offset).reshape(n, N, d)


def decode_npy(body: bytes) -> np.ndarray:
    X = _npy_fast(body)
    if X is not None:
        return X
    try:
        X = np.load(io.BytesIO(body), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise FramingError(f"the body is not a valid .npy array ({e})") from None
    if not isinstance(X, np.ndarray):
        raise FramingError("the body must be one .npy array, not an .npz archive")
    if X.dtype not in (np.float64, np.float32):
        raise FramingError(f"the array must be float64 or float32, got {X.dtype}")
    if X.ndim != 3:
        raise FramingError(f"the array must have shape (n, N, d) (n sequences of N tokens of dimension d); "
                           f"got shape {X.shape}")
    return np.asarray(X, dtype=np.float64)


def decode_sparse(body, max_entries: int) -> "tuple[np.ndarray, bytes]":
    """A sparse body: the dense (n, N, d) float64 batch it stands for and its :func:`payload_hash`
    (read from the nonzero entries when the batch is sparse: no pass over the dense array)."""
    mv = memoryview(body)
    if len(mv) < SPARSE_HEADER or bytes(mv[:8]) != SPARSE_MAGIC:
        raise FramingError(f"a sparse body starts with {SPARSE_MAGIC.decode()} and n, N, d, nnz (uint64 each): "
                           f"{SPARSE_HEADER} bytes")
    n, N, d, nnz = (int(k) for k in np.frombuffer(body, dtype="<u8", count=4, offset=8))
    size = n * N * d
    if size > max_entries:
        raise FramingError(f"the sparse batch stands for {n} x {N} x {d} = {size} entries; the most is {max_entries}")
    if nnz > size:
        raise FramingError(f"the sparse batch has {nnz} nonzero entries but only {size} entries in all")
    if len(mv) != SPARSE_HEADER + 16 * nnz:
        raise FramingError(f"a sparse body with nnz = {nnz} has {SPARSE_HEADER + 16 * nnz} bytes "
                           f"({SPARSE_HEADER} of header, 8 per index, 8 per value); got {len(mv)}")
    idx = np.frombuffer(body, dtype="<u8", count=nnz, offset=SPARSE_HEADER)
    vals = np.frombuffer(body, dtype="<f8", count=nnz, offset=SPARSE_HEADER + 8 * nnz)
    if nnz and (idx[-1] >= size or (nnz > 1 and not bool(np.all(idx[1:] > idx[:-1])))):
        raise FramingError(f"the sparse batch's indices must be strictly increasing and below n*N*d = {size}")
    X = np.zeros(size, dtype=np.float64)
    X[idx] = vals
    X = X.reshape(n, N, d)
    canonical = nnz <= SPARSE_MAX_DENSITY * size and not bool(np.any(vals.view("<u8") == 0))
    return X, sparse_hash(X.shape, idx, vals) if canonical else payload_hash(X)


def decode(body: bytes, content_type: str | None, max_entries: int = 2**23):
    """The batch of a request body (an (n, N, d) array or a list of (N_i, d) arrays); for a sparse body
    ``(array, payload hash)``."""
    mt = media_type(content_type) or JSON
    if mt == NPY:
        return decode_npy(body)
    if mt == SPARSE:
        return decode_sparse(body, max_entries)
    return decode_json(body)


def encode_npy(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a, dtype="<f8")
    return npy_header(a.shape) + a.tobytes()


def encode_json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
