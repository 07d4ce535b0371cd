"""Export of a canonical layer as BERT attention weights (safetensors, transformers' names): the file
loaded into transformers' BertAttention answers like the layer; its canonical parameters are the input's."""

import json

import numpy as np
import pytest

from headthief.models.bert_export import (FORMAT, NAMES, bert_attention_tensors, load_bert_attention,
                                          read_bert_attention, save_bert_attention)
from headthief.models.mha import CanonicalLayer, random_layer

EPS32 = float(np.finfo(np.float32).eps)


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))


def canonical_from_tensors(t, H, causal=False):
    """W_h, c_h, O_h, b re-derived from BERT tensors, written out independently of headthief."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    d = t["output.dense.bias"].shape[0]
    dh = t["self.query.weight"].shape[0] // H
    Q, K, V = (t[f"self.{n}.weight"].reshape(H, dh, d) for n in ("query", "key", "value"))
    bq, bv = t["self.query.bias"].reshape(H, dh), t["self.value.bias"]
    Wo = t["output.dense.weight"]
    W = np.stack([K[h].T @ Q[h] / np.sqrt(dh) for h in range(H)])
    c = np.stack([K[h].T @ bq[h] / np.sqrt(dh) for h in range(H)])
    O = np.stack([Wo[:, h * dh:(h + 1) * dh] @ V[h] for h in range(H)])
    b = t["output.dense.bias"] + Wo @ bv
    return W, c, O, b


def stacked(layer: CanonicalLayer):
    H = layer.heads
    return (np.stack([layer.W(h) for h in range(H)]), layer.C,
            np.stack([layer.O(h) for h in range(H)]), layer.b)


# ----------------------------------------------------------------------------- tensors (numpy only)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tensors_reproduce_the_canonical_parameters_in_float64(seed):
    layer = random_layer(32, 4, seed=seed, bias=True, output="all").canonical()
    t, report = bert_attention_tensors(layer, return_report=True)
    assert set(t) == set(NAMES)
    assert t["self.query.weight"].shape == (32, 32) and t["output.dense.weight"].shape == (32, 32)
    assert not t["self.key.bias"].any() and not t["self.value.bias"].any()     # bk = bv = 0
    np.testing.assert_array_equal(t["output.dense.bias"], layer.b)             # bo = b
    for got, want in zip(canonical_from_tensors(t, 4), stacked(layer)):
        assert rel(got, want) < 1e-12
    assert report["c_residual_max"] < 1e-12
    # the canonical choice depends only on (W_h, c_h, O_h, b): another factorisation gives the same tensors
    G = np.random.default_rng(seed + 10).standard_normal((4, 8, 8))
    other = CanonicalLayer(A=np.einsum("hdr,hrs->hds", layer.A, G),
                           B=np.einsum("hdr,hsr->hds", layer.B, np.linalg.inv(G)),
                           C=layer.C, U=np.einsum("hdr,hrs->hds", layer.U, G),
                           Vt=np.einsum("hdr,hsr->hds", layer.Vt, np.linalg.inv(G)), b=layer.b,
                           output="all")
    t2 = bert_attention_tensors(other)
    for n in NAMES:
        np.testing.assert_allclose(t2[n], t[n], rtol=0, atol=1e-9 * max(1.0, np.abs(t[n]).max()))


def test_an_attention_layer_is_taken_through_its_canonical_form():
    L = random_layer(32, 4, seed=4, bias=True, output="all")
    t_layer, t_canon = bert_attention_tensors(L), bert_attention_tensors(L.canonical())
    for n in NAMES:
        np.testing.assert_array_equal(t_layer[n], t_canon[n])


def test_c_outside_the_key_space_is_reported_as_the_residual():
    layer = random_layer(32, 2, head_dim=16, seed=5, bias=True, output="all").canonical()
    assert layer.A.shape == (2, 32, 16)
    # add to c_0 a direction orthogonal to col(W_0) = col(A_0): not representable by any bq
    Qa, _ = np.linalg.qr(layer.A[0], mode="complete")
    n = Qa[:, -1] * np.linalg.norm(layer.C[0])
    C = layer.C.copy()
    C[0] = C[0] + n
    noisy = CanonicalLayer(A=layer.A, B=layer.B, C=C, U=layer.U, Vt=layer.Vt, b=layer.b, output="all")
    _, report = bert_attention_tensors(noisy, return_report=True)
    assert report["c_residual"][0] == pytest.approx(np.linalg.norm(n) / np.linalg.norm(C[0]), rel=1e-9)
    assert report["c_residual"][1] < 1e-12


# ----------------------------------------------------------------------------- errors


def test_errors_are_clear(tmp_path):
    pytest.importorskip("safetensors")
    layer = random_layer(32, 4, seed=0, bias=True, output="all").canonical()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_bert_attention(layer, tmp_path / "missing" / "layer.safetensors")
    assert not (tmp_path / "missing").exists()
    narrow = random_layer(32, 4, head_dim=4, seed=0, output="all").canonical()     # H * r = 16 != 32
    with pytest.raises(ValueError, match=r"H \* head_dim = 4 \* 4 = 16 != hidden_size d = 32"):
        save_bert_attention(narrow, tmp_path / "narrow.safetensors")
    with pytest.raises(ValueError, match=r"H \* head_dim"):
        bert_attention_tensors(narrow)
    assert not (tmp_path / "narrow.safetensors").exists()
    causal = random_layer(32, 4, seed=0, causal=True, output="all").canonical()
    with pytest.raises(ValueError, match="causal"):
        save_bert_attention(causal, tmp_path / "causal.safetensors")
    with pytest.raises(ValueError, match="reserved"):
        save_bert_attention(layer, tmp_path / "m.safetensors", metadata={"heads": 3})
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_bert_attention(tmp_path / "nothing.safetensors")
    with pytest.raises(TypeError, match="CanonicalLayer"):
        bert_attention_tensors("layer")


# ----------------------------------------------------------------------------- the saved file


def test_saved_file_holds_the_canonical_parameters(tmp_path):
    pytest.importorskip("safetensors")
    layer = random_layer(32, 4, seed=7, bias=True, output="all").canonical()
    path = tmp_path / "layer.safetensors"
    report = save_bert_attention(layer, path, metadata={"target": "random", "seed": 7})
    assert report["path"] == str(path)
    t, meta = read_bert_attention(path)
    assert all(v.dtype == np.float32 for v in t.values())
    assert meta["format"] == FORMAT and meta["target"] == "random" and json.loads(meta["seed"]) == 7
    assert (int(meta["heads"]), int(meta["head_dim"]), int(meta["hidden_size"])) == (4, 8, 32)
    assert json.loads(meta["causal"]) is False
    # float32 storage: each parameter is a product of rounded factors, so ~eps32 relative (eps32 = 1.2e-7)
    for name, got, want in zip("WcOb", canonical_from_tensors(t, 4), stacked(layer)):
        assert rel(got, want) < 1e-6, name


def test_saved_minilm_layer_holds_its_canonical_parameters(tmp_path):
    pytest.importorskip("safetensors")
    from headthief.models.minilm import minilm_attention_layer
    layer = minilm_attention_layer(2, dtype=np.float64).canonical()
    path = tmp_path / "minilm2.safetensors"
    report = save_bert_attention(layer, path)
    assert report["c_residual_max"] < 1e-10
    t, _ = read_bert_attention(path)
    for name, got, want in zip("WcOb", canonical_from_tensors(t, 12), stacked(layer)):
        assert rel(got, want) < 1e-6, name


# ----------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("seed", [0, 1])
def test_loaded_bert_attention_answers_like_a_random_layer(tmp_path, seed):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    L = random_layer(32, 4, seed=seed, bias=True, output="all")
    layer = L.canonical()
    path = tmp_path / "layer.safetensors"
    save_bert_attention(layer, path)
    forward, attention = load_bert_attention(path)
    from transformers.models.bert.modeling_bert import BertAttention
    assert isinstance(attention, BertAttention) and not attention.training
    assert attention.self.attention_head_size == 8 and attention.self.num_attention_heads == 4
    rng = np.random.default_rng(100 + seed)
    for N in (1, 5, 16):
        X = rng.standard_normal((6, N, 32)).astype(np.float32)       # exactly representable in float32
        y = forward(torch.from_numpy(X))
        assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == (6, N, 32)
        y = y.numpy().astype(np.float64)
        want = layer.forward(X.astype(np.float64))
        np.testing.assert_allclose(L.forward(X.astype(np.float64)), want, rtol=0, atol=1e-12)
        # float32 bound: rounding of weights and length-n float32 accumulations (n = d in the projections
        # and the output dense, N in the attention average) each contribute <= n eps32 relative to the scale
        tol = (2 * 32 + N) * EPS32 * np.abs(want).max()
        assert np.abs(y - want).max() <= tol
    np.testing.assert_array_equal(forward(X), forward(torch.from_numpy(X)).numpy())   # numpy accepted


def test_loaded_minilm_layer_answers_like_transformers_own_layer(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from headthief.models.minilm import minilm_attention_layer
    from headthief.models.torch_modules import load_minilm_hf
    layer = minilm_attention_layer(2, dtype=np.float64).canonical()
    path = tmp_path / "minilm2.safetensors"
    save_bert_attention(layer, path)
    forward, _ = load_bert_attention(path)
    own = load_minilm_hf().encoder.layer[2].attention
    rng = np.random.default_rng(3)
    for N in (1, 7, 24):
        X = torch.from_numpy(rng.standard_normal((8, N, 384)).astype(np.float32))
        with torch.no_grad():
            want = own.output.dense(own.self(X)[0]).numpy().astype(np.float64)
        got = forward(X).numpy().astype(np.float64)
        assert rel(got, want) < 1e-4
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
