"""`headthief serve` and `headthief keys` as a provider uses them (issue 17): serving a `py:` model with
`--d`, requests without an Idempotency-Key (httpx and curl), the client waiting for a server that is
still starting, one server per database, port and database errors, key revocation and limits, and the
memory a large JSON body costs."""

import argparse
import json
import re
import shutil
import socket
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest

from _server import Server, add_key, headthief, py_server, used
from headthief.cli.target_options import add_target_arguments, target_from_args
from headthief.errors import OracleError, SpecError
from headthief.oracles.base import CallableOracle
from headthief.oracles.http import HTTPOracle

MODEL = """
import numpy as np
W = np.random.default_rng(3).normal(size=(8, 8)) / 8
def f(seqs):
    return [float(np.tanh(x @ W @ x[-1]).sum()) for x in seqs]
"""


def model_f(X):
    W = np.random.default_rng(3).normal(size=(8, 8)) / 8
    return [float(np.tanh(x @ W @ x[-1]).sum()) for x in X]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pyserver(tmp_path_factory):
    work = tmp_path_factory.mktemp("pyserve")
    with py_server(work, MODEL, 8, "provider") as (s, key):
        yield s, key, work


def test_a_provider_serves_its_own_py_model_with_d(pyserver):
    s, key, work = pyserver
    X = np.random.default_rng(0).normal(size=(5, 3, 8))
    with HTTPOracle(s.url, api_key=key) as o:
        assert o.d == 8 and o.output == "value"
        assert np.array_equal(o.query(X), model_f(list(X)))


def _args(*argv):
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_target_arguments(p)
    return p.parse_args(list(argv))


def test_d_that_disagrees_with_the_target_is_a_spec_error_naming_both():
    with pytest.raises(SpecError, match=r"--d 16 disagrees with the target random:d=8, whose tokens have d = 8"):
        target_from_args(_args("--target", "random:d=8", "--d", "16"))
    assert target_from_args(_args("--target", "random:d=8", "--d", "8")).d == 8
    r = headthief("serve", "--target", "random:d=8", "--d", "16", "--db", "never.sqlite", "--port", "0", check=False)
    assert r.returncode == 2 and "--d 16 disagrees" in r.stderr


def test_a_py_function_failing_on_the_given_d_names_d_and_the_shape(tmp_path):
    W = np.ones((8, 8))
    o = CallableOracle(lambda seqs: [float((x @ W @ x[-1]).sum()) for x in seqs], 5)
    with pytest.raises(OracleError, match=r"shape \(2, 5\) .*d = 5.*--d 5"):
        o.query(np.zeros((3, 2, 5)))
    (tmp_path / "model.py").write_text(MODEL)
    r = headthief("serve", "--target", f"py:{tmp_path / 'model.py'}:f", "--d", "5", "--db", tmp_path / "s.sqlite",
                  "--port", "0", check=False)
    assert r.returncode == 2 and "--d 5" in r.stderr and "(2, 5)" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s.sqlite").exists()


def test_requests_without_an_idempotency_key_are_charged_each_time(pyserver):
    s, key, work = pyserver
    name = "no-idem"
    k = add_key(s.db, name)
    body = {"sequences": np.random.default_rng(1).normal(size=(3, 2, 8)).tolist()}
    with httpx.Client(base_url=s.url, timeout=30) as c:
        answers = [c.post("/v1/query", json=body, headers={"Authorization": f"Bearer {k}"}) for _ in range(2)]
    assert [r.status_code for r in answers] == [200, 200]
    assert [r.json()["charged"] for r in answers] == [3, 3] and answers[0].json()["values"] == answers[1].json()["values"]
    assert used(s.db, name) == 6


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_plain_curl_gets_200_and_is_charged_twice(pyserver):
    s, key, work = pyserver
    name = "curl"
    k = add_key(s.db, name)
    data = json.dumps({"sequences": [[[0.5] * 8, [0.25] * 8]]})
    cmd = ["curl", "-sS", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {k}", "-H",
           "Content-Type: application/json", "-d", data, f"{s.url}/v1/query"]
    outs = [subprocess.run(cmd, capture_output=True, text=True, timeout=60) for _ in range(2)]
    for r in outs:
        doc, code = r.stdout.rsplit("\n", 1)
        assert code == "200", r.stdout + r.stderr
        assert json.loads(doc)["charged"] == 1 and json.loads(doc)["values"] == model_f([np.asarray([[0.5] * 8, [0.25] * 8])])
    assert used(s.db, name) == 2


