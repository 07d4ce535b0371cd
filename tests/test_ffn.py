"""The ReLU FFN learner (issue 10, item 2 and item 4's first bullet) and its model check."""

import json

import numpy as np
import pytest

from headthief.cli import main
from headthief.errors import BudgetExceeded, InvalidQuery, ModelMismatch, NotIdentifiable
from headthief.extraction.transformer.ffn import extract_ffn
from headthief.extraction.transformer.kinks import find_kinks
from headthief.models.attention import random_head
from headthief.models.ffn import ReLUFFN, canonical, compare_ffn, random_ffn
from headthief.oracles.base import CallableOracle, ModelOracle


def fidelity(res, truth, n=10_000, seed=7):
    """Max |error| / RMS on n Gaussian points, and next to every recovered kink (both sides)."""
    Z = np.random.default_rng(seed).standard_normal((n, truth.d))
    yt = truth(Z)
    rms = np.sqrt(np.mean(yt ** 2))
    near = res.near_kink_points(rng=seed, per_side=2)
    return (np.max(np.abs(res.predict(Z) - yt)) / rms, np.max(np.abs(res.predict(near) - truth(near))) / rms,
            near.shape[0])


# --------------------------------------------------------------------------- the model and its symmetries


def test_model_validates_and_answers_one_token_only():
    f = random_ffn(4, 3, 0)
    assert f(np.zeros((2, 4))).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        ReLUFFN(A=np.ones((4, 3)), w=np.ones(2))
    with pytest.raises(InvalidQuery):
        ModelOracle(f).query(np.zeros((1, 2, 4)))
    assert ModelOracle(f).query(np.ones((3, 1, 4))).shape == (3,)


def test_canonical_and_compare_see_through_permutation_rescaling_and_flips():
    f = random_ffn(6, 5, 1, bias=True)
    c = canonical(f)
    Z = np.random.default_rng(0).standard_normal((100, 6))
    assert np.allclose(c(Z), f(Z), rtol=0, atol=1e-13)
    assert np.allclose(np.linalg.norm(c.A, axis=0), 1.0)
    # permute, rescale by t > 0, flip neuron 0 into a linear term: the same function
    perm = [3, 0, 4, 1, 2]
    t = np.array([2.0, 0.5, 3.0, 1.0, 7.0])
    A, w, b = f.A[:, perm] * t, f.w[perm] / t, f.b1[perm] * t
    k = 1                      # neuron perm[1] = 0 faces the other way
    lin = w[k] * A[:, k]
    b2 = f.b2 + w[k] * b[k]
    A[:, k], b[k] = -A[:, k], -b[k]
    g = ReLUFFN(A=A, w=w, b1=b, b2=b2, linear=lin)
    assert g.neurons == 7
    r = compare_ffn(g, f)
    assert r["matched"] == 5 and r["flips"] == 1
    assert r["neuron_rel_err"] < 1e-13 and r["function_rel_err"] < 1e-13


# --------------------------------------------------------------------------- the bias-free learner


def test_m_below_d_gives_the_exact_canonical_form_with_flips_resolved():
    """Acceptance: ffn:d=32,m=16,seed=1: m neurons, every w_i a_i within 1e-9, function within 1e-10."""
    truth = random_ffn(32, 16, 1)
    res = extract_ffn(ModelOracle(truth), rng=0)
    r = compare_ffn(res.model, truth)
    assert res.diagnostics["flips_resolved"] and res.model.linear is None
    assert res.neurons == 16 and r["matched"] == 16 and r["flips"] == 0
    assert r["neuron_rel_err"] <= 1e-9
    rand, kink, k = fidelity(res, truth)
    assert rand <= 1e-10 and kink <= 1e-10 and k == 4 * 16
    assert 1500 <= res.queries <= 3000          # measured 2,044
    assert res.check.verdict == "pass"


def test_m_above_d_is_functionally_exact_under_10000_queries():
    """Acceptance: ffn:d=32,m=64,seed=1 (m > d): 1e-10 on 10,000 random points and next to every kink."""
    truth = random_ffn(32, 64, 1)
    res = extract_ffn(ModelOracle(truth), rng=0)
    rand, kink, _ = fidelity(res, truth)
    assert rand <= 1e-10 and kink <= 1e-10
    assert res.queries <= 10_000                # measured 7,495
    assert res.diagnostics["neurons"] == 64
    assert res.neurons in (64, 66)               # m with the flips resolved, m + 2 otherwise
    assert compare_ffn(res.model, truth)["matched"] == 64


