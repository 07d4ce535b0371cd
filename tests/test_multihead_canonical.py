"""Canonical form and Proposition 7.1's equivalent parameter sets."""

import numpy as np
import pytest

from headthief.extraction.multihead.canonical import canonical_form, equivalent_parameters, parameter_gap
from headthief.extraction.multihead.result import MultiHeadExtraction, match_heads
from headthief.extraction.result import random_sequences
from headthief.models.multihead import MultiHeadAttention, random_multihead

KINDS = [dict(identical=True), dict(), dict(rank=3), dict(bias=True), dict(subspaces="orthogonal", bias=True),
         dict(identical=True, rank=2, bias=True)]


def same_heads(a: MultiHeadAttention, b: MultiHeadAttention, tol: float) -> None:
    assert a.heads == b.heads
    rows, cols = match_heads(a.dense_W(), a.V, b.dense_W(), b.V)
    for i, j in zip(rows, cols):
        assert np.linalg.norm(a.dense_W()[i] - b.dense_W()[j]) <= tol * np.linalg.norm(b.dense_W()[j])
        assert np.linalg.norm(a.V[i] - b.V[j]) <= tol * np.linalg.norm(b.V[j])


@pytest.mark.parametrize("kw", KINDS, ids=[",".join(f"{k}={v}" for k, v in kw.items()) or "generic" for kw in KINDS])
def test_equivalent_parameters_same_function_different_parameters(kw):
    model = random_multihead(12, 4, rng=3, **kw)
    other = equivalent_parameters(model, rng=1)
    X = random_sequences(12, 10_000, rng=2)
    y, z = model.evaluate(X), other.evaluate(X)
    assert np.max(np.abs(y - z)) <= 1e-14 * np.sqrt(np.mean(y ** 2))
    assert parameter_gap(other, model) >= 0.5            # no head within 50% in both W and v
    if kw.get("identical"):
        assert other.heads == model.heads                # the paper's construction: same heads, new lambdas
        assert np.min(np.linalg.norm(other.V - model.V, axis=1) / np.linalg.norm(model.V, axis=1)) >= 0.5
    same_heads(canonical_form(other), canonical_form(model), 1e-12)
    assert other.factored == model.factored and other.beta == model.beta


def test_equivalent_parameters_is_seeded():
    model = random_multihead(8, 3, rng=0)
    a, b = equivalent_parameters(model, rng=5), equivalent_parameters(model, rng=5)
    assert np.array_equal(a.V, b.V)
    assert not np.array_equal(a.V, equivalent_parameters(model, rng=6).V)


def test_canonical_form_merges_identical_heads_and_drops_silent_ones():
    model = random_multihead(6, 4, rng=0, identical=True, bias=True)
    c = canonical_form(model)
    assert c.heads == 1
    assert np.allclose(c.V[0], model.V.sum(axis=0), rtol=0, atol=1e-15)
    assert np.array_equal(c.dense_W()[0], model.dense_W()[0]) and np.array_equal(c.C[0], model.C[0])
    assert c.beta == model.beta
    g = random_multihead(6, 3, rng=1)
    V = g.V.copy()
    V[1] = 0.0
    silent = MultiHeadAttention(V=V, W=g.W)
    c = canonical_form(silent)
    assert c.heads == 2
    same_heads(c, MultiHeadAttention(V=g.V[[0, 2]], W=g.W[[0, 2]]), 0.0)


def test_canonical_form_cancelling_values_and_all_silent():
    g = random_multihead(5, 2, rng=2)
    V = np.stack([g.V[0], -g.V[0]])
    c = canonical_form(MultiHeadAttention(V=V, W=np.stack([g.W[0], g.W[0]]), beta=0.25))
    assert c.heads == 1 and not c.V.any() and not c.W.any() and c.beta == 0.25
    X = random_sequences(5, 20, rng=0)
    assert np.allclose(c.evaluate(X), 0.25)


def test_canonical_form_keeps_storage_and_dtype():
    m = random_multihead(8, 3, rng=4, rank=2, dtype=np.float32)
    c = canonical_form(m)
    assert c.factored and c.dtype == np.float32 and c.left.shape == (3, 8, 2)
    X = random_sequences(8, 200, rng=1)
    assert np.allclose(c.evaluate(X), m.evaluate(X), rtol=0, atol=1e-5)
    with pytest.raises(ValueError):
        canonical_form(m, tol=-1.0)


def test_errors_use_the_canonical_form():
    # a recovered layer that found the merged head of an identical-heads target is exact
    model = random_multihead(6, 3, rng=0, identical=True)
    res = MultiHeadExtraction(method="t", W=model.W[:1], V=model.V.sum(axis=0, keepdims=True), C=None, beta=None,
                              queries=0, seconds=0.0)
    e = res.errors(model)
    assert e["heads_true"] == 1 and e["W_rel_err"] == 0.0 and e["v_rel_err"] < 1e-15