def test_require_idempotency_keeps_the_strict_mode(tmp_path):
    db = tmp_path / "s.sqlite"
    k = add_key(db, "strict")
    with Server("random:d=4,seed=1", db, "--require-idempotency") as s, httpx.Client(base_url=s.url) as c:
        assert c.get("/v1/info").json()["idempotency"] == "required"
        r = c.post("/v1/query", json={"sequences": [[[1.0, 2.0, 3.0, 4.0]]]}, headers={"Authorization": f"Bearer {k}"})
        assert r.status_code == 400 and r.json()["error"] == "idempotency_key_missing"
        assert c.get("/openapi.json").json()["paths"]["/v1/query"]["post"]["parameters"][0]["required"] is True
        assert used(db, "strict") == 0


def test_the_client_waits_for_a_server_that_is_still_starting(tmp_path):
    db = tmp_path / "s.sqlite"
    k = add_key(db, "early")
    port = free_port()
    got = {}

    def client():
        t0 = time.monotonic()
        try:
            with HTTPOracle(f"http://127.0.0.1:{port}", api_key=k, connect_wait=60) as o:
                got["y"] = o.query(np.ones((2, 1, 4)))
        except Exception as e:      # noqa: BLE001 - reported below
            got["error"] = e
        got["s"] = time.monotonic() - t0

    th = threading.Thread(target=client)
    th.start()
    time.sleep(1.5)                 # the client has been refused for 1.5 s (it gave up after ~0.35 s before)
    s = Server("random:d=4,seed=1", db)
    s.port = port
    with s:
        th.join(60)
        assert "error" not in got, got.get("error")
        assert got["y"].shape == (2,) and got["s"] > 1.5
        assert used(db, "early") == 2
    t0 = time.monotonic()
    with pytest.raises(OracleError, match=r"no answer from .*/v1/info after \d+ attempts in 1 s"):
        HTTPOracle(f"http://127.0.0.1:{port}", api_key=k, connect_wait=1)
    assert 0.9 < time.monotonic() - t0 < 10


def test_serve_prints_ready_and_refuses_a_second_server_on_the_same_database(tmp_path):
    db = tmp_path / "s.sqlite"
    with Server("random:d=4,seed=1", db) as s:
        assert f"headthief serve: ready on {s.url}" in (tmp_path / "serve1.err").read_text()
        r = headthief("serve", "--target", "random:d=4,seed=1", "--db", db, "--port", "0", check=False, timeout=60)
        assert r.returncode == 2 and "in use by another headthief serve" in r.stderr and "one server per database" in r.stderr
        assert httpx.get(s.url + "/v1/info").status_code == 200          # the first one still serves
    with Server("random:d=4,seed=1", db):                                 # after it stopped, a new one may start
        pass


def test_port_errors_exit_2_and_leave_no_database(tmp_path):
    r = headthief("serve", "--target", "random:d=4", "--db", tmp_path / "a.sqlite", "--port", "70000", check=False)
    assert r.returncode == 2 and "--port must be in 0..65535" in r.stderr and "Traceback" not in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = headthief("serve", "--target", "random:d=4", "--db", tmp_path / "b.sqlite", "--port", port, check=False)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert not (tmp_path / "a.sqlite").exists() and not (tmp_path / "b.sqlite").exists()


def test_keys_commands_other_than_add_never_make_a_database(tmp_path):
    for cmd in (["list"], ["audit"], ["revoke", "x"], ["set", "x", "--budget", "3"]):
        r = headthief("keys", *cmd, "--db", tmp_path / "typo.sqlite", check=False)
        assert r.returncode == 2 and "no server database at" in r.stderr and "typo.sqlite" in r.stderr, cmd
    assert not (tmp_path / "typo.sqlite").exists()


