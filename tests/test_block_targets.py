"""Whole BERT blocks and the MiniLM encoder as targets: the numpy models against transformers' own modules.

Tolerances are derived, not tuned: a block is about 8 rounded stages (the q/k/v projections, scores,
softmax-weighted sum, output dense, LN1, W_1, W_2, LN2), each a sum of at most n = max(d, ffn) rounded
products whose relative error grows like sqrt(n) eps; so two implementations of the same block in the
same precision agree to ``8 sqrt(n) eps`` relative (max |difference| over the RMS of the answers), and
hidden state k of the encoder (k blocks after the embeddings' LayerNorm) to ``(k + 1)`` times that.
torch and transformers are imported inside the tests (skipped where missing).
"""

import copy

import numpy as np
import pytest

from headthief.errors import InvalidQuery, SpecError
from headthief.models.bert_block import BertBlock, Encoder, from_minilm, gelu, minilm_encoder, random_block
from headthief.oracles.base import ModelOracle
from headthief.targets import describe, resolve

D = 384
FFN = 1536


def tol(dtype, n, stages=1):
    return stages * 8.0 * np.sqrt(n) * np.finfo(dtype).eps


def rel(a, b):
    """max |a - b| over the RMS of b."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.sqrt(np.mean(b * b)))


def ln_image(rng, shape, gamma=None, beta=None):
    """Tokens on a LayerNorm's image: gamma * n + beta with mean(n) = 0, |n| = sqrt(d)."""
    n = rng.standard_normal(shape)
    n -= n.mean(-1, keepdims=True)
    n /= np.sqrt((n * n).mean(-1, keepdims=True))
    if gamma is None:
        return n
    return n * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64)


def torch_modules():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    return torch


def run(module, X, torch):
    with torch.no_grad():
        out = module(torch.from_numpy(np.ascontiguousarray(X)))
    return (out[0] if isinstance(out, tuple) else out).double().numpy()


# ----------------------------------------------------------------------------- the numpy block


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_block_matches_transformers_bertlayer(dtype, seed):
    torch = torch_modules()
    from headthief.targets.encoder import hf_bert_layer
    block = random_block(32, 4, 128, seed=seed, dtype=dtype)
    module = hf_bert_layer(block)                   # the same weights in transformers' BertLayer, same dtype
    assert next(module.parameters()).dtype == (torch.float64 if dtype is np.float64 else torch.float32)
    rng = np.random.default_rng(seed)
    for N in (1, 2, 9):
        X = ln_image(rng, (12, N, 32), block.ln2_gamma, block.ln2_beta).astype(dtype)
        assert rel(block.forward(X), run(module, X, torch)) <= tol(dtype, 128)
    # a list batch of mixed lengths goes through evaluate in the batch's order
    seqs = [ln_image(rng, (N, 32)).astype(dtype) for N in (3, 1, 5, 3)]
    out = block.evaluate(seqs)
    for x, y in zip(seqs, out):
        assert y.shape == x.shape and rel(y, run(module, x[None], torch)[0]) <= tol(dtype, 128)


def test_random_block_is_not_trivial():
    """Scales of a trained block: attention neither uniform nor one-hot, GELU pre-activations spread over
    its curved region, outputs on LN2's image."""
    block = random_block(32, 4, 128, seed=3)
    X = ln_image(np.random.default_rng(0), (50, 8, 32), block.ln1_gamma, block.ln1_beta)
    canon = block.attention.canonical()
    A = np.stack([canon.attention(x) for x in X[:20]])                 # (20, H, N, N)
    entropy = float(-(A * np.log(A)).sum(-1).mean() / np.log(8))
    assert 0.2 < entropy < 0.85
    s = block.trace(X)["s"]
    assert 0.7 < s.std() < 2.0 and np.mean(np.abs(s) < 3) > 0.95 and np.mean(s > 1) > 0.1 and np.mean(s < -1) > 0.1
    y = block.forward(X)
    n = (y - block.ln2_beta) / block.ln2_gamma
    assert np.allclose(n.mean(-1), 0, atol=1e-12) and np.allclose(np.linalg.norm(n, axis=-1), np.sqrt(32), rtol=1e-10)


def test_bert_init_block_has_bertmodels_scales():
    """``init=bert``: weights N(0, 0.02^2), biases 0, LayerNorms 1 and 0 (BertModel's ``_init_weights``), so
    attention is nearly uniform and the FFN's pre-activations stay within GELU's nearly linear middle."""
    t = resolve("bert-block:d=32,heads=4,ffn=128,seed=3,init=bert")
    block = t.truth
    sd = block.state_dict()
    for name, w in sd.items():
        if name.endswith("LayerNorm.weight"):
            assert np.all(w == 1.0), name
        elif name.endswith("bias"):
            assert np.all(w == 0.0), name
        else:
            assert abs(float(np.std(w)) - 0.02) < 0.002 and abs(float(np.mean(w))) < 0.002, name
    X = np.random.default_rng(0).standard_normal((20, 8, 32))
    s = block.trace(X)["s"]
    assert float(s.std()) < 0.2
    canon = block.attention.canonical()
    A = np.stack([canon.attention(x) for x in X])
    assert float(-(A * np.log(A)).sum(-1).mean() / np.log(8)) > 0.99
    with pytest.raises(ValueError, match="init must be"):
        random_block(8, 2, 8, init="xavier")


