import numpy as np
import pytest

from headthief import AttentionHead, InvalidQuery, random_head


def naive(head: AttentionHead, X: np.ndarray) -> float:
    """The Section 3 formula, one sequence at a time, written out directly."""
    W = head.dense_W()
    c = np.zeros(head.d) if head.c is None else head.c.astype(float)
    s = np.array([x @ W @ X[-1] + c @ x for x in X])
    a = np.exp(s - s.max())
    a /= a.sum()
    return float(a @ (X @ head.v.astype(float)) + (head.beta or 0.0))


@pytest.mark.parametrize("kw", [{}, {"rank": 3}, {"bias": True}, {"sparse_v": 0.5, "bias": True, "rank": 2}])
def test_batch_of_mixed_lengths_matches_formula(kw):
    rng = np.random.default_rng(0)
    head = random_head(7, rng=1, **kw)
    batch = [rng.standard_normal((int(n), 7)) for n in rng.integers(1, 9, size=25)]
    got = head.evaluate(batch)
    want = np.array([naive(head, X) for X in batch])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_stacked_array_equals_list():
    rng = np.random.default_rng(1)
    head = random_head(5, rng=2, bias=True)
    X = rng.standard_normal((10, 3, 5))
    np.testing.assert_array_equal(head.evaluate(X), head.evaluate(list(X)))


def test_softmax_is_stable_for_huge_scores():
    head = random_head(4, rng=3)
    X = 1e4 * np.random.default_rng(2).standard_normal((6, 5, 4))
    y = head.evaluate(X)
    assert np.all(np.isfinite(y))
    # with huge scores the softmax picks the arg-max token
    W = head.dense_W()
    for i in range(6):
        s = X[i] @ W @ X[i, -1]
        assert y[i] == pytest.approx(X[i, np.argmax(s)] @ head.v, rel=1e-9)


def test_float32_head_computes_in_float32():
    h64 = random_head(16, rng=4, bias=True)
    h32 = AttentionHead(v=h64.v, W=h64.W, c=h64.c, beta=h64.beta, dtype=np.float32)
    X = np.random.default_rng(5).standard_normal((50, 4, 16))
    d = np.abs(h32.evaluate(X) - h64.evaluate(X))
    assert d.max() > 0           # really computed in lower precision
    assert d.max() < 1e-4


def test_random_head_options():
    h = random_head(20, rng=0, sparse_v=0.5)
    assert np.sum(h.v == 0) == 10
    assert random_head(20, rng=0, rank=3).rank == 3
    assert random_head(20, rng=0, rank=3).factored
    assert np.all(random_head(5, rng=0, v_zero=True).v == 0)
    with pytest.raises(ValueError, match="rank"):
        random_head(5, rng=0, rank=6)
    with pytest.raises(ValueError, match="sparse_v"):
        random_head(5, rng=0, sparse_v=1.0)


def test_wrong_dimension_is_refused():
    with pytest.raises(InvalidQuery, match="dimension"):
        random_head(4, rng=0).evaluate(np.zeros((2, 2, 5)))
