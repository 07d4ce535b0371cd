"""What an encoder API gives away without a block taken apart (issue 19: ``--method encoder`` with
``hidden=last``, and blocks planned past ``--max-tflop``; ``block/encoder_parts.py``), against the truth."""

from __future__ import annotations

import json

import numpy as np
import pytest

from headthief.cli import main


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
    assert mc["threshold"] == pytest.approx(max(100 * max(row["offsets_residual_all_tokens"], row["offsets_floor"],
                                                          row["equivariance_in_sample"]),
                                                2 * 16 * row["offsets_residual"]))       # set by the answers
    assert row["offsets_rel_err"] <= mc["threshold"] and row["ln_out_gamma_rel_err"] <= mc["threshold"]
    assert row["ln_out_beta_rel_err"] <= mc["threshold"] and mc["figure"] <= mc["threshold"]
    assert row["equivariance_without_offsets"] > 10 * mc["threshold"]       # the check sees the offsets
    assert row["verify_queries"] == 4 * 16 and row["queries_sent"] == row["queries"] + row["verify_queries"]
    assert row["equivariance_in_sample"] <= mc["threshold"] / 100
    # the typical sequence too: the median within 10x the position-keeping twins' median (or the floor)
    assert 0 < row["equivariance_median"] <= 10 * max(row["equivariance_in_sample_median"], row["offsets_floor"])
    from headthief.extraction.block.encoder_parts import BASES, SCALES
    assert row["offsets_queries"] >= 16 * BASES * (2 * 8 + 1 + len(SCALES))    # 16 positions, >= 1 Newton step


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


def test_an_encoder_whose_blocks_plan_past_the_limit_gives_what_it_can(capsys):
    """d = 96 with every layer's states and ``--max-tflop 1`` (the block plans about 8.3 with sequences of at most 4
    tokens, 3.9 with 16: a short encoder's fit asks more of them, ``fit_counts``): LN_emb, the offsets, every output
    LayerNorm (exact algebra) and block 0's stage V on LN_emb's image, the check passed, then exit 2 naming the
    plan and the limit."""
    from headthief.extraction.block.arithmetic import image_planned
    from headthief.extraction.block.encoder import POINTS, blocks_too_large
    assert blocks_too_large(96, 8, 1, 100, heads=2, length=4) == "" and blocks_too_large(96, 8, 1, 1)
    short, full = (sum(image_planned(96, 8, points=POINTS * 9, heads=2, lengths=L).values()) for L in ((2, 4), None))
    assert short > 2 * full
    code = main(["extract", "--target", "bert-encoder:d=96,heads=2,ffn=8,layers=1,seed=2,positions=4", "--method", "encoder",
                 "--verify", "8", "--max-tflop", "1", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 2 and row["model_check"]["verdict"] == "pass"
    assert f"the blocks: {blocks_too_large(96, 8, 1, 1, heads=2, length=4)}" in row["error"]
    assert row["ln_emb_gamma_rel_err"] <= 1e-9 and row["offsets_rel_err"] <= 1e-9
    assert row["ln_out_gamma_rel_err"] <= 1e-9 and row["ln_out_beta_rel_err"] <= 1e-9
    assert row["layers_seen"] == 1 and row["queries_sent"] == row["queries"] + 4 * 8
    # block 0's stage V on LN_emb's image, past the dense fit by alternating least squares: P B G_emb and c exact
    assert row["block0_value_sum"] == "read" and "block 0's stage V on LN_emb's image" in row["error"]
    assert row["block0_K_rel_err"] <= 1e-9 and row["block0_c_rel_err"] <= 1e-8
    # 3 bases, each: the tangent moves (the base and its stencil) and both pair stencils
    assert row["block0_value_sum_queries"] == 3 * ((4 * (96 - 2) + 1) + 2 * 4 * (96 - 2))


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


@pytest.mark.parametrize("leak", [0.0, 1e-3])
def test_a_position_effect_inside_the_blocks_fails_the_check(leak):
    """Blocks that see positions (here ``leak * t * w`` added to block 1's input at position t, after LN_emb)
    keep every other part intact: the offsets' scale invariance holds, every layer still ends in a LayerNorm.
    Only the check's permuted twins see it. Its reference figures come from twins that keep every token's
    position, so they do not grow with the effect; with leak = 0 the same run passes."""
    import dataclasses

    from headthief.errors import ModelMismatch
    from headthief.extraction.block.encoder_parts import extract_encoder_parts
    from headthief.models.bert_block import Encoder, layer_norm, random_encoder
    from headthief.oracles.base import ModelOracle

    w = np.random.default_rng(7).standard_normal(8)

    @dataclasses.dataclass(frozen=True)
    class Leaky(Encoder):
        def hidden_states(self, X):
            X = np.asarray(X, dtype=self.dtype)
            N = X.shape[1]
            h = layer_norm(X + self.token_type + self.position[:N], self.ln_gamma, self.ln_beta, self.eps)
            out = [h]
            h = h + leak * np.arange(N)[:, None] * w
            for b in self.blocks:
                h = b.trace(h)["y"]
                out.append(h)
            return out

    enc = random_encoder(8, 2, 8, 2, seed=5, hidden="last")
    leaky = Leaky(**{f.name: getattr(enc, f.name) for f in dataclasses.fields(Encoder)})
    run = lambda: extract_encoder_parts(ModelOracle(leaky), layers=2, hidden="last", rng=0, length=8, verify=32)  # noqa: E731
    if leak == 0.0:
        parts = run()
        assert parts.check.verdict == "pass" and parts.errors(enc)["offsets_rel_err"] <= 1e-9
        return
    with pytest.raises(ModelMismatch, match="not those of position-free blocks") as e:
        run()
    assert e.value.figure > 10 * e.value.threshold


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_last_layernorm_with_another_eps_is_a_mismatch_naming_it(dtype):
    """hidden=last reads the last LayerNorm only; one with RoBERTa's eps 1e-5 instead of BERT's 1e-12 puts the
    answers off its ellipsoid (about eps / var): ModelMismatch naming eps, as on every block route, before
    stage E's queries (it was read, and reported only as ``ln_out_sphere_residual``)."""
    import dataclasses

    from headthief.errors import ModelMismatch
    from headthief.extraction.block.encoder_parts import extract_encoder_parts
    from headthief.models.bert_block import random_encoder
    from headthief.oracles.base import ModelOracle
    enc = random_encoder(8, 2, 8, 1, seed=3, hidden="last", dtype=dtype)
    enc = dataclasses.replace(enc, blocks=(dataclasses.replace(enc.blocks[-1], eps=1e-5),))
    oracle = ModelOracle(enc)
    with pytest.raises(ModelMismatch, match="eps") as e:
        extract_encoder_parts(oracle, layers=1, hidden="last", rng=0, length=4, verify=4)
    assert "layer 1's output" in str(e.value) and e.value.check == "output-layernorm ellipsoid"
    assert oracle.queries == -(-4 * (8 + 2) // 4)           # stage L's sequences only
