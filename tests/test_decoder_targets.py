"""Decoder attention targets (rope-mha:, llama-attn:, gpt2-attn:): the numpy models against transformers' own
LlamaAttention and GPT2Attention, causality, and RoPE's relative form.

Tolerances are derived, not tuned. Two evaluations of the same layer in one precision agree to
``8 sqrt(n) eps`` relative (max |difference| over the RMS of the answers; about 8 rounded stages, each a sum
of at most n = max(d, N) rounded products, as in ``test_block_targets``). transformers adds one more float32
error of its own: ``LlamaRotaryEmbedding`` forms the angle ``p * inv_freq`` in float32, an absolute error up to
``2 p eps32`` (p < N, inv_freq <= 1), which moves a score by that much relative to |q||k|/sqrt(d_h) ~ 1 for
these layers' scales: ``2 N eps32`` more. Its eager attention also takes the softmax in float32 whatever
the module's dtype, so a float64 eager module is held to the float32 bound. torch and transformers are
imported inside the tests (skipped where missing).
"""

import numpy as np
import pytest

from headthief.errors import SpecError
from headthief.models.mha import AttentionLayer, CanonicalLayer, random_layer
from headthief.models.rope import RopeAttention, random_rope_layer, rotary_tables
from headthief.targets import describe, resolve

EPS32 = float(np.finfo(np.float32).eps)


def tol(dtype, n, N=0):
    """8 sqrt(n) eps, plus 2 N eps32 for transformers' float32 rotary angles when N (the length) is given."""
    return 8.0 * np.sqrt(n) * float(np.finfo(dtype).eps) + 2.0 * N * EPS32


def rel(a, b):
    """max |a - b| over the RMS of b."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.sqrt(np.mean(b * b)))


def torch_modules():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    return torch


def tables(torch, layer, N):
    """The rotary tables of the numpy layer (float64) as torch tensors (1, N, head_dim)."""
    cos, sin = rotary_tables(np.arange(N), layer.head_dim, layer.theta)
    return torch.from_numpy(cos)[None], torch.from_numpy(sin)[None]


# ----------------------------------------------------------------------------- the numpy twin vs LlamaAttention


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("G", [4, 2, 1])
def test_rope_layer_is_llama_attention_float64(G, bias):
    """Every convention (q/k/v/o_proj layout, GQA grouping h // (H/G), rotate_half, the scale, the causal mask,
    the biases) against transformers' LlamaAttention in float64. The rotary tables are handed in float64 and the
    attention runs through transformers' sdpa path: its eager path takes the softmax in float32 (next test)."""
    torch = torch_modules()
    from headthief.targets.decoder import causal_mask, llama_attention
    layer = random_rope_layer(32, 4, G, seed=10 + G, bias=bias, theta=500.0)
    module, _ = llama_attention(layer, attn_implementation="sdpa")
    assert module.o_proj.weight.dtype == torch.float64 and module.num_key_value_groups == 4 // G
    assert (module.q_proj.bias is not None) == bias
    rng = np.random.default_rng(G)
    for N in (1, 2, 7, 33):
        X = rng.standard_normal((5, N, 32))
        with torch.no_grad():
            ref = module(torch.from_numpy(X), position_embeddings=tables(torch, layer, N),
                         attention_mask=causal_mask(N, torch.float64))[0].numpy()
        assert rel(layer.forward(X), ref) <= 1e-12


def test_eager_llama_attention_float64_is_float32_accurate():
    """What a float64 llama-attn target answers: transformers' eager path (float32 softmax, float32 rotary
    tables from LlamaRotaryEmbedding) agrees with the float64 layer only to float32 precision."""
    torch = torch_modules()
    t = resolve("llama-attn:d=64,heads=4,kv_heads=2,seed=3,dtype=float64")
    assert isinstance(t.truth, RopeAttention) and t.truth.dtype is np.float64 and t.info["dtype"] == "float64"
    X = np.random.default_rng(0).standard_normal((4, 40, 64))
    y = t.make_oracle().query(X)
    err = rel(y, t.truth.forward(X))
    assert 1e-12 < err <= tol(np.float32, 64, N=40)
    # the rotary tables: transformers' float32 ones against the exact float64 ones
    from headthief.targets.decoder import llama_attention
    _, rotary = llama_attention(t.truth)
    N = 4096
    cos, sin = rotary(torch.zeros(1, N, 64, dtype=torch.float64), torch.arange(N)[None])
    c64, s64 = rotary_tables(np.arange(N), 16, 10000.0)
    worst = np.max(np.abs(cos[0].numpy() - c64) + np.abs(sin[0].numpy() - s64), axis=0)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    bound = 2 * (N - 1) * np.concatenate([inv_freq, inv_freq]) * EPS32 + 2 * EPS32    # angle error + rounding
    assert np.all(worst <= bound) and worst.max() > 1e-6


