import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from headthief import CallableOracle, InvalidQuery, ModelOracle, random_head
from headthief.cli import main
from headthief.oracles import Tolerance
from headthief.oracles.tolerance import parse_mode, round_tolerance


def _batch(rng, n=40, N=3, d=5, scale=0.3):
    return scale * rng.standard_normal((n, N, d))


@pytest.mark.parametrize("mode", ["adversarial", "uniform", "round:3"])
def test_answers_are_within_tau_and_deterministic(mode):
    head = random_head(5, rng=1)
    clean = ModelOracle(head)
    noisy = Tolerance(ModelOracle(head), None if mode.startswith("round") else 1e-3, mode)
    X = _batch(np.random.default_rng(0))
    y, y0 = noisy.query(X), clean.query(X)
    tau = noisy.tau
    assert np.all(np.abs(y - y0) <= tau * (1 + 1e-9) + 1e-15)
    # the same input always gets the same answer: asked again, one by one, or as a list (the noise is
    # a hash of each sequence, not of the batch; the head's own float rounding may differ by batch)
    assert np.array_equal(noisy.query(X), y)
    assert np.allclose(noisy.query([x for x in X[::-1]]), y[::-1], rtol=0, atol=1e-15)
    assert np.allclose(np.concatenate([noisy.query(X[i:i + 1]) for i in range(len(X))]), y, rtol=0, atol=1e-15)
    assert noisy.queries == 4 * len(X) and noisy.inner.queries == noisy.queries
    # bit for bit with a black box that evaluates each sequence on its own
    per_seq = Tolerance(CallableOracle(lambda s: [float(np.tanh(x).sum()) for x in s], d=5),
                        None if mode.startswith("round") else 1e-3, mode)
    z = per_seq.query(X)
    assert np.array_equal(np.concatenate([per_seq.query([x]) for x in X]), z)


def test_adversarial_is_exactly_plus_minus_tau_with_both_signs():
    head = random_head(4, rng=2)
    y0 = ModelOracle(head).query(_batch(np.random.default_rng(1), n=200, d=4))
    y = Tolerance(ModelOracle(head), 1e-2).query(_batch(np.random.default_rng(1), n=200, d=4))
    dev = y - y0
    assert np.allclose(np.abs(dev), 1e-2, rtol=0, atol=1e-14)
    assert 60 < (dev > 0).sum() < 140


def test_uniform_fills_the_interval_and_keys_differ():
    head = random_head(4, rng=2)
    X = _batch(np.random.default_rng(3), n=400, d=4)
    y0 = ModelOracle(head).query(X)
    u1 = (Tolerance(ModelOracle(head), 1.0, "uniform", key=1).query(X) - y0)
    u2 = (Tolerance(ModelOracle(head), 1.0, "uniform", key=2).query(X) - y0)
    assert u1.min() >= -1 and u1.max() <= 1
    assert u1.min() < -0.9 and u1.max() > 0.9 and abs(u1.mean()) < 0.15
    assert not np.allclose(u1, u2)


def test_negative_zero_reads_as_zero():
    o = Tolerance(CallableOracle(lambda s: [0.0] * len(s), d=2), 1.0, "uniform")
    assert o.query(np.zeros((1, 1, 2)))[0] == o.query(-np.zeros((1, 1, 2)))[0]


def test_round_mode():
    o = Tolerance(CallableOracle(lambda s: [float(x[0, 0]) for x in s], d=1), mode="round:2")
    assert o.tau == round_tolerance(2) == 0.005
    assert list(o.query([np.array([[0.12345]]), np.array([[-0.987]])])) == [0.12, -0.99]
    with pytest.raises(ValueError, match="tau = 0.005"):
        Tolerance(o.inner, 0.1, "round:2")


@pytest.mark.parametrize("mode,msg", [("gauss", "unknown noise mode"), ("round:x", "integer"),
                                      ("round:40", "0..15")])
def test_bad_modes(mode, msg):
    with pytest.raises(ValueError, match=msg):
        parse_mode(mode)


def test_tolerance_needs_tau_except_round():
    with pytest.raises(ValueError, match="needs a tolerance"):
        Tolerance(ModelOracle(random_head(3, rng=0)), None, "uniform")


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), tau=st.floats(1e-9, 1.0), mode=st.sampled_from(["adversarial", "uniform"]))
def test_bound_property(seed, tau, mode):
    rng = np.random.default_rng(seed)
    head = random_head(3, rng=seed)
    X = [rng.standard_normal((int(rng.integers(1, 5)), 3)) for _ in range(8)]
    y = Tolerance(ModelOracle(head), tau, mode, key=seed).query(X)
    assert np.all(np.abs(y - head.evaluate(X)) <= tau * (1 + 1e-12) + 1e-12)


def test_norm_bound_is_inherited_and_refused():
    o = Tolerance(ModelOracle(random_head(4, rng=0), input_norm=1.0), 1e-3)
    assert o.input_norm == 1.0
    o.query(np.eye(4)[:, None, :])                    # norm exactly 1: fine
    with pytest.raises(InvalidQuery, match=r"R = 1"):
        o.query(1.01 * np.eye(4)[:1, None, :])
    assert o.queries == 4 and o.inner.queries == 4   # the refused batch cost nothing
    assert "tau=0.001" in repr(o) and "adversarial" in repr(o)


def test_cli_refuses_a_query_above_the_norm_bound(capsys):
    code = main(["extract", "--target", "random:d=16,seed=1", "--method", "exact", "--input-norm", "0.5",
                 "--quiet"])
    assert code == 2
    assert "R = 0.5" in capsys.readouterr().err


def test_cli_noise_flags(capsys):
    code = main(["extract", "--target", "random:d=6,seed=1", "--noise-mode", "uniform", "--quiet"])
    assert code == 2 and "needs --noise" in capsys.readouterr().err
    code = main(["extract", "--target", "random:d=6,seed=1", "--noise-mode", "round:3", "--noise", "1e-2",
                 "--quiet"])
    assert code == 2 and "tau = 0.0005" in capsys.readouterr().err
