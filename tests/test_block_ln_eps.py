"""``--ln-eps``: post-LN blocks whose LayerNorms use another eps than BERT's 1e-12 (RoBERTa's 1e-5). The stages'
algebra is then a start and the block refit fits the answers with the eps itself fitted (as log eps): the loss
and its gradient, the checks before any query, extraction in float32 and float64 with the eps read back, the
saved file loaded into transformers' ``BertLayer`` with that eps, and a told eps the answers do not show."""

from __future__ import annotations

import json

import numpy as np
import pytest

import headthief as ht
from headthief.errors import SpecError
from headthief.extraction.block import block_refit
from headthief.extraction.block.block_refit import gauged
from headthief.extraction.block.extract import LN_EPS_EXACT
from headthief.models.bert_block import BERT_EPS, random_block

UNIT32 = 2.0 ** -24            # float32 answers' relative precision: the route --ln-eps takes


def _with_leps(block):
    p = {**block_refit.params_of(block), "leps": np.log(block.eps)}
    shapes = {k: np.shape(p[k]) for k in (*block_refit.NAMES, "leps")}
    return p, shapes, block_refit.pack(p, shapes)


def test_the_block_loss_with_a_fitted_eps_is_the_block_and_its_gradient_is_exact():
    import dataclasses
    block = gauged(dataclasses.replace(random_block(6, 2, 5, seed=1), eps=3e-3))
    rng = np.random.default_rng(2)
    X = rng.standard_normal((4, 3, 6))
    Y = np.asarray(block.forward(X))
    p, shapes, theta = _with_leps(block)
    assert block_refit.loss_and_grad(theta, shapes, [(X, Y)])[0] <= 1e-25       # the block's own answers
    no_eps = {k: v for k, v in shapes.items() if k != "leps"}                   # without leps: BERT's, left out
    assert block_refit.loss_and_grad(block_refit.pack(p, no_eps), no_eps, [(X, Y)])[0] > 1e-8
    Yn = Y + 1e-2 * rng.standard_normal(Y.shape)
    theta = theta + 1e-2 * rng.standard_normal(theta.size)
    L, G = block_refit.loss_and_grad(theta, shapes, [(X, Yn)])
    h = 1e-6
    num = np.array([(block_refit.loss_and_grad(theta + h * e, shapes, [(X, Yn)])[0]
                     - block_refit.loss_and_grad(theta - h * e, shapes, [(X, Yn)])[0]) / (2 * h)
                    for e in np.eye(theta.size)])
    assert np.max(np.abs(num - G)) <= 1e-7 * np.max(np.abs(G))
    assert abs(num[-1] - G[-1]) <= 1e-6 * abs(G[-1])                             # log eps's own, not drowned
    torch = pytest.importorskip("torch")
    del torch
    from headthief.extraction.block.torch_losses import BlockLoss
    Lt, Gt = BlockLoss(shapes, [(X, Yn)], {}, "cpu")(theta)
    assert abs(Lt - L) <= 1e-12 * L and np.max(np.abs(Gt - G)) <= 1e-11 * np.max(np.abs(G))


@pytest.mark.parametrize("value, message", [(0.0, "must lie in"), (-1e-5, "must lie in"), (1e-3, "must lie in"),
                                            ("abc", "must be a number")])
def test_a_bad_ln_eps_is_refused_before_any_query(value, message):
    with pytest.raises(SpecError, match=message):
        ht.extract("bert-block:d=8,heads=2,ffn=8,seed=1", "block", ln_eps=value)


def test_ln_eps_is_refused_where_it_is_not_built():
    with pytest.raises(SpecError, match="does not apply to --method vector"):
        ht.extract("bert-block:d=8,heads=2,ffn=8,seed=1", "vector", ln_eps=1e-5)
    with pytest.raises(SpecError, match="every layer's hidden states"):        # the parts read without a block
        ht.extract("bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=1,hidden=last", "encoder", ln_eps=1e-5)


