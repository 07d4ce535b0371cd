"""Adaptive low-rank extraction: exact query counts at the information limit, rank detection,
full-rank fallback, float32 oversampling, biases, and clear errors on bad input."""

import json

import numpy as np
import pytest

from headthief import (AttentionHead, BudgetExceeded, CallableOracle, ModelOracle, NotIdentifiable,
                       extract_lowrank, lowrank_query_count, random_head)
from headthief.cli import main
from headthief.testing import check_recovery


def info_limit(d, r, bias=False):
    return d + r * (2 * d - r) + (d + 1 if bias else 0)


def test_query_count_formula():
    assert lowrank_query_count(4096, 128) == 1_036_288 == info_limit(4096, 128)
    assert lowrank_query_count(4096, 128, auto=True) == 1_036_288 + 4096 - 128
    assert lowrank_query_count(4096, 128, auto=True) <= 1_040_384
    assert lowrank_query_count(50, 5, oversample=3) == info_limit(50, 5) + 3 * (2 * 50 - 2 * 5 - 3)
    assert lowrank_query_count(30, 30) == lowrank_query_count(30, 30, auto=True) == 30 * 30 + 30
    assert lowrank_query_count(30, 3, bias=True) == info_limit(30, 3, bias=True)


@pytest.mark.parametrize("d,r", [(30, 3), (64, 8), (40, 1)])
def test_known_rank_spends_exactly_the_information_limit(d, r):
    head = random_head(d, rng=d + r, rank=r)
    res = extract_lowrank(ModelOracle(head), rank=r, rng=0)
    assert res.rank == r
    assert res.diagnostics["requeried"] == 0
    check_recovery(res, head, queries=info_limit(d, r), W_tol=1e-9)


@pytest.mark.parametrize("d,r", [(40, 4), (50, 1), (60, 12)])
def test_rank_auto_detects_the_rank_for_at_most_d_more_queries(d, r):
    head = random_head(d, rng=7 * d + r, rank=r)
    res = extract_lowrank(ModelOracle(head), rng=1)
    assert res.rank == r
    # one extra right-sketch column (d queries) that saves one left-sketch entry per row
    check_recovery(res, head, queries=lowrank_query_count(d, r, auto=True), W_tol=1e-9,
                   max_queries=info_limit(d, r) + d)
    assert res.diagnostics["rank_search_queries"] == d - r
    assert res.diagnostics["sketch_sv_first_dropped"] < 1e-12 < res.diagnostics["sketch_sv_last_kept"]


def test_full_rank_target_ends_with_rank_d_and_the_exact_cost():
    d = 24
    head = random_head(d, rng=3)
    res = extract_lowrank(ModelOracle(head), rng=0)
    assert res.rank == d
    check_recovery(res, head, queries=d * d + d, W_tol=1e-9)


def test_full_rank_float32_target():
    # the rank of a complete sketch is W's own, not the (square, poorly conditioned) sketch's
    d = 48
    head = random_head(d, rng=1, dtype=np.float32)
    sv = np.linalg.svd(head.dense_W(), compute_uv=False)
    assert sv[-1] / sv[0] > 1e-3          # full rank well above float32 noise
    res = extract_lowrank(ModelOracle(head), rng=0)
    assert res.rank == d
    check_recovery(res, head, queries=d * d + d, W_tol=1e-4, v_tol=1e-6, fidelity_tol=1e-4)


def test_given_full_rank():
    d = 16
    head = random_head(d, rng=4)
    res = extract_lowrank(ModelOracle(head), rank=d, rng=0)
    check_recovery(res, head, queries=d * d + d, W_tol=1e-9)


def test_biases_cost_d_plus_one_more():
    d, r = 30, 3
    head = random_head(d, rng=5, rank=r, bias=True)
    res = extract_lowrank(ModelOracle(head), rank=r, bias=True, rng=0)
    check_recovery(res, head, queries=info_limit(d, r, bias=True), W_tol=1e-9)
    assert res.c is not None and res.beta is not None


def test_sparse_v():
    d, r = 40, 4
    head = random_head(d, rng=6, rank=r, sparse_v=0.6)
    assert np.sum(head.v == 0) >= 20
    res = extract_lowrank(ModelOracle(head), rng=0)
    assert res.rank == r
    check_recovery(res, head, queries=lowrank_query_count(d, r, auto=True), W_tol=1e-9)


def test_float32_oracle_gets_oversampling_automatically():
    d, r = 96, 8
    head = random_head(d, rng=2, rank=r, dtype=np.float32)
    res = extract_lowrank(ModelOracle(head), rng=0)
    dg = res.diagnostics
    assert res.rank == r
    assert dg["precision"] == "float32" and dg["oversample"] == 10
    assert dg["oversample_queries"] == 10 * (2 * d - 2 * r - 10)
    assert res.queries == lowrank_query_count(d, r, oversample=10) + dg["requeried"]
    check_recovery(res, head, W_tol=2e-5, v_tol=1e-6, fidelity_tol=1e-4)
    # the square core without oversampling amplifies the float32 noise far more
    square = extract_lowrank(ModelOracle(head), rank=r, oversample=0, rng=0, check=False)   # the worse design
    assert square.queries == info_limit(d, r) + square.diagnostics["requeried"]
    assert square.errors(head)["W_rel_err"] > 3 * res.errors(head)["W_rel_err"]


