"""The one extraction pipeline (``headthief.extract``): the same figures as the CLI's JSON, the budget over
every query sent, output paths checked before the first query, a finished result never lost, settings
refused with their names, ``method="auto"``."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import headthief as ht
from headthief.cli import main
from headthief.pipeline import EXIT_WRITE


def cli_json(capsys, *argv):
    code = main(["extract", *argv, "--json", "--quiet"])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]), err


SAME = ("queries", "W_rel_err", "v_rel_err", "c_rel_err", "fidelity_max_rel_err", "check_queries", "verify_queries",
        "rank")


@pytest.mark.parametrize("spec,method", [("random:d=16,seed=3,bias=1", "exact"),
                                         ("random:d=40,rank=3,seed=2", "lowrank"),
                                         ("multihead:d=32,heads=4,seed=1", "multihead")])
def test_library_call_gives_the_cli_figures(capsys, spec, method):
    rep = ht.extract(spec, method=method)
    code, row, _ = cli_json(capsys, "--target", spec, "--method", method)
    assert rep.ok and code == 0
    for k in SAME:
        assert rep.row.get(k) == row.get(k), k
    assert rep.row["model_check"]["verdict"] == row["model_check"]["verdict"] == "pass"
    if method == "multihead":
        assert rep.row["heads"] == row["heads"] == 4
        assert rep.row["W_rel_err"] <= 1e-6


def test_minilm_lowrank_through_the_library_matches_the_cli(capsys):
    pytest.importorskip("safetensors")
    rep = ht.extract("minilm:layer=2,head=5", method="lowrank", verify=32)
    code, row, _ = cli_json(capsys, "--target", "minilm:layer=2,head=5", "--method", "lowrank", "--verify", "32")
    assert code == 0 and rep.ok
    for k in SAME:
        assert rep.row.get(k) == row.get(k), k
    assert rep.row["rank"] == 32


def test_auto_picks_the_method_that_suits_the_target():
    assert ht.extract("random:d=8,seed=1", verify=8).row["method"] == "exact"
    assert ht.extract("random:d=24,rank=2,seed=1", verify=8).row["method"] == "lowrank"
    assert ht.extract("random:d=6,seed=1", verify=8, sign_only=True).row["method"] == "membership"
    assert ht.auto_method(ht.resolve("multihead:d=8,heads=2,seed=1"), ht.Options()) == "multihead"
    assert ht.auto_method(ht.resolve("ffn:d=4,m=3,seed=1"), ht.Options()) == "ffn"


def test_the_budget_bounds_every_query_sent_verification_included():
    d = 8
    spent = d * d + d + 16                         # exact's queries and the model check's identities
    # the check's fidelity is not asked for (--no-check): verification is what is left
    oracle_budget = spent - 16 + 40
    rep = ht.extract(f"random:d={d},seed=1", method="exact", budget=oracle_budget, check=False, verify=256)
    assert rep.ok
    assert rep.row["queries"] == d * d + d
    assert rep.row["verify_queries"] == 40          # not 256: the budget had 40 left
    assert any("budget" in w for w in rep.warnings)
    # budget spent exactly by the extraction: verification is skipped, never sent
    rep = ht.extract(f"random:d={d},seed=1", method="exact", budget=d * d + d, check=False, verify=256)
    assert rep.ok and rep.row["verify_queries"] == 0 and rep.row["fidelity_max_rel_err"] is None


def test_the_model_check_inside_the_budget_is_not_both_unchecked_and_verified():
    d = 8
    rep = ht.extract(f"random:d={d},seed=1", method="exact", budget=d * d + d + 16, verify=256)
    assert rep.ok
    assert rep.row["model_check"]["verdict"] == "unchecked"
    assert rep.row["verify_queries"] == 0


def test_output_paths_are_checked_before_the_first_query(tmp_path):
    head = ht.random_head(6, rng=1)
    oracle = ht.ModelOracle(head)
    with pytest.raises(ht.SpecError, match="does not exist"):
        ht.extract(oracle, method="exact", save=str(tmp_path / "missing" / "out.npz"))
    with pytest.raises(ht.SpecError, match="is a directory"):
        ht.extract(oracle, method="exact", journal=str(tmp_path))
    assert oracle.queries == 0


def test_cli_save_to_a_missing_folder_spends_nothing(capsys, tmp_path):
    code = main(["extract", "--target", "random:d=8,seed=1", "--save", str(tmp_path / "no" / "x.npz"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--save" in err and "does not exist" in err and "Traceback" not in err


def test_a_failing_write_keeps_the_finished_result(monkeypatch, tmp_path, capsys):
    from headthief.extraction.result import Extraction

    def broken(self, path):
        raise OSError("disk full")
    monkeypatch.setattr(Extraction, "save", broken)
    rep = ht.extract("random:d=8,seed=1", method="exact", save=str(tmp_path / "x.npz"), raise_errors=False)
    assert rep.exit_code == EXIT_WRITE and rep.result is not None
    assert rep.row["queries"] == 72 and "disk full" in rep.row["save_error"]
    code = main(["extract", "--target", "random:d=8,seed=1", "--save", str(tmp_path / "x.npz"), "--quiet", "--json"])
    out, err = capsys.readouterr()
    row = json.loads(out)
    assert code == EXIT_WRITE and row["queries"] == 72 and row["W_rel_err"] < 1e-10 and "disk full" in err


def test_a_failed_linear_solve_inside_a_method_is_said_as_such(monkeypatch):
    """numpy's LinAlgError ("Singular matrix", a ValueError) reached the user bare as exit 2's whole message
    (the block method on one head of width d did this); it is now named as the method's degenerate case, still
    exit 2, and a library caller gets it with numpy's error as its cause."""
    from headthief.errors import NotIdentifiable
    from headthief.extraction.single import exact

    def singular(*a, **kw):
        raise np.linalg.LinAlgError("Singular matrix")
    monkeypatch.setattr(exact, "extract_exact", singular)
    rep = ht.extract("random:d=8,seed=1", method="exact", raise_errors=False)
    assert rep.exit_code == 2 and rep.error.startswith("a linear solve inside the exact method failed")
    assert "Singular matrix" in rep.error and rep.row["error"] == rep.error
    with pytest.raises(NotIdentifiable, match="degenerate case") as e:
        ht.extract("random:d=8,seed=1", method="exact")
    assert isinstance(e.value.__cause__, np.linalg.LinAlgError) and e.value.report.exit_code == 2


