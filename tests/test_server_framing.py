"""The wire formats without a server: the in-place .npy decoder agrees with numpy.load on every array
it accepts and hands everything else to it (so the errors stay numpy's), the .npy header the client
writes is numpy.save's, and the answer decoder reads what the server writes."""

import io

import numpy as np
import pytest

from headthief.oracles.http import _npy_fast_1d, npy_header, payload_hash
from headthief.server.framing import FramingError, _npy_fast, decode_npy, encode_npy


def saved(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize("shape", [(3, 2, 5), (1, 1, 1), (0, 1, 4), (190, 2, 384), (2, 3, 1000)])
def test_header_and_fast_decoder_match_numpy(shape):
    a = np.random.default_rng(0).normal(size=shape)
    body = saved(a)
    assert npy_header(a.shape) + a.tobytes() == body == encode_npy(a)
    X = decode_npy(bytearray(body))
    assert X.dtype == np.float64 and X.shape == shape and np.array_equal(X, a) and X.flags.writeable
    assert payload_hash(X) == payload_hash(a)


def test_answers_decode_in_place():
    for n in (0, 1, 7, 4096):
        y = np.random.default_rng(n).normal(size=n)
        got = _npy_fast_1d(encode_npy(y))
        assert got is not None and np.array_equal(got, y) and got.flags.writeable
    assert _npy_fast_1d(saved(np.zeros((2, 3)))) is None and _npy_fast_1d(b"{}") is None


@pytest.mark.parametrize("a", [np.zeros((2, 3, 4), dtype=np.float32), np.asfortranarray(np.ones((2, 3, 4))),
                               np.arange(24.0).reshape(2, 3, 4)[:, ::-1].copy(order="F")])
def test_other_arrays_take_numpys_path(a):
    body = saved(a)
    assert _npy_fast(body) is None
    assert np.array_equal(decode_npy(body), a.astype(np.float64))


@pytest.mark.parametrize("body, words", [
    (saved(np.zeros((2, 3, 4)))[:-8], ".npy"),                  # truncated
    (saved(np.zeros((2, 3, 4), dtype=np.int64)), "float64 or float32"),
    (saved(np.zeros((2, 3))), "shape (n, N, d)"),
    (saved(np.zeros((2, 3, 4), dtype=">f8")), "float64 or float32"),
    (b"\x93NUMPY\x01\x00\xff\xff" + b"{" * 100, ".npy"),
])
def test_malformed_bodies_are_named(body, words):
    with pytest.raises(FramingError, match=words.replace("(", r"\(").replace(")", r"\)")):
        decode_npy(body)


def test_trailing_bytes_take_numpys_path():
    body = saved(np.ones((2, 3, 4))) + b"\0" * 8
    assert _npy_fast(body) is None
    assert np.array_equal(decode_npy(body), np.ones((2, 3, 4)))
