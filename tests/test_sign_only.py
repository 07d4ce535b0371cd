import json

import numpy as np
import pytest

from headthief import BudgetExceeded, InvalidQuery, ModelOracle, random_head
from headthief.cli import main
from headthief.oracles import SignOnly, Tolerance


def _batch(rng, n, d, scale=0.3):
    return [scale * rng.standard_normal((int(L), d)) for L in rng.integers(1, 6, size=n)]


def test_answers_are_the_bit_f_positive():
    head = random_head(6, rng=3, bias=True)
    rng = np.random.default_rng(0)
    batch = _batch(rng, 200, 6)
    y = head.evaluate(batch)
    bits = SignOnly(ModelOracle(head)).query(batch)
    assert set(np.unique(bits)) == {0.0, 1.0}
    np.testing.assert_array_equal(bits, (y > 0).astype(float))


def test_zero_output_reads_as_zero():
    head = random_head(4, rng=0, v_zero=True)          # f(X) = 0 for every X
    bits = SignOnly(ModelOracle(head)).query(_batch(np.random.default_rng(1), 30, 4))
    assert np.all(bits == 0.0)


def test_composes_with_tolerance_and_thresholds_the_noisy_answer():
    head = random_head(5, rng=2)
    inner = Tolerance(ModelOracle(head), 0.05, "adversarial", key=7)
    batch = _batch(np.random.default_rng(3), 300, 5, scale=0.1)
    noisy = Tolerance(ModelOracle(head), 0.05, "adversarial", key=7).query(batch)
    bits = SignOnly(inner).query(batch)
    np.testing.assert_array_equal(bits, (noisy > 0).astype(float))
    # the noise moved some signs: the sign-only view of a noisy oracle differs from the clean one
    assert np.any(bits != (head.evaluate(batch) > 0))
    assert "SignOnly(Tolerance(" in repr(SignOnly(inner))


def test_inherits_the_input_norm_bound_and_refuses():
    head = random_head(3, rng=0)
    o = SignOnly(ModelOracle(head, input_norm=1.0))
    assert o.input_norm == 1.0
    o.query([np.array([[0.6, 0.8, 0.0]])])                       # norm 1: fine
    with pytest.raises(InvalidQuery, match="R = 1"):
        o.query([np.array([[0.0, 0.0, 1.5]])])
    assert o.queries == 1


def test_counts_and_budget():
    head = random_head(3, rng=0)
    o = SignOnly(ModelOracle(head), budget=5)
    o.query(np.zeros((4, 2, 3)))
    assert (o.queries, o.calls, o.inner.queries) == (4, 1, 4)
    with pytest.raises(BudgetExceeded):
        o.query(np.zeros((2, 1, 3)))
    assert o.queries == 4


def _cli(argv, capsys):
    code = main(["extract", *argv, "--quiet", "--verify", "16"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_sign_only_with_a_value_method_is_refused(capsys):
    code, out, err = _cli(["--target", "random:d=4,seed=1", "--method", "exact", "--sign-only"], capsys)
    assert code == 2
    assert "answers only 0/1" in err and "membership" in err


def test_cli_membership_implies_sign_only(capsys):
    a = _cli(["--target", "random:d=5,seed=2", "--method", "membership", "--json"], capsys)
    b = _cli(["--target", "random:d=5,seed=2", "--method", "membership", "--sign-only", "--json"], capsys)
    assert a[0] == b[0] == 0
    ra, rb = json.loads(a[1]), json.loads(b[1])
    assert ra["queries"] == rb["queries"] and ra["W_rel_err"] == rb["W_rel_err"]


def test_cli_paper_probes_above_the_norm_bound_exit_2_naming_the_bound(capsys):
    spec = "random:d=8,seed=1,W_norm=2,v_norm=1,v_min=0.2"
    code, out, err = _cli(["--target", spec, "--method", "membership-paper", "--sign-only"], capsys)
    assert code == 2
    assert "R = 1" in err and "2.239" in err and "--input-norm" in err
