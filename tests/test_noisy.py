import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from headthief import AttentionHead, ConvergenceError, ModelOracle, NotIdentifiable, random_head
from headthief.cli import main
from headthief.extraction.robust.noisy import extract_noisy, noisy_query_count
from headthief.extraction.robust.noisy_paper import (extract_noisy_paper, noisy_paper_query_count, theorem_tolerance,
                                              theorem_W_bound)
from headthief.oracles import Tolerance
from headthief.testing import check_recovery


def noisy_oracle(head, tau, mode="adversarial", R=1.0, key=0):
    return Tolerance(ModelOracle(head, input_norm=R), None if mode.startswith("round") else tau, mode, key=key)


def test_theorem_tolerance_uses_the_proofs_constants():
    # mu eps_W / (80 W^2 d), halved for the zero-entry case
    assert theorem_tolerance(16, 4, 0.1, 0.05) == pytest.approx(0.1 * 0.05 / (80 * 16 * 16) / 2, rel=1e-12)
    assert theorem_tolerance(16, 4, 0.1, 0.05, zeros=False) == pytest.approx(0.1 * 0.05 / (80 * 16 * 16))
    assert theorem_tolerance(4, 2, 0.5, 0.9, eps_v=1e-6) == pytest.approx(1e-6 / 2)
    assert theorem_tolerance(1, 2, 0.01, 1e6) == 0.005                   # mu / 2
    assert theorem_W_bound(theorem_tolerance(16, 4, 0.1, 0.05), 16, 4, 0.1) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="W >= 2"):
        theorem_tolerance(16, 1.5, 0.1, 0.05)
    with pytest.raises(ValueError, match="W >= 2"):
        extract_noisy_paper(ModelOracle(random_head(3, rng=0)), W_bound=1.0, mu=0.1)


@pytest.mark.parametrize("seed", range(4))
def test_theorem_6_1_guarantee_at_the_prescribed_tolerance(seed):
    d, W, mu, eps_W, eps_v = 16, 4.0, 0.1, 0.05, 0.05
    head = random_head(d, rng=seed, W_norm=W, v_norm=1.0, v_min=mu, sparse_v=0.25)   # zeros in v too
    tau = theorem_tolerance(d, W, mu, eps_W, eps_v)
    res = extract_noisy_paper(noisy_oracle(head, tau, key=seed), W_bound=W, mu=mu)
    assert res.queries == noisy_paper_query_count(d) == d + d * d
    assert np.linalg.norm(res.W - head.W) <= eps_W
    assert np.linalg.norm(res.v - head.v) <= eps_v
    assert res.diagnostics["zero_entries_v"] == 4 and res.diagnostics["clipped"] == 0


@settings(max_examples=30, deadline=None)
@given(d=st.integers(2, 12), seed=st.integers(0, 2**31), W=st.floats(2.0, 20.0), sparse=st.sampled_from([0.0, 0.4]),
       eps_W=st.floats(0.01, 0.9), mode=st.sampled_from(["adversarial", "uniform"]))
def test_theorem_6_1_guarantee_property(d, seed, W, sparse, eps_W, mode):
    mu = 0.9 / np.sqrt(d)                      # v_min * sqrt(nnz) <= ||v|| = 1
    head = random_head(d, rng=seed, W_norm=W, v_norm=1.0, v_min=mu, sparse_v=sparse)
    tau = theorem_tolerance(d, W, mu, eps_W, eps_W)
    res = extract_noisy_paper(noisy_oracle(head, tau, mode, key=seed), W_bound=W, mu=mu)
    assert res.queries == d + d * d
    assert np.linalg.norm(res.v - head.v) <= eps_W
    # The proof's gap: a zero row i is probed with e_i + e_p, whose logit ab (W_ij + W_pj) can leave the
    # clip interval when |W_ij + W_pj| > W (it can reach sqrt(2) W). There the guarantee need not hold,
    # and the estimator must say so; everywhere else it must hold.
    p = int(np.argmax(np.abs(head.v)))
    zero = np.flatnonzero(head.v == 0)
    gap = zero.size > 0 and np.max(np.abs(head.W[zero] + head.W[p])) > W
    if gap and res.diagnostics["clipped"] > 0:
        return
    assert res.diagnostics["clipped"] == 0
    assert np.linalg.norm(res.W - head.W) <= eps_W


