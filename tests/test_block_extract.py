"""``--method block`` (issue 19): stage A (the heads) and the whole pipeline, against the truth of random
BERT blocks; the model-class refusals (ReLU, a 2-block stack) as exit 5; --save into transformers' BertLayer;
budget and journal."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import headthief as ht
from headthief.errors import ModelMismatch, NotIdentifiable, SpecError
from headthief.extraction.block import centre, value_sum
from headthief.extraction.block.heads import extract_heads, richardson, stage_a_queries
from headthief.models.bert_block import random_block
from headthief.oracles.base import ModelOracle

D, H, FFN = 16, 4, 32
SPEC = f"bert-block:d={D},heads={H},ffn={FFN}"


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))


def head_errors(att, block):
    """Worst relative error of P O_h, W_h, c_h over the heads, each matched to its nearest true head."""
    can = block.attention.canonical()
    worst = 0.0
    for h in range(block.heads):
        g = min(range(att.heads), key=lambda i: rel(att.O[i], centre(can.O(h))))
        worst = max(worst, rel(att.O[g], centre(can.O(h))), rel(att.W[g], can.W(h)), rel(att.c[g], can.C[h]))
    return worst


def test_richardson_weights_cancel_the_even_terms():
    w = richardson((1.0, 2.0, 3.0), 0.01)
    h = 0.01 * np.array([1.0, 2.0, 3.0])
    assert abs(w @ (2 * h ** 2) - 1.0) < 1e-12        # S(h) = 2 h^2 J r + a h^4 + b h^6
    assert abs(w @ h ** 4) < 1e-12 * abs(w) @ h ** 4 * 1e3 and abs(w @ h ** 6) < 1e-9 * abs(w) @ h ** 6


@pytest.mark.parametrize("seed", [31, 32])
def test_stage_a_recovers_every_head(seed):
    block = random_block(D, H, FFN, seed=seed)
    oracle = ModelOracle(block)
    rng = np.random.default_rng(seed)
    vs = value_sum(oracle, rng, precision=2.0 ** -53)
    before = oracle.queries
    att = extract_heads(oracle, vs, rng, heads=None, precision=2.0 ** -53)      # H read from the reads' rank
    assert att.heads == H and att.info["heads_detected"]
    P = 2 * D + 8
    assert oracle.queries - before == att.info["queries"] == 4 * D * P + 3 * 3 * P * (2 * D + 1)   # output=all
    assert att.info["queries"] == stage_a_queries(D)
    # the heads are as precise as the reads let them be: the ALS residual (the reads' precision, ~1e-10) times
    # the conditioning of the heads in the reads (measured 1.7x to 16x on seeds 31, 32, 44..46 at d = 16)
    assert att.info["heads_residual"] <= 1e-8
    assert head_errors(att, block) <= 100 * att.info["heads_residual"]


def test_stage_a_reads_in_bounded_batches_are_the_same_reads(monkeypatch):
    import headthief.extraction.block.heads as heads_mod
    block = random_block(D, H, FFN, seed=37)
    rng = np.random.default_rng(37)
    vs = value_sum(ModelOracle(block), rng, precision=2.0 ** -53)
    X = rng.standard_normal((D + 3, D))
    dirs = rng.standard_normal((2 * D + 1, D))
    whole, chunked = ModelOracle(block), ModelOracle(block)
    one = heads_mod.reads(whole, vs, X, dirs, 0.05)
    monkeypatch.setattr(heads_mod, "READ_BATCH", 3 * len(X))              # 3 directions a batch: 11 batches
    seen = []
    many = heads_mod.reads(chunked, vs, X, dirs, 0.05, progress=lambda done, total: seen.append((done, total)))
    assert chunked.queries == whole.queries == 3 * len(X) * len(dirs) * 3 and chunked.calls > whole.calls
    assert seen[-1] == (len(dirs), len(dirs)) and len(seen) == -(-len(dirs) // 3)
    # each read combines 4 answers per step size with the Richardson weights; a batch of another size may round
    # each answer differently (BLAS blocking), by a few units in the last place of the answers' size
    size = float(np.max(np.abs(block.forward(X[:, None, :]))))
    ulps = 4 * 8 * 2.0 ** -52 * size * float(np.sum(np.abs(heads_mod.richardson(heads_mod.LEVELS, 0.05))))
    assert np.max(np.abs(one - many)) <= ulps


def test_stage_a_from_the_last_position_only():
    block = random_block(D, H, FFN, seed=33, output="last")
    oracle = ModelOracle(block)
    rng = np.random.default_rng(33)
    vs = value_sum(oracle, rng, precision=2.0 ** -53)
    before = oracle.queries
    att = extract_heads(oracle, vs, rng, heads=H, precision=2.0 ** -53)
    assert oracle.queries - before == stage_a_queries(D, output_all=False)
    assert head_errors(att, block) <= 100 * att.info["heads_residual"] <= 1e-6


def test_stage_a_names_heads_too_weak_to_read_and_still_refuses_a_wrong_head_count():
    """float32 answers, the true one-token map as stage F's: BertModel's own init (scores near 0) leaves the
    second-order reads at 1.7x the answers' rounding through them (a trained-scale block's: 2.6e4x), so their
    failed fit is NotIdentifiable naming weak heads, not a wrong head count (it was that ModelMismatch, exit
    5, at d = 64 end to end); a trained block asked for 2 of its 4 heads is still a ModelMismatch."""
    from headthief.extraction.block.extract import parts_from_block
    from headthief.extraction.block.heads import READ_SNR
    from headthief.extraction.block.one_token_refit import model_jacobian
    for init, H, err, text in (("bert", 4, NotIdentifiable, "too weak to read"),
                               ("trained", 2, ModelMismatch, "not those of 2 softmax heads")):
        block = random_block(16, 4, 32, seed=3, init=init, dtype=np.float32)
        ln, vs, part, _ = parts_from_block(block)
        with pytest.raises(err, match=text) as e:
            extract_heads(ModelOracle(block), vs, np.random.default_rng(0), heads=H, precision=2.0 ** -24,
                          jacobian=model_jacobian(part, ln, vs))
        if init == "bert":
            assert float(str(e.value).split("rms is ")[1].split("x")[0]) < READ_SNR


def test_last_position_answers_are_refused_before_the_first_query():
    """A block behind --output last ran stage L and ended in exit 2 "fitting a LayerNorm over d=16 needs at
    least d + 2 = 18 answers, got 3" (transformers' BertLayer, measured); now refused up front, naming it."""
    oracle = ModelOracle(random_block(D, H, FFN, seed=33, output="last"))
    rep = ht.extract(oracle, "block", ffn=FFN, heads=H, raise_errors=False)
    assert rep.exit_code == 2 and "every position (--output all)" in rep.error and oracle.queries == 0