def test_gelu_is_exact_erf_form():
    s = np.linspace(-6, 6, 101)
    from scipy.stats import norm
    assert np.max(np.abs(gelu(s) - s * norm.cdf(s))) < 1e-15
    tanh_form = 0.5 * s * (1 + np.tanh(np.sqrt(2 / np.pi) * (s + 0.044715 * s ** 3)))
    assert np.max(np.abs(gelu(s) - tanh_form)) > 1e-4                   # not the tanh approximation


# ----------------------------------------------------------------------------- the real block


@pytest.mark.parametrize("layer", [0, 2, 5])
def test_minilm_block_float64_matches_the_packaged_bertlayer(layer):
    """The numpy block (weights read from the checkpoint) against transformers' own layer of the packaged
    BertModel, both in float64: the same mathematics to float64 rounding."""
    torch = torch_modules()
    from headthief.models.torch_modules import load_minilm_hf
    module = copy.deepcopy(load_minilm_hf().encoder.layer[layer]).double()
    block = from_minilm(layer, dtype=np.float64)
    prev = from_minilm(layer - 1) if layer > 0 else None
    g, b = (prev.ln2_gamma, prev.ln2_beta) if prev else (None, None)
    X = ln_image(np.random.default_rng(layer), (6, 10, D), g, b)
    assert rel(block.forward(X), run(module, X, torch)) <= tol(np.float64, FFN)
    assert block.info["checkpoint_prefix"] == f"encoder.layer.{layer}."


def test_minilm_block_and_hf_targets_agree():
    torch_modules()
    rng = np.random.default_rng(7)
    t_np, t_hf = resolve("minilm-block:layer=2"), resolve("minilm-block-hf:layer=2")
    for t in (t_np, t_hf):
        assert (t.d, t.output, t.d_out, t.bias) == (D, "all", D, True)
        assert isinstance(t.truth, BertBlock) and t.truth.dtype is np.float64 and t.info["layer"] == 2
        assert t.info["dtype"] == "float32" and t.info["ffn"] == FFN and t.info["heads"] == 12
    assert t_hf.info["black_box"].startswith("transformers")
    prev = from_minilm(1)
    seqs = [ln_image(rng, (N, D), prev.ln2_gamma, prev.ln2_beta) for N in (1, 4, 12, 4)]
    o_np, o_hf = t_np.make_oracle(), t_hf.make_oracle()
    y_np, y_hf = o_np.query(seqs), o_hf.query(seqs)
    y_64 = t_np.truth.evaluate(seqs)
    for a, b, c in zip(y_np, y_hf, y_64):
        assert a.shape == b.shape == c.shape
        assert rel(a, b) <= tol(np.float32, FFN)                      # numpy float32 vs transformers float32
        assert rel(a, c) <= tol(np.float32, FFN) and rel(b, c) <= tol(np.float32, FFN)
    # the answers lie on LN2's image
    n = (np.concatenate(y_np) - t_np.truth.ln2_beta) / t_np.truth.ln2_gamma
    assert np.max(np.abs(n.mean(-1))) < 1e-5


# ----------------------------------------------------------------------------- the encoder


