"""Theorem 5.1: Gaussian rank-one measurements, nuclear-norm (cvxpy) and ALS solvers."""

import json

import numpy as np
import pytest

from headthief import (ModelMismatch, AttentionHead, ConvergenceError, ModelOracle, extract_rop, random_head,
                       rop_query_count)
from headthief.cli import main
from headthief.extraction.single.rop import rop_measurement_count
from headthief.extraction.single.sensing_als import solve_als
from headthief.extraction.single.sensing_convex import CONVEX_MAX_D, solve_nuclear
from headthief.testing import check_recovery


def measurements(d, r, C):
    return int(np.ceil(C * r * (2 * d - r)))


def test_counts():
    assert rop_measurement_count(400, 8, 1.5) == 9504
    assert rop_query_count(400, 8, oversampling=1.5) == 400 + 9504
    assert rop_query_count(20, 2, solver="convex") == 20 + measurements(20, 2, 3)
    assert rop_query_count(20, 2, measurements=100, bias=True) == 20 + 21 + 100


def test_als_recovers_from_one_and_a_half_times_the_degrees_of_freedom():
    d, r = 40, 3
    head = random_head(d, rng=1, rank=r)
    res = extract_rop(ModelOracle(head), rank=r, solver="als", oversampling=1.5, rng=0)
    assert res.diagnostics["stop"] == "converged"
    check_recovery(res, head, queries=d + measurements(d, r, 1.5), W_tol=1e-8)


def test_convex_recovers_the_papers_program():
    pytest.importorskip("cvxpy", reason="cvxpy is not installed (pip install 'headthief[convex]')")
    d, r = 12, 1
    head = random_head(d, rng=2, rank=r)
    res = extract_rop(ModelOracle(head), rank=r, solver="convex", oversampling=3, rng=0)
    assert res.diagnostics["solution_rank"] == r
    check_recovery(res, head, queries=d + measurements(d, r, 3), W_tol=1e-6, fidelity_tol=1e-5)


def test_convex_refuses_large_d_before_any_query():
    d = CONVEX_MAX_D + 1
    oracle = ModelOracle(random_head(d, rng=0, rank=2))
    with pytest.raises(ValueError, match="als"):
        extract_rop(oracle, rank=2, solver="convex", rng=0)
    assert oracle.queries == 0
    with pytest.raises(ValueError, match=str(CONVEX_MAX_D)):
        solve_nuclear(np.zeros((3, d)), np.zeros((3, d)), np.zeros(3))


def test_rank_auto_runs_a_small_preamble():
    d, r = 30, 3
    head = random_head(d, rng=3, rank=r)
    res = extract_rop(ModelOracle(head), rank=None, solver="als", oversampling=2, rng=0)
    assert res.rank == r
    pre = res.diagnostics["rank_queries"]
    assert pre == (r + 2) ** 2
    check_recovery(res, head, queries=d + measurements(d, r, 2) + pre, W_tol=1e-8)


def test_biases_and_given_measurement_count():
    d, r, m = 24, 2, 200
    head = random_head(d, rng=4, rank=r, bias=True)
    res = extract_rop(ModelOracle(head), rank=r, measurements=m, bias=True, rng=0)
    check_recovery(res, head, queries=d + d + 1 + m, W_tol=1e-8)


def test_unit_scales_are_the_papers_probes():
    d, r = 10, 2
    h = random_head(d, rng=5, rank=r)
    head = AttentionHead(v=h.v, left=0.2 * h.left, right=0.2 * h.right)
    res = extract_rop(ModelOracle(head), rank=r, oversampling=2, scales="unit", rng=0)
    check_recovery(res, head, queries=d + measurements(d, r, 2), W_tol=1e-8)


def test_bad_input():
    oracle = ModelOracle(random_head(10, rng=0, rank=2))
    with pytest.raises(ValueError):
        extract_rop(oracle, rank=11, rng=0)
    with pytest.raises(ValueError):
        extract_rop(oracle, rank=2, measurements=10, oversampling=2, rng=0)
    with pytest.raises(ValueError):
        extract_rop(oracle, rank=2, oversampling=-1, rng=0)
    with pytest.raises(ValueError):
        extract_rop(oracle, rank=2, solver="sdp", rng=0)
    with pytest.raises(ValueError, match="lowrank"):
        extract_rop(ModelOracle(random_head(4096, rng=0, rank=2)), rank=128, rng=0)
    assert oracle.queries == 0


