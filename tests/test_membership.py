import json
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from headthief import (ModelMismatch, AttentionHead, BudgetExceeded, CallableOracle, ConvergenceError, InvalidQuery,
                       ModelOracle, NotIdentifiable, random_head)
from headthief.cli import main
from headthief.extraction.robust.membership import extract_membership, householder_basis, membership_query_bound
from headthief.extraction.robust.membership_paper import (bisection_steps, eps_v_required, extract_membership_paper,
                                                   paper_probe_norm, paper_query_count,
                                                   prescribed_sphere_queries, sphere_constant, sphere_estimate)
from headthief.extraction.result import direction_err
from headthief.oracles import SignOnly
from headthief.testing import check_recovery


def sign_oracle(head, R=1.0, **kw):
    return SignOnly(ModelOracle(head, input_norm=R, **kw))


# ---------------------------------------------------------------------------------------------- ours

@settings(max_examples=30, deadline=None)
@given(d=st.integers(1, 12), seed=st.integers(0, 2**31), sparse=st.sampled_from([0.0, 0.5]),
       bias=st.booleans())
def test_membership_recovers_direction_and_W(d, seed, sparse, bias):
    head = random_head(d, rng=seed, sparse_v=sparse, bias=bias)
    if bias:  # keep the threshold inside the ball by a margin (|beta| >= ||v|| is not identifiable)
        assume(abs(head.beta) < 0.5 * np.max(np.abs(head.v)))
    res = extract_membership(sign_oracle(head), bias=bias)
    assert res.v_scale_known is False
    check_recovery(res, head, max_queries=membership_query_bound(d, bias=bias), W_tol=1e-7, v_tol=1e-9,
                   fidelity_n=16, fidelity_tol=1e-6)
    if bias:
        assert res.c is not None and np.linalg.norm(res.c - head.c) <= 1e-7 * max(1, np.linalg.norm(head.c))
        assert abs(res.beta - head.beta / np.linalg.norm(head.v)) <= 1e-9


def test_acceptance_d16_direction_W_and_query_count():
    d = 16
    head = random_head(d, rng=1)
    res = extract_membership(sign_oracle(head), bias=False)
    errs = res.errors(head)
    assert errs["v_rel_err"] is None                      # ||v|| is not identifiable
    assert errs["v_dir_err"] <= 1e-8
    assert errs["W_rel_err"] <= 1e-6
    assert res.diagnostics["v_queries"] <= 64 * d
    assert res.queries <= 64 * (d + d * d)
    assert np.isclose(np.linalg.norm(res.v), 1.0)


def test_zeros_of_v_come_back_as_zeros():
    head = random_head(10, rng=5, sparse_v=0.6)
    zero = head.v == 0
    assert zero.sum() == 6
    res = extract_membership(sign_oracle(head))
    assert np.max(np.abs(res.v[zero])) <= 1e-10
    check_recovery(res, head, W_tol=1e-7, v_tol=1e-9, fidelity_n=0)


def test_W_is_identifiable_exactly_whatever_the_scale_of_v():
    base = random_head(6, rng=8)
    a = extract_membership(sign_oracle(base))
    b = extract_membership(sign_oracle(AttentionHead(v=7.5 * base.v, W=base.W)))
    np.testing.assert_allclose(b.W, a.W, atol=1e-9)
    np.testing.assert_allclose(b.v, a.v, atol=1e-11)        # the same unit direction
    assert a.queries == b.queries


def test_only_the_sign_is_used_value_oracle_gives_the_same_result():
    head = random_head(5, rng=4)
    a = extract_membership(ModelOracle(head, input_norm=1.0))
    b = extract_membership(sign_oracle(head))
    np.testing.assert_array_equal(a.W, b.W)
    assert a.queries == b.queries


def test_every_token_respects_the_norm_bound():
    head = random_head(6, rng=2, bias=True)
    seen = []

    def fn(seqs):
        seen.append(max(float(np.linalg.norm(x, axis=1).max()) for x in seqs))
        return head.evaluate(seqs)

    R = 0.5
    res = extract_membership(SignOnly(CallableOracle(fn, 6, input_norm=R)), bias=True)
    assert max(seen) <= R * (1 + 1e-12)
    check_recovery(res, head, W_tol=1e-7, v_tol=1e-9, fidelity_n=0)


