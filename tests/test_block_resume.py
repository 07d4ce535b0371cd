"""Resuming ``--method block`` from its journal's stage checkpoints (issue 19: "journal and resume, an encoder run
is long"): the computation of the stages a run finished is not redone, the result is the uninterrupted run's,
a block refit cut short goes on from its last checkpoint, and a journal's checkpoint never runs code."""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
from pathlib import Path

import numpy as np
import pytest

import headthief as ht
from headthief.extraction.block import extract, resume
from headthief.oracles.checkpoints import CheckpointError, code_of, dumps, loads, module_closure
from headthief.oracles.journal import Journal, JournalError

SPEC = "bert-block:d=12,heads=2,ffn=12,seed=41,dtype=float32"      # float32: every stage, both refits


@pytest.fixture(scope="module")
def uninterrupted():
    return ht.extract(SPEC, "block", verify=64)


def test_a_run_stopped_by_its_budget_resumes_after_its_last_stage(tmp_path, uninterrupted):
    journal = str(tmp_path / "j.sqlite")
    full = uninterrupted.row
    stop = full["queries_stage_L"] + full["queries_stage_activation"] + full["queries_stage_V"] + 10
    short = ht.extract(SPEC, "block", verify=64, budget=stop, journal=journal, raise_errors=False)
    assert short.exit_code == 3                                      # stopped in stage F, after V's checkpoint
    rep = ht.extract(SPEC, "block", verify=64, journal=journal)
    r = rep.row
    assert rep.ok and r["resumed_from"] == "V"
    assert r["queries_restored"] == full["queries_stage_L"] + full["queries_stage_activation"] + full["queries_stage_V"]
    assert r["queries"] == full["queries"]                           # the same run, counted whole
    # stages F, A, R and the model check (64 fresh sequences, 72 on the noise's segments) asked afresh: the
    # budget refused stage F's first batch whole
    assert r["journal_replayed"] == 0 and r["journal_sent"] == full["queries"] - r["queries_restored"] + 64 + 72
    for name in ("W1", "W2", "ln2_gamma", "ln1_gamma"):              # the uninterrupted run's result, bit for bit
        assert np.array_equal(getattr(rep.result.block, name), getattr(uninterrupted.result.block, name))
    again = ht.extract(SPEC, "block", verify=64, journal=journal)    # a finished run's journal: nothing recomputed
    assert again.row["resumed_from"] == "R" and again.row["queries_fresh"] == 0
    assert np.array_equal(again.result.block.W1, uninterrupted.result.block.W1)


@pytest.mark.parametrize("fit, stage, key", [
    ("refit_from_oracle", "F+partial", "one_token_resumed_from_evaluation"),
    ("refit_block", "R-partial", "block_refit_resumed_from_evaluation")])
