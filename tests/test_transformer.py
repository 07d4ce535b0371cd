"""One-layer transformers (Section 4.1): the model, the antisymmetric oracle, the paper's reduction, the
through-FFN method for FFN biases, several heads, the torch black box, the model check."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from headthief.errors import BudgetExceeded, ModelMismatch
from headthief.extraction.check import TRANSFORMER
from headthief.extraction.single.exact import extract_exact
from headthief.extraction.transformer.paper import (extract_transformer_heads, extract_transformer_paper,
                                                    paper_attention_query_count)
from headthief.extraction.transformer.recovered import kink_sequences, verify_transformer
from headthief.extraction.transformer.through_ffn import extract_transformer, through_ffn_query_count
from headthief.models.ffn import ReLUFFN
from headthief.models.transformer import Transformer, random_transformer
from headthief.oracles import AntiSymmetric, CallableOracle, ModelOracle, Transcript


def truth_learner(model: Transformer):
    """An FFN 'learner' that knows the answer (the paper's assumed A_FFN): tests the plumbing alone."""
    p = model.ffn_params()

    def learner(oracle, *, bias, rng, progress, **kw):
        oracle.query(np.eye(oracle.d)[:, None, :])        # spends d one-token queries, like a learner would
        return SimpleNamespace(model=ReLUFFN(p["A"], p["w"], p["b1"], p["b2"], p["linear"]), queries=oracle.d,
                               diagnostics={})

    return learner


def _seqs(d, n, rng, max_len=6):
    return [rng.standard_normal((int(N), d)) for N in rng.integers(1, max_len + 1, size=n)]


# --------------------------------------------------------------------------- the model


def test_merged_equals_unmerged_and_paper_formula():
    rng = np.random.default_rng(0)
    d, m = 5, 7
    Q, K, V = (rng.standard_normal((d, d)) for _ in range(3))
    W1, w2 = rng.standard_normal((m, d)), rng.standard_normal(m)
    t = Transformer.from_unmerged(Q, K, V, W1, w2)
    for X in _seqs(d, 5, rng):
        s = X @ (K.T @ Q) @ X[-1]
        a = np.exp(s - s.max())
        a /= a.sum()
        z = a @ (X @ V.T)                                  # softmax(...)^T (X V^T)
        want = w2 @ np.maximum(W1 @ z, 0)
        assert t([X])[0] == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_one_token_is_the_ffn_and_antisymmetric_part_is_attention():
    rng = np.random.default_rng(1)
    t = random_transformer(6, 9, 3, heads=2)
    p = t.ffn_params()
    x = rng.standard_normal((4, 6))
    assert np.allclose(t(x[:, None, :]), np.maximum(x @ p["A"], 0) @ p["w"], rtol=1e-13, atol=1e-13)
    X = _seqs(6, 8, rng)
    anti = t(X) - t([-x for x in X])
    assert np.allclose(anti, t.attention_part()(X), rtol=1e-12, atol=1e-12)


def test_bias_breaks_the_antisymmetric_identity_and_float32():
    rng = np.random.default_rng(2)
    t = random_transformer(6, 9, 3, bias=True)
    X = _seqs(6, 8, rng)
    assert not np.allclose(t(X) - t([-x for x in X]), t.attention_part()(X), atol=1e-3)
    t32 = random_transformer(6, 9, 3, bias=True, dtype=np.float32)
    y = t32(X)
    assert np.array_equal(y.astype(np.float32).astype(np.float64), y)
    assert np.allclose(y, t(X), rtol=1e-4, atol=1e-5)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="A must be"):
        Transformer(W=np.eye(3), A=np.ones((4, 2)), w_o=np.ones(2))
    with pytest.raises(ValueError, match="w_o"):
        Transformer(W=np.eye(3), A=np.ones((3, 2)), w_o=np.ones(3))
    with pytest.raises(ValueError, match=">= 1"):
        random_transformer(0, 3, 0)


# --------------------------------------------------------------------------- the antisymmetric oracle


def test_antisymmetric_counts_both_queries_and_budgets_them():
    t = random_transformer(4, 6, 0)
    inner = ModelOracle(t)
    a = AntiSymmetric(inner, budget=10)
    X = np.random.default_rng(0).standard_normal((3, 2, 4))
    y = a.query(X)
    assert np.allclose(y, t(X) - t(-X))
    assert (a.queries, a.fresh, inner.queries) == (6, 6, 6)
    with pytest.raises(BudgetExceeded):
        a.query(X)                                         # 6 + 6 > 10, refused whole
    assert inner.queries == 6
    with pytest.raises(ValueError, match="inner oracle"):
        AntiSymmetric(inner, transcript=Transcript())


