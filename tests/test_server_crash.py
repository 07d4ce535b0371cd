"""Crash tests: the client SIGKILLed at 10 random moments and resumed from its journal, the server
SIGKILLed mid-run and restarted; the run completes bit-identically and the key pays exactly what one
uninterrupted run pays (nothing paid twice)."""

import json
import signal
import sqlite3
import subprocess
import time

import numpy as np

from _server import HEADTHIEF, Server, add_key, headthief

ONE_RUN = 4160 + 16          # exact at d = 64: d^2 + d queries, plus the model check's 16


def journaled(path) -> int:
    try:
        with sqlite3.connect(path, timeout=1) as db:
            return int(db.execute("SELECT count(*) FROM answers").fetchone()[0])
    except sqlite3.Error:
        return 0


def wait_for(cond, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not cond():
        time.sleep(0.002)


def test_client_killed_10_times_and_server_once_pays_nothing_twice(tmp_path):
    db = tmp_path / "s.sqlite"
    key = add_key(db, "victim")
    headthief("extract", "--target", "random:d=64,seed=1", "--method", "exact", "--verify", "0", "--quiet",
              "--save", tmp_path / "local.npz")
    server = Server("random:d=64,seed=1", db).start()
    try:
        journal, out = tmp_path / "run.journal", tmp_path / "http.npz"
        cmd = [*HEADTHIEF, "extract", "--target", server.url, "--api-key", key, "--method", "exact", "--verify", "0",
               "--json", "--quiet", "--journal", str(journal), "--save", str(out)]
        total, kills = 134, 10          # batches one run asks (133 + the model check's), client kills
        gen = np.random.default_rng(11)
        killed = 0
        for i in range(kills):
            have = journaled(journal)
            step = int(gen.integers(0, max(2, 2 * (total - have) // (kills - i + 1))))
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_for(lambda: journaled(journal) >= have + step, proc, 60)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                killed += 1
            proc.wait(timeout=30)
        assert killed >= 8 and journaled(journal) < total
        # the last attempt: the server dies under it (SIGKILL) and comes back on the same port; the client
        # retries with backoff and finishes
        have = journaled(journal)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: journaled(journal) >= have + 3, proc, 60)
        assert proc.poll() is None, "the run ended before the server could be killed"
        server.kill()
        time.sleep(0.3)
        server.start()
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        row = json.loads(stdout)
        assert row["queries"] == 4160 and row["journal_replayed"] > 0
    finally:
        server.stop()
    with np.load(tmp_path / "local.npz") as a, np.load(out) as b:
        assert set(a.files) == set(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    rows = json.loads(headthief("keys", "list", "--db", db, "--json").stdout)
    assert rows[0]["used"] == ONE_RUN                                   # zero paid twice
    audit = headthief("keys", "audit", "--db", db)
    assert audit.returncode == 0 and f"victim: {total + 3} requests charged, {ONE_RUN} queries" in audit.stdout