def test_large_scores_are_reasked_at_a_smaller_token_scale():
    rng = np.random.default_rng(3)
    head = AttentionHead(v=rng.standard_normal(6), W=1000 * rng.standard_normal((6, 6)))
    res = extract_membership(sign_oracle(head))
    assert res.diagnostics["requeried"] > 0
    assert res.diagnostics["max_abs_logit"] <= 9
    check_recovery(res, head, W_tol=1e-8, v_tol=1e-9, fidelity_n=0)


def test_bias_without_an_axis_crossing_uses_pair_probes():
    # |beta| > R max|v_i|, but the diagonal probes (e_0 + e_1)/sqrt(2) cross the threshold
    v = np.array([1.0, 1.0, 0.1, -0.05])
    rng = np.random.default_rng(0)
    head = AttentionHead(v=v, W=rng.standard_normal((4, 4)) / 2, c=rng.standard_normal(4) / 2, beta=-1.2)
    res = extract_membership(sign_oracle(head), bias=True)
    check_recovery(res, head, W_tol=1e-7, v_tol=1e-9, fidelity_n=0)
    assert abs(res.beta - (-1.2) / np.linalg.norm(v)) <= 1e-9


def test_rounding_api_is_an_output_bias_under_sign_only():
    # sign(round(f, K)) = [f > 0.5 * 10**-K]: the biased variant recovers W exactly and the threshold
    from headthief.oracles import Tolerance
    head = random_head(6, rng=9)
    make = lambda: SignOnly(Tolerance(ModelOracle(head, input_norm=1.0), None, "round:2"))
    # the unbiased variant reads the rounding threshold as a different head: the model check says so
    with pytest.raises(ModelMismatch, match="sign predictions wrong") as e:
        extract_membership(make())
    plain = e.value.result
    biased = extract_membership(make(), bias=True)
    assert plain.errors(head)["W_rel_err"] > 1e-3
    check_recovery(biased, head, W_tol=1e-7, v_tol=1e-9, fidelity_n=0)
    assert abs(biased.beta * np.linalg.norm(head.v) - (-0.005)) <= 1e-9


def test_not_identifiable_cases():
    with pytest.raises(NotIdentifiable, match="v = 0"):
        extract_membership(sign_oracle(random_head(5, rng=0, v_zero=True)))
    head = AttentionHead(v=np.array([0.3, -0.2, 0.1]), W=np.eye(3), beta=2.0)   # |beta| > R ||v||
    with pytest.raises(NotIdentifiable, match="beta"):
        extract_membership(sign_oracle(head), bias=True)


def test_bisection_cap_raises_convergence_error():
    head = random_head(4, rng=1)
    with pytest.raises(ConvergenceError, match="max_iter = 10"):
        extract_membership(sign_oracle(head), max_iter=10)
    with pytest.raises(ConvergenceError, match="float64 cannot halve"):
        extract_membership(sign_oracle(head), tol=1e-30)


def test_a_black_box_that_never_flips_raises_convergence_error():
    v = np.array([0.5, -1.0, 0.3])

    def last_token_only(seqs):      # not an attention head: the first token never matters
        return [float(x[-1] @ v) for x in seqs]

    with pytest.raises(ConvergenceError, match="no usable sign flip"):
        extract_membership(SignOnly(CallableOracle(last_token_only, 3, input_norm=1.0)), max_retries=2)


def test_budget_is_enforced():
    with pytest.raises(BudgetExceeded):
        extract_membership(sign_oracle(random_head(6, rng=0), budget=500))


def test_householder_basis_is_orthonormal_with_equal_projections():
    v = np.random.default_rng(0).standard_normal(9)
    U = householder_basis(v)
    np.testing.assert_allclose(U.T @ U, np.eye(9), atol=1e-14)
    np.testing.assert_allclose(U.T @ v / np.linalg.norm(v), np.full(9, 1 / 3), atol=1e-14)


