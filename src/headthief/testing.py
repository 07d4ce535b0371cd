"""The shared recovery checker (the way PyLops ships its dot test): tests of every algorithm and
oracle kind call :func:`check_recovery` with the truth, the expected query count and error bounds."""

from __future__ import annotations

from .extraction.result import Extraction
from .models.attention import AttentionHead
from .oracles.base import ModelOracle


def check_recovery(res: Extraction, truth: AttentionHead, *, queries: int | None = None,
                   max_queries: int | None = None, W_tol: float = 1e-9, v_tol: float | None = None,
                   c_tol: float | None = None, beta_tol: float | None = None,
                   fidelity_tol: float | None = None, fidelity_n: int = 64, seed: int = 0) -> dict:
    """Assert that ``res`` recovered ``truth``; return the measured errors.

    ``queries`` is an exact expected count, ``max_queries`` an upper bound. Tolerances are relative
    errors (``beta_tol`` absolute); v, c, beta and fidelity default to ``W_tol``.
    """
    errs = res.errors(truth)
    problems = []
    if queries is not None and res.queries != queries:
        problems.append(f"queries {res.queries} != expected {queries}")
    if max_queries is not None and res.queries > max_queries:
        problems.append(f"queries {res.queries} > bound {max_queries}")
    v_tol = W_tol if v_tol is None else v_tol
    checks = [("W_rel_err", W_tol), ("v_rel_err", v_tol)]
    if truth.c is not None and res.c is not None:
        checks.append(("c_rel_err", W_tol if c_tol is None else c_tol))
    if truth.beta is not None and res.beta is not None:
        checks.append(("beta_abs_err", W_tol if beta_tol is None else beta_tol))
    if not res.v_scale_known:
        checks = [("W_rel_err", W_tol), ("v_dir_err", v_tol)]
    for key, tol in checks:
        val = errs.get(key)
        if val is None or not val <= tol:
            problems.append(f"{key} = {val} > {tol}")
    fid = None
    if fidelity_tol is not None or fidelity_n:
        fid = res.verify(ModelOracle(truth), fidelity_n, rng=seed)
        errs["fidelity_max_rel_err"] = fid.max_rel_err
        tol = W_tol if fidelity_tol is None else fidelity_tol
        if not fid.max_rel_err <= tol * 10 + 1e-12 and fidelity_tol is None:
            problems.append(f"fidelity {fid.max_rel_err} > {tol * 10}")
        elif fidelity_tol is not None and not fid.max_rel_err <= fidelity_tol:
            problems.append(f"fidelity {fid.max_rel_err} > {fidelity_tol}")
    if problems:
        raise AssertionError(f"{res.method} recovery failed: " + "; ".join(problems) + f" (errors: {errs})")
    return errs


COUNTING_TARGET = '''\
"""A black box for the kill test: a seeded random head that appends the size of every batch it receives
to a counter file (on receipt, as a paid API bills), so the queries paid over several killed attempts
can be added up."""
import os
import numpy as np
from headthief.models.attention import random_head

_HEAD = random_head(int(os.environ["HT_KILL_D"]), rng=int(os.environ["HT_KILL_SEED"]))


def answer(seqs):
    with open(os.environ["HT_KILL_COUNT"], "a") as f:
        f.write(f"{len(seqs)}\\n")
        f.flush()
        os.fsync(f.fileno())
    return _HEAD.evaluate(seqs)
'''


def kill_resume(workdir, *, d: int = 256, method: str = "exact", kills: int = 20, seed: int = 1,
                rng: int = 0, python: str | None = None, progress=None) -> dict:
    """Run one extraction uninterrupted, then again with SIGKILL at ``kills`` random moments, resuming
    each time from the journal; return the queries paid each way and whether the results are
    bit-identical.

    The target is a seeded random head behind a ``py:`` black box that counts every query it receives.
    Each attempt is killed after a random number of newly journaled batches (0 = during start-up),
    spread over what is left so that every attempt dies while work remains.
    """
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import numpy as np

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    target_py = work / "counting_target.py"
    target_py.write_text(COUNTING_TARGET)
    py = python or sys.executable
    gen = np.random.default_rng(rng)

    def command(journal: Path, out: Path) -> list[str]:
        return [py, "-m", "headthief.cli", "extract", "--target", f"py:{target_py}:answer", "--d", str(d),
                "--method", method, "--journal", str(journal), "--save", str(out), "--json", "--quiet"]

    def env(count: Path) -> dict:
        return {**os.environ, "HT_KILL_D": str(d), "HT_KILL_SEED": str(seed), "HT_KILL_COUNT": str(count)}

    def paid(count: Path) -> int:
        return sum(int(x) for x in count.read_text().split()) if count.exists() else 0

    for p in work.glob("run*"):
        p.unlink()
    t0 = time.perf_counter()
    ref = subprocess.run(command(work / "run0.journal", work / "run0.npz"), env=env(work / "run0.count"),
                         capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if ref.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed ({ref.returncode}): {ref.stderr.strip()}")
    one_run = paid(work / "run0.count")
    journal, count, out = work / "run1.journal", work / "run1.count", work / "run1.npz"
    total_batches = len((work / "run0.count").read_text().split())

    def journaled() -> int:
        import sqlite3
        try:
            with sqlite3.connect(journal, timeout=1) as db:
                return int(db.execute("SELECT count(*) FROM answers").fetchone()[0])
        except sqlite3.Error:
            return 0

    killed = 0
    for i in range(kills):
        # kill after a random number of newly journaled batches, spread so that every attempt is killed
        # while work remains (and now and then before the first answer: during start-up)
        have = journaled()
        left = max(total_batches - have, 1)
        step = int(gen.integers(0, max(2, 2 * left // (kills - i + 1))))
        proc = subprocess.Popen(command(journal, out), env=env(count), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.perf_counter() + 4 * wall + 10
        while proc.poll() is None and time.perf_counter() < deadline:
            if journaled() >= have + step:
                break
            time.sleep(0.002)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed += 1
        if progress:
            progress(1)
    final = subprocess.run(command(journal, out), env=env(count), capture_output=True, text=True, timeout=3600)
    if final.returncode != 0:
        raise RuntimeError(f"the resumed run failed ({final.returncode}): {final.stderr.strip()}")
    row = json.loads(final.stdout)
    all_attempts = paid(count)
    with np.load(work / "run0.npz") as a, np.load(out) as b:
        identical = all(np.array_equal(a[k], b[k]) for k in a.files) and set(a.files) == set(b.files)
    return {"d": d, "method": method, "kills": killed, "one_run_queries": one_run,
            "fresh_over_all_attempts": all_attempts, "overhead": all_attempts - one_run,
            "bit_identical": bool(identical), "uninterrupted_seconds": round(wall, 2),
            "final_replayed": row.get("journal_replayed"), "final_sent": row.get("journal_sent"),
            "oracle_calls_one_run": len((work / "run0.count").read_text().split())}
