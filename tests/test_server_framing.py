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


# -- the sparse framing (application/x-headthief-sparse) ----------------------------------------------

from headthief.oracles.http import SPARSE_MAX_DENSITY, sparse_form, sparse_hash, sparse_parts  # noqa: E402
from headthief.server.framing import decode_sparse  # noqa: E402


def sparse_body(A, sp=None) -> bytes:
    sp = sparse_form(A) if sp is None else sp
    return b"".join(bytes(p) for p in sparse_parts(A.shape, *sp))


def basis_probes(n=190, d=384, seed=0):
    """Theorem 4.1's two-token probes [s e_l + lam e_j ; lam e_j]: 2-3 nonzeros in 2 d entries."""
    rng = np.random.default_rng(seed)
    X = np.zeros((n, 2, d))
    X[np.arange(n), 0, np.arange(n) % d] = rng.normal(size=n)
    X[:, :, 7] += 0.5
    X[3, 1, 9] = -0.0          # a negative zero is an entry (its bits are not zero)
    return X


def test_sparse_bodies_rebuild_the_batch_bit_for_bit_and_hash_like_the_dense_one():
    X = basis_probes()
    idx, vals = sparse_form(X)
    assert np.all(np.diff(idx.astype(np.int64)) > 0) and len(idx) == np.count_nonzero(X.view("<u8"))
    body = sparse_body(X)
    assert len(body) == 40 + 16 * len(idx) and len(body) < X.nbytes / 50
    Y, ph = decode_sparse(bytearray(body), X.size)
    assert Y.shape == X.shape and np.array_equal(Y.view("<u8"), X.view("<u8"))       # -0.0 survives
    assert np.signbit(Y[3, 1, 9]) and ph == payload_hash(X) == payload_hash(list(X)) == sparse_hash(X.shape, idx, vals)
    assert payload_hash(Y) == ph


def test_dense_batches_have_no_sparse_form_and_a_forced_sparse_body_still_hashes_like_npy():
    X = np.random.default_rng(1).normal(size=(4, 3, 8))
    assert sparse_form(X) is None
    Y, ph = decode_sparse(sparse_body(X, sparse_form(X, max_density=1.0)), X.size)
    assert np.array_equal(Y, X) and ph == payload_hash(X)
    # explicit zero entries are allowed, and the hash is still the batch's
    Z = basis_probes(n=5, d=16)
    flat = Z.reshape(-1)
    idx = np.arange(10, dtype="<u8")
    Y, ph = decode_sparse(sparse_body(Z, (idx, flat[:10])), Z.size)
    W = np.zeros_like(Z).reshape(-1)
    W[:10] = flat[:10]
    assert np.array_equal(Y.reshape(-1), W) and ph == payload_hash(W.reshape(Z.shape))


def test_the_density_rule_is_a_quarter():
    X = np.zeros((1, 1, 8))
    X[0, 0, :2] = 1.0
    assert sparse_form(X) is not None and SPARSE_MAX_DENSITY == 0.25
    X[0, 0, 2] = 1.0
    assert sparse_form(X) is None


def _hdr(n, N, d, nnz):
    return b"HTSPARSE" + np.asarray([n, N, d, nnz], dtype="<u8").tobytes()


@pytest.mark.parametrize("body, words", [
    (b"HTSPARSE", "starts with HTSPARSE"),
    (b"NOTSPARS" + bytes(32), "starts with HTSPARSE"),
    (_hdr(10**6, 10**3, 10**3, 0), "the most is 1000"),
    (_hdr(1, 1, 4, 5) + bytes(80), "5 nonzero entries but only 4"),
    (_hdr(1, 1, 4, 2) + bytes(16), "has 72 bytes"),
    (_hdr(1, 1, 4, 2) + np.asarray([2, 1], "<u8").tobytes() + np.ones(2).tobytes(), "strictly increasing"),
    (_hdr(1, 1, 4, 2) + np.asarray([1, 1], "<u8").tobytes() + np.ones(2).tobytes(), "strictly increasing"),
    (_hdr(1, 1, 4, 1) + np.asarray([4], "<u8").tobytes() + np.ones(1).tobytes(), "below n*N*d = 4"),
])
def test_malformed_sparse_bodies_are_named(body, words):
    with pytest.raises(FramingError, match=words.replace("*", r"\*")):
        decode_sparse(body, 1000)
