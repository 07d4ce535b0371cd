import numpy as np
import pytest

from headthief import (BudgetExceeded, CallableOracle, InvalidQuery, ModelOracle, OracleError, Transcript,
                       extract_exact, random_head)


def test_counts_queries_and_calls():
    o = ModelOracle(random_head(3, rng=0))
    o.query([np.ones((1, 3)), np.ones((4, 3))])
    o.query(np.zeros((5, 2, 3)))
    assert (o.queries, o.calls) == (7, 2)
    o.reset()
    assert o.queries == 0


@pytest.mark.parametrize("batch, match", [
    ([np.zeros((0, 3))], "empty sequence"),
    (np.zeros((2, 0, 3)), "empty sequence"),
    ([np.zeros((2, 4))], "dimension d = 3"),
    ([np.array([[np.nan, 0, 0]])], "non-finite"),
    ([np.zeros(3)], "2-D"),
    (np.zeros((2, 3)), "wrap a single sequence"),
    ("abc", "list"),
])
def test_bad_batches_are_refused_and_not_counted(batch, match):
    o = ModelOracle(random_head(3, rng=0))
    with pytest.raises(InvalidQuery, match=match):
        o.query(batch)
    assert o.queries == 0


def test_budget_refuses_whole_batch_and_reports_spent():
    o = ModelOracle(random_head(3, rng=0), budget=5)
    o.query(np.zeros((4, 1, 3)))
    with pytest.raises(BudgetExceeded) as e:
        o.query(np.zeros((2, 1, 3)))
    assert (e.value.spent, e.value.budget, e.value.requested) == (4, 5, 2)
    assert o.queries == 4
    o.query(np.zeros((1, 1, 3)))  # what still fits is answered


def test_extraction_with_too_small_budget_raises_budget_exceeded():
    o = ModelOracle(random_head(8, rng=0), budget=50)
    with pytest.raises(BudgetExceeded) as e:
        extract_exact(o)
    assert e.value.spent <= 50 and o.queries == e.value.spent


@pytest.mark.parametrize("fn, match", [
    (lambda seqs: [float("nan")] * len(seqs), "non-finite"),
    (lambda seqs: [1.0] * (len(seqs) + 1), "one value per sequence"),
    (lambda seqs: 1 / 0, "ZeroDivisionError"),
    (lambda seqs: ["x"] * len(seqs), "not numbers"),
])
def test_bad_oracle_answers_raise_oracle_error(fn, match):
    o = CallableOracle(fn, 3)
    with pytest.raises(OracleError, match=match):
        o.query([np.ones((1, 3))])
    assert o.queries == 0


def test_input_norm_bound_refuses_never_clips():
    o = ModelOracle(random_head(3, rng=0), input_norm=1.0)
    o.query([np.array([[0.6, 0.8, 0.0]])])
    with pytest.raises(InvalidQuery, match="R = 1"):
        o.query([np.array([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])])


def test_transcript_replays_what_was_paid_for(tmp_path):
    head = random_head(10, rng=3, bias=True)
    path = tmp_path / "t.npz"
    t = Transcript()
    with pytest.raises(BudgetExceeded):
        extract_exact(ModelOracle(head, budget=60, transcript=t), bias=True, check=False)
    paid = t.queries
    assert 0 < paid <= 60
    t.save(path)
    # resume: the same run asks the same batches; those are free, only the rest is sent
    o = ModelOracle(head, transcript=Transcript.load(path))
    res = extract_exact(o, bias=True, check=False)
    assert o.replayed == paid
    assert o.fresh == res.queries - paid
    assert res.queries == 10 * 10 + 2 * 10 + 1
    assert np.linalg.norm(res.W - head.dense_W()) <= 1e-9 * np.linalg.norm(head.dense_W())


def test_repr_shows_settings():
    assert "budget=7" in repr(ModelOracle(random_head(3, rng=0), budget=7))


def test_a_noise_wrapper_over_vector_answers_to_one_token_sequences():
    """A wrapper's packed rows for one-token sequences are those positions' answers (they were refused as
    answers of the wrong shape, so no defence could wrap --method block's one-token queries)."""
    from headthief.models.bert_block import random_block
    from headthief.oracles.tolerance import Tolerance
    block = random_block(8, 2, 16, seed=3)
    rng = np.random.default_rng(3)
    for X in (rng.standard_normal((5, 1, 8)), [rng.standard_normal((1, 8)) for _ in range(4)],
              rng.standard_normal((3, 4, 8))):
        inner = ModelOracle(block)
        y = np.asarray(inner.query_packed(X))
        noisy = Tolerance(ModelOracle(block), 1e-3, mode="uniform", key=1)
        z = np.asarray(noisy.query_packed(X))
        assert z.shape == y.shape and 0 < np.abs(z - y).max() <= 1e-3
        assert np.array_equal(noisy.query_packed(X), z)                      # the same noise for the same query