def test_wide_network_falls_back_to_m_plus_2_and_stays_exact():
    truth = random_ffn(8, 64, 3)                # m = 8 d: the flip search has no unique 0/1 vertex
    res = extract_ffn(ModelOracle(truth), rng=1)
    assert res.diagnostics["neurons"] == 64
    assert res.neurons in (64, 66)
    if not res.diagnostics["flips_resolved"]:
        assert res.neurons == 66 and res.model.linear is not None
    rand, kink, _ = fidelity(res, truth, n=4000)
    assert rand <= 1e-10 and kink <= 1e-10


def test_tiny_neurons_are_found():
    """Sparse option without biases: a quarter of the neurons carry 1e-3 of the usual output weight."""
    truth = random_ffn(16, 32, 5, sparse=0.25)
    res = extract_ffn(ModelOracle(truth), rng=0)
    r = compare_ffn(res.model, truth)
    assert r["matched"] == 32 and r["neuron_rel_err"] <= 1e-7     # relative to each (tiny) neuron
    assert fidelity(res, truth, n=2000)[0] <= 1e-10


def test_same_seed_same_queries():
    truth = random_ffn(8, 6, 2)
    a = extract_ffn(ModelOracle(truth), rng=3)
    b = extract_ffn(ModelOracle(truth), rng=3)
    assert a.queries == b.queries and np.array_equal(a.model.A, b.model.A)


# --------------------------------------------------------------------------- biases (Carlini et al. 2020 style)


def test_biased_ffn_is_recovered_with_its_biases():
    truth = random_ffn(16, 32, 1, bias=True)
    res = extract_ffn(ModelOracle(truth), bias=True, rng=0)
    r = compare_ffn(res.model, truth)
    assert r["matched"] == 32 and r["neuron_rel_err"] <= 1e-9 and r["bias_rel_err"] <= 1e-9
    rand, kink, _ = fidelity(res, truth, n=4000)
    assert rand <= 1e-10 and kink <= 1e-10
    assert res.diagnostics["flips_resolved"] and abs(res.model.b2 - truth.b2) <= 1e-9


def test_rarely_active_neurons_are_not_missed():
    """A third of the neurons fire on ~0.1 % of Gaussian inputs (the neurons a reference attack missed)."""
    truth = random_ffn(32, 48, 2, bias=True, sparse=1 / 3)
    Z = np.random.default_rng(0).standard_normal((20_000, 32))
    share = np.mean((Z @ truth.A + truth.b1) > 0, axis=0)
    assert np.sum(share < 0.01) >= 16            # the test really has rarely active neurons
    res = extract_ffn(ModelOracle(truth), bias=True, rng=0)
    r = compare_ffn(res.model, truth)
    assert r["matched"] == 48 and r["neuron_rel_err"] <= 1e-8
    rand, kink, _ = fidelity(res, truth, n=4000)
    assert rand <= 1e-10 and kink <= 1e-10


# --------------------------------------------------------------------------- float32 answers


class OtherCPU(ModelOracle):
    """A float32 FFN summed in another order: every dot product accumulated one term at a time in a seeded
    permutation of its terms (what another CPU's BLAS blocking does to float32 rounding). The answers differ
    from numpy's by a few ulps, deterministically per input."""

    def __init__(self, ffn, order_seed):
        super().__init__(ffn)
        g = np.random.default_rng(order_seed)
        self.p1, self.p2 = g.permutation(ffn.d), g.permutation(ffn.m)

    def _query(self, X):
        f = self.model
        Z = np.array([np.asarray(x)[-1] for x in X], dtype=np.float32)
        H = np.zeros((Z.shape[0], f.m), dtype=np.float32)
        for j in self.p1:
            H = H + Z[:, j:j + 1] * f.A[j][None, :]
        if f.b1 is not None:
            H = H + f.b1
        H = np.maximum(H, np.float32(0))
        out = np.zeros(Z.shape[0], dtype=np.float32)
        for j in self.p2:
            out = out + H[:, j] * f.w[j]
        if f.b2 is not None:
            out = out + np.float32(f.b2)
        return out.astype(np.float64)