def test_the_targets_draw_blocks_and_encoders_with_their_eps():
    from headthief.targets import resolve
    assert resolve("bert-block:d=8,heads=2,ffn=8,seed=1,ln_eps=1e-5").truth.eps == 1e-5
    assert resolve("bert-block:d=8,heads=2,ffn=8,seed=1").truth.eps == BERT_EPS
    enc = resolve("bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=1,ln_eps=1e-5").truth
    assert enc.eps == 1e-5 and all(b.eps == 1e-5 for b in enc.blocks)
    for bad in ("abc", "0", "0.1"):
        with pytest.raises(SpecError, match="ln_eps"):
            resolve(f"bert-block:d=8,heads=2,ffn=8,seed=1,ln_eps={bad}")


def test_the_journal_fingerprint_holds_the_eps():
    from headthief.pipeline import Options, fingerprint
    assert fingerprint(Options(target="t", method="block", ln_eps=1e-5))["ln_eps"] == 1e-5
    assert "ln_eps" not in fingerprint(Options(target="t", method="block"))       # old journals still resume


def test_a_float32_block_with_roberta_eps_is_extracted_and_loads_into_bert_layer(tmp_path, capsys):
    """Refused at stage L without --ln-eps (naming it); with it every part within the float32 route's 1e-4
    (measured ~1e-6), the eps fitted near the truth's, and the saved file, loaded into ``BertLayer`` with the
    eps of its metadata, answers as the black box does."""
    from headthief.cli import main
    spec = "bert-block:d=8,heads=2,ffn=8,seed=21020,dtype=float32,ln_eps=1e-5"
    rep = ht.extract(spec, "block", raise_errors=False)
    assert rep.exit_code == 5 and "--ln-eps" in rep.row["error"]
    out = tmp_path / "block.safetensors"
    code = main(["extract", "--target", spec, "--method", "block", "--ln-eps", "1e-5", "--verify", "64", "--json",
                 "--quiet", "--save", str(out)])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    parts = ("ln2_gamma_rel_err", "ln2_beta_rel_err", "B_rel_err", "O_rel_err", "W_rel_err", "c_rel_err",
             "ln1_gamma_rel_err", "W1_rel_err", "W2_rel_err", "ffn_bias_rel_err")
    assert max(row[k] for k in parts) <= 1e-4
    assert row["fidelity_max_rel_err"] <= 100 * UNIT32 * np.sqrt(8)
    assert row["ln_eps_true"] == 1e-5 and abs(row["ln_eps"] / 1e-5 - 1) <= 0.3
    assert row["block_refit_ln_eps"] == row["ln_eps"]
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer
    from headthief.extraction.block.extract import SAVE_FORMAT
    from headthief.models.bert_export import read_safetensors
    from headthief.targets import resolve
    tensors, meta = read_safetensors(str(out), SAVE_FORMAT)
    assert float(meta["layer_norm_eps"]) == row["ln_eps"]
    cfg = BertConfig(hidden_size=8, num_attention_heads=int(meta["heads"]), intermediate_size=int(meta["ffn"]),
                     hidden_act=meta["hidden_act"], layer_norm_eps=float(meta["layer_norm_eps"]),
                     attn_implementation="eager")
    layer = BertLayer(cfg).double().eval()
    layer.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, strict=True)
    X = np.random.default_rng(11).standard_normal((4, 6, 8)) * np.sqrt(8)
    with torch.no_grad():
        out_t = layer(torch.from_numpy(X))
    y = (out_t[0] if isinstance(out_t, tuple) else out_t).numpy()
    y_t = np.asarray(resolve(spec).truth.forward(X))
    assert np.max(np.abs(y - y_t)) / np.sqrt(np.mean(y_t ** 2)) <= 100 * UNIT32 * np.sqrt(8)


def test_an_eps_the_answers_do_not_show_is_fitted_below_it():
    """A BERT block (eps 1e-12, float32) told 1e-5: extracted at the float32 route's precision, and the eps
    fitted orders below the told one (not reported as 1e-5), R run again from its result."""
    rep = ht.extract("bert-block:d=8,heads=2,ffn=8,seed=21022,dtype=float32", "block", ln_eps=1e-5, verify=64,
                     raise_errors=False)
    row = rep.row
    assert rep.exit_code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    assert row["ln_eps_true"] == BERT_EPS and row["ln_eps"] <= 1e-2 * 1e-5
    assert row["block_refit_eps_restarted"] is True                # the eps moved: R run again from its result
    assert row["fidelity_max_rel_err"] <= 100 * UNIT32 * np.sqrt(8)
    assert 1e-5 > LN_EPS_EXACT                                                    # the route this test is about


