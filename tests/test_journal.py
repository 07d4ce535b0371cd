"""The crash-proof journal: kill -9 at random points, torn writes, damaged files, another command's
journal, SIGTERM and SIGHUP (issue 8)."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

from headthief import ModelOracle, random_head
from headthief.cli import main
from headthief.oracles.journal import Journal, JournalError, JournalMismatch
from headthief.testing import kill_resume


def test_kill_9_at_random_points_resumes_bit_identical(tmp_path):
    r = kill_resume(tmp_path, d=24, kills=4, rng=3)
    assert r["bit_identical"]
    # at most one oracle batch lost per kill (the one in flight); the journal keeps every answered one
    assert 0 <= r["overhead"] <= r["kills"] * 64
    assert r["final_replayed"] + r["final_sent"] == r["one_run_queries"] or r["kills"] == 0


def test_journal_is_written_before_the_answers_are_used(tmp_path):
    path = tmp_path / "j.db"
    head = random_head(6, rng=1)
    j = Journal(path, {"t": 1})
    o = ModelOracle(head, transcript=j)
    y = o.query([np.ones((1, 6)), np.zeros((2, 6))])
    # a second connection sees the committed record at once (no close, no flush needed)
    with sqlite3.connect(path) as db:
        n, blob = db.execute("SELECT n, answers FROM answers").fetchone()
    assert n == 2 and np.array_equal(np.frombuffer(blob, "<f8"), y)
    j.close()
    o2 = ModelOracle(head, transcript=Journal(path, {"t": 1}))
    assert np.array_equal(o2.query([np.ones((1, 6)), np.zeros((2, 6))]), y) and o2.replayed == 2 and o2.fresh == 0


def test_journal_reads_answers_from_the_file_not_from_memory(tmp_path):
    path = tmp_path / "j.db"
    writer, reader = Journal(path, {"t": 1}), Journal(path, {"t": 1})
    writer.record(b"k" * 16, np.arange(6.0).reshape(2, 3))
    # a record written after the reader opened is found by it: lookups go to the file
    assert np.array_equal(reader.lookup(b"k" * 16, 2), np.arange(6.0).reshape(2, 3))
    assert reader.lookup(b"k" * 16, 4) is None and reader.lookup(b"x" * 16, 2) is None
    assert len(reader) == 1 and reader.queries == 2
    with sqlite3.connect(path) as db:              # damaged after it was opened: refused when read
        db.execute("UPDATE answers SET answers = zeroblob(length(answers))")
    with pytest.raises(JournalError, match="fails its checksum"):
        reader.lookup(b"k" * 16, 2)
    writer.close(), reader.close()


def test_torn_last_write_is_dropped_with_a_message(tmp_path):
    path = tmp_path / "j.db"
    code = ("import os, numpy as np; from headthief.oracles.journal import Journal\n"
            f"j = Journal({str(path)!r}, {{'t': 1}})\n"
            "for i in range(40): j.record(bytes([i]) * 16, np.arange(3.0) + i)\n"
            "os._exit(0)\n")      # dies without closing: the WAL stays behind, as after kill -9
    subprocess.run([sys.executable, "-c", code], check=True)
    wal = tmp_path / "j.db-wal"
    assert wal.exists() and wal.stat().st_size > 32
    with open(wal, "r+b") as f:     # the crash tore the last frame
        f.truncate(wal.stat().st_size - 100)
    j = Journal(path, {"t": 1})
    assert j.torn > 0
    assert 35 <= len(j) <= 39      # the torn record (and its transaction) dropped, the rest kept
    assert np.array_equal(j.lookup(bytes([0]) * 16, 3), np.arange(3.0))


def test_damaged_journals_are_refused_with_a_message(tmp_path, capsys):
    bad = tmp_path / "notdb.journal"
    bad.write_bytes(b"this is not a journal at all" * 10)
    code = main(["extract", "--target", "random:d=8,seed=1", "--journal", str(bad), "--quiet"])
    assert code == 2 and "not a headthief journal" in capsys.readouterr().err
    good = tmp_path / "j.db"
    assert main(["extract", "--target", "random:d=8,seed=1", "--journal", str(good), "--quiet", "--json"]) == 0
    capsys.readouterr()
    with sqlite3.connect(good) as db:          # flip bytes of one answer behind the journal's back
        db.execute("UPDATE answers SET answers = zeroblob(length(answers)) WHERE id = 3")
    code = main(["extract", "--target", "random:d=8,seed=1", "--journal", str(good), "--quiet"])
    assert code == 2 and "fails its checksum" in capsys.readouterr().err
    mangled = tmp_path / "m.db"
    data = bytearray(good.read_bytes())
    data[100:4096] = os.urandom(4096 - 100)      # the schema page is garbage now
    mangled.write_bytes(bytes(data))
    code = main(["extract", "--target", "random:d=8,seed=1", "--journal", str(mangled), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "damaged" in err and "Traceback" not in err


def test_another_commands_journal_is_refused_naming_the_difference(tmp_path, capsys):
    j = tmp_path / "j.db"
    assert main(["extract", "--target", "random:d=32,seed=2", "--journal", str(j), "--quiet", "--json"]) == 0
    capsys.readouterr()
    code = main(["extract", "--target", "random:d=32,seed=1", "--journal", str(j), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "random:d=32,seed=2" in err and "random:d=32,seed=1" in err and "target" in err
    code = main(["extract", "--target", "random:d=32,seed=2", "--seed", "4", "--journal", str(j), "--quiet"])
    assert code == 2 and "seed" in capsys.readouterr().err
    with pytest.raises(JournalMismatch, match="method"):
        Journal(j, {"target": "random:d=32,seed=2", "method": "lowrank", "seed": 0})


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_end_the_run_and_the_journal_resumes(tmp_path, sig, code):
    j = tmp_path / "j.db"
    cmd = [sys.executable, "-m", "headthief.cli", "extract", "--target", "random:d=160,seed=1", "--journal", str(j),
           "--json", "--quiet"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:        # wait until answers are being journaled
        time.sleep(0.05)
        try:
            with sqlite3.connect(j) as db:
                if db.execute("SELECT count(*) FROM answers").fetchone()[0] >= 20:
                    break
        except sqlite3.Error:
            pass
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    assert f"terminated by {signal.Signals(sig).name}" in err and str(j) in err
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    row = json.loads(r.stdout)
    assert r.returncode == 0 and row["journal_replayed"] > 0 and row["W_rel_err"] < 1e-10


def test_float32_answers_are_kept_as_float32_and_read_back_bit_for_bit(tmp_path):
    """A float32 model's answers (every number a float32 number) take half the bytes; any other batch, even one
    number off float32's grid, keeps float64; -0.0, infinities and NaNs come back as they went in."""
    path = tmp_path / "j.db"
    j = Journal(path, {"t": 1})
    g = np.random.default_rng(5)
    y32 = g.standard_normal((3, 8)).astype(np.float32).astype(np.float64)
    y32[0, :4] = [-0.0, np.inf, -np.inf, np.nan]
    y64 = y32.copy()
    y64[2, 7] += 2.0 ** -40                        # off float32's grid: the whole batch stays float64
    j.record(b"a" * 16, y32)
    j.record(b"b" * 16, y64)
    with sqlite3.connect(path) as db:
        rows = dict(db.execute("SELECT key, dtype || ':' || length(answers) FROM answers").fetchall())
    assert rows == {b"a" * 16: f"f4:{4 * y32.size}", b"b" * 16: f"f8:{8 * y64.size}"}
    j.close()
    again = Journal(path, {"t": 1})                # every record checked on opening, then read from the file
    for key, y in ((b"a" * 16, y32), (b"b" * 16, y64)):
        got = again.lookup(key, 3)
        assert got.dtype == np.float64 and got.tobytes() == np.ascontiguousarray(y).tobytes()
    assert again.summary()["format"] == "headthief-journal-2"
    again.close()
    with sqlite3.connect(path) as db:              # a record whose dtype was changed fails its checksum
        db.execute("UPDATE answers SET dtype = 'f8' WHERE dtype = 'f4'")
    with pytest.raises(JournalError, match="fails its checksum"):
        Journal(path, {"t": 1})


