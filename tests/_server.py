"""Helpers for the server tests: a real ``headthief serve`` process on 127.0.0.1 (a free port), and keys."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HEADTHIEF = [sys.executable, "-m", "headthief.cli"]


def headthief(*args, check=True, env=None, timeout=120) -> subprocess.CompletedProcess:
    r = subprocess.run([*HEADTHIEF, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    if check and r.returncode != 0:
        raise AssertionError(f"headthief {' '.join(map(str, args))} exited {r.returncode}: {r.stderr}")
    return r


def keys(*args) -> str:
    """``headthief keys ARGS`` in this process (the set-up of the server tests: a Python start-up less per call;
    the ``keys`` commands themselves are tested as subprocesses in test_server_cli.py); its stdout."""
    import io

    from headthief.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["keys", *map(str, args)])
    if code != 0:
        raise AssertionError(f"headthief keys {' '.join(map(str, args))} exited {code}: {err.getvalue()}")
    return out.getvalue()


def add_key(db, name, *opts) -> str:
    key = keys("add", name, "--db", db, *opts)
    assert re.fullmatch(r"ht_[A-Za-z0-9_-]{40,}\n", key), key
    return key.strip()


class Server:
    """``headthief serve TARGET --db DB`` in a subprocess; ``url`` once it says it is ready. SIGKILL-able,
    restartable. ``target`` may carry options: ``Server("py:m.py:f --d 8", db)``."""

    def __init__(self, target: str, db, *opts: str, workdir=None):
        self.target, self.db, self.opts = target, Path(db), list(opts)
        self.workdir = Path(workdir or self.db.parent)
        self.proc = None
        self.port = 0
        self.starts = 0

    def start(self, timeout: float = 60.0) -> "Server":
        self.starts += 1
        log = self.workdir / f"serve{self.starts}.err"
        self._log = open(log, "w")
        target, *topts = self.target.split(" ")
        self.proc = subprocess.Popen([*HEADTHIEF, "serve", "--target", target, *topts, "--db", str(self.db),
                                      "--port", str(self.port), *self.opts],
                                     stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"headthief serve: ready on http://127\.0\.0\.1:(\d+)", log.read_text())
            if m:
                self.port = int(m.group(1))
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"headthief serve exited {self.proc.returncode}: {log.read_text()}")
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"headthief serve did not start in {timeout} s: {log.read_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=15)
        self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def used(db, name) -> int:
    """Queries charged to the key ``name`` (``keys list --json``)."""
    return {r["name"]: r["used"] for r in json.loads(keys("list", "--db", db, "--json"))}[name]


@contextlib.contextmanager
def py_server(work: Path, model_source: str, d: int, key_name: str):
    """A provider's own model (``model.py`` with ``f``) served with ``--d d`` and the default limits;
    yields ``(server, key)``."""
    (work / "model.py").write_text(model_source)
    db = work / "s.sqlite"
    key = add_key(db, key_name)
    with Server(f"py:{work / 'model.py'}:f --d {d}", db) as s:
        yield s, key
