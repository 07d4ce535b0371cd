"""Proposition C.2: multi-head extraction with known orthogonal head subspaces."""

import numpy as np
import pytest

from headthief.errors import BudgetExceeded, NotIdentifiable, SpecError
from headthief.extraction.multihead.subspaces import (check_bases, extract_multihead_subspaces,
                                                      subspaces_query_count)
from headthief.models.multihead import MultiHeadAttention, random_multihead
from headthief.oracles.base import ModelOracle


def test_acceptance_d32_h4():
    model = random_multihead(32, 4, subspaces="orthogonal", rng=1)
    oracle = ModelOracle(model)
    res = extract_multihead_subspaces(oracle, model._cache["bases"])
    e = res.errors(model)
    assert e["W_rel_err"] <= 1e-10 and e["v_rel_err"] <= 1e-10
    assert res.queries == oracle.queries == 288 == subspaces_query_count([8] * 4)
    assert res.C is None and res.beta is None and res.heads == 4
    for h in range(4):                     # head h is the head of subspace h, in the order given
        assert np.linalg.norm(res.W[h] - model.W[h]) <= 1e-10 * np.linalg.norm(model.W[h])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_biases_read_beta_once(seed):
    model = random_multihead(12, 3, subspaces="orthogonal", rng=seed, bias=True)
    oracle = ModelOracle(model)
    res = extract_multihead_subspaces(oracle, model._cache["bases"], bias=True)
    e = res.errors(model)
    assert max(e["W_rel_err"], e["v_rel_err"], e["c_rel_err"]) <= 1e-10 and e["beta_abs_err"] <= 1e-14
    assert res.queries == oracle.queries == 3 * (16 + 8) + 1 == subspaces_query_count([4, 4, 4], bias=True)


def test_unequal_dims_list_of_bases_and_low_rank():
    rng = np.random.default_rng(0)
    d, dims = 10, [1, 3, 5]
    Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    bases, start = [], 0
    for k in dims:
        bases.append(Q[:, start:start + k])
        start += k
    W = np.stack([B @ rng.standard_normal((B.shape[1], B.shape[1])) @ B.T for B in bases])
    W[2] = bases[2] @ np.outer(rng.standard_normal(5), rng.standard_normal(5)) @ bases[2].T    # rank 1
    V = np.stack([B @ rng.standard_normal(B.shape[1]) for B in bases])
    model = MultiHeadAttention(V=V, W=W)
    res = extract_multihead_subspaces(ModelOracle(model), bases)
    assert res.queries == subspaces_query_count(bases) == sum(k * k + k for k in dims)
    assert res.errors(model)["W_rel_err"] <= 1e-10


def test_float32_answers():
    model = random_multihead(16, 4, subspaces="orthogonal", rng=3, dtype=np.float32)
    res = extract_multihead_subspaces(ModelOracle(model), model._cache["bases"])
    e = res.errors(model)
    assert e["W_rel_err"] <= 1e-5 and e["v_rel_err"] <= 1e-6 and res.queries == 80


def test_silent_subspace_is_left_out():
    model = random_multihead(9, 3, subspaces="orthogonal", rng=0)
    V = model.V.copy()
    V[1] = 0.0
    silent = MultiHeadAttention(V=V, W=model.W)
    res = extract_multihead_subspaces(ModelOracle(silent), model._cache["bases"])
    assert res.heads == 2 and res.diagnostics["silent"] == [1]
    assert res.errors(silent)["W_rel_err"] <= 1e-10
    with pytest.raises(NotIdentifiable, match="every head subspace is silent"):
        extract_multihead_subspaces(ModelOracle(MultiHeadAttention(V=0 * V, W=model.W)), model._cache["bases"])


def test_bad_bases_are_refused_clearly():
    model = random_multihead(8, 2, subspaces="orthogonal", rng=0)
    B = model._cache["bases"]
    oracle = ModelOracle(model)
    with pytest.raises(SpecError, match="not orthonormal"):
        extract_multihead_subspaces(oracle, [2 * B[0], B[1]])
    with pytest.raises(SpecError, match="not orthogonal"):
        extract_multihead_subspaces(oracle, [B[0], B[0]])
    tilted = np.linalg.qr(B[1] + 0.1 * B[0])[0]
    with pytest.raises(SpecError, match="subspaces 0 and 1 are not orthogonal"):
        extract_multihead_subspaces(oracle, [B[0], tilted])
    with pytest.raises(SpecError, match="6 rows but the oracle's tokens have d = 8"):
        extract_multihead_subspaces(oracle, [B[0][:6]])
    with pytest.raises(SpecError, match=r"\(H, d, d_h\) array"):
        extract_multihead_subspaces(oracle, B[0])
    with pytest.raises(SpecError, match="empty"):
        check_bases([], 8)
    assert oracle.queries == 0


def test_budget_is_enforced_through_the_subspace_oracle():
    model = random_multihead(8, 2, subspaces="orthogonal", rng=0)
    with pytest.raises(BudgetExceeded):
        extract_multihead_subspaces(ModelOracle(model, budget=30), model._cache["bases"])