def test_a_small_block_whose_reads_sit_above_the_old_tolerance_is_extracted():
    """Unseen bert-block:d=8,heads=2,ffn=16,seed=23407 (float64, 2 heads) was a false exit 5, "not those of 2
    softmax heads": one read's (H+1)-th singular value 2e4x the reads' nominal precision, against 1e4x allowed.
    At d = 8 the true count reaches 9.5e3x on 60 seeds, one head too few 2e10x and more: 1e-6 relative is now
    allowed too (16x above 6.1e-8; a wrong count, the tests around this one, is still refused)."""
    rep = ht.extract("bert-block:d=8,heads=2,ffn=16,seed=23407", "block", raise_errors=False)
    assert rep.exit_code == 0, rep.error
    assert max(rep.row[k] for k in ("O_rel_err", "W_rel_err", "c_rel_err")) <= 1e-6


def test_stage_a_with_the_wrong_head_count_is_a_mismatch():
    block = random_block(24, 4, 48, seed=34)
    oracle = ModelOracle(block)
    rng = np.random.default_rng(34)
    vs = value_sum(oracle, rng, precision=2.0 ** -53)
    few = dict(precision=2.0 ** -53, points=27)                          # the fewest base tokens (d + 3): cheap
    with pytest.raises(ModelMismatch, match="not those of 2 softmax heads") as e:
        extract_heads(oracle, vs, rng, heads=2, **few)
    assert e.value.check == "head rank" and e.value.figure > 0.1
    with pytest.raises(ModelMismatch, match="fewer than 8 heads"):
        extract_heads(oracle, vs, np.random.default_rng(35), heads=8, **few)
    with pytest.raises(SpecError, match="must divide"):
        extract_heads(oracle, vs, rng, heads=5, **few)
    with pytest.raises(NotIdentifiable, match="2 H <= d - 1"):
        extract_heads(oracle, vs, rng, heads=12, **few)
    before = oracle.queries
    with pytest.raises(SpecError, match="fit must be 'output' or 'pullback'"):
        extract_heads(oracle, vs, rng, heads=4, fit="pulled", **few)
    assert oracle.queries == before                                      # refused before the first query


