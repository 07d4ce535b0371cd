"""The model check: identities before the extraction, the fidelity verdict after (issue 8)."""

import json

import numpy as np
import pytest

from headthief import (CallableOracle, ModelMismatch, ModelOracle, NotIdentifiable, SignOnly, Tolerance,
                       extract_exact, extract_lowrank, extract_membership, random_head)
from headthief.cli import main
from headthief.extraction.check import MULTI, SINGLE, fidelity_threshold, preflight, AnswerKind
from headthief.models.multihead import random_multihead

D = 12


def two_heads(seqs):
    h1, h2 = random_head(D, rng=101), random_head(D, rng=202)
    return h1.evaluate(seqs) + h2.evaluate(seqs)


def tanh_mlp(seqs):
    r = np.random.default_rng(5)
    A, w = r.standard_normal((D, 16)) / np.sqrt(D), r.standard_normal(16) / 4
    return [float(np.tanh(x.mean(axis=0) @ A) @ w) for x in seqs]


def constant(seqs):
    return [3.0] * len(seqs)


@pytest.mark.parametrize("fn, identity", [(two_heads, "one softmax"), (tanh_mlp, "one-token affinity"),
                                          (constant, "zero token")])
@pytest.mark.parametrize("method", [extract_exact, extract_lowrank])
def test_wrong_model_class_fails_fast(fn, identity, method):
    o = CallableOracle(fn, D)
    with pytest.raises(ModelMismatch, match=identity) as e:
        method(o)
    assert o.queries <= D + 16          # stopped before paying for d^2 queries
    assert e.value.check == identity and e.value.figure > e.value.threshold


def test_constant_with_bias_is_not_identifiable():
    with pytest.raises(NotIdentifiable, match="do not depend on the tokens"):
        extract_exact(CallableOracle(constant, D), bias=True)


def test_noisy_answers_still_refuse_two_heads():
    o = Tolerance(CallableOracle(two_heads, D, input_norm=1.0), 1e-6)
    with pytest.raises(ModelMismatch):
        extract_exact(o)


@pytest.mark.parametrize("make", [
    lambda: ModelOracle(random_head(D, rng=1)),
    lambda: ModelOracle(random_head(D, rng=2, bias=True)),
    lambda: ModelOracle(random_head(32, rng=3, dtype=np.float32)),
    lambda: Tolerance(ModelOracle(random_head(D, rng=4), input_norm=1.0), 1e-4),
    lambda: SignOnly(ModelOracle(random_head(D, rng=5), input_norm=1.0)),
])
def test_identities_hold_on_the_assumed_class(make):
    o = make()
    bias = o.inner.model.has_bias if hasattr(o, "inner") else o.model.has_bias
    ids, spent, kind = preflight(o, bias=bias)
    assert spent == 16 and all(i.ok is not False for i in ids)
    assert sum(i.ok is True for i in ids) >= 3


def test_multi_head_identities_refuse_an_mlp_and_accept_heads():
    ids, _, _ = preflight(ModelOracle(random_multihead(D, 3, rng=1)), model=MULTI)
    assert {i.name for i in ids} == {"zero token", "one-token affinity", "key order", "repetition"}
    with pytest.raises(ModelMismatch, match="one-token affinity"):
        preflight(CallableOracle(tanh_mlp, D), model=MULTI)
    with pytest.raises(ModelMismatch, match="one softmax"):   # several heads are not one head
        preflight(ModelOracle(random_multihead(D, 3, rng=1)), model=SINGLE)


def test_key_order_catches_positional_models():
    head = random_head(D, rng=1)

    def positional(seqs):
        return [float(head.evaluate([x + 0.3 * np.arange(len(x))[:, None] / len(x)])[0]) for x in seqs]

    with pytest.raises(ModelMismatch, match="key order|repetition|one softmax"):
        extract_exact(CallableOracle(positional, D))


def test_result_records_the_check_and_costs_apart():
    head = random_head(10, rng=3, bias=True)
    o = ModelOracle(head)
    res = extract_exact(o, bias=True)
    assert res.queries == 10 * 10 + 2 * 10 + 1                         # the method's own count
    assert res.check.verdict == "pass" and res.check.check_queries == 16
    assert res.check.verify_queries == 256
    assert o.queries == res.queries + 16 + 256
    assert res.check.figure <= res.check.threshold
    d = res.diagnostics
    assert d["queries_fresh"] == res.queries and d["queries_replayed"] == 0 and d["oracle_calls"] >= 1
    assert d["oracle_seconds"] > 0
    unchecked = extract_exact(ModelOracle(head), bias=True, check=False)
    assert unchecked.check.verdict == "unchecked" and np.array_equal(unchecked.W, res.W)


def test_fidelity_verdict_when_the_identities_cannot_see_it(tmp_path, capsys):
    # a head whose softmax ignores the last token's own score: passes the 16-query identities (one
    # softmax still holds) only by luck of scale, so the final verdict must catch what remains
    head = random_head(D, rng=7)
    bent = random_head(D, rng=8)

    def almost(seqs):
        y = head.evaluate(seqs)
        return y + 1e-3 * np.array([float(np.tanh(x[0] @ bent.v)) if len(x) > 4 else 0.0 for x in seqs])

    with pytest.raises(ModelMismatch, match="fidelity") as e:
        extract_exact(CallableOracle(almost, D))
    assert e.value.model_check.verdict == "fail" and e.value.result.check.verdict == "fail"


def test_thresholds_follow_the_precision():
    f64 = fidelity_threshold(AnswerKind(), 64, 1.0)
    f32 = fidelity_threshold(AnswerKind(float32=True), 64, 1.0)
    noisy = fidelity_threshold(AnswerKind(tau=1e-4), 64, 1.0)
    assert f64 < 1e-8 < f32 < noisy


def test_cli_exit_code_5_and_json_model_check(tmp_path, capsys):
    src = tmp_path / "bad.py"
    src.write_text("import numpy as np\nfrom headthief.models.attention import random_head\n"
                   "h1, h2 = random_head(12, rng=101), random_head(12, rng=202)\n"
                   "def f(seqs):\n    return list(h1.evaluate(seqs) + h2.evaluate(seqs))\n")
    code = main(["extract", "--target", f"py:{src}:f", "--d", "12", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 5 and "one softmax" in err and "multihead" in err
    row = json.loads(out)
    assert row["model_check"]["verdict"] == "fail" and row["check_queries"] <= 12 + 16
    code = main(["extract", "--target", "random:d=8,seed=1", "--json", "--quiet"])
    row = json.loads(capsys.readouterr()[0])
    assert code == 0 and row["model_check"]["verdict"] == "pass" and row["check_queries"] == 16
    assert {"queries_fresh", "queries_replayed", "oracle_calls", "oracle_seconds", "seconds"} <= set(row)
    code = main(["extract", "--target", f"py:{src}:f", "--d", "12", "--json", "--quiet", "--no-check"])
    row = json.loads(capsys.readouterr()[0])
    assert code == 0 and row["model_check"]["verdict"] == "unchecked" and row["fidelity_max_rel_err"] > 1


def test_sign_only_methods_check_bits():
    res = extract_membership(SignOnly(ModelOracle(random_head(6, rng=2), input_norm=1.0)))
    assert res.check.verdict == "pass" and res.check.answers == "sign-only"
