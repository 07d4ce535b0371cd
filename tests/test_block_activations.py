"""The block method's assumed FFN activation (``--activation``): BERT's exact GELU by default, or GELU's tanh
form (GPT-2's, ALBERT's ``gelu_new``), SiLU or quick GELU (:mod:`headthief.models.activations`). A block of
one is extracted when that one is assumed and refused (exit 5) when another is."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _grad import numeric_grad as _numeric_grad

import headthief as ht
from headthief.errors import SpecError
from headthief.extraction.block import block_refit, one_token_refit
from headthief.extraction.block.block_refit import gauged, params_of
from headthief.models.activations import SMOOTH, activation, value_and_prime
from headthief.models.bert_block import random_block

SPEC = "bert-block:d=12,heads=2,ffn=24"


@pytest.mark.parametrize("name", list(SMOOTH))
def test_each_activation_has_its_derivatives_and_transformers_function(name):
    a = activation(name)
    s = np.linspace(-9, 9, 3001)
    h = 1e-5
    assert np.max(np.abs((a.f(s + h) - a.f(s - h)) / (2 * h) - a.prime(s))) <= 1e-8
    assert np.max(np.abs((a.prime(s + h) - a.prime(s - h)) / (2 * h) - a.second(s))) <= 1e-8
    assert a.f(s.astype(np.float32)).dtype == np.float32              # a float32 model computes it in float32
    assert np.max(np.abs(a.prime(-s) - (1 - a.prime(s)))) <= 1e-12      # the profile fit's two-sign rule
    value, prime = value_and_prime(name, s)                             # the refits' fused pair
    assert np.max(np.abs(value - a.f(s))) <= 1e-14 and np.max(np.abs(prime - a.prime(s))) <= 1e-14
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.activations import ACT2FN
    assert np.max(np.abs(ACT2FN[a.hf](torch.from_numpy(s)).numpy() - a.f(s))) <= 1e-14
    assert np.max(np.abs(a.torch(torch.from_numpy(s)).numpy() - a.f(s))) <= 1e-14


def test_an_unknown_activation_is_refused_by_name():
    with pytest.raises(ValueError, match="relu"):
        activation("relu")
    with pytest.raises(SpecError, match="--activation must be one of"):
        ht.extract(f"{SPEC},seed=1", "block", activation="relu")
    with pytest.raises(SpecError, match="activation"):           # a setting the method does not read
        ht.extract("mha:d=8,heads=2,seed=1,output=all", "vector", activation="silu")


@pytest.mark.parametrize("name", ["gelu_tanh", "silu"])
def test_the_refits_gradients_are_exact_for_other_activations(name):
    rng = np.random.default_rng(5)
    d, f = 5, 7
    n = sum(int(np.prod(s)) for s in one_token_refit.shapes(d, f).values())
    theta = 0.5 * rng.standard_normal(n)
    X, Y = rng.standard_normal((11, d)), rng.standard_normal((11, d))
    L, G = one_token_refit.loss_and_grad(theta, X, Y, d, f, name)
    num = _numeric_grad(lambda t: one_token_refit.loss_and_grad(t, X, Y, d, f, name)[0], theta)
    assert np.max(np.abs(num - G)) <= 1e-7 * np.max(np.abs(G))
    # another activation is another loss
    assert abs(one_token_refit.loss_and_grad(theta, X, Y, d, f)[0] - L) > 1e-6 * L
    block = gauged(random_block(4, 2, 6, seed=3, activation=name))
    p = params_of(block)
    shapes = {k: np.shape(p[k]) for k in block_refit.NAMES}
    from headthief.extraction.block.lbfgs import pack
    theta = pack(p, shapes)
    groups = [(rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4)))]
    L, G = block_refit.loss_and_grad(theta, shapes, groups, activation=name)
    num = _numeric_grad(lambda t: block_refit.loss_and_grad(t, shapes, groups, activation=name)[0], theta)
    assert np.max(np.abs(num - G)) <= 1e-6 * np.max(np.abs(G))
    Y = block.forward(groups[0][0])                     # the loss's block is the model's block (LN eps aside)
    assert block_refit.loss_and_grad(theta, shapes, [(groups[0][0], Y)], activation=name)[0] <= 1e-20 * np.sum(Y * Y)
    assert block_refit.loss_and_grad(theta, shapes, [(groups[0][0], Y)])[0] > 1e-12 * np.sum(Y * Y)


@pytest.mark.parametrize("name", ["gelu_tanh", "silu"])
def test_the_torch_losses_take_the_activation(name):
    pytest.importorskip("torch")
    from headthief.extraction.block.torch_losses import BlockLoss
    block = gauged(random_block(4, 2, 6, seed=4, activation=name))
    p = params_of(block)
    shapes = {k: np.shape(p[k]) for k in block_refit.NAMES}
    from headthief.extraction.block.lbfgs import pack
    theta = pack(p, shapes)
    rng = np.random.default_rng(6)
    groups = [(rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4)))]
    L, G = block_refit.loss_and_grad(theta, shapes, groups, activation=name)
    Lt, Gt = BlockLoss(shapes, groups, {}, "cpu", activation=name)(theta)
    assert abs(Lt - L) <= 1e-12 * L and np.max(np.abs(Gt - G)) <= 1e-10 * np.max(np.abs(G))


@pytest.mark.parametrize("name", ["gelu_tanh", "silu"])
def test_a_block_of_another_activation_is_extracted_when_that_one_is_assumed(name):
    rep = ht.extract(f"{SPEC},seed=44,act={name}", "block", activation=name, verify=64)
    r = rep.row
    assert rep.exit_code == 0 and r["model_check"]["verdict"] == "pass" and f"{name} FFN" in r["model_check"]["model"]
    worst = max(v for k, v in r.items() if k.endswith("_rel_err") and k != "fidelity_max_rel_err" and v is not None)
    assert r["W1_rel_err"] is not None and worst <= 1e-8 and r["fidelity_max_rel_err"] <= 1e-8


@pytest.mark.parametrize("truth,assumed", [("gelu_tanh", "gelu"), ("gelu", "gelu_tanh"), ("gelu_tanh", "silu")])
def test_another_activation_than_the_assumed_one_ends_in_exit_5(truth, assumed):
    rep = ht.extract(f"{SPEC},seed=45,act={truth}", "block", activation=assumed, verify=32, raise_errors=False)
    assert rep.exit_code == 5 and rep.row["model_check"]["verdict"] == "fail"
    assert f"not a post-LN {assumed} block" in rep.error


def test_silu_and_quick_gelu_are_one_class_up_to_the_neurons_scale():
    """``quick_gelu(s) = s sigma(1.702 s) = silu(1.702 s) / 1.702``: a quick-GELU neuron is a SiLU neuron with
    its input weights times 1.702 and its output weights over it, so either assumption recovers the block."""
    truth = random_block(12, 2, 24, seed=46, activation="quick_gelu")
    rep = ht.extract(f"{SPEC},seed=46,act=quick_gelu", "block", activation="silu", verify=64)
    assert rep.exit_code == 0 and rep.row.get("W1_rel_err") is None       # another class's parts are not compared
    got = rep.result.block
    X = np.random.default_rng(9).standard_normal((4, 6, 12)) * np.sqrt(12)
    y = truth.forward(X)
    assert np.max(np.abs(got.forward(X) - y)) / np.sqrt(np.mean(y ** 2)) <= 1e-8
    # the recovered input weights are the truth's times 1.702 (neurons matched by direction)
    # (pre-activations are LN1's normalised output times W_1 Gamma_1, without the ones-component; no scale)
    P = np.eye(12) - 1.0 / 12
    W1t = (truth.W1 * truth.ln1_gamma[None, :]) @ P
    W1g = (got.W1 * got.ln1_gamma[None, :]) @ P
    cos = np.abs((W1g / np.linalg.norm(W1g, axis=1)[:, None]) @ (W1t / np.linalg.norm(W1t, axis=1)[:, None]).T)
    match = np.argmax(cos, axis=0)
    assert sorted(match) == list(range(24)) and np.min(cos.max(axis=0)) >= 1 - 1e-10
    ratio = [np.linalg.norm(W1g[j]) / np.linalg.norm(w) for j, w in zip(match, W1t)]
    assert np.allclose(ratio, 1.702, rtol=1e-6)


def test_transformers_gelu_new_bert_layer_extracted_saved_and_loaded_back(tmp_path, capsys):
    """transformers' own ``BertLayer`` with ``hidden_act="gelu_new"`` (float64) as the black box; ``--save``
    names the activation, and the file loads into a ``BertLayer`` of that ``hidden_act`` that answers as the
    black box does."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from headthief.cli import main
    from headthief.extraction.block.extract import SAVE_FORMAT
    from headthief.models.bert_export import read_safetensors
    from headthief.targets.encoder import hf_bert_layer
    f = tmp_path / "layer.py"
    f.write_text(
        "import numpy as np, torch\n"
        "from headthief.models.bert_block import random_block\n"
        "from headthief.targets.encoder import hf_bert_layer\n"
        "LAYER = hf_bert_layer(random_block(12, 2, 24, seed=47, activation='gelu_tanh'))\n"
        "def one(x):\n"
        "    out = LAYER(torch.from_numpy(np.asarray(x, dtype=np.float64))[None])\n"
        "    return (out[0] if isinstance(out, tuple) else out)[0].numpy()\n"
        "def f(seqs):\n"
        "    with torch.no_grad():\n"
        "        return [one(x) for x in seqs]\n")
    out = tmp_path / "block.safetensors"
    code = main(["extract", "--target", f"py:{f}:f", "--d", "12", "--output", "all", "--ffn", "24", "--method",
                 "block", "--activation", "gelu_tanh", "--verify", "32", "--json", "--quiet", "--save", str(out)])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["fidelity_max_rel_err"] <= 1e-8
    tensors, meta = read_safetensors(str(out), SAVE_FORMAT)
    assert meta["activation"] == "gelu_tanh" and meta["hidden_act"] == "gelu_new"
    truth = hf_bert_layer(random_block(12, 2, 24, seed=47, activation="gelu_tanh"))
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer
    cfg = BertConfig(hidden_size=12, num_attention_heads=int(meta["heads"]), intermediate_size=int(meta["ffn"]),
                     hidden_act=meta["hidden_act"], layer_norm_eps=1e-12, attn_implementation="eager")
    layer = BertLayer(cfg).double().eval()
    layer.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, strict=True)
    X = torch.from_numpy(np.random.default_rng(10).standard_normal((3, 7, 12)) * np.sqrt(12))
    with torch.no_grad():
        y, y_t = (out[0] if isinstance(out, tuple) else out for out in (layer(X), truth(X)))
    y, y_t = y.numpy(), y_t.numpy()
    assert np.max(np.abs(y - y_t)) / np.sqrt(np.mean(y_t ** 2)) <= 1e-8