def test_stage_a_pull_back_fit_agrees_on_exact_answers():
    block = random_block(D, H, FFN, seed=36)
    oracle = ModelOracle(block)
    vs = value_sum(oracle, np.random.default_rng(36), precision=2.0 ** -53)
    out = extract_heads(oracle, vs, np.random.default_rng(37), heads=H, precision=2.0 ** -53)
    pull = extract_heads(oracle, vs, np.random.default_rng(37), heads=H, precision=2.0 ** -53, fit="pullback")
    for att in (out, pull):
        assert head_errors(att, block) <= 100 * att.info["heads_residual"] <= 1e-6


@pytest.mark.parametrize("stage_f", ["auto", "probes"])
def test_method_block_recovers_every_part_and_passes_its_check(stage_f):
    from headthief.extraction.block.ffn_probes import full_queries, probe_queries
    rep = ht.extract(f"{SPEC},seed=36", "block", verify=64, stage_f=stage_f)
    r = rep.row
    assert rep.ok and r["model_check"]["verdict"] == "pass" and r["heads"] == H
    assert r["stage_f_route"] == ("full" if stage_f == "auto" else "probes")    # auto: full Jacobians at this d
    assert r["queries_stage_F"] == 64 + (full_queries(D, FFN) if stage_f == "auto" else probe_queries(D, FFN))
    parts = ("ln2_gamma_rel_err", "ln2_beta_rel_err", "B_rel_err", "b_rel_err", "ln1_gamma_rel_err", "W1_rel_err",
             "W2_rel_err", "ffn_bias_rel_err", "O_rel_err", "W_rel_err", "c_rel_err")
    assert max(r[k] for k in parts) <= 1e-8
    assert r["b1_abs_err"] <= 1e-8
    assert r["fidelity_max_rel_err"] <= r["model_check"]["threshold"]
    stages = [r[f"queries_stage_{k}"] for k in ("L", "activation", "V", "F", "A")]
    polished = r.get("block_polish") == "run"                      # the float64 polish: stage R's queries
    assert r["queries"] == sum(stages) + (r["queries_stage_R"] if polished else 0) and min(stages) > 0
    # the recovered block answers like the target on fresh sequences of its own
    block = random_block(D, H, FFN, seed=36)
    X = np.random.default_rng(7).standard_normal((4, 9, D))
    y = block.forward(X)
    assert np.max(np.abs(rep.result.predict(X) - y)) / np.sqrt(np.mean(y ** 2)) <= 1e-7


def test_method_block_with_one_head_of_width_d():
    """heads=1: the head's centred output map has rank d - 1 of its d columns, so stage A's polish meets a
    singular normal matrix (it was exit 2 with numpy's bare "Singular matrix"); the minimum-norm solution
    gives the same head."""
    rep = ht.extract("bert-block:d=12,heads=1,ffn=24,seed=43", "block", verify=64)
    r = rep.row
    assert rep.ok and r["model_check"]["verdict"] == "pass" and r["heads"] == 1
    parts = ("B_rel_err", "W1_rel_err", "W2_rel_err", "O_rel_err", "W_rel_err", "c_rel_err")
    assert max(r[k] for k in parts) <= 1e-8 and r["fidelity_max_rel_err"] <= r["model_check"]["threshold"]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_more_heads_than_the_method_separates_are_said_as_such_not_a_spec_error(dtype):
    """Beyond 2 H <= d - 1 the head count cannot be read. With exact answers the reads' rank is d - 1 = 11 at
    d = 12 (12 heads of width 1): that count does not divide d, said as the method's limit (it was SpecError
    "heads=11 must divide d=12", as though the user had asked for 11). With float32 answers the reads show no
    rank gap (it was exit 5, "not those of 1 softmax heads", for a genuine BERT block); a block within the
    limit still has its count read."""
    from headthief.extraction.block.extract import parts_from_block
    from headthief.extraction.block.heads import COUNT_GAP
    from headthief.extraction.block.one_token_refit import model_jacobian
    eps = 2.0 ** -53 if dtype == np.float64 else 2.0 ** -24
    for heads, words in ((12, "does not divide d = 12" if dtype == np.float64 else "no rank gap"), (2, None)):
        block = random_block(12, heads, 24, seed=44, dtype=dtype)
        ln, vs, part, _ = parts_from_block(block)
        run = lambda: extract_heads(ModelOracle(block), vs, np.random.default_rng(0), heads=None, precision=eps,
                                    jacobian=model_jacobian(part, ln, vs))
        if words is None:
            assert run().heads == 2
            continue
        with pytest.raises(NotIdentifiable, match=words) as e:
            run()
        if dtype == np.float32:
            assert float(str(e.value).split("is ")[1].split(";")[0]) < COUNT_GAP / 3