def test_a_journal_of_the_first_format_is_resumed_as_it_is(tmp_path):
    """A file written before records had a dtype (format headthief-journal-1, float64 only) is read, checked and
    resumed; what it records stays float64, so the code that wrote it can still read it."""
    from headthief.oracles.journal import _checksum
    path = tmp_path / "old.db"
    y = np.arange(6.0).reshape(2, 3)              # float32 numbers: a new journal would narrow them
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        db.execute("CREATE TABLE answers (id INTEGER PRIMARY KEY, key BLOB UNIQUE, n INTEGER NOT NULL, "
                   "answers BLOB NOT NULL, checksum BLOB NOT NULL)")
        db.executemany("INSERT INTO meta VALUES (?, ?)", [("format", "headthief-journal-1"),
                                                          ("fingerprint", json.dumps({"t": 1})), ("created", "x")])
        blob = y.astype("<f8").tobytes()
        db.execute("INSERT INTO answers (key, n, answers, checksum) VALUES (?, ?, ?, ?)",
                   (b"o" * 16, 2, blob, _checksum(b"o" * 16, 2, blob)))
    j = Journal(path, {"t": 1})
    assert np.array_equal(j.lookup(b"o" * 16, 2), y) and j.summary()["format"] == "headthief-journal-1"
    j.record(b"p" * 16, y + 1)
    j.close()
    with sqlite3.connect(path) as db:
        cols = [r[1] for r in db.execute("PRAGMA table_info(answers)")]
        sizes = [r[0] for r in db.execute("SELECT length(answers) FROM answers")]
    assert "dtype" not in cols and sizes == [8 * y.size, 8 * y.size]
    assert np.array_equal(Journal(path, {"t": 1}).lookup(b"p" * 16, 2), y + 1)