@pytest.mark.parametrize("rounding", ["numpy", "other-cpu"])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_answers_reach_the_precision_they_allow(bias, rounding):
    """A black box computing in float32 (every answer carries ~6e-8 relative rounding): the learner reads
    the precision from the answers, fits each hyperplane to kink points and the output weights by least
    squares. ffn:d=16,m=32,seed=1,dtype=float32 measured 4.1e-6 (bias-free) and 3.3e-6 (biases). The same
    network summed in another order (another CPU's rounding) must reach the same: nothing is tuned to
    one machine's rounding."""
    truth = random_ffn(16, 32, 1, bias=bias, dtype=np.float32)
    exact = random_ffn(16, 32, 1, bias=bias)                 # the same weights, computed in float64
    oracle = ModelOracle(truth) if rounding == "numpy" else OtherCPU(truth, order_seed=11)
    res = extract_ffn(oracle, bias=bias, rng=0)
    assert res.diagnostics["float32_answers"] and res.check.verdict == "pass"
    assert res.check.threshold <= 2e-4                       # the threshold follows the measured noise
    assert res.diagnostics["neurons"] == 32
    assert res.diagnostics["hyperplanes_from_kink_points"] == 32
    r = compare_ffn(res.model, exact)
    assert r["matched"] == 32 and r["neuron_rel_err"] <= 1e-3
    rand, kink, k = fidelity(res, exact, n=4000)
    assert rand <= 1e-4 and kink <= 1e-4 and k == 4 * 32
    assert res.queries <= 40_000                   # measured 9,415 (bias-free) and 18,703 (biases)


@pytest.mark.parametrize("seed", [21, 23, 25])
def test_float32_learner_tries_harder_until_the_values_read_are_explained(seed):
    """Networks where a neuron used to be dropped as a phantom (the fit of the values read was 7e-5 to 5e-2
    of their largest, against 1.3e-6 when complete): the learner adds paths until the values are explained
    to FIT_LIMIT_EPS eps, or says which neuron it could not pin down."""
    from headthief.extraction.transformer.ffn import FIT_LIMIT_EPS
    bias = seed != 21
    truth = random_ffn(16, 32, seed, bias=bias, dtype=np.float32)
    exact = random_ffn(16, 32, seed, bias=bias)
    res = extract_ffn(OtherCPU(truth, order_seed=seed), bias=bias, rng=0)
    assert res.diagnostics["output_fit_rel_residual"] <= FIT_LIMIT_EPS * 2.0 ** -24
    assert compare_ffn(res.model, exact)["matched"] == 32
    assert fidelity(res, exact, n=4000)[0] <= 1e-4


def test_float32_kink_search_sees_every_kink_of_a_chord():
    """Tolerances from float32 rounding (16 eps S, slopes over 1/16 of the interval): close kinks and
    kinks whose slope change is 1e-2 of the function's scale are found, located to ~1e-6."""
    rng = np.random.default_rng(3)
    ts = np.sort(rng.uniform(0.05, 0.95, 12))
    J = rng.choice([-1.0, 1.0], 12) * rng.uniform(0.01, 0.3, 12)

    def g(t):
        t = np.asarray(t, dtype=np.float64)
        v = 0.3 + 0.5 * t + np.maximum(t[:, None] - ts[None, :], 0.0) @ J
        return v.astype(np.float32).astype(np.float64)          # float32 rounding of every answer

    S = 1.0
    kinks, spent, _ = find_kinks(g, tau=16 * 2.0 ** -24 * S, max_evals=5000, rng=np.random.default_rng(0),
                                 h0=1 / 16, min_width=4e-6)
    found = np.array([k.t for k in kinks])
    assert len(found) == 12 and np.max(np.abs(found - ts)) <= 1e-4
    assert spent < 400


# --------------------------------------------------------------------------- faint neurons (float32 answers)