def test_antisymmetric_replays_from_the_inner_transcript():
    t = random_transformer(4, 6, 0)
    tr = Transcript()
    r1 = extract_exact(AntiSymmetric(ModelOracle(t, transcript=tr)), check=False)
    inner = ModelOracle(t, transcript=tr)
    r2 = extract_exact(AntiSymmetric(inner), check=False)
    assert inner.fresh == 0 and inner.replayed == 2 * (16 + 4)
    assert np.array_equal(r1.W, r2.W)


# --------------------------------------------------------------------------- the paper's reduction


def test_paper_reduction_exact_with_a_known_ffn():
    t = random_transformer(16, 32, 1)
    res = extract_transformer_paper(ModelOracle(t), ffn_learner=truth_learner(t))
    assert res.attention_queries == paper_attention_query_count(16) == 544
    assert res.ffn_queries == 16
    assert res.queries == 544 + 16 + res.diagnostics["reduction_check_queries"]
    e = res.errors(t)
    assert e["W_rel_err"] <= 1e-12 and e["v_rel_err"] <= 1e-12
    assert res.check.verdict == "pass" and res.check.model == TRANSFORMER
    f = verify_transformer(res, ModelOracle(t), n=2000, rng=1)
    assert f.random.max_rel_err <= 1e-11 and f.kinks.max_rel_err <= 1e-11
    assert f.kinks.n == 2 * 2 * 32


def test_kink_sequences_land_next_to_the_kinks():
    t = random_transformer(8, 10, 4)
    res = extract_transformer_paper(ModelOracle(t), ffn_learner=truth_learner(t))
    seqs = kink_sequences(res, per_kink=1, offset=1e-6, rng=0)
    from headthief.extraction.transformer.recovered import attended
    p = t.ffn_params()
    for i, k in enumerate(range(0, len(seqs), 2)):
        z = np.stack([attended(t.dense_W(), None, s[None])[0] for s in seqs[k:k + 2]])
        pre = z @ p["A"][:, i]
        assert pre[0] < 0 < pre[1] and np.abs(pre).max() < 1e-4


def test_paper_refuses_ffn_biases_with_the_reason():
    t = random_transformer(8, 12, 1, bias=True)
    for check in (True, False):
        with pytest.raises(ModelMismatch) as e:
            extract_transformer_paper(ModelOracle(t), check=check, ffn_learner=truth_learner(t))
        msg = str(e.value)
        assert "ReLU(z + b" in msg and "--method transformer" in msg and "antisymmetric" in msg
    with pytest.raises(ValueError, match="extract_transformer"):
        extract_transformer_paper(ModelOracle(t), bias=True)


def test_out_of_class_target_is_a_model_mismatch():
    v = np.random.default_rng(0).standard_normal(6)
    first_token = CallableOracle(lambda seqs: [float(np.tanh(x[0] @ v)) for x in seqs], 6)
    with pytest.raises(ModelMismatch, match="key order"):
        extract_transformer_paper(first_token)
    # two heads read as one: Theorem 4.1 on the antisymmetric answers fits a wrong W; the verdict says so
    t2 = random_transformer(8, 12, 1, heads=2)
    with pytest.raises(ModelMismatch, match="fidelity|--heads"):
        extract_transformer_paper(ModelOracle(t2), ffn_learner=truth_learner(t2))


def test_several_heads_through_the_antisymmetric_oracle():
    t = random_transformer(16, 32, 1, heads=2)
    res = extract_transformer_heads(ModelOracle(t), heads=2, rng=0)
    e = res.errors(t)
    assert e["heads_found"] == 2 and e["W_rel_err"] <= 1e-8
    assert res.predicts == "antisymmetric" and res.check.verdict == "pass"


# --------------------------------------------------------------------------- through the FFN (biases)


@pytest.mark.parametrize("bias", [True, False])
def test_through_ffn_with_a_known_ffn(bias):
    t = random_transformer(12, 20, 5, bias=bias)
    res = extract_transformer(ModelOracle(t), bias=bias, ffn_learner=truth_learner(t))
    assert res.attention_queries == through_ffn_query_count(12, bias=bias) + res.diagnostics["requeried"]
    assert res.errors(t)["W_rel_err"] <= 1e-10
    assert res.check.verdict == "pass"


def test_through_ffn_score_bias():
    t0 = random_transformer(8, 16, 2, bias=True)
    c = np.random.default_rng(3).standard_normal(8) / np.sqrt(8)
    t = Transformer(W=t0.W, A=t0.A, w_o=t0.w_o, b1=t0.b1, b2=t0.b2, C=c)
    res = extract_transformer(ModelOracle(t), bias=True, ffn_learner=truth_learner(t))
    e = res.errors(t)
    assert e["W_rel_err"] <= 1e-10 and e["c_rel_err"] <= 1e-10


def test_through_ffn_rejects_bad_settings():
    t = random_transformer(4, 6, 0)
    with pytest.raises(ValueError, match="lam"):
        extract_transformer(ModelOracle(t), lam=-1.0, ffn_learner=truth_learner(t))


