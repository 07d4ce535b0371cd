"""The reproduce engine and report: seeds keyed by task, bit-identical results on one process and on a
real dask LocalCluster, resume after SIGKILL without recomputing, failing tasks reported, every claim
in the report with a verdict, and the audit's defence table."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from headthief.errors import SpecError
from headthief.reproduce.claims import EXPERIMENTS
from headthief.reproduce.engine import Task, run_sweep, task_seed
from headthief.reproduce.run import reproduce

EXE = [sys.executable, "-m", "headthief.cli"]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}


def test_task_seed_is_keyed_by_the_task():
    a = Task("e", "k=1", "headthief.reproduce.tasks:exact_recovery", {"d": 4})
    b = Task("e", "k=2", "headthief.reproduce.tasks:exact_recovery", {"d": 4})
    draw = lambda t: np.random.default_rng(task_seed(t)).integers(1 << 62)
    assert draw(a) == draw(Task("e", "k=1", "headthief.reproduce.tasks:exact_recovery", {"d": 4}))
    assert draw(a) != draw(b)


def test_failing_task_is_reported_and_does_not_sink_the_others(tmp_path):
    good = Task("e", "d=4", "headthief.reproduce.tasks:exact_recovery", {"d": 4})
    bad = Task("e", "d=0", "headthief.reproduce.tasks:exact_recovery", {"d": 0})
    s = run_sweep([good, bad], store=tmp_path, scheduler="serial")
    assert s.failed == 1 and s.computed == 2
    rec_good, rec_bad = s.records
    assert rec_good["value"]["queries"] == 20 and rec_good["error"] is None
    assert rec_bad["value"] is None and rec_bad["params"] == {"d": 0} and "Error" in rec_bad["error"]
    again = run_sweep([good, bad], store=tmp_path, scheduler="serial")   # failed tasks are retried
    assert again.reused == 1 and again.computed == 1


def test_bad_scheduler_and_duplicate_tasks_are_refused():
    t = Task("e", "d=4", "headthief.reproduce.tasks:exact_recovery", {"d": 4})
    with pytest.raises(SpecError, match="scheduler"):
        run_sweep([t], scheduler="threads")
    with pytest.raises(SpecError, match="share"):
        run_sweep([t, t], scheduler="serial")
    with pytest.raises(SpecError, match="unknown experiment"):
        reproduce("unused", quick=True, only=["theorem-9.9"], scheduler="serial")


def test_quick_report_has_every_claim_with_a_verdict(tmp_path):
    res = reproduce(tmp_path, quick=True, scheduler="serial")
    assert res.failed == 0 and set(res.verdicts) == {e.name for e in EXPERIMENTS}
    assert all(v in ("holds", "holds with a caveat", "fails") for v in res.verdicts.values())
    md = (tmp_path / "report.md").read_text()
    for e in EXPERIMENTS:
        assert f"| {e.ref} |" in md
    assert "data:image/png;base64," in (tmp_path / "report.html").read_text()
    data = json.loads((tmp_path / "results.json").read_text())
    t41 = next(x for x in data["experiments"] if x["name"] == "theorem-4.1")
    # the measured figures are real: every float64 run spent exactly d^2 + d queries
    for t in t41["tasks"]:
        assert t["value"]["queries"] == t["params"]["d"] ** 2 + t["params"]["d"]
    assert any(p.suffix == ".png" for p in tmp_path.iterdir())


def test_serial_and_local_cluster_give_bit_identical_results(tmp_path):
    pytest.importorskip("distributed", reason="pip install 'headthief[sweep]'")
    only = ["theorem-4.1", "proposition-7.1", "conjecture-C"]
    a = reproduce(tmp_path / "serial", quick=True, only=only, scheduler="serial")
    b = reproduce(tmp_path / "cluster", quick=True, only=only, scheduler="processes", workers=2)
    assert a.computed == b.computed > 0
    assert (tmp_path / "serial" / "results.json").read_bytes() == (tmp_path / "cluster" / "results.json").read_bytes()


def test_sigkill_halfway_then_resume_recomputes_nothing_finished(tmp_path):
    out = tmp_path / "r"
    cmd = EXE + ["reproduce", "--quick", "--only", "theorem-5.1", "--scheduler", "serial", "--out", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = out / "tasks" / "quick"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if store.exists() and len(list(store.glob("*.json"))) >= 6:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = len(list(store.glob("*.json")))
    assert finished >= 6
    total = len(next(e for e in EXPERIMENTS if e.name == "theorem-5.1").tasks(True))
    assert finished < total, "the run finished before it could be killed"
    r = subprocess.run(cmd[:-1] + ["--json"], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["reused"] == finished and s["computed"] == total - finished and s["failed"] == 0


def test_audit_defence_table(tmp_path):
    out = tmp_path / "a"
    r = subprocess.run(EXE + ["audit", "--target", "random:d=8,seed=1", "--scheduler", "serial", "--out", str(out),
                              "--json", "--defences", "none", "--defences", "sign-only", "--defences", "budget 32",
                              "--defences", "noise adversarial 1e-4", "--defences", "prada"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    cell = {(x["defence"], x["method"]): x for x in rows}
    assert set(cell) == {("none", "exact"), ("none", "lowrank"), ("none", "noisy"), ("sign-only", "membership"),
                         ("budget 32", "exact"), ("budget 32", "lowrank"), ("budget 32", "noisy"),
                         ("noise adversarial 1e-4", "exact"), ("noise adversarial 1e-4", "lowrank"),
                         ("noise adversarial 1e-4", "noisy"), ("prada", "exact"), ("prada", "lowrank"),
                         ("prada", "noisy"), ("prada", "membership")}
    assert cell[("none", "exact")]["outcome"] == "extracted" and cell[("none", "exact")]["W_rel_err"] <= 1e-9
    assert cell[("none", "exact")]["queries"] == 72
    assert cell[("sign-only", "membership")]["outcome"] == "extracted"
    assert cell[("budget 32", "exact")]["outcome"] == "budget spent" and cell[("budget 32", "exact")]["queries"] <= 32
    noisy = cell[("noise adversarial 1e-4", "noisy")]
    assert noisy["outcome"] == "extracted" and 1e-9 < noisy["W_rel_err"] < 1e-1
    # the server's PRADA-style detector flags the probe designs of Theorem 4.1 (structured, not natural)
    assert cell[("prada", "exact")]["outcome"].startswith("flagged at query")
    assert cell[("prada", "exact")]["W_rel_err"] <= 1e-9
    assert (out / "audit.md").exists() and (out / "audit.json").exists()


def test_bench_real_runs_through_the_engine_and_resumes(tmp_path, capsys):
    from headthief.cli import main
    argv = ["bench", "real", "--layers", "1", "--heads", "3,7", "--no-blackbox", "--verify", "32", "--json",
            "--scheduler", "serial", "--store", str(tmp_path / "store")]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert [(r["layer"], r["head"]) for r in first["rows"]] == [(1, 3), (1, 7)]
    assert len(list((tmp_path / "store").glob("*.json"))) == 2
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "2 head(s) reused" in captured.err
    again = json.loads(captured.out)
    drop = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert drop(again["rows"]) == drop(first["rows"])