def test_float32_with_biases_and_rank_auto():
    # the shape of a real pretrained head (MiniLM: d = 384, rank 32, biases, float32), scaled down
    d, r = 96, 12
    head = random_head(d, rng=11, rank=r, bias=True, dtype=np.float32)
    res = extract_lowrank(ModelOracle(head), bias=True, rng=0)
    assert res.rank == r
    check_recovery(res, head, W_tol=1e-4, v_tol=1e-6, c_tol=1e-5, beta_tol=1e-6, fidelity_tol=1e-4)


def test_explicit_oversampling_on_float64():
    d, r, k = 50, 5, 3
    head = random_head(d, rng=8, rank=r)
    res = extract_lowrank(ModelOracle(head), rank=r, oversample=k, rng=0)
    assert res.diagnostics["oversample_queries"] == k * (2 * d - 2 * r - k)
    check_recovery(res, head, queries=lowrank_query_count(d, r, oversample=k), W_tol=1e-9)


def test_noisy_oracle_with_given_rank_and_oversampling():
    d, r = 48, 4
    head = random_head(d, rng=9, rank=r)
    noise = np.random.default_rng(0)

    def answer(seqs):
        y = head.evaluate(seqs)
        return y + 1e-9 * noise.standard_normal(y.shape)

    # the noise is not declared (no Tolerance wrapper): the model check would rightly refuse f([0]) != 0
    res = extract_lowrank(CallableOracle(answer, d), rank=r, oversample=8, rng=0, check=False)
    assert res.errors(head)["W_rel_err"] < 1e-6
    # rank auto needs a tolerance above the noise: rank_tol says so
    res_auto = extract_lowrank(CallableOracle(answer, d), oversample=8, rank_tol=1e-4, rng=0, check=False)
    assert res_auto.rank == r
    assert res_auto.errors(head)["W_rel_err"] < 1e-6


def test_unit_scales_are_the_papers_probes():
    d, r = 12, 2
    h = random_head(d, rng=10, rank=r)
    head = AttentionHead(v=h.v, left=0.3 * h.left, right=0.3 * h.right)
    res = extract_lowrank(ModelOracle(head), rank=r, scales="unit", rng=0)
    check_recovery(res, head, queries=info_limit(d, r), W_tol=1e-9)


def test_deterministic_for_a_seed():
    head = random_head(20, rng=12, rank=2)
    a = extract_lowrank(ModelOracle(head), rng=5)
    b = extract_lowrank(ModelOracle(head), rng=np.random.default_rng(5))
    assert np.array_equal(a.W, b.W) and a.queries == b.queries


def test_bad_input():
    oracle = ModelOracle(random_head(10, rng=0, rank=2))
    for bad in (0, 11, -1, 2.5, True):
        with pytest.raises(ValueError):
            extract_lowrank(oracle, rank=bad, rng=0)
    with pytest.raises(ValueError):
        extract_lowrank(oracle, oversample=-1, rng=0)
    with pytest.raises(ValueError):
        extract_lowrank(oracle, rank_tol=2.0, rng=0)
    with pytest.raises(ValueError):
        extract_lowrank(oracle, scales="big", rng=0)
    assert oracle.queries == 0
    with pytest.raises(NotIdentifiable):
        extract_lowrank(ModelOracle(random_head(10, rng=0, rank=2, v_zero=True)), rng=0)


def test_budget_is_enforced():
    d, r = 30, 3
    oracle = ModelOracle(random_head(d, rng=1, rank=r), budget=info_limit(d, r) - 1)
    with pytest.raises(BudgetExceeded):
        extract_lowrank(oracle, rank=r, rng=0, check=False)
    ok = ModelOracle(random_head(d, rng=1, rank=r), budget=info_limit(d, r))
    assert extract_lowrank(ok, rank=r, rng=0, check=False).queries == info_limit(d, r)


def test_cli_lowrank_json(capsys):
    assert main(["extract", "--target", "random:d=32,rank=3,seed=1", "--method", "lowrank", "--json",
                 "--quiet", "--verify", "32"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["rank"] == 3 and row["method"] == "lowrank"
    assert row["queries"] == lowrank_query_count(32, 3, auto=True)
    assert row["W_rel_err"] < 1e-9 and row["fidelity_max_rel_err"] < 1e-8
    for key in ("target", "d", "v_rel_err", "c_rel_err", "beta_abs_err", "seconds"):
        assert key in row
    assert main(["extract", "--target", "random:d=32,rank=3,seed=1", "--method", "lowrank", "--json",
                 "--quiet", "--verify", "0", "--rank", "3"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["queries"] == info_limit(32, 3)


def test_cli_lowrank_bad_rank(capsys):
    assert main(["extract", "--target", "random:d=8,rank=2", "--method", "lowrank", "--rank", "x",
                 "--quiet"]) == 2
    assert "--rank" in capsys.readouterr().err
    assert main(["extract", "--target", "random:d=8,rank=2", "--method", "lowrank", "--rank", "9",
                 "--quiet"]) == 2
    assert "rank" in capsys.readouterr().err