def _faint_setup(seed, rounding, faint=(0,), scale=1e-3):
    """A float32 FFN with biases whose neurons ``faint`` have output weights ``scale`` times their draw (torch
    default init draws a few such), the learner's homogeneous view of it, and its true neurons."""
    from headthief.extraction.transformer import ffn as F
    t = random_ffn(16, 32, seed, bias=True, dtype=np.float32)
    w = np.array(t.w, dtype=np.float32)
    w[list(faint)] *= np.float32(scale)
    truth = ReLUFFN(A=t.A, w=w, b1=t.b1, b2=t.b2, dtype=np.float32)
    oracle = ModelOracle(truth) if rounding == "numpy" else OtherCPU(truth, order_seed=5)
    H = np.vstack([np.asarray(truth.A, float), np.asarray(truth.b1, float)[None]])
    nrm = np.linalg.norm(H, axis=0)
    neurons = [F._Neuron(n=H[:, k] / nrm[k], gamma=float(truth.w[k]) * nrm[k], refined=True, lines=1)
               for k in range(32)]
    Hm = F._Homog(oracle, True, None, None)
    ctx = F._Ctx(F=Hm, D=17, bias=True, eps=2.0 ** -24, rng=np.random.default_rng(0), scale=0.1)
    return F, truth, neurons, ctx


@pytest.mark.parametrize("rounding", ["numpy", "other-cpu"])
def test_a_predicted_kink_the_search_passed_over_is_looked_for_before_dropping(rounding):
    """A recovered neuron whose kink the chord search did not report is checked where it is predicted (four
    values): the true kink is confirmed, a kink predicted where there is none is not."""
    F, truth, neurons, ctx = _faint_setup(3, rounding, faint=())
    g = np.random.default_rng(1)
    N = np.array([nu.n for nu in neurons])
    gam = np.array([nu.gamma for nu in neurons])
    confirmed = rejected = 0
    for _ in range(6):
        P, Q, R = F._path(ctx, g)
        A, U = P, Q - P
        tk = -(N @ A) / (N @ U)
        inside = np.flatnonzero((tk > 0.02) & (tk < 0.98))
        S = float(np.max(np.abs(ctx.F(A[None, :] + np.linspace(0, 1, 5)[:, None] * U[None, :]))))
        tau = 16 * ctx.eps * S
        for i in inside:
            ok, q = F._kink_there(ctx, A, U, float(tk[i]), float(gam[i] * abs(N[i] @ U)), tk[inside], tau)
            if q:                      # a kink the answers can judge
                assert ok
                confirmed += 1
            # the same kink predicted 0.01 away, where no neuron crosses
            t1 = float(tk[i]) + 0.01
            if np.min(np.abs(tk - t1)) > 0.005 and t1 < 1:
                ok, q = F._kink_there(ctx, A, U, t1, float(gam[i] * abs(N[i] @ U)), np.append(tk[inside], tk[i]), tau)
                if q:
                    assert not ok
                    rejected += 1
    assert confirmed >= 20 and rejected >= 10


@pytest.mark.parametrize("rounding", ["numpy", "other-cpu"])
def test_a_faint_neuron_is_found_on_the_residual_and_fit_to_the_values(rounding):
    """A neuron whose output weight is 1e-3 of its draw bends the answers by ~1e-5 of their scale, often
    too little for the chord search beside the others' kinks. With every other neuron known, the residual of
    the fit shows it (its kink is the only one there) and the values read place its hyperplane (variable
    projection): found to 1 - cos <= 1e-4, and the fit then explains the values to FIT_LIMIT_EPS eps."""
    F, truth, neurons, ctx = _faint_setup(4, rounding, faint=(0,))
    faint = neurons.pop(0)
    g = np.random.default_rng(2)
    Z = g.standard_normal((3000, 17))
    Z[:, -1] = np.abs(Z[:, -1]) + 0.5
    ctx.samples.extend(zip(Z, ctx.F(Z)))
    gam, lin, fit = F._fit_output(ctx, np.array([nu.n for nu in neurons]), np.array([nu.gamma for nu in neurons]),
                                  np.zeros(17))
    assert fit > F.FIT_LIMIT_EPS * ctx.eps                # the values read show that a neuron is missing
    best = None
    for _ in range(3):
        found, q = F._residual_path(ctx, neurons, gam, lin, g, max_evals=20_000)
        for cand, z in found:
            new, res = F._fit_faint(ctx, neurons, cand)
            if new is not None and (best is None or res < best[1]):
                best = (new, res)
        if best is not None and best[1] <= F.FIT_LIMIT_EPS * ctx.eps:
            break
    assert best is not None
    new, res = best
    assert 1 - abs(float(new.n @ faint.n)) <= 1e-4
    assert abs(new.gamma - faint.gamma) <= 0.05 * abs(faint.gamma)
    assert res <= F.FIT_LIMIT_EPS * ctx.eps


