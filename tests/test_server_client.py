"""Extraction through HTTP (`HTTPOracle`, `--target http://...`) against a real `headthief serve`:
bit-identical results, the same query counts, and what the server charges; budgets, rate limits, keys."""

import json

import numpy as np
import pytest

from _server import Server, add_key, headthief, used
from headthief.errors import BudgetExceeded, InvalidQuery, SpecError
from headthief.models.attention import random_head
from headthief.oracles.http import HTTPOracle


@pytest.fixture(scope="module")
def d64(tmp_path_factory):
    work = tmp_path_factory.mktemp("d64")
    with Server("random:d=64,seed=1", work / "s.sqlite") as s:
        yield s, work


@pytest.fixture(scope="module")
def d8plain(tmp_path_factory):
    work = tmp_path_factory.mktemp("d8plain")
    with Server("random:d=8,seed=1", work / "s.sqlite") as s:
        yield s, work


@pytest.fixture(scope="module")
def d8(tmp_path_factory):
    work = tmp_path_factory.mktemp("d8")
    with Server("random:d=8,seed=1", work / "s.sqlite", "--max-batch", "7") as s:
        yield s, work


def extract(target, out, *args, env=None, check=True):
    r = headthief("extract", "--target", target, "--verify", "0", "--json", "--quiet", "--save", out, *args,
                  env=env, check=check)
    return r, (json.loads(r.stdout) if r.returncode == 0 else None)


def same_npz(a, b):
    with np.load(a) as x, np.load(b) as y:
        return set(x.files) == set(y.files) and all(np.array_equal(x[k], y[k]) for k in x.files)


@pytest.fixture(scope="module")
def local64(d64):
    """The same extraction in process, once for every framing."""
    _, local = extract("random:d=64,seed=1", d64[1] / "local.npz", "--method", "exact")
    return local


@pytest.mark.parametrize("framing", ["auto", "npy", "sparse", "json"])
def test_exact_through_http_is_bit_identical_and_charged_exactly(d64, local64, framing):
    s, work = d64
    key = add_key(s.db, f"acceptance-{framing}")
    local = local64
    _, remote = extract(f"{s.url}?framing={framing}", work / f"http-{framing}.npz", "--method", "exact", "--api-key", key)
    assert same_npz(work / "local.npz", work / f"http-{framing}.npz")
    assert remote["queries"] == local["queries"] == 4160
    assert remote["check_queries"] == local["check_queries"] == 16
    assert used(s.db, f"acceptance-{framing}") == 4160 + 16
    http = remote["http"]
    assert http["retried"] == 0 and http["server_replays"] == 0 and sum(http["sent"].values()) == http["requests"]
    if framing == "auto":       # the basis probes go sparse, the model check's random sequences as .npy
        assert http["sent"]["sparse"] > 100 and 0 < http["sent"]["npy"] < 10
        assert http["sent_bytes"] < 0.1 * 4160 * 2 * 64 * 8
    else:
        assert set(http["sent"]) == {framing}
    assert headthief("keys", "audit", "--db", s.db).returncode == 0


def test_budget_spent_exits_3_saying_how_many_were_spent(d64):
    s, work = d64
    key = add_key(s.db, "poor", "--budget", "1000")
    r, _ = extract(s.url, work / "poor.npz", "--method", "exact", env={"HEADTHIEF_API_KEY": key}, check=False)
    spent = used(s.db, "poor")
    assert r.returncode == 3, r.stderr
    assert 0 < spent <= 1000 and f"query budget exceeded: {spent} queries spent, budget 1000" in r.stderr


def test_a_bad_key_is_bad_input(d64):
    s, work = d64
    r, _ = extract(s.url, work / "x.npz", "--api-key", "ht_wrong", check=False)
    assert r.returncode == 2 and "refused the API key (401" in r.stderr
    r, _ = extract("http://127.0.0.1:1", work / "x.npz", check=False,          # nobody listens there
                   env={"HEADTHIEF_CONNECT_WAIT": "2"})                         # (30 s by default)
    assert r.returncode == 2 and "no answer from http://127.0.0.1:1" in r.stderr and "in 2 s" in r.stderr


@pytest.mark.parametrize("method, extra", [("lowrank", []), ("noisy", ["--noise", "1e-6"]), ("membership", [])])
def test_methods_run_unchanged_through_http(d8plain, method, extra):
    s, work = d8plain
    key = add_key(s.db, f"m-{method}")
    _, local = extract("random:d=8,seed=1", work / f"{method}-local.npz", "--method", method, *extra)
    _, remote = extract(s.url, work / f"{method}-http.npz", "--method", method, "--api-key", key, *extra)
    assert same_npz(work / f"{method}-local.npz", work / f"{method}-http.npz")
    assert remote["queries"] == local["queries"]
    assert used(s.db, f"m-{method}") == local["queries"] + local["check_queries"]


