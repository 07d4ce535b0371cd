"""Kill test of ``--method block``'s stage checkpoints: one run uninterrupted, then the same command killed with
SIGKILL at random moments and run again on its journal each time, until it finishes.

    .venv/bin/python benchmarks/bench_block_resume.py [--target SPEC] [--kills 6] [--every 2] [--seed 0]

Each attempt is killed after a random share (5% to 50%) of the uninterrupted run's wall time, so it dies in
whatever it is doing (a stage, a refit, a checkpoint's write). ``--every``: seconds between the refits'
checkpoints (``HEADTHIEF_CHECKPOINT_SECONDS``; the default 60 would never fire in a run this short). Prints the
uninterrupted run's seconds and queries, every attempt's wall time and the checkpoint it had reached when it
died (read from the journal), the final attempt's ``resumed_from``, the wall time of all attempts together,
the positions the black box answered in all (the journal's rows) against the uninterrupted run's, and the
final result against the uninterrupted one: queries, fidelity on fresh sequences and every part's error
against the truth.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PARTS = ("ln2_gamma_rel_err", "B_rel_err", "ln1_gamma_rel_err", "W1_rel_err", "W2_rel_err", "O_rel_err",
         "W_rel_err", "c_rel_err")


def command(target: str, journal: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "headthief.cli", "extract", "--target", target, "--method", "block", "--verify", "64",
           "--json", "--quiet"]
    return cmd + (["--journal", str(journal)] if journal is not None else [])


def reached(journal: Path) -> str:
    """The stage of the journal's checkpoint (what a run given it goes on from), or '-'."""
    try:
        with sqlite3.connect(journal, timeout=5) as db:
            row = db.execute("SELECT blob FROM checkpoints WHERE name = 'block'").fetchone()
    except sqlite3.Error:
        return "-"
    if row is None:
        return "-"
    from headthief.oracles.checkpoints import loads
    return str(loads(row[0])["stage"])


def answered(journal: Path) -> int:
    """Answered positions (vectors) in the journal: every one the black box gave, each once."""
    with sqlite3.connect(journal, timeout=5) as db:
        return int(db.execute("SELECT COALESCE(SUM(n), 0) FROM answers").fetchone()[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="bert-block:d=16,heads=4,ffn=32,seed=7,dtype=float32")
    p.add_argument("--kills", type=int, default=6)
    p.add_argument("--every", type=float, default=2.0, help="seconds between a refit's checkpoints")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    a = p.parse_args(argv)
    if a.kills < 0 or not a.every >= 0:
        p.error("--kills must be >= 0 and --every >= 0")
    gen = np.random.default_rng(a.seed)
    env = {**os.environ, "HEADTHIEF_CHECKPOINT_SECONDS": str(a.every)}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ref = subprocess.run(command(a.target, Path(tmp) / "whole.sqlite"), env=env, capture_output=True, text=True,
                             timeout=7200)
        wall = time.perf_counter() - t0
        if ref.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed ({ref.returncode}): {ref.stderr.strip()[-500:]}")
        whole = json.loads(ref.stdout)
        positions = answered(Path(tmp) / "whole.sqlite")
        print(f"{a.target}: uninterrupted {wall:.1f} s, {whole['queries']:,} queries, fidelity "
              f"{whole['fidelity_max_rel_err']:.3g}")
        journal = Path(tmp) / "block.sqlite"
        total = 0.0
        for i in range(a.kills):
            moment = float(gen.uniform(0.05, 0.5)) * wall
            t = time.perf_counter()
            proc = subprocess.Popen(command(a.target, journal), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            try:
                proc.wait(timeout=moment)
                state = f"finished before its kill (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                state = "killed"
            total += time.perf_counter() - t
            print(f"  attempt {i + 1}: {state} after {time.perf_counter() - t:.1f} s; the journal's checkpoint: "
                  f"{reached(journal)}")
        t = time.perf_counter()
        last = subprocess.run(command(a.target, journal), env=env, capture_output=True, text=True, timeout=7200)
        total += time.perf_counter() - t
        if last.returncode != 0:
            raise SystemExit(f"the last attempt failed ({last.returncode}): {last.stderr.strip()[-500:]}")
        row = json.loads(last.stdout)
        print(f"  last attempt: {time.perf_counter() - t:.1f} s, resumed from {row.get('resumed_from')}, "
              f"{row.get('queries_restored', 0):,} queries restored, {row.get('journal_replayed', 0):,} replayed, "
              f"{row.get('journal_sent', 0):,} sent")
        print(f"all attempts: {total:.1f} s of wall time ({total / wall:.2f}x the uninterrupted run); "
              f"{answered(journal):,} positions answered by the black box in all (the uninterrupted run: "
              f"{positions:,})")
    print(f"queries {row['queries']:,} (uninterrupted {whole['queries']:,}); "
          f"fidelity {row['fidelity_max_rel_err']:.3g} (uninterrupted {whole['fidelity_max_rel_err']:.3g}); "
          f"model check {row['model_check']['verdict']}")
    print("parts: " + ", ".join(f"{k[:-8]} {row[k]:.2e} ({whole[k]:.2e})" for k in PARTS if k in row))
    print("refit iterations (the whole fit's, across resumes): " + ", ".join(
        f"{k[:-11]} {row.get(k)} ({whole.get(k)})" for k in ("one_token_refit_iterations", "block_refit_iterations")))
    return 0 if row["model_check"]["verdict"] == "pass" else 1


if __name__ == "__main__":
    raise SystemExit(main())
