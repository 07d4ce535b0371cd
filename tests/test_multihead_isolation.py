"""Multi-head extraction by switching and head isolation: recovery to the answers' precision, exact
query counts beside the switch search, head-count detection, Proposition 7.1's merged heads, and clear
errors on bad input or a wrong head count."""

import numpy as np
import pytest

from headthief.errors import BudgetExceeded, ModelMismatch, NotIdentifiable
from headthief.extraction.multihead.isolation import extract_multihead, multihead_query_count
from headthief.extraction.multihead.result import match_heads
from headthief.extraction.result import rel_err
from headthief.models.multihead import MultiHeadAttention, random_multihead
from headthief.oracles.base import ModelOracle


def worst_errors(res, W_true, V_true, C_true=None):
    """Worst matched head's relative errors (our own matching; no canonical form needed)."""
    assert res.heads == len(V_true)
    rows, cols = match_heads(res.W, res.V, W_true, V_true)
    out = {"W": max(rel_err(res.W[i], W_true[j]) for i, j in zip(rows, cols)),
           "v": max(rel_err(res.V[i], V_true[j]) for i, j in zip(rows, cols))}
    if C_true is not None:
        out["c"] = max(rel_err(res.C[i], C_true[j]) for i, j in zip(rows, cols))
    return out


def planned(res) -> int:
    return res.diagnostics["planned_queries"] + res.diagnostics["switch_search_queries"]


@pytest.mark.parametrize("d,H", [(8, 6), (12, 3), (20, 2)])
def test_dense_heads_recovered_to_float64_precision(d, H):
    model = random_multihead(d, H, rng=1)
    res = extract_multihead(ModelOracle(model))
    e = worst_errors(res, model.dense_W(), model.V)
    assert e["W"] <= 1e-11 and e["v"] <= 1e-13
    assert res.queries == planned(res)
    assert res.diagnostics["requeried"] == 0
    assert res.diagnostics["planned_queries"] == multihead_query_count(d, H)
    assert res.C is None and res.beta is None


def test_d32_four_heads_within_the_query_goal():
    model = random_multihead(32, 4, rng=1)
    res = extract_multihead(ModelOracle(model), heads=4)
    e = worst_errors(res, model.dense_W(), model.V)
    assert e["W"] <= 1e-9 and e["v"] <= 1e-9
    assert res.queries <= 8200
    assert res.queries == multihead_query_count(32, 4) + res.diagnostics["switch_search_queries"]


def test_biases_recovered():
    model = random_multihead(16, 3, rng=2, bias=True)
    res = extract_multihead(ModelOracle(model), bias=True)
    e = worst_errors(res, model.dense_W(), model.V, model.C)
    assert max(e.values()) <= 1e-11
    assert abs(res.beta - model.beta) <= 1e-13
    assert res.diagnostics["planned_queries"] == multihead_query_count(16, 3, bias=True)


@pytest.mark.parametrize("given", [True, False])
def test_low_rank_heads(given):
    d, H, r = 40, 3, 5
    model = random_multihead(d, H, rng=3, rank=r, bias=True)
    res = extract_multihead(ModelOracle(model), rank=r if given else None, bias=True)
    e = worst_errors(res, model.dense_W(), model.V, model.C)
    assert max(e.values()) <= 1e-10
    assert res.diagnostics["ranks"] == [r] * H
    assert res.diagnostics["planned_queries"] == multihead_query_count(d, H, r, bias=True, detect=not given)
    assert res.queries == planned(res)
    assert res.queries < H * d * d      # below dense isolation


