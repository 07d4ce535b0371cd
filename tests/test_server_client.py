"""Extraction through HTTP (`HTTPOracle`, `--target http://...`) against a real `headthief serve`:
bit-identical results, the same query counts, and what the server charges; budgets, rate limits, keys."""

import json

import numpy as np
import pytest

from _server import Server, add_key, headthief
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


def used(db, name):
    return {r["name"]: r["used"] for r in json.loads(headthief("keys", "list", "--db", db, "--json").stdout)}[name]


def extract(target, out, *args, env=None, check=True):
    r = headthief("extract", "--target", target, "--verify", "0", "--json", "--quiet", "--save", out, *args,
                  env=env, check=check)
    return r, (json.loads(r.stdout) if r.returncode == 0 else None)


def same_npz(a, b):
    with np.load(a) as x, np.load(b) as y:
        return set(x.files) == set(y.files) and all(np.array_equal(x[k], y[k]) for k in x.files)


@pytest.mark.parametrize("framing", ["npy", "json"])
def test_exact_through_http_is_bit_identical_and_charged_exactly(d64, framing):
    s, work = d64
    key = add_key(s.db, f"acceptance-{framing}")
    _, local = extract("random:d=64,seed=1", work / "local.npz", "--method", "exact")
    _, remote = extract(f"{s.url}?framing={framing}", work / f"http-{framing}.npz", "--method", "exact", "--api-key", key)
    assert same_npz(work / "local.npz", work / f"http-{framing}.npz")
    assert remote["queries"] == local["queries"] == 4160
    assert remote["check_queries"] == local["check_queries"] == 16
    assert used(s.db, f"acceptance-{framing}") == 4160 + 16
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
    r, _ = extract("http://127.0.0.1:1", work / "x.npz", check=False)          # nobody listens there
    assert r.returncode == 2 and "no answer from http://127.0.0.1:1" in r.stderr


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