@pytest.mark.parametrize("spec,n", [("llama-attn:d=64,heads=4,kv_heads=2,seed=1", 64),
                                    ("llama-attn:d=64,heads=8,kv_heads=1,rope_theta=500,seed=2", 64),
                                    ("rope-mha:d=48,heads=6,kv_heads=3,bias=1,seed=4,dtype=float32", 48),
                                    ("gpt2-attn:d=64,heads=4,seed=1", 64)])
def test_float32_targets_against_float64_truth(spec, n):
    torch_modules()
    t = resolve(spec)
    assert (t.output, t.d_out) == ("all", t.d) and t.info["dtype"] == "float32" and t.truth is not None
    o = t.make_oracle()
    rng = np.random.default_rng(5)
    for N in (1, 2, 16, 64):
        X = rng.standard_normal((6, N, t.d))
        y = o.query(X)
        assert y.shape == (6, N, t.d)
        err = rel(y, t.truth.evaluate(X))
        assert 0 < err <= tol(np.float32, max(n, N), N=N if spec.startswith("llama") else 0), (N, err)
    # mixed lengths come back as a list in the batch's order
    seqs = [rng.standard_normal((N, t.d)) for N in (3, 1, 5, 3)]
    ys = o.query(seqs)
    for x, y in zip(seqs, ys):
        assert y.shape == x.shape and rel(y, t.truth.evaluate(x[None])[0]) <= tol(np.float32, n, N=5)


def test_llama_attn_holds_rope_mha_weights_for_the_same_seed():
    torch_modules()
    t = resolve("llama-attn:d=32,heads=4,kv_heads=2,rope_theta=1000,seed=7,dtype=float64")
    twin = resolve("rope-mha:d=32,heads=4,kv_heads=2,rope_theta=1000,seed=7").truth
    for k, v in twin.state_dict().items():
        assert np.array_equal(t.truth.state_dict()[k], v), k
    assert t.bias is False and t.info["kv_heads"] == 2 and t.info["rope_theta"] == 1000.0
    assert "LlamaAttention" in t.info["black_box"]


# ----------------------------------------------------------------------------- gpt2-attn


def test_gpt2_attention_is_a_causal_attention_layer():
    """The Conv1D layout (c_attn (d, 3d): [Q; K; V]^T, heads in order; c_proj = Wo^T) against transformers'
    GPT2Attention run with the causal mask, in float64; and the target's truth is that layer's canonical form."""
    torch = torch_modules()
    from headthief.targets.decoder import gpt2_attention, gpt2_attn_forward, gpt2_layer, gpt2_state_dict
    layer = random_layer(48, 3, seed=2, bias=True, causal=True, output="all")
    module = gpt2_attention(layer)
    back = gpt2_layer(module)
    for name in ("Q", "K", "V", "Wo", "bq", "bk", "bv", "bo"):
        assert np.array_equal(getattr(back, name), getattr(layer, name)), name
    assert gpt2_state_dict(layer)["c_attn.weight"].shape == (48, 144)
    forward = gpt2_attn_forward(module)
    rng = np.random.default_rng(1)
    for N in (1, 2, 9):
        X = rng.standard_normal((4, N, 48))
        with torch.no_grad():
            y = forward(torch.from_numpy(X)).numpy()
        assert rel(y, layer.forward(X)) <= tol(np.float64, 48)
        if N > 1:                    # without the mask the module attends both ways: the mask is ours to pass
            with torch.no_grad():
                both = module(torch.from_numpy(X))[0].numpy()
            assert rel(both, layer.forward(X)) > 1e-3
    t = resolve("gpt2-attn:d=48,heads=3,seed=2,dtype=float64")
    assert isinstance(t.truth, CanonicalLayer) and t.truth.causal and t.bias
    X = rng.standard_normal((3, 6, 48))
    assert rel(t.make_oracle().query(X), layer.forward(X)) <= tol(np.float64, 48)
    assert rel(t.truth.forward(X), layer.forward(X)) <= tol(np.float64, 48)


# ----------------------------------------------------------------------------- causality and RoPE


@pytest.mark.parametrize("spec", ["rope-mha:d=32,heads=4,kv_heads=2,bias=1,seed=1",
                                  "llama-attn:d=32,heads=4,kv_heads=1,seed=1",
                                  "gpt2-attn:d=32,heads=4,seed=1"])
def test_answers_before_a_token_do_not_see_it(spec):
    torch_modules()
    t = resolve(spec)
    o = t.make_oracle()
    rng = np.random.default_rng(2)
    X = rng.standard_normal((1, 9, t.d))
    for pos in (0, 4, 8):
        Z = X.copy()
        Z[0, pos] = rng.standard_normal(t.d)
        y, z = o.query(np.concatenate([X, Z]))
        assert np.array_equal(y[:pos], z[:pos])
        assert np.all(np.max(np.abs(y[pos:] - z[pos:]), axis=1) > 1e-3)