@pytest.mark.parametrize("factor", [2.0, 1e3])
def test_a_stage_f_map_just_outside_its_check_is_refitted_in_float64(monkeypatch, factor):
    """Exact answers whose stage-F map misses its one-token check by a small factor (measured: transformers'
    ``BertLayer`` at d = 32, FFN 128, PyTorch's init, 7.3e-10 against 5.7e-10) get the one-token refit float32
    answers always get, then the same check again; far outside it (a wrong model class) stays exit 5. Here the
    first check's verdict is made to miss by ``factor``."""
    from headthief.errors import ModelMismatch
    from headthief.extraction.block import extract as ex
    real, calls = ex.check_one_token, []

    def misses_once(*a, **kw):
        out = real(*a, **kw)
        calls.append(out)
        if len(calls) == 1:
            raise ModelMismatch("one-token fidelity", check="one-token fidelity", figure=factor * out["threshold"],
                                threshold=out["threshold"])
        return out
    monkeypatch.setattr(ex, "check_one_token", misses_once)
    rep = ht.extract("bert-block:d=12,heads=2,ffn=12,seed=42", "block", verify=64, raise_errors=False)
    r = rep.row
    if factor > ex.RESCUE:
        assert rep.exit_code == 5 and len(calls) == 1 and "one_token_refit_queries" not in r
        return
    assert rep.exit_code == 0 and r["model_check"]["verdict"] == "pass" and len(calls) == 2
    assert r["one_token_after_check"] == pytest.approx(factor * calls[0]["threshold"])
    assert r["one_token_refit_queries"] > 0 and "refitted to one-token answers" in r["fitted"]
    assert r["queries_stage_F"] >= r["one_token_refit_queries"] + 2 * 64
    assert r["one_token_fidelity"] <= calls[0]["fidelity"] and r["fidelity_max_rel_err"] <= 1e-8
    parts = ("ln2_gamma_rel_err", "B_rel_err", "ln1_gamma_rel_err", "W1_rel_err", "W2_rel_err", "O_rel_err")
    assert max(r[k] for k in parts) <= 1e-8


@pytest.mark.parametrize("case", ["minilm-like tiny gammas, float32", "sum(gamma_2) < 0, float64"])
def test_method_block_through_an_unusual_output_layernorm(case):
    """LN2 as all-MiniLM-L6-v2's block 5 has it (gamma -6e-33, -4.8e-33, -1.5e-9 with beta -8.6e-33, 1.6e-32,
    -8.7e-8 at three coordinates: stage L refused it before), and LN2 with sum(gamma) < 0 (stage L's sign
    rule then reads -gamma: stage F flipped LN1 and the FFN to match, a symmetry of the block; before, its
    check failed at fidelity 5.3): every part recovered, up to that sign, at the level of an ordinary block."""
    import dataclasses

    from headthief.extraction.block.extract import block_errors, extract_block
    float32 = case.endswith("float32")
    block = random_block(12, 2, 12, seed=43, dtype=np.float32 if float32 else np.float64)
    g, b = np.array(block.ln2_gamma, np.float64), np.array(block.ln2_beta, np.float64)
    if float32:
        g[[2, 5, 7]], b[[2, 5, 7]] = [-6.0e-33, -4.8e-33, -1.5e-9], [-8.6e-33, 1.6e-32, -8.7e-8]
    else:
        g = -g
    block = dataclasses.replace(block, ln2_gamma=g.astype(block.dtype), ln2_beta=b.astype(block.dtype))
    res = extract_block(ModelOracle(block), heads=2, ffn=12, rng=43, verify=32)
    assert res.check.verdict == "pass"
    err = block_errors(res, block)
    worst = max(v for k, v in err.items() if k.endswith("_rel_err"))
    assert worst <= (1e-5 if float32 else 1e-8)
    gam = np.asarray(res.ln.gamma)
    assert gam.sum() > 0 and np.max(np.abs(gam / (np.sign(g.sum()) * g) - 1)) <= (1e-6 if float32 else 1e-10)