def test_als_solver_stops_for_a_reason():
    rng = np.random.default_rng(0)
    d, r = 30, 2
    W = rng.standard_normal((d, r)) @ rng.standard_normal((d, r)).T / d
    m = measurements(d, r, 2)
    A, B = rng.standard_normal((m, d)), rng.standard_normal((m, d))
    t = np.einsum("ij,ij->i", A @ W, B)
    with pytest.raises(ConvergenceError, match="cap"):
        solve_als(A, B, t, r, max_iter=2)
    noisy = solve_als(A, B, t + 1e-9 * rng.standard_normal(m), r)
    assert noisy.reason == "noise floor"
    assert np.linalg.norm(noisy.U @ noisy.V.T - W) / np.linalg.norm(W) < 1e-7
    with pytest.raises(ConvergenceError, match="stalled"):
        solve_als(A, B, rng.standard_normal(m), r)      # no rank-2 matrix fits random numbers


def test_cli_rop(capsys):
    assert main(["extract", "--target", "random:d=30,rank=2,seed=1", "--method", "rop", "--rank", "2",
                 "--oversampling", "1.5", "--json", "--quiet", "--verify", "16"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["rank"] == 2 and row["solver"] == "als"
    assert row["queries"] == 30 + measurements(30, 2, 1.5)
    assert row["W_rel_err"] < 1e-8
    assert main(["extract", "--target", "random:d=80,rank=2", "--method", "rop", "--solver", "convex",
                 "--quiet"]) == 2
    assert "--solver als" in capsys.readouterr().err


def test_too_few_measurements_warn_and_fail_honestly(capsys):
    d, r = 16, 2
    head = random_head(d, rng=4, rank=r)
    # the model check sees what the warning says: the recovered head does not reproduce the target
    with pytest.raises(ModelMismatch, match="fidelity") as e:
        extract_rop(ModelOracle(head), rank=r, oversampling=0.5, rng=0)
    res = e.value.result
    assert "fewer than the 60 degrees of freedom" in res.diagnostics["warning"]
    assert res.errors(head)["W_rel_err"] > 1e-3          # underdetermined: no exact recovery
    ok = extract_rop(ModelOracle(head), rank=r, oversampling=1.5, rng=0)
    assert "warning" not in ok.diagnostics
    code = main(["extract", "--target", f"random:d={d},rank={r},seed=4", "--method", "rop", "--rank", str(r),
                 "--oversampling", "0.5", "--quiet", "--json", "--no-check"])
    assert code == 0 and "warning: 30 rank-one measurements" in capsys.readouterr().err


def test_float32_answers_weighted_and_oversampled():
    # float32 answers: the stall at the rounding floor is convergence, measurements are weighted by their
    # rounding error and the default oversampling doubles. The bound: a float32 measurement carries an
    # error of about 1e-7 of ||a|| ||b|| after weighting (median; measured 3e-8 to 6e-8 on this CPU), so W
    # comes out near 1e-6 (measured 3e-7 to 2e-6 on 20 targets); 1e-4 leaves a factor 50 for other BLAS
    # roundings and is still 100x below what the unweighted, un-oversampled fit reached (up to 5e-5,
    # or no convergence at all).
    from headthief.extraction.single.rop import DEFAULT_OVERSAMPLING, FLOAT32_OVERSAMPLING
    d, r = 32, 2
    for seed in (3, 4):
        h = random_head(d, rng=seed, rank=r, dtype=np.float32)
        W = np.asarray(h.left @ h.right.T, dtype=np.float64)
        res = extract_rop(ModelOracle(h), rank=r, rng=seed, check=False)
        assert res.diagnostics["precision"] == "float32"
        assert res.diagnostics["stop"] in ("noise floor", "converged")
        assert res.diagnostics["stall_tol"] == pytest.approx(2.0 ** -12)
        m = measurements(d, r, DEFAULT_OVERSAMPLING["als"] * FLOAT32_OVERSAMPLING)
        assert res.diagnostics["measurements"] == m
        assert res.queries == rop_query_count(d, r, float32=True) + res.diagnostics["requeried"]
        assert np.linalg.norm(res.W - W) / np.linalg.norm(W) < 1e-4


def test_als_stall_tolerance_follows_the_answers():
    from headthief.extraction.single.sensing_als import STALL_TOL, als_stall_tol
    assert als_stall_tol(2.0 ** -53) == STALL_TOL            # float64: unchanged
    assert als_stall_tol(2.0 ** -24) == pytest.approx(2.44e-4, rel=1e-3)