def test_paper_estimator_is_exact_without_noise_and_keeps_the_norm_bound():
    head = random_head(9, rng=3, W_norm=2.0, v_norm=1.0, v_min=0.2, sparse_v=0.4)
    # R = 1, W = 2 with zeros in v: the e_i + e_p probes with j in {i, p} have norm 1.118 and are shrunk
    res = extract_noisy_paper(ModelOracle(head, input_norm=1.0), W_bound=2.0, mu=0.2)
    check_recovery(res, head, queries=90, W_tol=1e-11, fidelity_n=16)
    assert res.diagnostics["shrunk_probes"] > 0
    res = extract_noisy_paper(ModelOracle(head, input_norm=0.5), W_bound=2.0, mu=0.2)  # every probe shrunk
    check_recovery(res, head, queries=90, W_tol=1e-10, fidelity_n=16)


@pytest.mark.parametrize("mode", ["adversarial", "uniform", "round:4"])
@pytest.mark.parametrize("W_norm,factor", [(2.0, 2.0), (8.0, 10.0)])
def test_ours_beats_the_paper_at_the_same_queries_and_norm_bound(mode, W_norm, factor):
    d, tau = 12, 1e-4
    for seed in range(2):
        head = random_head(d, rng=seed, W_norm=W_norm, v_norm=1.0, v_min=0.1)
        paper = extract_noisy_paper(noisy_oracle(head, tau, mode), W_bound=W_norm, mu=0.1)
        o = noisy_oracle(head, tau, mode)
        ours = extract_noisy(o, tau=o.tau, W_bound=W_norm)
        assert ours.queries == paper.queries == d + d * d
        ep, eo = paper.errors(head)["W_rel_err"], ours.errors(head)["W_rel_err"]
        assert eo * factor <= ep, (seed, ep, eo)
        assert eo <= 100 * o.tau * W_norm        # and small in absolute terms


def test_small_benchmark_suite():
    # the benchmark's suite at d = 16 (benchmarks/bench_noisy.py runs d = 32): every cell, one seed
    d = 16
    for W_norm, factor in [(2.0, 2.0), (8.0, 10.0), (32.0, 10.0)]:
        head = random_head(d, rng=11, W_norm=W_norm, v_norm=1.0, v_min=0.1)
        for tau in (1e-6, 1e-4, 1e-2):
            for mode in ("adversarial", "uniform", f"round:{int(-np.log10(tau))}"):
                paper = extract_noisy_paper(noisy_oracle(head, tau, mode), W_bound=W_norm, mu=0.1)
                o = noisy_oracle(head, tau, mode)
                ours = extract_noisy(o, tau=o.tau, W_bound=W_norm)
                assert ours.queries == paper.queries == d + d * d
                ep, eo = paper.errors(head)["W_rel_err"], ours.errors(head)["W_rel_err"]
                assert eo * factor <= ep, (W_norm, tau, mode, ep, eo)


def test_query_counts():
    assert noisy_query_count(16) == 272 == noisy_paper_query_count(16)
    assert noisy_query_count(16, bias=True) == 289
    assert noisy_query_count(16, extra=3) == 320


@settings(max_examples=25, deadline=None)
@given(d=st.integers(1, 10), seed=st.integers(0, 2**31), sparse=st.sampled_from([0.0, 0.3, 0.7]),
       bias=st.booleans(), mode=st.sampled_from(["adversarial", "uniform"]))
def test_ours_recovers_any_random_head_with_tiny_noise(d, seed, sparse, bias, mode):
    head = random_head(d, rng=seed, sparse_v=sparse, bias=bias)
    o = noisy_oracle(head, 1e-10, mode, key=seed)
    res = extract_noisy(o, tau=1e-10, bias=bias)
    # v_i = f([e_i]) - beta, two answers each within +-tau: relative error up to 2 tau sqrt(d) / ||v||
    # (v may be tiny; 2.5 tau leaves room for the rounding of the answers themselves)
    v_tol = max(1e-8, 2.5e-10 * np.sqrt(d) / np.linalg.norm(head.v))
    check_recovery(res, head, queries=noisy_query_count(d, bias=bias) + res.diagnostics["requeried"],
                   W_tol=1e-4, v_tol=v_tol, c_tol=1e-4, beta_tol=1e-9, fidelity_tol=1e-4, fidelity_n=16)


def test_ours_with_biases_zeros_and_rounding():
    head = random_head(10, rng=5, W_norm=8.0, v_norm=1.0, v_min=0.1, sparse_v=0.3, bias=True)
    o = noisy_oracle(head, None, "round:5")
    res = extract_noisy(o, tau=o.tau, W_bound=8.0, bias=True)
    check_recovery(res, head, queries=noisy_query_count(10, bias=True), W_tol=1e-3, v_tol=1e-4,
                   c_tol=1e-3, beta_tol=1e-5, fidelity_tol=1e-3, fidelity_n=16)
    assert res.diagnostics["mixed_rows"] > 0     # zeros of v: rows mixed with e_p