def rotation(offset, head_dim, theta):
    """R(offset) built plane by plane: coordinates (j, j + d_h/2) turned by offset * theta^(-2j/d_h)."""
    h = head_dim // 2
    R = np.zeros((head_dim, head_dim))
    for j in range(h):
        a = offset * theta ** (-2.0 * j / head_dim)
        R[j, j], R[j, j + h], R[j + h, j], R[j + h, j + h] = np.cos(a), -np.sin(a), np.sin(a), np.cos(a)
    return R


def test_rope_scores_depend_on_the_offset_only():
    """For a query token b at position t and a key token a at position i, log(A[t, i] / A[t, t]) (the softmax's
    normaliser cancels) must equal (q_b^T R(i - t) k_a - q_b^T k_b) / sqrt(d_h) with R built plane by plane,
    wherever the pair sits and whatever precedes it. Checked on the numpy layer (exactly) and on transformers'
    LlamaAttention's own attention weights; the scores do change with the offset (not a position-free layer)."""
    torch = torch_modules()
    from headthief.targets.decoder import llama_attention
    layer = random_rope_layer(32, 2, 1, seed=5, theta=100.0)     # theta 100: every plane turns visibly by 30
    module, rotary = llama_attention(layer)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(32), rng.standard_normal(32)
    dh, s = 16, 1 / np.sqrt(16)
    qb = [layer.Q[h] @ b for h in range(2)]
    ka, kb = layer.K[0] @ a, layer.K[0] @ b
    seen = {}
    for start, gap in [(0, 1), (5, 1), (30, 1), (0, 3), (12, 3), (27, 3)]:
        X = rng.standard_normal((1, start + gap + 1, 32))
        X[0, start], X[0, start + gap] = a, b
        t, i = start + gap, start
        want = np.array([(qb[h] @ rotation(-gap, dh, 100.0) @ ka - qb[h] @ kb) * s for h in range(2)])
        A = layer.trace(X)["A"][0]
        got = np.log(A[:, t, i] / A[:, t, t])
        assert np.max(np.abs(got - want)) <= 1e-12 * (1 + np.abs(want).max())
        # transformers: eager weights (float32 softmax) with its own float32 rotary tables
        Xt = torch.from_numpy(X)
        with torch.no_grad():
            from headthief.targets.decoder import causal_mask
            W = module(Xt, position_embeddings=rotary(Xt, torch.arange(X.shape[1])[None]),
                       attention_mask=causal_mask(X.shape[1], torch.float64))[1][0].numpy()
        hf = np.log(W[:, t, i] / W[:, t, t])
        scale = max(np.linalg.norm(qb[h]) * max(np.linalg.norm(ka), np.linalg.norm(kb)) for h in range(2)) * s
        assert np.max(np.abs(hf - want)) <= 8 * EPS32 + 4 * (t + 1) * EPS32 * scale    # softmax + angle rounding
        seen.setdefault(gap, []).append(got)
    assert np.max(np.abs(seen[1][0] - seen[3][0])) > 0.1      # a different offset gives a different score


def test_random_rope_layer_attention_is_not_trivial():
    """N(0, 1/d) projections for tokens of norm ~sqrt(d): scores of std ~1, attention neither uniform nor one-hot."""
    layer = random_rope_layer(64, 4, 2, seed=0)
    X = np.random.default_rng(0).standard_normal((40, 16, 64))
    tr = layer.trace(X)
    assert 0.7 < tr["S"][:, :, 15, :].std() < 1.4
    A = tr["A"]
    ent = np.mean([np.mean(-(A[:, :, t, :t + 1] * np.log(A[:, :, t, :t + 1])).sum(-1)) / np.log(t + 1)
                   for t in range(1, 16)])
    top = A[:, :, 15, :].max(-1).mean()
    assert 0.5 < ent < 0.95 and 2 / 16 < top < 0.6
    assert np.allclose(A.sum(-1), 1) and np.all(np.triu(A[0, 0], 1) == 0)