def test_a_float32_block_on_the_image_with_an_eps_is_extracted_holding_it():
    """The image route (the encoder's per-block method): the told eps held in the fits (not fitted: on the image
    the answers barely see it), every part within the float32 route's 1e-4, the fidelity within 100x float32's
    unit; refused at stage L without it."""
    spec = "bert-block:d=8,heads=2,ffn=8,seed=21041,dtype=float32,inputs=image,ln_eps=1e-5"
    assert ht.extract(spec, "block", raise_errors=False).exit_code == 5
    rep = ht.extract(spec, "block", ln_eps=1e-5, verify=64, raise_errors=False)
    row = rep.row
    assert rep.exit_code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    assert max(row[k] for k in ("ln2_gamma_rel_err", "B_rel_err", "O_rel_err", "W_rel_err", "W1_rel_err",
                                "W2_rel_err", "ffn_bias_rel_err")) <= 1e-4
    assert row["fidelity_max_rel_err"] <= 100 * UNIT32 * np.sqrt(8) and row["ln_eps"] == 1e-5


def test_the_embeddings_layernorm_with_an_eps_is_read_exactly_in_float64():
    """Stage E with LN_emb's eps: gamma, beta and the offsets fitted jointly; float64 answers give them to
    ~1e-11 (the ellipsoid fit alone, which assumes no eps, leaves ~1e-6)."""
    from headthief.extraction.block.embeddings import embedding_stage
    from headthief.extraction.block.value_sum import centre
    from headthief.targets import resolve
    t = resolve("bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=21053,ln_eps=1e-5")
    truth = t.truth
    c = centre((np.asarray(truth.position[:16]) + np.asarray(truth.token_type)).T).T

    def errors(eps):
        e = embedding_stage(t.make_oracle(), np.random.default_rng(0), length=16, d_hidden=8, eps=eps)
        return (np.linalg.norm(e.ln.gamma - truth.ln_gamma) / np.linalg.norm(truth.ln_gamma),
                np.linalg.norm(e.offsets - c) / np.linalg.norm(c))
    assert max(errors(1e-5)) <= 1e-9
    assert max(errors(None)) >= 1e-8                      # what the eps costs the exact algebra


def test_a_float32_encoder_with_roberta_eps_is_extracted():
    """``--method encoder --ln-eps``: every block and LN_emb with the told eps, the offsets and LN_emb as
    exact as without an eps, the encoder's fidelity within the float32 route's 100x 30 eps."""
    spec = "bert-encoder:d=8,heads=2,ffn=8,layers=1,seed=21050,dtype=float32,ln_eps=1e-5"
    rep = ht.extract(spec, "encoder", ln_eps=1e-5, verify=64, raise_errors=False)
    row = rep.row
    assert rep.exit_code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    assert row["ln_eps"] == 1e-5 and rep.result.encoder.eps == 1e-5
    assert row["offsets_rel_err"] <= 30 * UNIT32 and row["ln_emb_gamma_rel_err"] <= 30 * UNIT32
    assert row["fidelity_max_rel_err"] <= 100 * 30 * UNIT32
    assert ht.extract(spec, "encoder", verify=64, raise_errors=False).exit_code == 5     # nothing told


# --ln-eps auto: the eps measured from the answers, for black boxes whose configuration is not published

def _stage_l_fit(spec: str):
    from headthief.extraction.block.extract import _answers_for_ln, token_scale
    from headthief.extraction.block.layernorm import fit_output_layernorm
    from headthief.targets import resolve
    oracle = resolve(spec).make_oracle()
    Y, _ = _answers_for_ln(oracle, np.random.default_rng(0), token_scale(oracle))
    return fit_output_layernorm(Y)


@pytest.mark.parametrize("dtype, precision", [("float64", 2.0 ** -52), ("float32", UNIT32)])
def test_auto_keeps_bert_eps_on_the_ellipsoid_and_starts_from_the_distance_off_it(dtype, precision):
    """Stage L's decision: a BERT block's answers lie on LN2's ellipsoid (BERT's eps kept, the exact route); with
    eps 1e-5 they lie ~eps / var inside it, and that distance is R's start, within two decades of the truth (R
    fits it from there and runs again where it moved 3x)."""
    from headthief.extraction.block.extract import ln_eps_measured
    assert ln_eps_measured(_stage_l_fit(f"bert-block:d=8,heads=2,ffn=8,seed=22030,dtype={dtype}"), precision) is None
    start = ln_eps_measured(_stage_l_fit(f"bert-block:d=8,heads=2,ffn=8,seed=22030,dtype={dtype},ln_eps=1e-5"),
                            precision)
    assert start is not None and 1e-7 <= start <= 1e-3 and start > LN_EPS_EXACT