def test_relu_where_gelu_is_assumed_ends_in_exit_5():
    rep = ht.extract(f"{SPEC},seed=37,act=relu", "block", raise_errors=False)
    assert rep.exit_code == 5 and rep.row["model_check"]["check"] == "activation"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_two_blocks_as_one_end_in_exit_5(tmp_path, dtype):
    """float32 too: the refits that follow the algebra there never get to fit a wrong model class."""
    f = tmp_path / "stack.py"
    f.write_text(
        "import numpy as np\n"
        "from headthief.models.bert_block import random_block\n"
        f"A = random_block(16, 4, 32, seed=38, dtype=np.{dtype})\n"
        f"B = random_block(16, 4, 32, seed=39, dtype=np.{dtype})\n"
        "def f(seqs):\n"
        "    return [B.forward(A.forward(np.asarray(x)[None]))[0] for x in seqs]\n")
    rep = ht.extract(f"py:{f}:f", "block", d=16, output="all", ffn=32, raise_errors=False)
    assert rep.exit_code == 5 and rep.row["model_check"]["check"] == "value-sum"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_layernorm_eps_of_1e_5_is_a_mismatch_at_stage_l(tmp_path, dtype):
    """LayerNorms with eps 1e-5 (RoBERTa's) put the answers off the ellipsoid by ~eps / var: exit 5 at stage L,
    after its queries and the refusal's repeat check only, in float32 too (there it was extracted at 20x the
    fidelity of an eps 1e-12 block).
    The same block with BERT's 1e-12 passes stage L (the other tests here)."""
    f = tmp_path / "eps.py"
    f.write_text(
        "import dataclasses\n"
        "import numpy as np\n"
        "from headthief.models.bert_block import random_block\n"
        f"A = dataclasses.replace(random_block(16, 4, 32, seed=40, dtype=np.{dtype}), eps=1e-5)\n"
        "def f(seqs):\n"
        "    return [A.forward(np.asarray(x)[None])[0] for x in seqs]\n")
    rep = ht.extract(f"py:{f}:f", "block", d=16, output="all", ffn=32, raise_errors=False)
    check = rep.row["model_check"]
    assert rep.exit_code == 5 and check["check"] == "output-layernorm ellipsoid", rep.row
    assert check["figure"] > check["threshold"] and "eps" in rep.row["error"]
    from headthief.extraction.block.extract import _ln_sequences
    from headthief.extraction.precision import REPEAT_QUERIES      # a refusal's repeat check (deterministic: passed)
    assert rep.row["queries_sent"] == _ln_sequences(16) + REPEAT_QUERIES


def test_answers_rounded_to_6_decimals_are_extracted_within_their_precision():
    """A rounding defence over the block (one-token queries pass through it): extracted, its check passed, the
    fidelity within 100x the rounding's relative size; stage L's ellipsoid check uses that precision, not
    float64's."""
    rep = ht.extract("bert-block:d=12,heads=2,ffn=12,seed=41", "block", noise_mode="round:6", verify=64,
                     raise_errors=False)
    row = rep.row
    assert rep.exit_code == 0 and row["model_check"]["verdict"] == "pass", row.get("error")
    tau = 0.5e-6
    assert tau * 1e-2 < row["fidelity_max_rel_err"] <= 100 * tau
    assert row["ln2_sphere_residual"] > 1e3 * np.finfo(float).eps              # above float64's own precision


def test_block_needs_vector_answers_and_the_ffn_width(tmp_path):
    with pytest.raises(SpecError, match="needs vector answers"):
        ht.extract("random:d=8,seed=1", "block")
    f = tmp_path / "one.py"
    f.write_text(
        "import numpy as np\n"
        "from headthief.models.bert_block import random_block\n"
        "A = random_block(16, 4, 32, seed=40)\n"
        "def f(seqs):\n"
        "    return [A.forward(np.asarray(x)[None])[0] for x in seqs]\n")
    rep = ht.extract(f"py:{f}:f", "block", d=16, output="all", raise_errors=False)
    assert rep.exit_code == 2 and "--ffn" in rep.error
    with pytest.raises(SpecError, match="--ffn does not apply to --method vector"):
        ht.extract(f"{SPEC},seed=40", "vector", ffn=32)
    with pytest.raises(SpecError, match="--stage-f does not apply to --method vector"):
        ht.extract(f"{SPEC},seed=40", "vector", stage_f="probes")
    with pytest.raises(SpecError, match="--stage-f must be auto, full or probes"):
        ht.extract(f"{SPEC},seed=40", "block", stage_f="half")
    rep = ht.extract("bert-block:d=4,heads=1,ffn=4,seed=1", "block", stage_f="probes", raise_errors=False)
    assert rep.exit_code == 2 and "use --stage-f full" in rep.error and rep.row["queries_sent"] == 0


def test_planned_arithmetic_stops_minilm_sized_runs_and_not_the_sizes_run_here():
    from headthief.extraction.block.arithmetic import MAX_TFLOP, over_limit, planned
    from headthief.extraction.block.extract import _probes
    for d, ffn in ((16, 32), (32, 128), (64, 256)):      # the sizes measured end to end on a 2-core machine
        for coarse in (False, True):
            assert not over_limit(planned(d, ffn, probes=_probes(d, ffn, "auto"), coarse=coarse), MAX_TFLOP)
    big = planned(384, 1536, probes=True, coarse=True)
    assert over_limit(big, 1000.0) and set(big) == {"F span", "F+ one-token refit", "R block refit", "A reads fit",
                                                    "A polish"}
    assert set(planned(384, 1536, probes=True, coarse=False)) == {"F span", "A reads fit", "A polish"}
    assert planned(384, 1536, probes=True, coarse=False)["F span"] == big["F span"]
    assert ht.Options().max_tflop == MAX_TFLOP                  # the CLI's default is the method's