def test_save_writes_where_numpy_says(tmp_path):
    rep = ht.extract("random:d=6,seed=1", method="exact", save=str(tmp_path / "head"))
    assert Path(rep.row["saved"]) == tmp_path / "head.npz"
    W = np.load(tmp_path / "head.npz")["W"]
    assert np.allclose(W, ht.resolve("random:d=6,seed=1").truth.W, atol=1e-10)


@pytest.mark.parametrize("kw,words", [({"heads": "3"}, "--heads does not apply to --method exact"),
                                      ({"seed": -1}, "--seed must be >= 0"),
                                      ({"d": 16}, "--d 16 disagrees with the target random:d=8"),
                                      ({"budget": -1}, "--budget must be >= 0")])
def test_bad_settings_are_refused_with_their_names(kw, words):
    with pytest.raises(ht.SpecError, match=words.replace("-", r"\-")):
        ht.extract("random:d=8,seed=1", method="exact", **kw)


def test_a_target_option_given_twice_or_too_large_is_refused():
    with pytest.raises(ht.SpecError, match="given twice"):
        ht.resolve("random:d=8,d=9")
    with pytest.raises(ht.SpecError, match="GiB of memory"):
        ht.resolve("random:d=100000")


def test_errors_carry_the_report_and_the_json_row_says_how_it_ended(capsys):
    with pytest.raises(ht.BudgetExceeded) as ei:
        ht.extract("random:d=8,seed=1", method="exact", budget=20)
    assert ei.value.report.exit_code == 3 and ei.value.report.row["queries_sent"] <= 20
    code = main(["extract", "--target", "random:d=8,seed=1", "--budget", "20", "--json", "--quiet"])
    row = json.loads(capsys.readouterr().out)
    assert code == 3 and row["exit"] == 3 and row["queries_sent"] <= 20


def test_a_failed_fidelity_check_reports_the_figure(capsys):
    """A head whose answers drift on long sequences (a length-dependent term no identity of <= 4 tokens
    sees): the check fails on the fresh sequences, and the row carries the measured fidelity."""
    head = ht.random_head(8, rng=2)

    def f(seqs):
        return [float(head.evaluate([x])[0]) + (1e-3 * float(x.sum()) if len(x) > 6 else 0.0) for x in seqs]
    rep = ht.extract(ht.CallableOracle(f, 8), method="exact", raise_errors=False)
    assert rep.exit_code == 5
    mc = rep.row["model_check"]
    assert mc["verdict"] == "fail" and rep.row["fidelity_max_rel_err"] == pytest.approx(mc["figure"])
    assert rep.row["fidelity_max_rel_err"] > mc["threshold"]


def test_targets_piped_into_head_ends_quietly():
    exe = Path(sys.executable).with_name("headthief")
    p = subprocess.run(f"'{exe}' targets | head -1", shell=True, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr
    assert p.stdout.count("\n") == 1


def test_import_headthief_imports_no_optional_framework():
    code = ("import sys, headthief; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', "
            "'cvxpy', 'fastapi', 'uvicorn', 'httpx', 'dask', 'distributed', 'matplotlib', 'safetensors')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_journal_replay_counts_the_method_queries_only(tmp_path):
    j = str(tmp_path / "j.db")
    first = ht.extract("random:d=8,seed=1", method="exact", journal=j)
    again = ht.extract("random:d=8,seed=1", method="exact", journal=j)
    assert first.row["queries_fresh"] == first.row["queries"] == 72 and first.row["queries_replayed"] == 0
    assert again.row["queries"] == 72
    assert again.row["queries_replayed"] == 72 and again.row["queries_fresh"] == 0
    assert np.array_equal(first.result.W, again.result.W)


def test_an_oracle_failure_and_a_stalled_procedure_are_told_apart():
    """Both are exit 4; the status says which: an answer of the wrong shape was reported "did not converge"."""
    def wrong_shape(seqs):
        return [np.zeros(3) for _ in seqs]
    rep = ht.extract(ht.CallableOracle(wrong_shape, 8), method="exact", raise_errors=False)
    assert rep.exit_code == 4 and rep.status == "the oracle failed" and "the oracle returned" in rep.error