def test_the_image_route_takes_the_activation_too():
    spec = "bert-block:d=8,heads=2,ffn=8,seed=48,act=gelu_tanh,inputs=image"
    rep = ht.extract(spec, "block", activation="gelu_tanh", verify=32)
    assert rep.exit_code == 0 and rep.row["W1_rel_err"] <= 1e-8 and rep.row["O_rel_err"] <= 1e-8
    assert "gelu_tanh FFN" in rep.row["model_check"]["model"] and "image" in rep.row["model_check"]["model"]
    rep = ht.extract(spec, "block", verify=32, raise_errors=False)
    assert rep.exit_code == 5 and "not a post-LN gelu block" in rep.error


def test_a_journal_is_not_resumed_under_another_activation(tmp_path):
    """Stage F's checkpoints hold neurons fitted with the assumed activation: a journal written under one is
    refused for a run that assumes another (naming the setting), and resumed under the same one."""
    journal = str(tmp_path / "j.sqlite")
    first = ht.extract(f"{SPEC},seed=49,act=gelu_tanh", "block", activation="gelu_tanh", journal=journal, verify=16)
    assert first.exit_code == 0
    with pytest.raises(Exception, match="activation"):
        ht.extract(f"{SPEC},seed=49,act=gelu_tanh", "block", activation="silu", journal=journal, verify=16)
    again = ht.extract(f"{SPEC},seed=49,act=gelu_tanh", "block", activation="gelu_tanh", journal=journal, verify=16)
    assert again.exit_code == 0 and again.row["queries_fresh"] == 0


