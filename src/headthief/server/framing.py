"""The wire formats of ``POST /v1/query``, chosen by content type.

- ``application/json`` (interoperable): ``{"sequences": [[[x_11, ..., x_1d], ...], ...]}`` in, and
  ``{"values": [...], "charged": n, "used": u, "budget": b, "replayed": false, "flagged": false}`` out.
  Python writes a float64 with the shortest decimal that reads back to the same bits, so JSON loses
  nothing.
- ``application/x-npy`` (fast): the body is one ``.npy`` file (:func:`numpy.save`, no pickles) of a
  float64 (or float32) array of shape (n, N, d): n sequences of N tokens each. The answer is an
  ``.npy`` of the n float64 values; the other fields travel in ``X-Headthief-*`` headers. Sequences of
  different lengths go in separate requests (the client does that).

Both decoders name what is wrong with a malformed body (:class:`FramingError`, answered 422).
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from ..errors import InvalidQuery
from ..oracles.http import npy_header

JSON = "application/json"
NPY = "application/x-npy"
FRAMINGS = (JSON, NPY)


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
        except (ValueError, TypeError, OverflowError):
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


def decode(body: bytes, content_type: str | None):
    mt = media_type(content_type) or JSON
    if mt == NPY:
        return decode_npy(body)
    return decode_json(body)


def encode_npy(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a, dtype="<f8")
    return npy_header(a.shape) + a.tobytes()


def encode_json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