def test_oracle_splits_batches_within_limits_and_replays_on_retry(d8):
    s, work = d8
    key = add_key(s.db, "split")
    head = random_head(8, rng=1)
    X = [np.random.default_rng(i).normal(size=(1 + i % 3, 8)) for i in range(20)]   # ragged, > max_batch 7
    with HTTPOracle(s.url, api_key=key, run_id="run-a") as o:
        assert o.max_batch == 7 and o.d == 8
        y = o.query(X)
        assert np.array_equal(y, head.evaluate(X)) and o.requests >= 3
    with HTTPOracle(s.url, api_key=key, run_id="run-a") as o:   # the same run asks again (a crash): free
        assert np.array_equal(o.query(X), y) and o.server_replays == o.requests
    assert used(s.db, "split") == 20
    with HTTPOracle(s.url, api_key=key, run_id="run-b", framing="json") as o:   # another run pays
        # JSON sends the ragged batch in one request, npy one request per length: the server's model
        # batches differently, so the last bits may differ (the values agree to rounding)
        assert np.allclose(o.query(X), y, rtol=1e-12, atol=1e-14) and o.server_replays == 0
    assert used(s.db, "split") == 40
    with HTTPOracle(s.url, api_key=key) as o:
        with pytest.raises(InvalidQuery, match="dimension d = 8"):
            o.query([np.zeros((2, 3))])


def test_rate_limit_is_waited_out(d8):
    s, work = d8
    key = add_key(s.db, "rated", "--rate", "3")
    head = random_head(8, rng=1)
    with HTTPOracle(s.url, api_key=key) as o:
        ys = [o.query(np.random.default_rng(100 + i).normal(size=(1, 2, 8))) for i in range(6)]
        assert o.rate_waits >= 1 and o.waited >= 1.0
    for i, y in enumerate(ys):
        assert np.array_equal(y, head.evaluate(np.random.default_rng(100 + i).normal(size=(1, 2, 8))))
    assert used(s.db, "rated") == 6


def test_oracle_errors_are_typed(d8):
    s, work = d8
    key = add_key(s.db, "tiny", "--budget", "2")
    with HTTPOracle(s.url, api_key=key) as o:
        o.query(np.zeros((2, 1, 8)))
        with pytest.raises(BudgetExceeded) as e:
            o.query(np.ones((1, 1, 8)))
        assert (e.value.spent, e.value.budget, e.value.requested) == (2, 2, 1)
    with HTTPOracle(s.url, api_key="ht_nope") as o, pytest.raises(SpecError, match="401"):
        o.query(np.zeros((1, 1, 8)))


class _OldServer:
    """A transport standing in for a server that publishes only JSON and .npy (no sparse framing): it
    answers each query with the head's values and records the content types it was sent."""

    def __init__(self, d):
        from headthief.oracles.http import _Response
        self.head, self.types, self.R = random_head(d, rng=1), [], _Response
        self.info = {"d": d, "framings": ["application/json", "application/x-npy"], "max_batch": 64}

    def request(self, method, path, headers, parts=()):
        import io
        if path == "/v1/info":
            return self.R(200, {"content-type": "application/json"}, json.dumps(self.info).encode())
        if path == "/v1/usage":     # an older server without the key's output: the client keeps /v1/info's
            return self.R(404, {"content-type": "application/json"}, b'{"detail": "Not Found"}')
        self.types.append(headers["Content-Type"])
        X = np.load(io.BytesIO(b"".join(bytes(p) for p in parts)))
        buf = io.BytesIO()
        np.save(buf, self.head.evaluate(X))
        return self.R(200, {"content-type": "application/x-npy"}, buf.getvalue())

    def close(self):
        pass


def test_auto_framing_falls_back_to_npy_where_the_server_has_no_sparse_framing():
    X = np.zeros((5, 2, 8))
    X[:, 0, 0] = 1.0
    old = _OldServer(8)
    with HTTPOracle("http://127.0.0.1:9", api_key="k", client=old) as o:
        assert o.framing == "npy" and o.output == "value" and o.answer_tau == 0.0
        assert np.array_equal(o.query(X), old.head.evaluate(X)) and old.types == ["application/x-npy"]
    with pytest.raises(SpecError, match="does not accept framing=sparse"):
        HTTPOracle("http://127.0.0.1:9", api_key="k", client=_OldServer(8), framing="sparse")
    with pytest.raises(SpecError, match="framing='msgpack': use auto, npy, sparse, json"):
        HTTPOracle("http://127.0.0.1:9", api_key="k", client=_OldServer(8), framing="msgpack")


def test_the_noisy_method_reads_the_tolerance_the_server_publishes_for_the_key(d8plain):
    """A key with a noise defence: /v1/usage says noisy:TAU, so `--method noisy` needs no --noise (which
    would add the client's own noise on top), and the model check allows for TAU instead of failing."""
    s, work = d8plain
    key = add_key(s.db, "noisy-key", "--defence", "noise=1e-5,mode=uniform")
    r, row = extract(s.url, work / "noisy.npz", "--method", "noisy", "--api-key", key)
    assert r.returncode == 0, r.stderr
    assert row["tau"] == 1e-5 and row["target_server_output"] == "noisy:1e-05"
    assert row["model_check"]["answers"] == "float64, tolerance 1e-05" and row["model_check"]["verdict"] != "fail"
    head = random_head(8, rng=1)
    with np.load(work / "noisy.npz") as z:
        err = np.linalg.norm(z["W"] - head.W) / np.linalg.norm(head.W)
    assert 0 < err < 1e-2          # measured 8.2e-5: noise of 1e-5 amplified under the input-norm bound R = 1
    # the exact method on the same key: its check knows the answers are noisy too, and is not fooled into
    # calling the tolerance a wrong model class
    r, row = extract(s.url, work / "exact-noisy.npz", "--method", "exact", "--api-key", key)
    assert r.returncode == 0 and row["model_check"]["answers"] == "float64, tolerance 1e-05"