def test_keys_revoke_and_set_take_effect_on_a_running_server(pyserver):
    s, key, work = pyserver
    k = headthief("keys", "add", "limits", "--budget", "4", "--db", s.db).stdout      # as a user types it
    assert re.fullmatch(r"ht_[A-Za-z0-9_-]{40,}\n", k), k
    k = k.strip()
    h = {"Authorization": f"Bearer {k}"}
    one = {"sequences": [[[0.1] * 8]]}
    with httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post("/v1/query", json={"sequences": [[[0.1] * 8]] * 4}, headers=h).status_code == 200
        r = c.post("/v1/query", json=one, headers=h)
        assert r.status_code == 403 and r.json()["budget"] == 4
        out = headthief("keys", "set", "limits", "--budget", "6", "--rate", "100", "--db", s.db).stdout
        assert out.strip() == "limits: budget 6, rate 100, used 4"
        assert c.post("/v1/query", json=one, headers=h).status_code == 200
        assert c.get("/v1/usage", headers=h).json() | {} == {"name": "limits", "used": 5, "budget": 6, "rate": 100.0,
                                                              "flagged_at": None, "output": "value"}
        assert "revoked at" in headthief("keys", "revoke", "limits", "--db", s.db).stdout
        r = c.post("/v1/query", json=one, headers=h)
        assert r.status_code == 401 and "revoked" in r.json()["detail"]
        assert c.get("/v1/usage", headers=h).status_code == 401
    rows = {r["name"]: r for r in json.loads(headthief("keys", "list", "--db", s.db, "--json").stdout)}
    assert rows["limits"]["revoked"] is not None and rows["limits"]["used"] == 5 and rows["provider"]["revoked"] is None
    r = headthief("keys", "set", "nobody", "--budget", "1", "--db", s.db, check=False)
    assert r.returncode == 2 and "no key named 'nobody'" in r.stderr
    assert headthief("keys", "audit", "--db", s.db).returncode == 0


def test_the_http_target_publishes_a_sign_only_output_before_any_query(pyserver):
    """What `extract` needs to refuse a value method up front: the key's published output, read at resolve time."""
    from headthief.targets import resolve
    s, key, work = pyserver
    k = add_key(s.db, "signs", "--defence", "sign=1")
    t = resolve(s.url, api_key=k)
    assert t.info["server_output"] == "sign" and t.d == 8
    assert resolve(s.url, api_key=key).info["server_output"] == "value"
    assert used(s.db, "signs") == 0


def _rss(pid):
    status = open(f"/proc/{pid}/status").read()
    return {k: int(v.split()[0]) // 1024 for k, v in (line.split(":", 1) for line in status.splitlines())
            if k in ("VmRSS", "VmHWM")}


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs /proc")
def test_a_large_json_body_costs_about_its_size_not_ten_times(tmp_path):
    """Before: a 50.6 MB JSON body took the server from 94 MB to 583 MB RSS. JSON over max_json_bytes (8 MiB)
    is not parsed: answered 422 (too many sequences, counted) or 413 holding only the body."""
    db = tmp_path / "s.sqlite"
    k = add_key(db, "big")
    X = np.random.default_rng(0).normal(size=(4097, 64, 8))       # one more sequence than max_batch, 48 MB
    rows = [json.dumps(x) for x in X.tolist()]                     # each sequence's JSON, written once

    def as_json(n):
        return ('{"sequences": [' + ", ".join(rows[:n]) + "]}").encode()

    body = as_json(len(rows))
    assert len(body) > 40e6 and as_json(2) == json.dumps({"sequences": X[:2].tolist()}).encode()
    with Server("random:d=8,seed=1", db) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        before = _rss(s.proc.pid)
        r = c.post("/v1/query", content=body, headers={"Authorization": f"Bearer {k}", "Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["error"] == "batch_too_large", r.text
        body2 = as_json(4000)
        r = c.post("/v1/query", content=body2, headers={"Authorization": f"Bearer {k}", "Content-Type": "application/json"})
        assert r.status_code == 413 and "the most for JSON is 8388608" in r.json()["detail"]
        after = _rss(s.proc.pid)
    grew = after["VmHWM"] - before["VmHWM"]
    print(f"server RSS {before} -> {after} MB for a {len(body) / 1e6:.1f} MB JSON body")
    assert grew < 2.5 * len(body) / 2**20, (before, after)          # ~1x the body (it was ~10x)
    assert used(db, "big") == 0