def test_rope_state_dict_round_trip_and_validation():
    layer = random_rope_layer(24, 6, 2, head_dim=6, bias=True, seed=1, theta=50.0, dtype=np.float32)
    sd = layer.state_dict()
    assert set(sd) == {f"{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")}
    assert sd["q_proj.weight"].shape == (36, 24) and sd["k_proj.weight"].shape == (12, 24)
    assert sd["o_proj.weight"].shape == (24, 36) and sd["q_proj.weight"].dtype == np.float32
    back = RopeAttention.from_state_dict(sd, 6, 2, theta=50.0, dtype=np.float32)
    X = np.random.default_rng(0).standard_normal((2, 5, 24))
    assert np.array_equal(back.forward(X), layer.forward(X)) and back.bias
    assert np.array_equal(layer.astype(np.float64).Q, layer.Q.astype(np.float64))
    assert layer.evaluate(X).shape == (2, 5, 24) and layer.with_output("last").evaluate(X).shape == (2, 24)
    nb = random_rope_layer(16, 2, seed=0)
    assert set(nb.state_dict()) == {f"{p}_proj.weight" for p in "qkvo"}
    with pytest.raises(ValueError, match="not a multiple of kv_heads"):
        random_rope_layer(16, 4, 3)
    with pytest.raises(ValueError, match="even"):
        random_rope_layer(12, 4)
    with pytest.raises(ValueError, match="does not divide"):
        random_rope_layer(10, 4)
    with pytest.raises(ValueError, match="bias=False"):
        RopeAttention(Q=nb.Q, K=nb.K, V=nb.V, Wo=nb.Wo, bo=np.ones(16))
    with pytest.raises(ValueError, match="theta"):
        random_rope_layer(16, 2, theta=0.0)
    with pytest.raises(ValueError, match="dtype"):
        random_rope_layer(16, 2, dtype=np.float16)


# ----------------------------------------------------------------------------- specs


def test_rope_mha_target():
    t = resolve("rope-mha:d=32,heads=4,kv_heads=2,seed=3,output=last")
    assert (t.d, t.d_out, t.output, t.bias) == (32, 32, "last", False)
    assert t.info["kv_heads"] == 2 and t.info["head_dim"] == 8 and t.info["rope_theta"] == 10000.0
    o = t.make_oracle(budget=3)
    X = np.random.default_rng(0).standard_normal((3, 6, 32))
    y = o.query(X)
    assert y.shape == (3, 32) and np.array_equal(y, t.truth.forward(X)[:, -1])
    assert isinstance(resolve("rope-mha:d=32,heads=2,head_dim=6").truth, RopeAttention)
    assert not isinstance(t.truth, AttentionLayer)


@pytest.mark.parametrize("spec,match", [
    ("rope-mha:d=32,heads=4,kv_heads=3", "heads=4 is not a multiple of kv_heads=3"),
    ("rope-mha:d=12,heads=4", "head_dim=3 is odd"),
    ("rope-mha:d=32,heads=2,head_dim=5", "head_dim=5 is odd"),
    ("rope-mha:d=30,heads=4", "heads=4 does not divide d=30"),
    ("rope-mha:d=32,heads=4,dtype=float16", "dtype='float16': use float64 or float32"),
    ("rope-mha:d=32,heads=4,rope_theta=-1", "rope_theta=-1 must be a finite number > 0"),
    ("rope-mha:d=32,heads=4,output=value", "output='value'"),
    ("rope-mha:d=32,heads=4,bias=2", "bias='2'"),
    ("rope-mha:d=32,heads=4,causal=1", "unknown option.*causal"),
    ("rope-mha:heads=4", "d= is required"),
    ("llama-attn:d=64,heads=8,kv_heads=3", "heads=8 is not a multiple of kv_heads=3"),
    ("llama-attn:d=24,heads=8", "head_dim=3 is odd"),
    ("llama-attn:d=64,heads=4,head_dim=8", "unknown option.*head_dim"),
    ("llama-attn:d=64,heads=4,bias=1", "unknown option.*bias"),
    ("llama-attn:d=64,heads=4,dtype=bfloat16", "dtype='bfloat16'"),
    ("llama-attn:d=64,heads=4,rope_theta=abc", "not a number"),
    ("gpt2-attn:d=30,heads=4", "heads=4 does not divide d=30"),
    ("gpt2-attn:d=32,heads=4,kv_heads=2", "unknown option.*kv_heads"),
    ("gpt2-attn:d=32,heads=4,dtype=int8", "dtype='int8'"),
])
def test_spec_errors(spec, match):
    with pytest.raises(SpecError, match=match):
        resolve(spec)


def test_missing_torch_names_the_install_command(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_torch(name, *a, **kw):
        if name == "torch" or name.startswith("torch.") or name.startswith("transformers"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    for spec in ("llama-attn:d=16,heads=2", "gpt2-attn:d=16,heads=2"):
        with pytest.raises(SpecError, match="pip install"):
            resolve(spec)


def test_targets_are_listed(capsys):
    from headthief.cli import main
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    syntaxes = [s for s, _ in describe()]
    for kind in ("rope-mha:", "llama-attn:", "gpt2-attn:"):
        assert any(s.startswith(kind) for s in syntaxes) and kind in out, kind