def test_a_refit_cut_short_goes_on_from_its_checkpoint(tmp_path, monkeypatch, uninterrupted, fit, stage, key):
    journal = str(tmp_path / "j.sqlite")
    real = getattr(extract, fit)

    class Cut(Exception):
        pass

    done = []

    def cut(*args, checkpoint, **kw):                   # the process dies just after the refit's first checkpoint
        def keep(calls, fitted, history):
            checkpoint(calls, fitted, history)
            done.append(len(history) - 1)
            raise Cut
        return real(*args, checkpoint=keep, **kw)

    monkeypatch.setattr(resume, "EVERY", 0.0)
    monkeypatch.setattr(extract, fit, cut)
    with pytest.raises(Cut):
        ht.extract(SPEC, "block", verify=64, journal=journal)
    monkeypatch.setattr(extract, fit, real)
    rep = ht.extract(SPEC, "block", verify=64, journal=journal)
    r, full = rep.row, uninterrupted.row
    assert rep.ok and r["resumed_from"] == stage and r[key] == 50
    assert r["queries"] == full["queries"] == r["queries_restored"] + r["queries_replayed"] + r["queries_fresh"]
    # the refit's answers replayed from the journal, what follows it asked afresh (and the model check)
    assert r["journal_sent"] == r["queries_fresh"] + r["verify_queries"]
    if stage == "R-partial":
        assert r["queries_replayed"] == full["queries_stage_R"] and r["queries_fresh"] == 0
    else:
        # F+'s answers and the noise segments measured just before it
        assert r["queries_replayed"] == full["one_token_refit_queries"] + full["one_token_refit_noise_queries"]
    # the refit reaches the same precision as the uninterrupted one, and the block passes its model check
    for k in ("block_refit_rms_after", "one_token_refit_rms_after"):
        assert r[k] <= 2 * full[k]
    # the resumed fit is the cut one continued: its start, its iterations before the cut (and so its stopping
    # rule's window and its iteration cap) carried in the checkpoint
    prefix = "block_refit" if stage == "R-partial" else "one_token_refit"
    assert r[f"{prefix}_rms_before"] == pytest.approx(full[f"{prefix}_rms_before"], rel=1e-9)
    assert done[0] > 0 and r[f"{prefix}_iterations"] > done[0]
    assert r["fidelity_max_rel_err"] <= r["model_check"]["threshold"]


def test_checkpoints_of_other_code_are_not_used_and_damage_is_named(tmp_path):
    path = tmp_path / "j.sqlite"
    j = Journal(path, {"target": "t"})
    j.checkpoint("block", "code-a", {"x": np.arange(3.0)})
    assert np.array_equal(j.restore("block", "code-a")["x"], np.arange(3.0))
    assert j.restore("block", "code-b") is None and j.restore("other", "code-a") is None
    j.close()
    with sqlite3.connect(path) as db:                               # one byte of the checkpoint flipped
        blob = bytearray(db.execute("SELECT blob FROM checkpoints").fetchone()[0])
        blob[-5] ^= 1
        db.execute("UPDATE checkpoints SET blob = ?", (bytes(blob),))
    j = Journal(path, {"target": "t"})
    with pytest.raises(JournalError, match="checkpoint 'block' fails its checksum"):
        j.restore("block", "code-a")
    j.close()