def test_the_encoder_method_takes_the_activation_and_saves_its_hidden_act(tmp_path):
    """``--method encoder --activation gelu_tanh`` on an encoder of tanh-GELU blocks: every block recovered, the
    file names ``gelu_new`` and loads into transformers' ``BertEncoder`` of that ``hidden_act``; the default GELU
    is refused. One block: what is per block here is the activation, which every block shares."""
    spec = "bert-encoder:d=8,heads=2,ffn=8,layers=1,seed=50,act=gelu_tanh"
    out = tmp_path / "enc.safetensors"
    rep = ht.extract(spec, "encoder", activation="gelu_tanh", verify=32, save=str(out))
    r = rep.row
    assert rep.exit_code == 0 and "gelu_tanh FFN" in r["model_check"]["model"] and r["fidelity_max_rel_err"] <= 1e-8
    assert max(v for k, v in r.items() if k.endswith("_rel_err") and v is not None) <= 1e-8
    wrong = ht.extract(spec, "encoder", verify=32, raise_errors=False)
    assert wrong.exit_code in (4, 5) and not wrong.ok
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertEncoder

    from headthief.models.encoder_export import read_bert_encoder
    tensors, meta = read_bert_encoder(str(out))
    assert meta["hidden_act"] == "gelu_new"
    cfg = BertConfig(hidden_size=8, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1,
                     hidden_act=meta["hidden_act"], layer_norm_eps=1e-12, attn_implementation="eager")
    enc = BertEncoder(cfg).double().eval()
    enc.load_state_dict({k[len("encoder."):]: torch.from_numpy(np.array(v, np.float64)) for k, v in tensors.items()},
                        strict=True)
    truth = ht.targets.resolve(spec).truth
    # the blocks act on hidden states (each block is read on its previous LayerNorm's image only)
    states = truth.forward(np.random.default_rng(11).standard_normal((2, 5, 8))).reshape(2, 5, 2, 8)
    with torch.no_grad():
        y = enc(torch.from_numpy(np.ascontiguousarray(states[:, :, 0])))[0].numpy()
    want = states[:, :, -1]
    assert np.max(np.abs(y - want)) / np.sqrt(np.mean(want ** 2)) <= 1e-5          # the file holds float32