def test_auto_measures_a_roberta_eps_on_free_inputs():
    """``--ln-eps auto`` on a float32 block with eps 1e-5 (refused at stage L with nothing told): the start from
    stage L, the eps fitted by R within the told route's 30%, every part within the float32 route's 1e-4."""
    rep = ht.extract("bert-block:d=8,heads=2,ffn=8,seed=22031,dtype=float32,ln_eps=1e-5", "block", ln_eps="auto",
                     verify=64, raise_errors=False)
    row = rep.row
    assert rep.exit_code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    assert row["ln_eps_auto_start"] is not None and abs(row["ln_eps"] / 1e-5 - 1) <= 0.3
    assert "off LN2's ellipsoid" in row["ln_eps_auto"]
    assert max(row[k] for k in ("ln2_gamma_rel_err", "B_rel_err", "O_rel_err", "W_rel_err", "W1_rel_err",
                                "W2_rel_err", "ffn_bias_rel_err")) <= 1e-4
    assert row["fidelity_max_rel_err"] <= 100 * UNIT32 * np.sqrt(8)


def test_auto_on_a_float32_bert_block_keeps_bert_eps_end_to_end():
    """A float32 BERT block (eps 1e-12) with ``--ln-eps auto``: on the ellipsoid, BERT's eps kept through every
    stage and the refits (the float32 route without an eps fitted), extracted as without the option."""
    rep = ht.extract("bert-block:d=8,heads=2,ffn=8,seed=22034,dtype=float32", "block", ln_eps="auto", verify=64,
                     raise_errors=False)
    row = rep.row
    assert rep.exit_code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    assert row["ln_eps_auto_start"] is None and row["ln_eps"] == BERT_EPS and "kept" in row["ln_eps_auto"]
    assert row["fidelity_max_rel_err"] <= 100 * UNIT32 * np.sqrt(8)


def test_auto_fits_again_from_a_higher_eps_where_r_lets_it_fall(monkeypatch):
    """R's eps fallen 100x below its start is fitted once more from 10x above the start, the lower rms kept.
    The fall is made certain here: R's first run and its rerun hold the eps at 2e-16, where an early build's R
    had let it fall on its own (seed 22205, from a start 10x low, rms 8.6x the noise, inside the check); the
    parts fitted around it are real fits. The run from the higher eps (10x the start, at most LN_EPS_MAX) must
    find 1e-5 and win."""
    import dataclasses
    from headthief.extraction.block import extract
    real = extract.refit_block
    calls = []

    def trapped(block, groups, **kw):
        calls.append(kw.get("ln_eps"))
        if len(calls) <= 2:                      # the first run and its rerun (moved 3x): the eps held fallen
            return real(dataclasses.replace(block, eps=2e-16), groups, **{**kw, "ln_eps": "fixed"})
        return real(block, groups, **kw)
    monkeypatch.setattr(extract, "refit_block", trapped)
    rep = ht.extract("bert-block:d=8,heads=2,ffn=8,seed=22205,dtype=float32,ln_eps=1e-5", "block", ln_eps="auto",
                     verify=64, raise_errors=False)
    row = rep.row
    assert len(calls) == 3 and calls[2] == "fit"
    assert rep.exit_code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    assert row["block_refit_eps_from_higher"] == min(extract.LN_EPS_RAISE * row["ln_eps_auto_start"], extract.LN_EPS_MAX)
    assert abs(row["ln_eps"] / 1e-5 - 1) <= 0.3


