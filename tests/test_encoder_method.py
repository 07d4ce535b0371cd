"""``--method encoder`` (issue 19) on random float64 encoders answering every layer's hidden states: the
embeddings' LayerNorm and offsets, then every block from forward paths, against the truth."""

from __future__ import annotations

import json

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


def test_layernorms_with_negative_gamma_sums_in_an_encoder():
    """The embeddings' LayerNorm with sum(gamma) < 0: its sign is not a symmetry (``hidden_states[0]`` is seen
    and the inputs cannot be negated), so stage E fixes it from the offsets' scales, which are norms. With
    block 0's LN2 and block 1's LN1 negated as well (the image route's stage F flips LN1 and the FFN when the
    answers point against them), every part is within 1e-9 of this truth, the signs included."""
    import dataclasses
    from headthief.extraction.block.encoder import extract_encoder
    from headthief.models.bert_block import random_encoder
    from headthief.oracles.base import ModelOracle
    enc = random_encoder(8, 2, 8, 2, seed=7)
    b0, b1 = enc.blocks
    enc = dataclasses.replace(enc, ln_gamma=-enc.ln_gamma,
                              blocks=(dataclasses.replace(b0, ln2_gamma=-b0.ln2_gamma),
                                      dataclasses.replace(b1, ln1_gamma=-b1.ln1_gamma)))
    assert enc.ln_gamma.sum() < 0 and enc.blocks[0].ln2_gamma.sum() < 0 and enc.blocks[1].ln1_gamma.sum() < 0
    oracle = ModelOracle(enc)
    res = extract_encoder(oracle, layers=2, heads=2, ffn=8, rng=7, verify=32)
    assert np.allclose(res.embeddings.ln.gamma, enc.ln_gamma, rtol=1e-9, atol=0)
    errs = res.errors(enc)
    assert errs["worst_rel_err"] <= 1e-9 and errs["ln_emb_gamma_rel_err"] <= 1e-9, errs
    assert res.check.verdict == "pass"


def test_a_block_with_layernorm_eps_1e_5_in_an_encoder_is_named():
    """Block 1 of an encoder with eps 1e-5 in its LayerNorms: block 0 is extracted, block 1's stage L says it."""
    import dataclasses
    from headthief.errors import ModelMismatch
    from headthief.extraction.block.encoder import extract_encoder
    from headthief.models.bert_block import random_encoder
    from headthief.oracles.base import ModelOracle
    enc = random_encoder(8, 2, 8, 2, seed=8)
    enc = dataclasses.replace(enc, blocks=(enc.blocks[0], dataclasses.replace(enc.blocks[1], eps=1e-5)))
    with pytest.raises(ModelMismatch, match="block 1: the answers are off the LayerNorm's ellipsoid") as e:
        extract_encoder(ModelOracle(enc), layers=2, heads=2, ffn=8, rng=8, verify=32)
    assert e.value.check == "output-layernorm ellipsoid"