def test_a_run_above_max_tflop_stops_after_stage_v_with_its_parts(tmp_path):
    from headthief.extraction.block.arithmetic import over_limit
    journal = str(tmp_path / "parts.sqlite")
    rep = ht.extract(f"{SPEC},seed=42", "block", max_tflop=1e-6, journal=journal, raise_errors=False)
    assert rep.exit_code == 2 and "stopped after stage V" in rep.error and "--max-tflop" in rep.error
    row, parts = rep.row, rep.result
    assert type(rep.exception).__name__ == "ComputeLimit" and parts.method == "block (parts)"
    told = float(re.search(r"the same command with --max-tflop ([0-9.e+-]+)", rep.error).group(1))
    assert not over_limit(parts.plan, told) and over_limit(parts.plan, 0.9 * told)   # enough, and not far above
    assert "--refit-device" not in rep.error              # float64 answers: no refits planned
    assert row["queries"] == row["queries_sent"] == parts.queries == sum(
        row[f"queries_stage_{k}"] for k in ("L", "activation", "V"))
    assert row["B_rel_err"] <= 1e-9 and row["ln2_gamma_rel_err"] <= 1e-9 and row["planned_tflop"] > 1e-6
    assert row["model_check"]["verdict"] == "pass" and "not checked" in row["model_check"]["detail"]
    # stages L and V read no activation: with --activation auto (recorded "auto") the parts are compared too
    auto = ht.extract(f"{SPEC},seed=42", "block", max_tflop=1e-6, activation="auto", raise_errors=False).row
    assert auto["activation"] == "auto" and auto["B_rel_err"] <= 1e-9 and auto["ln2_gamma_rel_err"] <= 1e-9
    full = ht.extract(f"{SPEC},seed=42", "block", journal=journal, verify=32)      # the limit raised: resumes
    # stages L to V restored from the journal's checkpoint (their answers not even replayed), the same parts
    assert full.ok and full.row["resumed_from"] == "V" and full.row["queries_restored"] == parts.queries
    assert full.row["journal_replayed"] == 0 and full.row["B_rel_err"] == row["B_rel_err"]
    with pytest.raises(SpecError, match="--max-tflop must be > 0"):
        ht.extract(f"{SPEC},seed=42", "block", max_tflop=0)
    with pytest.raises(SpecError, match="--max-tflop does not apply to --method vector"):
        ht.extract(f"{SPEC},seed=42", "vector", max_tflop=5)


@pytest.mark.parametrize("layer", [1, 2, 5])
def test_minilm_block_stops_after_stage_v_with_b_read(layer):
    """The real block as the model runs it (float32 answers): the stacked solve with a measured step reads
    ``P B`` and ``P b`` within a few times the derivatives' own measured error (the per-base solve with the
    rule's step refused block 2; the solve for ``B^{-1}`` refused block 1, whose ``P B`` is conditioned at
    1.8e-4), and the run stops there: the stages after V plan thousands of TFLOP."""
    from headthief.models.bert_block import from_minilm
    rep = ht.extract(f"minilm-block:layer={layer}", "block", seed=31, raise_errors=False)
    assert rep.exit_code == 2 and type(rep.exception).__name__ == "ComputeLimit"
    vs = rep.result.value
    B, b = from_minilm(layer, dtype=np.float32).value_output_sum()
    B, b = centre(B), centre(b)
    scale = np.max(np.abs(B))
    # measured over seeds 10 - 14 (block 2): B 1.5 - 2.2x and b 5 - 14x the stated error (b = B c0 carries c0's
    # error too); blocks 0 - 4, seeds 12 - 13: B 1.3 - 5.0x, b 1.8 - 12x. Block 5 (its LN2's three tiny gammas
    # read by stage L since it fits in units of each coordinate's spread): stopped at stage L before
    assert np.max(np.abs(vs.B - B)) <= 10 * vs.expected * scale
    assert np.max(np.abs(vs.b - b)) <= 50 * vs.expected * scale
    assert vs.conditioning > 30 * vs.expected and vs.expected < 1e-4
    assert rep.row["planned_tflop"] > 1000 and rep.row["queries"] == rep.row["queries_sent"] < 25_000
    # the message says how to go on: a --max-tflop that runs the plan, and the GPU for the refits (most of it)
    told = float(re.search(r"the same command with --max-tflop ([0-9.e+-]+)", rep.error).group(1))
    assert told >= rep.row["planned_tflop"] and "--refit-device cuda" in rep.error and "--journal" in rep.error