@pytest.mark.parametrize("eps", [1e-5, 1e-7, BERT_EPS])
def test_stage_e_measures_the_embeddings_eps(eps):
    """Stage E's ``eps="auto"``: inputs_embeds that nearly cancel the offsets leave LN_emb's input a small known
    vector, where eps / var is large. Float32 answers (6e-8) and float32 sums of the offsets (~6e-8 of them,
    1e-4 of the smallest spread, 1e-5, taken here) bound the eps's error by ~1e-4 relative; 1e-3 allowed. BERT's
    1e-12 is measured below ``LN_EPS_EXACT`` (the exact route) and leaves gamma and the offsets as read."""
    from headthief.extraction.block.embeddings import embedding_stage
    from headthief.targets import resolve
    from headthief.extraction.block.value_sum import centre
    spec = "bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=22032,dtype=float32" + (
        "" if eps == BERT_EPS else f",ln_eps={eps}")
    t = resolve(spec)
    e = embedding_stage(t.make_oracle(), np.random.default_rng(0), length=16, d_hidden=8, eps="auto",
                        negligible=LN_EPS_EXACT)
    if eps == BERT_EPS:
        assert e.eps <= LN_EPS_EXACT
    else:
        assert abs(e.eps / eps - 1) <= 1e-3
    c = centre((np.asarray(t.truth.position[:16]) + np.asarray(t.truth.token_type)).T).T
    assert np.linalg.norm(e.offsets - c) / np.linalg.norm(c) <= 30 * UNIT32


def test_auto_measures_the_eps_of_an_encoder():
    """``--method encoder --ln-eps auto``: the eps measured at stage E and held in every block, as a told one."""
    spec = "bert-encoder:d=8,heads=2,ffn=8,layers=1,seed=22033,dtype=float32,ln_eps=1e-5"
    rep = ht.extract(spec, "encoder", ln_eps="auto", verify=64, raise_errors=False)
    row = rep.row
    assert rep.exit_code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    assert abs(row["ln_eps_measured"] / 1e-5 - 1) <= 1e-3 and rep.result.encoder.eps == row["ln_eps_measured"]
    assert row["fidelity_max_rel_err"] <= 100 * 30 * UNIT32


def test_auto_is_refused_on_the_image_and_a_bad_value_by_the_cli(capsys):
    with pytest.raises(SpecError, match="auto is measured on free inputs"):
        ht.extract("bert-block:d=8,heads=2,ffn=8,seed=1,inputs=image", "block", ln_eps="auto")
    from headthief.cli import main
    with pytest.raises(SystemExit):
        main(["extract", "--target", "bert-block:d=8,heads=2,ffn=8,seed=1", "--method", "block", "--ln-eps", "abc"])
    assert "number (e.g. 1e-5) or auto" in capsys.readouterr().err


def test_encoder_stage_v_draws_fresh_bases_where_a_pair_jacobian_is_near_singular(monkeypatch):
    """Stage V behind the embeddings: a base token whose pair Jacobian is near singular is a poor draw (unseen
    float32 encoder seed 22717, block 1: 1.2e-4 of the largest, exit 2). Its bases are drawn again, at most
    ``V_DRAWS`` times in all, the queries of every draw counted; the first draw here is made singular."""
    from headthief.extraction.block import encoder
    from headthief.extraction.block.embeddings import embedding_stage
    from headthief.targets import resolve
    from headthief.errors import NotIdentifiable
    oracle = resolve("bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=22035").make_oracle()
    emb = embedding_stage(oracle, np.random.default_rng(0), length=16, d_hidden=8)
    paths = encoder._Paths(oracle, emb, 2)
    real, draws = encoder.value_sum_data, []

    def first_singular(*a, **kw):
        data, q = real(*a, **kw)
        draws.append(q)
        if len(draws) == 1:
            nx, T2, Z, Yb = data[0]
            U, S, Vt = np.linalg.svd(Z, full_matrices=False)
            data = [(nx, T2, (U * np.append(S[:-1], 0.0)) @ Vt, Yb)] + list(data[1:])
        return data, q
    monkeypatch.setattr(encoder, "value_sum_data", first_singular)
    ivs = encoder._value_sum(paths, 0, paths.image, np.random.default_rng(1), 2.0 ** -52)
    assert len(draws) == 2 and ivs.queries == sum(draws) and ivs.residual <= ivs.expected
    draws.clear()
    monkeypatch.setattr(encoder, "V_DRAWS", 1)
    with pytest.raises(NotIdentifiable, match="on 1 draws of base tokens"):
        encoder._value_sum(paths, 0, paths.image, np.random.default_rng(1), 2.0 ** -52)