def test_ours_respects_a_smaller_norm_bound():
    head = random_head(8, rng=2, W_norm=8.0, v_norm=1.0, v_min=0.1)
    res = extract_noisy(noisy_oracle(head, 1e-6, R=0.25), tau=1e-6)
    assert res.queries == 72 and res.diagnostics["rho_max"] <= 0.25
    assert res.errors(head)["W_rel_err"] < 0.05     # the oracle refuses any token above R: none was sent


def test_an_outlying_entry_is_reasked_not_clipped():
    d = 8
    W = np.zeros((d, d))
    W[2, 5] = 32.0
    head = AttentionHead(v=random_head(d, rng=1, v_norm=1.0, v_min=0.1).v, W=W)
    # logits of 32 under tau = 1e-6: W is found to 0.05, far from what the fidelity check accepts
    res = extract_noisy(noisy_oracle(head, 1e-6), tau=1e-6, W_bound=32.0, check=False)
    assert res.diagnostics["requeried"] >= 1 and res.queries == 72 + res.diagnostics["requeried"]
    assert np.linalg.norm(res.W - W) < 0.05
    paper = extract_noisy_paper(noisy_oracle(head, 1e-6), W_bound=32.0, mu=0.1, check=False)
    assert np.linalg.norm(res.W - W) < np.linalg.norm(paper.W - W)
    fixed = extract_noisy(noisy_oracle(head, 1e-6), tau=1e-6, W_bound=32.0, reask=False, check=False)
    assert fixed.queries == 72 and fixed.diagnostics["requeried"] == 0


def test_reasks_are_bounded():
    W = np.zeros((4, 4))
    W[1, 2] = 1e6
    head = AttentionHead(v=np.array([0.5, 0.4, 0.3, 0.6]), W=W)
    with pytest.raises(ConvergenceError, match="still saturated after 3 re-asks"):
        extract_noisy(ModelOracle(head, input_norm=1.0), max_retries=3)


def test_extra_probes_use_least_squares():
    head = random_head(10, rng=4, W_norm=8.0, v_norm=1.0, v_min=0.1)
    errs = []
    for extra in (0, 10):
        res = extract_noisy(noisy_oracle(head, 1e-4, "uniform"), tau=1e-4, extra=extra, rng=0)
        assert res.queries == noisy_query_count(10, extra=extra)
        errs.append(res.errors(head)["W_rel_err"])
    assert errs[1] < errs[0]


def test_v_zero_is_not_identifiable():
    head = random_head(5, rng=0, v_zero=True, W_norm=4.0)
    with pytest.raises(NotIdentifiable, match="not identifiable"):
        extract_noisy(noisy_oracle(head, 1e-6), tau=1e-6)
    with pytest.raises(NotIdentifiable, match="not identifiable"):
        extract_noisy_paper(noisy_oracle(head, 1e-6), W_bound=4.0, mu=0.1)


def _cli_json(capsys, *argv):
    code = main(["extract", *argv, "--json", "--quiet", "--verify", "16"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else out.err)


def test_cli_noisy_methods(capsys):
    spec = "random:d=8,seed=1,W_norm=8,v_norm=1,v_min=0.1"
    code, paper = _cli_json(capsys, "--target", spec, "--method", "noisy-paper", "--noise", "1e-4")
    assert code == 0 and paper["queries"] == 72 and paper["input_norm"] == 1.0 and paper["W_bound"] == 8.0
    code, ours = _cli_json(capsys, "--target", spec, "--method", "noisy", "--noise", "1e-4",
                           "--noise-mode", "uniform")
    assert code == 0 and ours["queries"] == 72 and ours["tau"] == 1e-4
    assert ours["W_rel_err"] * 10 <= paper["W_rel_err"]
    assert ours["fidelity_max_rel_err"] < 1e-2          # checked against the clean target
    code, ours = _cli_json(capsys, "--target", spec, "--method", "noisy", "--noise-mode", "round:4")
    assert code == 0 and ours["tau"] == 5e-5
    code, err = _cli_json(capsys, "--target", "random:d=8,seed=1", "--method", "noisy-paper", "--noise", "1e-4")
    assert code == 2 and "--W-bound" in err
    code, err = _cli_json(capsys, "--target", "random:d=8,seed=1,bias=1", "--method", "noisy-paper",
                          "--W-bound", "4", "--mu", "0.1")
    assert code == 2 and "no biases" in err
    code, err = _cli_json(capsys, "--target", spec, "--method", "noisy", "--input-norm", "-1")
    assert code == 2 and "--input-norm" in err