# --------------------------------------------------------------------------- out of class, bad input, budgets


def test_tanh_network_is_a_model_mismatch():
    rng = np.random.default_rng(0)
    A, w = rng.standard_normal((8, 16)) / 3, rng.standard_normal(16)

    def tanh_net(seqs):
        return [float(np.tanh(s[-1] @ A) @ w) for s in seqs]

    with pytest.raises(ModelMismatch) as e:
        extract_ffn(CallableOracle(tanh_net, 8))
    assert e.value.check == "homogeneity"
    with pytest.raises(ModelMismatch) as e:
        extract_ffn(CallableOracle(tanh_net, 8), bias=True)
    assert e.value.check == "piecewise linear"


def test_attention_head_on_one_token_is_a_model_mismatch():
    with pytest.raises(ModelMismatch) as e:
        extract_ffn(ModelOracle(random_head(8, rng=1)))
    assert e.value.check == "kinks"
    with pytest.raises(ModelMismatch) as e:
        extract_ffn(ModelOracle(random_head(8, rng=1, bias=True)))
    assert e.value.check == "zero token"


def test_biased_target_read_without_bias_fails_the_zero_token():
    with pytest.raises(ModelMismatch) as e:
        extract_ffn(ModelOracle(random_ffn(8, 4, 0, bias=True)))
    assert e.value.check == "zero token"


def test_zero_network_is_not_identifiable():
    with pytest.raises(NotIdentifiable):
        extract_ffn(ModelOracle(ReLUFFN(A=np.ones((4, 2)), w=np.zeros(2))))


def test_budgets_and_settings():
    truth = random_ffn(8, 8, 0)
    with pytest.raises(BudgetExceeded):
        extract_ffn(ModelOracle(truth), max_queries=100, check=False)
    with pytest.raises(BudgetExceeded):
        extract_ffn(ModelOracle(truth, budget=50))
    with pytest.raises(ValueError):
        extract_ffn(ModelOracle(truth), max_paths=1)


def test_kink_search_separates_close_kinks_and_sees_small_ones():
    # kinks at 0.3 and 0.3 + 1e-6 (opposite slope changes) and a 1e-6-sized one at 0.8
    def g(t):
        t = np.asarray(t)
        return (np.maximum(t - 0.3, 0) - 2 * np.maximum(t - 0.3 - 1e-6, 0) + 1e-6 * np.maximum(t - 0.8, 0)
                + 0.5 * t)

    kinks, spent, _ = find_kinks(g, tau=1e-14, max_evals=2000, rng=np.random.default_rng(0))
    ts = [k.t for k in kinks]
    assert len(ts) == 3 and abs(ts[0] - 0.3) < 1e-9 and abs(ts[1] - 0.3 - 1e-6) < 1e-9 and abs(ts[2] - 0.8) < 1e-6
    assert spent < 200


# --------------------------------------------------------------------------- the command line


def test_cli_ffn_target_and_method(capsys):
    code = main(["extract", "--target", "ffn:d=12,m=8,seed=1", "--method", "ffn", "--json", "--quiet"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0
    assert row["neurons"] == 8 and row["neurons_needed"] == 8 and row["flips_resolved"]
    assert row["neuron_rel_err"] <= 1e-9 and row["fidelity_max_rel_err"] <= 1e-10
    assert row["model_check"]["verdict"] == "pass" and row["queries"] > 0


def test_cli_out_of_class_exits_5(capsys):
    code = main(["extract", "--target", "random:d=8,seed=1", "--method", "ffn", "--quiet"])
    assert code == 5 and "no kink" in capsys.readouterr().err