def test_budget_then_resume_from_the_journal(tmp_path):
    journal = str(tmp_path / "block.sqlite")
    short = ht.extract(f"{SPEC},seed=41", "block", budget=3000, journal=journal, raise_errors=False)
    assert short.exit_code == 3 and short.row["queries_sent"] <= 3000
    rep = ht.extract(f"{SPEC},seed=41", "block", journal=journal, verify=32)
    # the answers paid for come back: replayed, or restored with the stages the first run finished
    assert rep.ok and rep.row["journal_replayed"] + rep.row["queries_restored"] >= 2900 and rep.row["O_rel_err"] <= 1e-8


def test_cli_json_and_save_loads_into_transformers_bert_layer(tmp_path, capsys):
    """One CLI run (``--json --save``): the row, then the file loaded into transformers' ``BertLayer``."""
    from headthief.cli import main
    out = tmp_path / "block.safetensors"
    code = main(["extract", "--target", f"{SPEC},seed=43", "--method", "block", "--verify", "32", "--json",
                 "--quiet", "--save", str(out)])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["method"] == "block" and row["O_rel_err"] <= 1e-8 and out.exists()
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from headthief.models.bert_export import read_safetensors
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer
    cfg = BertConfig(hidden_size=D, num_attention_heads=H, intermediate_size=FFN, hidden_act="gelu",
                     layer_norm_eps=1e-12, attn_implementation="eager")
    layer = BertLayer(cfg).double().eval()
    tensors, meta = read_safetensors(str(out), "headthief-bert-block-1")
    missing = layer.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, strict=True)
    assert not missing.missing_keys and meta.get("heads") == str(H)
    X = np.random.default_rng(8).standard_normal((3, 7, D))
    with torch.no_grad():
        out_t = layer(torch.from_numpy(X))
    y_t = (out_t[0] if isinstance(out_t, tuple) else out_t).numpy()
    y = random_block(D, H, FFN, seed=43).forward(X)
    assert np.max(np.abs(y_t - y)) / np.sqrt(np.mean(y ** 2)) <= 1e-6