def test_the_code_fingerprint_follows_the_imports_and_ignores_docstrings(tmp_path):
    """A checkpoint's ``code``: the method's module and what it imports, at any depth, docstrings aside."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text('"""A."""\nfrom .b import f\n\n\ndef g():\n    from .sub import c\n    return c.x\n')
    (pkg / "b.py").write_text("import pkg.sub.d\n\n\ndef f():\n    return 1\n")
    (pkg / "sub" / "c.py").write_text("x = 2\n")
    (pkg / "sub" / "d.py").write_text("from ..e import y\n")
    (pkg / "e.py").write_text("y = 3\n")
    (pkg / "unused.py").write_text("z = 4\n")
    got = {p.relative_to(pkg).as_posix() for p in module_closure(pkg, [pkg / "a.py"])}
    assert got == {"a.py", "b.py", "sub/__init__.py", "sub/c.py", "sub/d.py", "e.py"}
    src = 'def f(a):\n    """Doc."""\n    return a + 1  # one\n'
    assert code_of(src) == code_of('def f(a):\n    """Another doc."""\n\n    return a + 1\n')
    assert code_of(src) == code_of("def f(a):\n    return (a +\n            1)\n")
    assert code_of(src) != code_of("def f(a):\n    return a + 2\n")
    assert code_of('"""only a docstring"""\n') == code_of("")
    block, encoder = resume.current_code("block"), resume.current_code("encoder")
    assert len(block) == 24 and block != encoder
    root = Path(ht.__file__).parent
    files = {p.relative_to(root).as_posix() for p in module_closure(root, [root / "extraction/block/extract.py"])}
    assert {"extraction/block/block_refit.py", "extraction/vector/affine.py", "models/bert_block.py"} <= files
    assert "extraction/block/encoder.py" not in files and not any(f.startswith("cli/") for f in files)
    with pytest.raises(ValueError, match="no checkpointing method 'heads'"):
        resume.current_code("heads")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_checkpoint_naming_a_callable_is_refused():
    import types
    back = loads(dumps({"a": np.float32(1.5), "b": [np.ones((2, 2))], "m": types.MappingProxyType({"k": 1})}))
    assert back["a"] == np.float32(1.5) and type(back["m"]) is types.MappingProxyType and back["m"]["k"] == 1
    with pytest.raises(CheckpointError, match="not plain data"):
        loads(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="not plain data"):
        loads(pickle.dumps(np.linalg.norm))
    with pytest.raises(CheckpointError, match="cannot be read"):
        loads(b"not a pickle")


class _Bar:
    """A progress bar that keeps what it is told."""

    def __init__(self):
        self.count, self.texts = 0, []

    def __call__(self, n):
        self.count += n

    def describe(self, text):
        self.texts.append(text)


def test_the_progress_bar_is_told_each_stage_and_the_refits_evaluations():
    from headthief.models.bert_block import random_block
    from headthief.oracles.base import ModelOracle

    bar = _Bar()
    oracle = ModelOracle(random_block(12, 2, 12, seed=41, dtype=np.float32))
    res = extract.extract_block(oracle, heads=2, ffn=12, rng=41, verify=16, progress=bar)
    assert bar.count == res.queries == oracle.queries - 16 - 72     # every query but the model check's
    assert res.check.verify_queries == 16 + 72                     # (float32: 72 on the noise's segments)
    stages = [t for t in bar.texts if "evaluation" not in t and "span step" not in t and "neuron search" not in t]
    assert [t.split(" (")[0] for t in stages] == ["stage F", "F+ one-token refit", "stage A", "R block refit"]
    assert any(", span step 1, fixed-point residual " in t for t in bar.texts)
    # the neuron search (most of an hour at MiniLM's size) names each neuron found, the last one 12 of 12
    found = [t for t in bar.texts if ", neuron search, " in t]
    assert found[0].endswith(", neuron search, 1 of 12 found in 1 starts") and " 12 of 12 found in " in found[-1]
    assert any(t.startswith("R block refit, evaluation 50, rms ") for t in bar.texts)


def test_the_bar_total_comes_down_by_the_stage_a_reads_its_pilot_did_not_send(monkeypatch):
    """float32 answers: stage A's pilot chose two of the three Richardson levels, so its reads sent fewer
    queries than the plan (``expected_queries``) counts; the bar is told the difference, and after it the
    plan's stage A is what stage A sent. (The run is stopped at the block refit R, which follows: the bar is
    told before it.)"""
    from headthief.extraction.block.heads import stage_a_planned
    from headthief.models.bert_block import random_block
    from headthief.oracles.base import ModelOracle

    class Shrinking(_Bar):
        shrunk = []

        def shrink(self, n):
            self.shrunk.append(n)

    class AtR(Exception):
        pass

    real, drawn = extract.extract_heads, []

    def counted(oracle, *a, **kw):
        q0 = oracle.queries
        att = real(oracle, *a, **kw)
        drawn.append((att.info["levels"], oracle.queries - q0))
        return att

    def at_r(*a, **kw):
        raise AtR

    monkeypatch.setattr(extract, "extract_heads", counted)
    monkeypatch.setattr(extract, "refit_block", at_r)
    bar = Shrinking()
    d = 16
    oracle = ModelOracle(random_block(d, 4, 32, seed=59051, dtype=np.float32))
    with pytest.raises(AtR):
        extract.extract_block(oracle, heads=4, ffn=32, rng=59051, verify=16, progress=bar)
    (levels, sent), = drawn
    levels = levels.split("/")
    assert len(levels) < 3                                  # this block's pilot: fewer levels than the plan's
    assert bar.shrunk == [stage_a_planned(d, True) - sent] and bar.shrunk[0] > 0
    P = 2 * d + 8                                           # base tokens; 3 queries a read, base token and level
    assert sent == 3 * P * (3 * 3 + len(levels) * (2 * d + 1 - 3))      # 3 pilot reads at 3 levels, the rest


def test_the_cli_bar_shrinks_to_what_was_sent_and_never_below_the_count():
    from headthief.cli.extract import _ProgressBar
    bar = _ProgressBar(None, "block x", enabled=False)
    bar.set_total(1000)
    bar(300)
    bar.shrink(200)
    assert bar.total == 800
    bar.shrink(0)
    bar.shrink(-5)                                          # more sent than planned: the total stays
    assert bar.total == 800
    bar.shrink(10_000)
    assert bar.total == 300                                 # never below what was counted


def test_an_encoder_run_cut_in_its_second_block_resumes_after_the_first(tmp_path, monkeypatch):
    """``--method encoder`` keeps a checkpoint after stage E and after every block: killed in block 1, the same
    command goes on at block 1, with block 0 restored bit for bit and its queries counted, not asked. (The
    uninterrupted run's progress bar: every query but the model check's counted, each block named.)"""
    from headthief.extraction.block import encoder
    spec = "bert-encoder:d=8,heads=2,ffn=8,layers=2,seed=1"
    bar = _Bar()
    whole = ht.extract(spec, "encoder", verify=32, progress=bar)
    assert bar.count == whole.row["queries"] > 0 and bar.texts == ["block 0 of 2", "block 1 of 2"]
    journal = str(tmp_path / "enc.sqlite")
    real, calls = encoder._value_sum, []

    class Cut(Exception):
        pass

    def dies_in_block_1(paths, k, *a):
        calls.append(k)
        if k == 1:
            raise Cut
        return real(paths, k, *a)

    monkeypatch.setattr(encoder, "_value_sum", dies_in_block_1)
    with pytest.raises(Cut):
        ht.extract(spec, "encoder", verify=32, journal=journal)
    monkeypatch.setattr(encoder, "_value_sum", real)
    rep = ht.extract(spec, "encoder", verify=32, journal=journal)
    r, w = rep.row, whole.row
    assert rep.ok and r["resumed_from"] == "block 0" and calls == [0, 1]
    assert r["queries_restored"] == 3 + w["queries_block_0"] and r["queries"] == w["queries"]
    assert r["journal_replayed"] < w["queries_block_1"]     # block 1's answers asked before the cut, replayed
    for a, b in zip(rep.result.blocks, whole.result.blocks):
        assert np.array_equal(a.W1, b.W1) and np.array_equal(a.attention.Q, b.attention.Q)
    assert r["fidelity_max_rel_err"] == w["fidelity_max_rel_err"] <= 1e-9


def test_the_checkpoint_interval_from_the_environment(monkeypatch):
    from headthief.errors import SpecError
    monkeypatch.delenv(resume.ENV, raising=False)
    assert resume._every() == resume.EVERY == 60.0
    monkeypatch.setenv(resume.ENV, "2.5")
    assert resume._every() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(resume.ENV, bad)
        with pytest.raises(SpecError, match="HEADTHIEF_CHECKPOINT_SECONDS must be a number of seconds >= 0"):
            resume._every()


def test_a_neuron_search_cut_short_goes_on_where_it_was_kept(tmp_path, monkeypatch, capsys):
    """The probe route's neuron search (hours at MiniLM's size) keeps its state as ``F-search``: a run killed
    in the search reads stage F again (its answers replayed from the journal), finds the same span bit for bit
    and goes on from the kept starts; the result and the queries are the uninterrupted run's. (float64: the
    search is the same code, and the refits after it, which float32 answers add, are not what is tested.)"""
    from headthief.extraction.block import ffn
    spec = SPEC.replace(",dtype=float32", "")
    whole = ht.extract(spec, "block", verify=64, stage_f="probes")
    journal = str(tmp_path / "j.sqlite")
    real, steps, kept = ffn._power_step, [0], []

    class Cut(Exception):
        pass

    def dies_in_the_search(C, Q, d, cols, tol, settle=None):
        steps[0] += 1                                    # killed once a kept state holds two neurons or more
        with sqlite3.connect(journal) as db:
            meta = [r[0] for r in db.execute("SELECT meta FROM checkpoints")]
        if meta and json.loads(meta[0]).get("neurons_found", 0) >= 2:
            kept.extend(meta)
            raise Cut
        return real(C, Q, d, cols, tol, settle)

    monkeypatch.setattr(resume, "EVERY", 0.0)
    monkeypatch.setattr(ffn, "_power_step", dies_in_the_search)
    with pytest.raises(Cut):
        ht.extract(spec, "block", verify=64, stage_f="probes", journal=journal)
    assert len(kept) == 1 and '"F-search"' in kept[0]
    from headthief.cli import main
    assert main(["journal", "show", journal]) == 0                  # where the search stands, without running it
    import re
    got = re.search(r"after F-search \(([\d,]+) neurons found in ([\d,]+) starts\)", capsys.readouterr().out)
    assert got is not None and 2 <= int(got[1]) < 12 and int(got[2]) >= 64
    monkeypatch.setattr(ffn, "_power_step", real)
    rep = ht.extract(spec, "block", verify=64, stage_f="probes", journal=journal)
    r, full = rep.row, whole.row
    assert rep.ok and r["resumed_from"] == "F-search" and r["neuron_search_resumed_from"] > 0
    assert r["queries"] == full["queries"] and r["queries_restored"] == (
        full["queries_stage_L"] + full["queries_stage_activation"] + full["queries_stage_V"])
    assert 0 < r["queries_replayed"] < full["queries_stage_F"]        # stage F's answers before the cut, replayed
    for name in ("W1", "W2", "b1", "ln1_gamma", "ln2_gamma"):          # the uninterrupted run's, bit for bit
        assert np.array_equal(getattr(rep.result.block, name), getattr(whole.result.block, name))
    other = ht.extract(spec, "block", verify=64, stage_f="probes", journal=journal)   # finished: nothing redone
    last = "R" if "queries_stage_R" in r else "A"     # float64's last stage: A, or the polish R where stage A's
    # heads fell short of POLISH_ABOVE in sample (a matter of rounding: R on some machines' BLAS, A on others)
    assert other.row["resumed_from"] == last and other.row["queries_fresh"] == 0


def test_journal_show_says_where_a_run_stands(tmp_path, capsys):
    import json

    from headthief.cli import main
    journal = tmp_path / "j.sqlite"
    spec = "bert-block:d=8,heads=2,ffn=8,seed=1,dtype=float32"
    short = ht.extract(spec, "block", verify=16, budget=2000, journal=str(journal), raise_errors=False)
    assert short.exit_code == 3
    assert main(["journal", "show", str(journal), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprint"]["target"] == spec and info["fingerprint"]["method"] == "block"
    assert info["answered"] > 0 and info["format"] == "headthief-journal-2"
    (c,) = info["checkpoints"]
    assert c["name"] == "block" and c["stage"] == "V" and c["usable"] and 0 < c["spent"] <= 2000
    with sqlite3.connect(journal) as db:                           # as written by another version
        db.execute("UPDATE checkpoints SET code = 'other'")
    assert main(["journal", "show", str(journal)]) == 0
    out = capsys.readouterr().out
    assert "after V" in out and "written by another version" in out and f"--target {spec}" in out
    assert main(["journal", "show", str(tmp_path / "none.sqlite")]) == 2
    assert "no journal at" in capsys.readouterr().err
