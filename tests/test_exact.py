import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from headthief import (AttentionHead, CallableOracle, ModelOracle, NotIdentifiable, exact_query_count,
                       extract_exact, random_head)
from headthief.testing import check_recovery


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 24), seed=st.integers(0, 2**31), sparse=st.sampled_from([0.0, 0.3, 0.7]),
       bias=st.booleans(), probes=st.sampled_from(["basis", "gaussian"]),
       rank=st.one_of(st.none(), st.integers(1, 24)))
def test_exact_recovery_property(d, seed, sparse, bias, probes, rank):
    rank = None if rank is None else min(rank, d)
    head = random_head(d, rng=seed, sparse_v=sparse, bias=bias, rank=rank)
    res = extract_exact(ModelOracle(head), bias=bias, probes=probes, rng=np.random.default_rng(seed))
    check_recovery(res, head, queries=exact_query_count(d, bias=bias), W_tol=1e-9, fidelity_n=16)
    assert res.diagnostics["requeried"] == 0


def test_query_counts_match_the_paper():
    assert exact_query_count(64) == 4160
    assert exact_query_count(64, bias=True) == 4225
    assert exact_query_count(384, bias=True) == 148_225


def test_v_zero_is_not_identifiable():
    for bias in (False, True):
        head = random_head(6, rng=0, v_zero=True, bias=bias)
        with pytest.raises(NotIdentifiable, match="W .*not identifiable"):
            extract_exact(ModelOracle(head), bias=bias)


def test_float32_head_with_adaptive_scales_beats_unit_probes():
    # small scores, like a pretrained head after its 1/sqrt(d_h) scaling: unit probes leave alpha ~ 1/2
    head = random_head(96, rng=4, rank=8, dtype=np.float32, bias=True, W_norm=0.5)
    adaptive = extract_exact(ModelOracle(head), bias=True)
    unit = extract_exact(ModelOracle(head), bias=True, scales="unit", check=False)   # the worse design: no check
    ea, eu = adaptive.errors(head)["W_rel_err"], unit.errors(head)["W_rel_err"]
    assert ea <= 1e-5
    assert ea < eu / 3
    assert adaptive.queries == exact_query_count(96, bias=True)


def test_large_scores_are_reasked_at_smaller_scale():
    # W with huge entries: unit probes saturate the softmax; adaptive scales re-ask and still recover
    rng = np.random.default_rng(7)
    head = AttentionHead(v=rng.standard_normal(6), W=200 * rng.standard_normal((6, 6)))
    res = extract_exact(ModelOracle(head))
    check_recovery(res, head, max_queries=exact_query_count(6) + 36, W_tol=1e-8, fidelity_n=0)
    with pytest.raises(NotIdentifiable, match="saturated"):
        extract_exact(ModelOracle(head), scales="unit")


class TorchStyleHead:
    """A user's black box written differently from AttentionHead: explicit loops, Q/K/V projections."""

    def __init__(self, seed, d=5, r=2):
        rng = np.random.default_rng(seed)
        self.Q, self.K = rng.standard_normal((r, d)), rng.standard_normal((r, d))
        self.Vo = rng.standard_normal(d)
        self.bq = rng.standard_normal(r)
        self.bo = 0.3

    def __call__(self, seqs):
        out = []
        for X in seqs:
            q = self.Q @ X[-1] + self.bq
            logits = [float((self.K @ x) @ q) for x in X]
            m = max(logits)
            w = [np.exp(s - m) for s in logits]
            out.append(sum(wi * float(x @ self.Vo) for wi, x in zip(w, X)) / sum(w) + self.bo)
        return out


def test_callable_oracle_written_in_another_style():
    box = TorchStyleHead(seed=11)
    res = extract_exact(CallableOracle(box, 5), bias=True)
    truth = AttentionHead(v=box.Vo, W=box.K.T @ box.Q, c=box.K.T @ box.bq, beta=box.bo)
    check_recovery(res, truth, queries=exact_query_count(5, bias=True), W_tol=1e-9)
    assert res.rank == 2


def test_result_is_frozen():
    res = extract_exact(ModelOracle(random_head(3, rng=0)))
    with pytest.raises(Exception):
        res.queries = 0
    with pytest.raises(ValueError):
        res.W[0, 0] = 1.0