def test_cli_table_lists_every_head(capsys):
    # the per-head lines of the results table (CanonicalLayer-style rows name the head "head")
    from headthief.cli import main
    code = main(["extract", "--target", "mha:d=16,heads=2,seed=3,output=all", "--method", "vector", "--verify", "16",
                 "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "  head 0" in out and "  head 1" in out


def test_cli_logs_stages_when_stderr_is_a_file(capsys):
    """stderr not a terminal (a log file, nohup): a line per stage, timestamped, with the queries so far (a small
    block: the lines are the same at any size)."""
    from headthief.cli import main
    code = main(["extract", "--target", "bert-block:d=8,heads=2,ffn=8,seed=44", "--method", "block", "--verify", "16",
                 "--json"])
    err = capsys.readouterr().err.splitlines()
    assert code == 0
    stages = [line for line in err if "stage F (" in line or "stage A (" in line]
    assert len(stages) == 2 and all(re.match(r"\d\d:\d\d:\d\d headthief block bert-block:", s) for s in stages)
    assert int(stages[1].rsplit(", ", 1)[1].split()[0].replace(",", "")) > 0


def test_progress_log_lines_at_most_once_a_minute_between_stages(capsys):
    from headthief.cli.extract import LOG_EVERY, _ProgressBar
    now = [0.0]
    bar = _ProgressBar(None, "block x", enabled=True, clock=lambda: now[0])
    bar.describe("stage F (span)")                        # a new stage: a line
    for _ in range(10):                                   # queries and evaluations within the minute: none
        now[0] += LOG_EVERY / 20
        bar(100)
        bar.describe("stage F (span), evaluation 1")
    now[0] += LOG_EVERY                                    # a minute on: one line
    bar(5)
    bar.describe("stage A (heads)")                        # a new stage: a line
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and lines[1].endswith("1,005 queries") and "stage A (heads)" in lines[2]
    assert _ProgressBar(None, "quiet", enabled=False).log is False


def test_cli_log_names_the_span_steps(capsys, monkeypatch):
    """Stage F's span and neuron search (hours at MiniLM's size) log their steps: every one when lines may come
    at any time. (A small block: the lines are the same at any size.)"""
    import headthief.cli.extract as cli_extract
    from headthief.cli import main
    monkeypatch.setattr(cli_extract, "LOG_EVERY", 0.0)
    code = main(["extract", "--target", "bert-block:d=8,heads=2,ffn=8,seed=45", "--method", "block", "--verify", "16",
                 "--json"])
    err = capsys.readouterr().err.splitlines()
    steps = [line for line in err if ", span step " in line]
    assert code == 0 and steps and "span step 1, fixed-point residual" in steps[0]
    found = [line for line in err if ", neuron search, " in line]
    assert found and "neuron search, 1 of " in found[0]



def test_heads_short_of_the_float64_level_are_polished_and_the_polish_resumes(tmp_path, monkeypatch):
    """Exact answers: stage A's heads are a fitted part, at the second-order reads' precision (measured at d = 16:
    1.5e-8 - 3.6e-8 on some unseen seeds, fidelity up to 1.8e-7, against ~1e-10 for every other part). A block
    above POLISH_ABOVE on stage L's answers is refitted to fresh sequences, and every part then lies within it
    (measured: ~1e-10). Here stage A's score matrices are moved by 1e-7 (relative), its residual with them, so the
    polish must run (heads off by more than their residual says are refused instead: the check's rule). It
    keeps a checkpoint (stage R): a run cut inside it resumes after stage A and pays nothing twice; a finished
    run's journal gives the polished block back without running the polish again."""
    import dataclasses

    from headthief.extraction.block import extract
    real = extract.extract_heads

    def short(*args, **kw):
        att = real(*args, **kw)
        g = np.random.default_rng(3)
        return dataclasses.replace(att, W=att.W * (1 + 1e-7 * g.standard_normal(att.W.shape)),
                                   info={**att.info, "heads_residual": 1e-7})      # reads that precise, as measured

    monkeypatch.setattr(extract, "extract_heads", short)
    spec = "bert-block:d=12,heads=2,ffn=12,seed=43"
    rep = ht.extract(spec, "block", verify=16)
    r = rep.row
    assert rep.ok and r["block_polish"] == "run" and r["block_polish_kept"] is True
    assert r["block_polish_insample_before"] > extract.POLISH_ABOVE > 100 * r["block_polish_insample_after"]
    # within the level the polish is for (a tenth of float64's 1e-8), as every part the algebra reads
    assert max(r[k] for k in ("O_rel_err", "W_rel_err", "c_rel_err", "W1_rel_err", "W2_rel_err", "B_rel_err",
                              "ln1_gamma_rel_err", "ffn_bias_rel_err")) <= extract.POLISH_ABOVE
    assert r["fidelity_max_rel_err"] <= extract.POLISH_ABOVE and r["block_polish_queries"] == r["queries_stage_R"] > 0
    assert r["queries"] == sum(r[f"queries_stage_{k}"] for k in ("L", "activation", "V", "F", "A", "R"))
    assert "the float64 polish" in r["fitted"]

    journal = str(tmp_path / "j.sqlite")
    stop = r["queries"] - r["queries_stage_R"] + 100               # inside the polish's sequences
    assert ht.extract(spec, "block", verify=16, budget=stop, journal=journal, raise_errors=False).exit_code == 3
    resumed = ht.extract(spec, "block", verify=16, journal=journal).row
    assert resumed["resumed_from"] == "A" and resumed["queries"] == r["queries"]
    assert resumed["fidelity_max_rel_err"] == r["fidelity_max_rel_err"]
    monkeypatch.setattr(extract, "_polish", lambda *a, **k: pytest.fail("the polish ran again"))
    again = ht.extract(spec, "block", verify=16, journal=journal).row
    assert again["resumed_from"] == "R" and again["queries_fresh"] == 0 and again["block_polish_kept"] is True
    assert again["fidelity_max_rel_err"] == r["fidelity_max_rel_err"]


def test_heads_off_by_more_than_their_residual_are_refused_not_polished(monkeypatch):
    """The polish refits only a block the model check takes as of its class (stage L's error within 100x the
    parts' own precision): heads moved by 1e-7 while stage A's residual says 3e-11 end in exit 5, unpolished."""
    import dataclasses

    from headthief.extraction.block import extract
    real = extract.extract_heads

    def off(*args, **kw):
        att = real(*args, **kw)
        return dataclasses.replace(att, W=att.W * (1 + 1e-7 * np.random.default_rng(3).standard_normal(att.W.shape)))

    monkeypatch.setattr(extract, "extract_heads", off)
    rep = ht.extract(f"{SPEC},seed=43", "block", verify=16, raise_errors=False)
    assert rep.exit_code == 5 and rep.row["block_polish"].startswith("not run")
    assert "queries_stage_R" not in rep.row