def test_minilm_encoder_matches_bertmodel_hidden_states():
    torch = torch_modules()
    from headthief.models.torch_modules import load_minilm_hf
    rng = np.random.default_rng(11)
    X = (0.05 * rng.standard_normal((3, 9, D)))                     # inputs_embeds of word-embedding scale
    # float64: the numpy encoder against BertModel(output_hidden_states=True) in float64
    model64 = copy.deepcopy(load_minilm_hf()).double()
    with torch.no_grad():
        hs = model64(inputs_embeds=torch.from_numpy(X), output_hidden_states=True).hidden_states
    ref = np.concatenate([h.numpy() for h in hs], axis=-1)
    del model64
    enc64 = minilm_encoder("all", dtype=np.float64)
    y64 = enc64.forward(X)
    assert y64.shape == ref.shape == (3, 9, 7 * D)
    for k in range(7):
        sl = slice(k * D, (k + 1) * D)
        assert rel(y64[..., sl], ref[..., sl]) <= tol(np.float64, FFN, stages=k + 1)
    # the target (transformers float32) against its float64 truth, and against the numpy float32 encoder
    t = resolve("minilm-encoder")
    assert (t.output, t.d_out, t.info["hidden"]) == ("all", 7 * D, "all") and isinstance(t.truth, Encoder)
    o = t.make_oracle()
    y32 = o.query(X)
    np32 = minilm_encoder("all").forward(X)
    for k in range(7):
        sl = slice(k * D, (k + 1) * D)
        assert rel(y32[..., sl], ref[..., sl]) <= tol(np.float32, FFN, stages=k + 1)
        assert rel(np32[..., sl], y32[..., sl]) <= tol(np.float32, FFN, stages=k + 1)
    assert o.queries == 3 and o.numbers == 3 * 9 * 7 * D
    # hidden=last: the last slice of hidden=all
    t_last = resolve("minilm-encoder:hidden=last")
    assert t_last.d_out == D and t_last.truth.d_out == D
    y_last = t_last.make_oracle().query(X)
    assert y_last.shape == (3, 9, D)
    assert np.array_equal(y_last, y32[..., 6 * D:])


def test_encoder_refuses_sequences_past_its_positions():
    enc = minilm_encoder("last")
    assert enc.max_positions == 512
    with pytest.raises(InvalidQuery, match="512 positions"):
        ModelOracle(enc).query([np.zeros((513, D))])


# ----------------------------------------------------------------------------- targets and oracles


def test_bert_block_target_and_model_oracle_counts():
    t = resolve("bert-block:d=16,heads=2,ffn=32,seed=4")
    assert (t.d, t.output, t.d_out) == (16, "all", 16) and isinstance(t.truth, BertBlock)
    assert t.info["heads"] == 2 and t.info["ffn"] == 32 and t.info["dtype"] == "float64"
    o = t.make_oracle(budget=10)
    assert isinstance(o, ModelOracle) and o.output.value == "all" and o.d_out == 16
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((N, 16)) for N in (1, 3, 2)]
    ys = o.query(seqs)
    assert [y.shape for y in ys] == [(1, 16), (3, 16), (2, 16)]
    assert (o.queries, o.fresh, o.numbers) == (3, 3, 6 * 16)
    for x, y in zip(seqs, ys):
        assert np.array_equal(y, t.truth.forward(x[None])[0])
    o.query(np.zeros((7, 2, 16)))
    assert o.queries == 10
    from headthief.errors import BudgetExceeded
    with pytest.raises(BudgetExceeded):
        o.query([np.zeros((1, 16))])
    # float32: the oracle rounds like a float32 model; its truth is the same weights in float64
    t32 = resolve("bert-block:d=16,heads=2,ffn=32,seed=4,dtype=float32")
    assert t32.truth.dtype is np.float64 and t32.info["dtype"] == "float32"
    y32 = t32.make_oracle().query(seqs)
    for x, y in zip(seqs, y32):
        assert 0 < rel(y, t32.truth.forward(x[None])[0]) <= tol(np.float32, 32)
    # act=relu: the same weights with ReLU where BERT has GELU answer differently
    relu = resolve("bert-block:d=16,heads=2,ffn=32,seed=4,act=relu")
    assert relu.truth.activation == "relu"
    assert rel(relu.make_oracle().query(seqs)[1], ys[1]) > 1e-3


@pytest.mark.parametrize("spec,match", [
    ("bert-block:d=30,heads=4,ffn=8", "does not divide"),
    ("bert-block:d=32,heads=4", "ffn= is required"),
    ("bert-block:d=32,heads=4,ffn=8,output=last", "unknown option"),
    ("bert-block:d=32,heads=4,ffn=8,dtype=float16", "dtype"),
    ("bert-block:d=32,heads=4,ffn=8,act=tanh", "act="),
    ("bert-block:d=32,heads=4,ffn=8,init=xavier", "init="),
    ("minilm-block:layer=-1", "blocks 0..5"),
    ("minilm-block:layer=6", "blocks 0..5"),
    ("minilm-block:layer=x", "not an integer"),
    ("minilm-block", "layer= is required"),
    ("minilm-block:layer=2,head=3", "unknown option"),
    ("minilm-block-hf:layer=6", "blocks 0..5"),
    ("minilm-block-hf:layer=2,readout=1", "unknown option"),
    ("minilm-encoder:hidden=first", "hidden="),
    ("minilm-encoder:layer=2", "unknown option"),
])
def test_spec_errors(spec, match):
    with pytest.raises(SpecError, match=match):
        resolve(spec)


def test_targets_are_listed():
    syntaxes = [s for s, _ in describe()]
    for kind in ("bert-block:", "minilm-block:", "minilm-block-hf:", "minilm-encoder"):
        assert any(s.startswith(kind) for s in syntaxes), kind