def test_float32_target_at_float32_precision():
    model = random_multihead(16, 3, rng=4, dtype=np.float32, bias=True)
    res = extract_multihead(ModelOracle(model), bias=True)
    assert res.diagnostics["precision"] == "float32"
    e = worst_errors(res, model.dense_W(), model.V.astype(np.float64), model.C.astype(np.float64))
    assert e["W"] <= 2e-5 and e["v"] <= 2e-6 and e["c"] <= 5e-5
    assert res.diagnostics["planned_queries"] == multihead_query_count(16, 3, bias=True, float32=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_zero_score_biases_with_bias_flag(dtype):
    """torch's default in_proj_bias is zero: every c_h = 0, so no head can be switched off at the zero
    token; the cross coordinates of c_h come from the mirror token -e_1 (regression: this raised
    ConvergenceError on torch-mha and on MiniLM layer 2)."""
    base = random_multihead(16, 3, rng=6, bias=True)
    model = MultiHeadAttention(V=base.V, W=base.dense_W(), C=np.zeros((3, 16)), beta=0.25, dtype=dtype)
    res = extract_multihead(ModelOracle(model), bias=True)
    e = worst_errors(res, model.dense_W(), model.V.astype(np.float64))
    tol = 1e-9 if dtype is np.float64 else 2e-5
    assert e["W"] <= tol and e["v"] <= tol
    assert np.max(np.abs(res.C)) <= tol * np.max(np.abs(model.dense_W()))
    assert res.beta == pytest.approx(0.25, abs=1e-6)
    assert res.queries == planned(res)


@pytest.mark.parametrize("H", [1, 2, 3, 5])
def test_head_count_detected(H):
    for seed in (11, 12):
        model = random_multihead(20, H, rng=seed)
        res = extract_multihead(ModelOracle(model), rng=seed)
        assert res.heads == H
        assert worst_errors(res, model.dense_W(), model.V)["W"] <= 1e-10


def test_identical_heads_merge_into_the_canonical_form():
    model = random_multihead(12, 3, rng=5, identical=True)
    res = extract_multihead(ModelOracle(model))
    assert res.heads == 1 and res.canonical
    e = worst_errors(res, model.dense_W()[:1], model.V.sum(axis=0, keepdims=True))
    assert max(e.values()) <= 1e-12
    assert "Proposition 7.1" in res.diagnostics["not_identifiable"]
    with pytest.raises(ModelMismatch) as err:            # asking for the 3 heads cannot be answered
        extract_multihead(ModelOracle(model), heads=3)
    assert err.value.check == "head count" and err.value.figure == 1 and err.value.threshold == 3


def test_zero_head_is_absent_and_equal_heads_merge():
    base = random_multihead(12, 3, rng=6)
    W = base.dense_W().copy()
    V = base.V.copy()
    W[2] = W[0]                     # heads 0 and 2 share W: one head in canonical form
    V[1] = 0.0                      # head 1 is a zero head
    model = MultiHeadAttention(V=V, W=W)
    res = extract_multihead(ModelOracle(model))
    e = worst_errors(res, W[:1], (V[0] + V[2])[None, :])
    assert max(e.values()) <= 1e-12


def test_wrong_head_count_is_a_model_mismatch():
    model = random_multihead(16, 4, rng=7)
    with pytest.raises(ModelMismatch) as err:
        extract_multihead(ModelOracle(model), heads=3)
    assert err.value.figure == 4 and err.value.threshold == 3
    assert "4" in str(err.value) and "3" in str(err.value)
    with pytest.raises(ModelMismatch):
        extract_multihead(ModelOracle(model), max_heads=2)


def test_bad_input():
    oracle = ModelOracle(random_multihead(8, 2, rng=8))
    for kw in ({"heads": 9}, {"heads": 0}, {"heads": 1.5}, {"max_heads": 0}, {"rank": 0}, {"rank": 9}):
        with pytest.raises(ValueError):
            extract_multihead(oracle, **kw)
    with pytest.raises(ValueError):
        multihead_query_count(8, 7)


def test_too_many_heads_for_isolation():
    model = random_multihead(6, 5, rng=9)          # d - H = 1 < 2
    with pytest.raises(NotIdentifiable):
        extract_multihead(ModelOracle(model))


def test_no_switching_head_is_not_identifiable():
    model = MultiHeadAttention(V=np.ones((1, 6)), W=np.zeros((1, 6, 6)))
    with pytest.raises(NotIdentifiable):
        extract_multihead(ModelOracle(model))


def test_budget_and_progress():
    model = random_multihead(10, 2, rng=10)
    seen = []
    res = extract_multihead(ModelOracle(model), progress=seen.append)
    assert sum(seen) == res.queries
    with pytest.raises(BudgetExceeded):
        extract_multihead(ModelOracle(model, budget=100))


def test_reproducible_for_a_seed():
    model = random_multihead(10, 3, rng=11)
    a = extract_multihead(ModelOracle(model), rng=3)
    b = extract_multihead(ModelOracle(model), rng=3)
    assert a.queries == b.queries and np.array_equal(a.W, b.W) and np.array_equal(a.V, b.V)
    assert a.verify(ModelOracle(model), 32).max_rel_err <= 1e-10