# --------------------------------------------------------------------------- torch


def test_torch_transformer_truth_matches_the_module():
    pytest.importorskip("torch")
    from headthief.targets import resolve
    rng = np.random.default_rng(0)
    for spec in ("torch-transformer:d=8,m=12,seed=1", "torch-transformer:d=8,m=12,seed=1,heads=2"):
        target = resolve(spec)
        X = _seqs(8, 20, rng)
        assert np.allclose(target.make_oracle().query(X), target.truth(X), rtol=1e-5, atol=1e-6)


def test_target_specs():
    from headthief.errors import SpecError
    from headthief.targets import resolve
    t = resolve("transformer:d=6,m=9,seed=2,heads=2,dtype=float32")
    assert t.truth.heads == 2 and t.truth.dtype == np.float32 and not t.bias
    assert resolve("transformer:d=6,m=9,bias=1").bias
    for bad in ("transformer:d=6", "transformer:d=6,m=9,bogus=1", "transformer:d=6,m=9,dtype=float16",
                "transformer:d=6,m=9,bias=maybe"):
        with pytest.raises(SpecError):
            resolve(bad)


# --------------------------------------------------------------------------- the command line


def _cli(capsys, *args):
    from headthief.cli import main
    code = main(["extract", "--quiet", "--json", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_cli_refusal_exit_5_and_several_heads(capsys):
    rc, row, err = _cli(capsys, "--target", "transformer:d=8,m=12,seed=1,bias=1", "--method", "transformer-paper")
    assert rc == 5 and "ReLU(z + b" in err and "--method transformer" in err
    rc, row, err = _cli(capsys, "--target", "transformer:d=8,m=12,seed=1,heads=2", "--method", "transformer-paper",
                        "--heads", "2")
    assert rc == 0 and row["W_rel_err"] <= 1e-8 and row["heads"] == 2


def test_cli_heads_auto_takes_the_published_head_count(capsys):
    # --heads auto on a target that publishes heads=2: both heads extracted (it used to mean one head, and the
    # one-head method ended in a failed model check); a contradicting --heads and FFN biases are refused
    rc, row, err = _cli(capsys, "--target", "transformer:d=8,m=12,seed=3,heads=2")
    assert rc == 0 and row["heads"] == 2 and row["W_rel_err"] <= 1e-8
    rc, row, err = _cli(capsys, "--target", "transformer:d=8,m=12,seed=3,heads=2", "--heads", "3")
    assert rc == 2 and "contradicts" in err and row["queries_sent"] == 0
    rc, row, err = _cli(capsys, "--target", "transformer:d=8,m=12,seed=3,heads=2,bias=1")
    assert rc == 2 and "needs an FFN without biases" in err


# --------------------------------------------------------------------------- with the real FFN learner


def test_acceptance_paper_reduction_with_the_ffn_learner():
    t = random_transformer(16, 32, 1)
    res = extract_transformer_paper(ModelOracle(t), rng=0)
    assert res.attention_queries == 544 and res.ffn_queries > 0
    assert res.errors(t)["W_rel_err"] <= 1e-10
    f = verify_transformer(res, ModelOracle(t), n=10_000, rng=1)
    assert f.random.max_rel_err <= 1e-9 and f.kinks.max_rel_err <= 1e-9


def test_acceptance_ffn_biases_through_the_ffn():
    t = random_transformer(16, 32, 1, bias=True)
    res = extract_transformer(ModelOracle(t), bias=True, rng=0)
    assert res.errors(t)["W_rel_err"] <= 1e-8
    assert res.attention_queries == 16 * 16 + 16 + res.diagnostics["requeried"]
    f = verify_transformer(res, ModelOracle(t), n=10_000, rng=1)
    assert f.random.max_rel_err <= 1e-8 and f.kinks.max_rel_err <= 1e-8


def test_cli_reports_parts_and_kinks(capsys):
    rc, row, err = _cli(capsys, "--target", "transformer:d=8,m=12,seed=2", "--method", "transformer-paper")
    assert rc == 0, err
    assert row["attention_queries"] == 2 * (64 + 8) and row["ffn_queries"] > 0
    assert row["queries"] == row["attention_queries"] + row["ffn_queries"] + row["reduction_check_queries"]
    assert row["W_rel_err"] <= 1e-10 and row["fidelity_kinks_max_rel_err"] <= 1e-9
    assert row["model_check"]["verdict"] == "pass" and row["kink_sequences"] == 4 * 12
    rc, row, err = _cli(capsys, "--target", "transformer:d=8,m=12,seed=2,bias=1", "--method", "transformer")
    assert rc == 0, err
    assert row["W_rel_err"] <= 1e-8 and row["fidelity_max_rel_err"] <= 1e-8