def test_a_py_encoder_reads_its_layer_count_from_the_answers_or_from_layers(tmp_path, capsys):
    """A ``py:`` encoder publishes no layer count: with every layer's hidden states it is ``--d-out / --d - 1``
    (extracted, every part within 1e-9; one block here, 16 / 8 - 1: no count is assumed, as the last layer's
    case shows); with the last layer's only, ``--layers`` is asked for by name; a ``--layers`` that
    contradicts a target's own count, or below 1, is refused before any query."""
    f = tmp_path / "enc.py"
    f.write_text("import numpy as np\n"
                 "from headthief.models.bert_block import random_encoder\n"
                 "E = random_encoder(8, 2, 8, 1, seed=11)\n"
                 "L = E.with_hidden('last')\n"
                 "def every(seqs):\n"
                 "    return [E.forward(np.asarray(x)[None])[0] for x in seqs]\n"
                 "def last(seqs):\n"
                 "    return [L.forward(np.asarray(x)[None])[0] for x in seqs]\n")
    code = main(["extract", "--target", f"py:{f}:every", "--d", "8", "--output", "all", "--d-out", "16",
                 "--method", "encoder", "--heads", "2", "--ffn", "8", "--verify", "32", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    assert "fit_attempts_block_0" in row and "fit_attempts_block_1" not in row       # one block, read from 16 / 8
    assert row["fidelity_max_rel_err"] <= 1e-9
    code = main(["extract", "--target", f"py:{f}:last", "--d", "8", "--output", "all", "--method", "encoder",
                 "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 2 and "--layers L" in row["error"] and row.get("queries_sent", 0) == 0
    code = main(["extract", "--target", "bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=1", "--method", "encoder",
                 "--layers", "3", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 2 and "contradicts" in row["error"] and row.get("queries_sent", 0) == 0
    for bad in (["--method", "encoder", "--layers", "0"], ["--method", "block", "--layers", "2"]):
        code = main(["extract", "--target", "bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=1", *bad, "--json"])
        row = json.loads(capsys.readouterr().out)
        assert code == 2 and "--layers" in row["error"], row


def test_a_neuron_search_behind_an_earlier_block_gets_the_wider_tolerances(capsys):
    """Behind block 0 stage F's span is good to ~1e-9, not 1e-13, and is only the fit's start there: its
    neuron search gets the wider tolerances (3x, 10x) that float32 spans get. Unseen seed 15015 (FFN 16):
    block 1's search found 14 of 16 neurons on all 3 tries at the strict tolerance (exit 2); now exit 0."""
    code = main(["extract", "--target", "bert-encoder:d=8,heads=2,ffn=16,layers=2,seed=15015", "--method", "encoder",
                 "--verify", "32", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["model_check"]["verdict"] == "pass" and row["fidelity_max_rel_err"] <= 1e-9


def test_an_encoder_whose_answers_are_not_a_function_of_its_input_is_refused_as_such(tmp_path, capsys):
    """transformers' BertModel left in training mode (dropout after the embeddings' LayerNorm) was refused as
    "no LayerNorm at its output" at stage E (exit 5, 3 queries); a refusal now first asks one sequence three
    times. Here an encoder's answers are scaled by fresh random factors (10%)."""
    f = tmp_path / "dropout.py"
    f.write_text(
        "import numpy as np\n"
        "from headthief.targets import resolve\n"
        "E = resolve('bert-encoder:d=8,heads=2,ffn=16,layers=2,seed=3').truth\n"
        "rng = np.random.default_rng(3)\n"
        "def f(seqs):\n"
        "    return [E.forward(np.asarray(x)[None])[0] * (1 + 0.1 * rng.standard_normal((len(x), 24)))\n"
        "            for x in seqs]\n")
    code = main(["extract", "--target", f"py:{f}:f", "--d", "8", "--d-out", "24", "--output", "all", "--ffn", "16",
                 "--heads", "2", "--layers", "2", "--method", "encoder", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 5 and "answers the same query differently" in row["error"]
    assert row["model_check"]["check"] == "repeatability" and row["queries_sent"] == 3 + 3     # stage E, the repeat


def test_the_fits_sequences_tell_every_heads_scores_where_the_encoder_answers_short_ones(capsys):
    """An encoder of 2 positions answers 2-token sequences only: a row gives a head one softmax difference,
    and a head of width d = 16 has 16 (2 x 16 - 16) = 256 score unknowns. The default 125 sequences gave 250
    (on this encoder the heads' fit found no block on any try: a false exit 5); ``fit_counts`` now draws
    SCORE_FACTOR x as many, and every part is recovered."""
    from headthief.extraction.block.block_refit import SCORE_FACTOR, fit_counts, score_rows
    counts = fit_counts(16, 8, heads=1, lengths=(2,))
    assert fit_counts(16, 8, lengths=(2,)) == [125] and score_rows([125], (2,)) < 256
    assert SCORE_FACTOR * 256 <= score_rows(counts, (2,)) < SCORE_FACTOR * 256 + 2
    assert fit_counts(8, 8, heads=2) == fit_counts(8, 8) == [125, 63, 32, 16]       # binds only where short
    short = fit_counts(64, 8, heads=2, lengths=(2, 4))
    assert short[0] == fit_counts(64, 8)[0] and score_rows(short, (2, 4)) >= SCORE_FACTOR * 32 * (128 - 32)
    code = main(["extract", "--target", "bert-encoder:d=16,heads=1,ffn=8,layers=1,seed=1,positions=2", "--method",
                 "encoder", "--verify", "32", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    assert row["worst_rel_err"] <= 1e-9 and row["fidelity_max_rel_err"] <= 1e-9


def test_the_repeat_check_after_a_refusal_asks_no_longer_sequences_than_the_encoder_answers():
    """A refusal asks one sequence three times (dropout left on is refused as that): 4 tokens, fewer where the
    encoder answers fewer (an encoder of 2 positions refused a 4-token query, and the run ended on that
    instead of the refusal)."""
    from headthief.errors import InvalidQuery, ModelMismatch
    from headthief.extraction.precision import refuse_if_random
    from headthief.targets import resolve
    oracle = resolve("bert-encoder:d=8,heads=2,ffn=8,layers=1,seed=1,positions=2").make_oracle()
    with pytest.raises(InvalidQuery):
        refuse_if_random(oracle, ModelMismatch("a refusal"), what="The encoder method")
    refuse_if_random(oracle, ModelMismatch("a refusal"), what="The encoder method", length=2)   # repeatable: no raise
    assert oracle.queries == 3                                   # the refused 4-token query not counted