def test_cli_acceptance_json(capsys):
    code = main(["extract", "--target", "random:d=16,seed=1", "--method", "membership", "--sign-only",
                 "--json", "--quiet", "--verify", "32"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0
    assert row["v_rel_err"] is None and row["v_dir_err"] <= 1e-8
    assert row["W_rel_err"] <= 1e-6
    assert row["queries"] <= 64 * (16 + 16 * 16)
    assert row["v_scale_known"] is False


# --------------------------------------------------------------------------------------- the paper's

def test_sphere_constant_closed_forms():
    assert math.isclose(sphere_constant(2), 2 / math.pi, rel_tol=1e-12)
    assert math.isclose(sphere_constant(3), 0.5, rel_tol=1e-12)
    x = np.random.default_rng(0).standard_normal((200_000, 8))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    assert abs(np.mean(np.abs(x[:, 0])) - sphere_constant(8)) < 3e-3


def test_prescribed_k_is_astronomical():
    d, eps_W, mu, W, delta = 8, 0.1, 0.2, 2.0, 0.1
    eps_v = eps_W * mu ** 3 / (40 * W * d)
    assert math.isclose(eps_v_required(d, eps_W, mu, W), eps_v)
    k = 2 / (eps_v ** 2 * sphere_constant(d) ** 2) * math.log(2 * d / delta)
    assert math.isclose(prescribed_sphere_queries(d, eps_W, mu, W, delta), k)
    assert k > 1e13


def test_paper_W_bisection_meets_eps_W_with_stated_queries():
    d, W, mu, eps_W = 8, 2.0, 0.2, 0.1
    R = paper_probe_norm(W, mu)
    rng = np.random.default_rng(0)
    for seed in range(3):
        head = random_head(d, rng=seed, W_norm=W, v_norm=1.0, v_min=mu)
        # v_hat within the theorem's eps_v of v in every coordinate (the worst sign pattern is random)
        v_hat = head.v + eps_v_required(d, eps_W, mu, W) * rng.choice([-1.0, 1.0], size=d)
        o = sign_oracle(head, R=R)
        res = extract_membership_paper(o, W_bound=W, mu=mu, eps_W=eps_W, k=0, v_hat=v_hat, check=False)
        assert np.linalg.norm(res.W - head.W) <= eps_W
        assert res.queries == d * d * bisection_steps(d, eps_W, mu, W) == o.queries


def test_paper_sphere_estimator_error_falls_like_one_over_sqrt_k():
    d = 8
    head = random_head(d, rng=3, W_norm=2.0, v_norm=1.0, v_min=0.2)
    errs = {}
    for k in (1_000, 100_000):
        e = [np.max(np.abs(sphere_estimate(sign_oracle(head), k, rng=np.random.default_rng(s)) - head.v))
             for s in range(5)]
        errs[k] = np.mean(e)
    ratio = errs[1_000] / errs[100_000]
    assert 5 < ratio < 20                                    # sqrt(100) = 10
    # and below Hoeffding's bound at delta = 0.01: t = sqrt(2 log(2d/delta) / (R^2 k))
    assert errs[1_000] <= math.sqrt(2 * math.log(2 * d / 0.01) / (sphere_constant(d) ** 2 * 1_000))


def test_paper_full_run_query_count_and_direction():
    d, W, mu = 6, 2.0, 0.3
    head = random_head(d, rng=1, W_norm=W, v_norm=1.0, v_min=mu)
    o = sign_oracle(head, R=paper_probe_norm(W, mu))
    res = extract_membership_paper(o, W_bound=W, mu=mu, eps_W=0.1, k=20_000, rng=0)
    assert res.queries == paper_query_count(d, 20_000, 0.1, mu, W)
    assert res.v_scale_known is False
    assert direction_err(res.v, head.v) < 0.1


def test_paper_refuses_a_norm_bound_its_probes_break_before_querying():
    head = random_head(8, rng=1, W_norm=2.0, v_norm=1.0, v_min=0.2)
    o = sign_oracle(head, R=1.0)
    with pytest.raises(InvalidQuery, match=r"R = 1.*--input-norm 2\.239"):
        extract_membership_paper(o, W_bound=2.0, mu=0.2, k=100)
    assert o.queries == 0