def test_an_encoder_file_takes_one_hidden_act_for_every_block():
    from headthief.models.encoder_export import encoder_tensors
    a = random_block(8, 2, 8, seed=51, activation="silu")
    b = random_block(8, 2, 8, seed=52)
    with pytest.raises(ValueError, match="share one hidden_act"):
        encoder_tensors([a, b])
    assert len(encoder_tensors([a, random_block(8, 2, 8, seed=52, activation="silu")])) == 2 * len(a.state_dict())


def test_auto_reads_the_activation_class_from_stage_f_in_float64_at_no_extra_query():
    """``--activation auto``: the neurons' profiles fitted with GELU, its tanh form and SiLU; the right class
    fits to the Jacobians' precision, the others 1e-3 or worse (measured: 6e-11 against 1.2e-3 and 0.08)."""
    fixed = ht.extract(f"{SPEC},seed=53,act=gelu_tanh", "block", activation="gelu_tanh", verify=32)
    rep = ht.extract(f"{SPEC},seed=53,act=gelu_tanh", "block", activation="auto", verify=32)
    r = rep.row
    assert rep.exit_code == 0 and r["activation"] == "gelu_tanh" and r["activation_assumed"] == "auto"
    assert r["queries"] == fixed.row["queries"] and r["W1_rel_err"] <= 1e-8
    fits = dict(item.split() for item in r["activation_fits"].split(", "))
    assert float(fits["gelu_tanh"]) * 1e3 < min(float(fits["gelu"]), float(fits["silu"]))
    assert rep.result.ffn.info.get("activation_alternatives") is None       # not carried past stage F


def test_auto_in_float32_refits_gelu_and_its_tanh_form_and_keeps_the_better():
    """float32 profiles fit GELU and its tanh form within 3x of each other; both are refitted to the same
    one-token answers and the lower rms kept (measured: 1.2e-7 against 3.1e-5 at d = 8; 1.3e-7 against 3.6e-5 at
    d = 12)."""
    rep = ht.extract("bert-block:d=8,heads=2,ffn=8,seed=54,act=gelu_tanh,dtype=float32", "block", activation="auto",
                     verify=32)
    r = rep.row
    assert rep.exit_code == 0 and r["activation"] == "gelu_tanh"
    refits = dict(item.split() for item in r["one_token_activation_refits"].split(", "))
    assert set(refits) == {"gelu", "gelu_tanh"} and 10 * float(refits["gelu_tanh"]) < float(refits["gelu"])


def test_auto_is_refused_where_stage_f_does_not_read_it_before_any_query():
    for spec, method in (("bert-block:d=8,heads=2,ffn=8,seed=1,inputs=image", "block"),
                         ("bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=1", "encoder")):
        rep = ht.extract(spec, method, activation="auto", raise_errors=False)
        assert rep.exit_code == 2 and "auto" in rep.error and rep.row.get("queries_sent", 0) == 0
