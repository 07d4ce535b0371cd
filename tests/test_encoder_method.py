"""``--method encoder`` (issue 19) on random float64 encoders answering every layer's hidden states: the
embeddings' LayerNorm and offsets, then every block from forward paths, against the truth."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from headthief.cli import main


def test_a_two_block_encoder_from_the_cli(tmp_path, capsys):
    """Every part of both blocks within 1e-9 of the truth (on each block's previous LayerNorm's image), the
    reassembled encoder within 1e-9 on fresh inputs_embeds, the queries accounted for, the file written."""
    pytest.importorskip("safetensors")
    from headthief.models.encoder_export import read_bert_encoder
    out_file = tmp_path / "encoder.safetensors"
    code = main(["extract", "--target", "bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=1", "--method", "encoder",
                 "--verify", "32", "--json", "--save", str(out_file)])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["status"] == "extracted" and row["model_check"]["verdict"] == "pass"
    assert len(row["per_block"]) == 2
    for block in row["per_block"]:
        assert max(block.values()) <= 1e-9, block
    assert row["worst_rel_err"] <= 1e-9 and row["offsets_rel_err"] <= 1e-9
    assert row["fidelity_max_rel_err"] <= 1e-9 and row["verify_queries"] == 32
    assert row["queries"] == 3 + row["queries_block_0"] + row["queries_block_1"]      # stage E: 3 sequences
    assert row["fit_attempts_block_0"] == row["fit_attempts_block_1"] == 1
    tensors, meta = read_bert_encoder(out_file)
    assert meta["layers"] == "2" and meta["heads"] == "2"
    assert any(k.startswith("encoder.layer.1.") for k in tensors)


def test_a_float32_encoder_within_its_answers_precision(capsys, monkeypatch):
    """float32 answers (as MiniLM's): the stages' algebra is the fits' start, and every part ends within 1e3 x the
    answers' rounding (2^-24) of the truth; the model check says float32 and allows 100 x 30 x that rounding.
    The first try's two fits are cut to one L-BFGS iteration (a fit that stalls): that try finds no block, and
    the method tries stages V, F and the fits again (stage V at fresh bases: one fit per try) instead of calling
    a genuine encoder a mismatch."""
    from headthief.extraction.block import encoder
    real, fits = encoder.refit_block, []
    real_v, stage_v = encoder._value_sum, []
    monkeypatch.setattr(encoder, "_value_sum", lambda *a: stage_v.append(real_v(*a)) or stage_v[-1])

    def stalls_first(start, groups, **kwargs):
        fits.append(kwargs)
        return real(start, groups, **(kwargs if len(fits) > 2 else {**kwargs, "max_iter": 1}))

    monkeypatch.setattr(encoder, "refit_block", stalls_first)
    eps = 2.0 ** -24
    code = main(["extract", "--target", "bert-encoder:d=8,heads=2,ffn=8,layers=1,seed=3,dtype=float32", "--method",
                 "encoder", "--verify", "32", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["model_check"]["verdict"] == "pass" and row["model_check"]["answers"] == "float32"
    assert row["fit_attempts_block_0"] == 2 and len(fits) == 4 and len(stage_v) == 2
    assert stage_v[0].K is not stage_v[1].K and not np.array_equal(stage_v[0].K, stage_v[1].K)
    assert 100 * 30 * eps <= row["model_check"]["threshold"] <= 100 * 1e3 * eps     # set by the answers, not the fit
    assert row["worst_rel_err"] <= 1e3 * eps and row["offsets_rel_err"] <= 1e3 * eps
    assert row["fidelity_max_rel_err"] <= row["model_check"]["threshold"]


def test_a_float32_block_far_above_the_methods_precision_is_not_called_done(capsys, monkeypatch):
    """A block whose best fit stays above 10x the method's floor is not reported as extracted (exit 4, the
    figures named), though the model class is right: the floor is made 1e6x stricter here, one try; the best
    try's slow-valley polish runs first (cut to 100 iterations here)."""
    from headthief.extraction.block import encoder
    monkeypatch.setattr(encoder, "FIT_TRIES", 1)
    monkeypatch.setattr(encoder, "GOOD_FACTOR", 1e-5)
    monkeypatch.setattr(encoder, "POLISH", 100)                 # the slow-valley polish, cut short
    code = main(["extract", "--target", "bert-encoder:d=8,heads=2,ffn=8,layers=1,seed=3,dtype=float32", "--method",
                 "encoder", "--verify", "32", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 4 and "block 0: the best of 1 fits" in row["error"] and "not at the method's precision" in row["error"]
    polished = re.search(r"\((\d+) more iterations at 1% a chunk", row["error"])
    assert polished and 0 < int(polished.group(1)) <= 100
    assert row["queries_sent"] > 0


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_last_layer_only_gives_the_offsets_and_the_last_layernorm(capsys, dtype):
    """hidden=last: the offsets (scale invariance of LN_emb) and the last LayerNorm, each within the model
    check's own threshold (100x the offsets' residual or 30x the answers' precision) of the truth; the check
    passes on permuted, rescaled twins (and would not without the offsets); exit 2 with what is not recovered;
    every query accounted for."""
    code = main(["extract", "--target", f"bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=5,hidden=last,dtype={dtype}",
                 "--method", "encoder", "--verify", "16", "--json"])
    row = json.loads(capsys.readouterr().out)
    mc = row["model_check"]
    assert code == 2 and mc["verdict"] == "pass" and "Not recovered: blocks 1..2" in row["error"]
    eps = 1e-15 if dtype == "float64" else 2.0 ** -24
    assert row["offsets_floor"] >= 30 * eps * row["offsets_condition"] and 1.0 <= row["offsets_condition"] <= 1e4
    assert row["offsets_residual"] <= 100 * row["offsets_floor"]
    assert mc["threshold"] == pytest.approx(max(100 * max(row["offsets_residual_all_tokens"], row["offsets_floor"]),
                                                2 * 16 * row["offsets_residual"]))       # set by the answers
    assert row["offsets_rel_err"] <= mc["threshold"] and row["ln_out_gamma_rel_err"] <= mc["threshold"]
    assert row["ln_out_beta_rel_err"] <= mc["threshold"] and mc["figure"] <= mc["threshold"]
    assert row["equivariance_without_offsets"] > 10 * mc["threshold"]       # the check sees the offsets
    assert row["verify_queries"] == 4 * 16 and row["queries_sent"] == row["queries"] + row["verify_queries"]
    assert row["offsets_queries"] >= 16 * 3 * (2 * 8 + 1 + 2)               # 16 positions, 3 bases, >= 1 step


def test_a_parts_run_is_journaled_and_replays(tmp_path, capsys):
    """Every answer of a parts-only run (exit 2) is in the journal: the same command again asks nothing."""
    argv = ["extract", "--target", "bert-encoder:d=8,heads=2,ffn=8,layers=1,seed=6,hidden=last", "--method",
            "encoder", "--verify", "8", "--json", "--journal", str(tmp_path / "j.db")]
    rows = []
    for _ in range(2):
        assert main(argv) == 2
        rows.append(json.loads(capsys.readouterr().out))
    assert rows[0]["journal_sent"] == rows[0]["queries_sent"] > 0 and rows[0]["journal_replayed"] == 0
    assert rows[1]["journal_sent"] == 0 and rows[1]["journal_replayed"] == rows[0]["queries_sent"]
    assert rows[1]["offsets_rel_err"] == rows[0]["offsets_rel_err"]


def test_an_encoder_wider_than_the_dense_stage_v_gives_what_it_can(capsys):
    """d = 96 with every layer's states: LN_emb, the offsets and every output LayerNorm (exact algebra), the
    check passed, then exit 2 naming the stage that is not built."""
    code = main(["extract", "--target", "bert-encoder:d=96,heads=2,ffn=8,layers=2,seed=2", "--method", "encoder",
                 "--verify", "8", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 2 and "d = 96 is not built" in row["error"] and row["model_check"]["verdict"] == "pass"
    assert row["ln_emb_gamma_rel_err"] <= 1e-9 and row["offsets_rel_err"] <= 1e-9
    assert row["ln_out_gamma_rel_err"] <= 1e-9 and row["ln_out_beta_rel_err"] <= 1e-9
    assert row["layers_seen"] == 2 and row["queries_sent"] == row["queries"] + 4 * 8


def test_a_block_is_not_an_encoder_behind_a_layernorm():
    """One BERT block (position-free, but no LayerNorm before it) answers as an encoder's last layer would not:
    scaling a token about any point moves the other positions' answers. ModelMismatch, not parts."""
    from headthief.errors import ModelMismatch
    from headthief.extraction.block.encoder_parts import extract_encoder_parts
    from headthief.models.bert_block import random_block
    from headthief.oracles.base import ModelOracle
    with pytest.raises(ModelMismatch, match="not invariant to scaling a token"):
        extract_encoder_parts(ModelOracle(random_block(8, 2, 8, seed=4)), layers=1, hidden="last", rng=1, length=4)


def test_constant_output_coordinates_are_read_as_such():
    """An output LayerNorm with gamma = 0 at two coordinates (as all-MiniLM-L6-v2's last one, 4.8e-33 and 6.0e-33):
    those coordinates are constant, their beta is read, and stage L is not claimed for the others."""
    import dataclasses

    from headthief.extraction.block.encoder_parts import extract_encoder_parts
    from headthief.models.bert_block import random_encoder
    from headthief.oracles.base import ModelOracle
    enc = random_encoder(8, 2, 8, 1, seed=3, hidden="last")
    last = enc.blocks[-1]
    g = np.array(last.ln2_gamma, np.float64)
    g[[2, 5]] = 0.0
    enc = dataclasses.replace(enc, blocks=(dataclasses.replace(last, ln2_gamma=g),))
    parts = extract_encoder_parts(ModelOracle(enc), layers=1, hidden="last", rng=0, length=4, verify=4)
    (read,) = parts.output_lns
    assert read.ln is None and list(read.constant) == [2, 5]
    assert np.allclose(read.constant_value, np.asarray(last.ln2_beta)[[2, 5]], rtol=0, atol=1e-12)
    err = parts.errors(enc)
    assert err["ln_out_gamma_rel_err"] is None and err["ln_out_constant_err"] <= 1e-12
    from headthief.errors import NotIdentifiable
    from headthief.extraction.block.layernorm import fit_output_layernorm
    Y = np.asarray(ModelOracle(enc).query(np.random.default_rng(1).standard_normal((8, 4, 8)))).reshape(-1, 8)
    with pytest.raises(NotIdentifiable, match="output coordinates 2, 5 are constant"):     # stage L says why
        fit_output_layernorm(Y)
    assert err["offsets_rel_err"] <= parts.check.threshold


def test_the_encoder_target_bad_input():
    from headthief.errors import SpecError
    from headthief.targets import resolve
    with pytest.raises(SpecError, match="does not divide"):
        resolve("bert-encoder:d=8,heads=3,ffn=8,layers=2")
    with pytest.raises(SpecError, match="hidden='x'"):
        resolve("bert-encoder:d=8,heads=2,ffn=8,layers=2,hidden=x")
    t = resolve("bert-encoder:d=8,heads=2,ffn=8,layers=3,seed=2")
    y = np.asarray(t.make_oracle().query(np.ones((1, 4, 8))))
    assert y.shape == (1, 4, 4 * 8)                                   # every layer's states: (3 + 1) x d


def test_stage_v_tries_again_after_a_settled_mismatch_only_where_asked():
    """``retrying``: on the image route a fit that settled above its threshold is a mismatch at once; in the
    encoder (``settled_mismatch=True``) it is tried again at fresh bases, and a mismatch only when every try is."""
    from headthief.errors import ConvergenceError, ModelMismatch
    from headthief.extraction.block.value_sum_image import retrying

    def attempts(*outcomes):
        it = iter(outcomes)

        def attempt():
            out = next(it)
            if isinstance(out, Exception):
                raise out
            return out
        return attempt

    def mismatch():
        return ModelMismatch("settled far above the stencil's error", check="value-sum", figure=1.0, threshold=0.1)

    with pytest.raises(ModelMismatch):
        retrying(attempts(mismatch(), "ivs"))
    assert retrying(attempts(mismatch(), "ivs"), settled_mismatch=True) == "ivs"
    with pytest.raises(ModelMismatch):
        retrying(attempts(mismatch(), mismatch(), mismatch()), settled_mismatch=True)
    unsettled = ConvergenceError("did not settle")
    with pytest.raises(ConvergenceError):                  # the last try neither: not called a mismatch
        retrying(attempts(mismatch(), mismatch(), unsettled), settled_mismatch=True)
