"""The HTTP API of `headthief serve` against a real uvicorn process on 127.0.0.1: keys, status codes,
idempotency, budgets, rate limits, framings, and the ledger's agreement with what was answered."""

import io
import json
import sqlite3

import httpx
import numpy as np
import pytest

from _server import Server, add_key, headthief
from headthief.models.attention import random_head
from headthief.oracles.http import sparse_form, sparse_parts
from headthief.server.accounts import Accounts

D = 4


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    work = tmp_path_factory.mktemp("api")
    db = work / "s.sqlite"
    keys = {"free": add_key(db, "free"), "small": add_key(db, "small", "--budget", 10),
            "slow": add_key(db, "slow", "--rate", 1)}
    with Server(f"random:d={D},seed=1", db, "--max-batch", "64", "--max-len", "16",
                "--max-body-bytes", "200000", "--max-json-bytes", "100000") as s:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            yield s, c, keys, db


def post(c, key, X, idem, *, npy=False, sparse=False, headers=None):
    h = {"Idempotency-Key": idem, **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    if sparse:
        X = np.asarray(X, dtype=np.float64)
        body = b"".join(bytes(p) for p in sparse_parts(X.shape, *sparse_form(X, max_density=1.0)))
        return c.post("/v1/query", content=body, headers={**h, "Content-Type": "application/x-headthief-sparse"})
    if npy:
        buf = io.BytesIO()
        np.save(buf, np.asarray(X))
        return c.post("/v1/query", content=buf.getvalue(), headers={**h, "Content-Type": "application/x-npy"})
    return c.post("/v1/query", json={"sequences": np.asarray(X).tolist()}, headers=h)


def batch(seed, n=3, N=2):
    return np.random.default_rng(seed).normal(size=(n, N, D))


def test_info_publishes_limits_not_weights(api):
    s, c, keys, db = api
    info = c.get("/v1/info").json()
    assert info["d"] == D and info["max_batch"] == 64 and info["max_len"] == 16 and info["output"] == "value"
    assert info["idempotency"] == "optional" and "application/x-npy" in info["framings"]
    assert info["max_body_bytes"] == 200_000 and info["max_json_bytes"] == 100_000
    assert not {"W", "v", "weights"} & set(info)


def test_answers_are_the_heads_values_in_both_framings(api):
    s, c, keys, db = api
    head = random_head(D, rng=1)
    X = batch(1)
    r = post(c, keys["free"], X, "answers-json")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["charged"] == 3 and doc["replayed"] is False
    assert np.array_equal(np.asarray(doc["values"]), head.evaluate(X))          # JSON loses no bits
    r = post(c, keys["free"], X, "answers-npy", npy=True)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy"
    assert r.headers["x-headthief-charged"] == "3"
    assert np.array_equal(np.load(io.BytesIO(r.content)), head.evaluate(X))
    S = np.zeros((4, 2, D))
    S[np.arange(4), 0, np.arange(4)] = [1.5, -2.0, 0.25, 3.0]
    S[:, :, 1] += 0.5
    r = post(c, keys["free"], S, "answers-sparse", sparse=True)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy", r.text
    assert r.headers["x-headthief-charged"] == "4"
    assert np.array_equal(np.load(io.BytesIO(r.content)), head.evaluate(S))
    r = post(c, keys["free"], S, "answers-sparse-json", sparse=True, headers={"Accept": "application/json"})
    assert r.status_code == 200 and r.json()["values"] == head.evaluate(S).tolist()
    ragged = {"sequences": [batch(2, 1, 1)[0].tolist(), batch(3, 1, 5)[0].tolist()]}
    r = c.post("/v1/query", json=ragged, headers={"Authorization": f"Bearer {keys['free']}", "Idempotency-Key": "rg"})
    assert r.status_code == 200 and len(r.json()["values"]) == 2


@pytest.mark.parametrize("auth", [None, "Bearer ht_not_a_key", "Basic abc", "Bearer"])
def test_401_without_a_valid_key(api, auth):
    s, c, keys, db = api
    h = {"Idempotency-Key": "k"} | ({"Authorization": auth} if auth else {})
    r = c.post("/v1/query", json={"sequences": batch(0).tolist()}, headers=h)
    assert r.status_code == 401 and r.json()["error"] == "unauthorized" and "Bearer" in r.headers["www-authenticate"]
    assert c.get("/v1/usage", headers={"Authorization": auth} if auth else {}).status_code == 401


@pytest.mark.parametrize("body, ctype, status, words", [
    (b"{not json", "application/json", 422, "not valid JSON"),
    (json.dumps({"seqs": []}).encode(), "application/json", 422, "sequences"),
    (json.dumps({"sequences": [[[1.0, 2.0]]]}).encode(), "application/json", 422, "dimension d = 4"),
    (json.dumps({"sequences": [[[1.0, 2.0, 3.0, 4.0], [1.0]]]}).encode(), "application/json", 422, "same length"),
    (json.dumps({"sequences": [[[1.0, True, 3.0, 4.0]]]}).encode(), "application/json", 422, "not a number"),
    (json.dumps({"sequences": [[]]}).encode(), "application/json", 422, "empty"),
    (json.dumps({"sequences": []}).encode(), "application/json", 422, "empty"),
    (b"\x93NUMPY garbage", "application/x-npy", 422, ".npy"),
    (b"x", "text/plain", 415, "application/x-headthief-sparse"),
    (b"HTSPARSE" + np.asarray([1, 1, D, 1], "<u8").tobytes() + np.asarray([D], "<u8").tobytes() + bytes(8),
     "application/x-headthief-sparse", 422, "strictly increasing and below"),
    (b"HTSPARSE" + np.asarray([1, 1, 3, 0], "<u8").tobytes(), "application/x-headthief-sparse", 422, "dimension"),
    (b"HTSPARSE" + np.asarray([10**4, 16, D, 0], "<u8").tobytes(), "application/x-headthief-sparse", 422,
     "the most is 25000"),
    (json.dumps({"sequences": np.zeros((65, 1, D)).tolist()}).encode(), "application/json", 422, "the most is 64"),
    (json.dumps({"sequences": np.zeros((1, 17, D)).tolist()}).encode(), "application/json", 422, "17 tokens"),
    (b" " * 200_001, "application/x-npy", 413, "the most is 200000"),
    (b" " * 200_001, "application/json", 413, "the most is 200000"),
    # JSON over max_json_bytes (100000) is not parsed: beyond the batch limits 422 (counted), else 413
    (json.dumps({"sequences": np.full((70, 16, D), -1.2345678901234567e-100).tolist()}).encode(), "application/json", 422,
     "more than 64 sequences (counted without parsing"),
    (json.dumps({"sequences": np.full((1, 3000, D), 0.1234567).tolist()}).encode(), "application/json", 422,
     "sequence 0 has more than 16 tokens"),
    (json.dumps({"sequences": np.full((64, 16, D), -1.2345678901234567e-100).tolist()}).encode(), "application/json", 413,
     "the most for JSON is 100000"),
    (b"[" * 50_000 + b"]" * 50_000, "application/json", 422, "nests lists deeper"),
    # JSON over max_body_bytes (200000) is not held but counted as it streams by: beyond the batch limits 422,
    # whatever its size (Schemathesis's maxItems cases with long decimals), else 413
    (json.dumps({"sequences": np.full((200, 16, D), -1.2345678901234567e-100).tolist()}).encode(), "application/json",
     422, "more than 64 sequences (counted without parsing"),
    (json.dumps({"sequences": [np.full((3, D), -1.2345678901234567e-100).tolist()] * 3000}).encode(), "application/json",
     422, "more than 64 sequences"),
    (json.dumps({"sequences": np.full((1, 20_000, D), 0.1234567).tolist()}).encode(), "application/json", 422,
     "sequence 0 has more than 16 tokens"),
    (json.dumps({"sequences": np.full((64, 16, D), 1.2345678901234567e-100).tolist()}).encode() + b" " * 200_000,
     "application/json", 413, "send it as application/x-npy"),
])
def test_malformed_or_oversized_batches_name_the_problem(api, body, ctype, status, words):
    s, c, keys, db = api
    before = c.get("/v1/usage", headers={"Authorization": f"Bearer {keys['free']}"}).json()["used"]
    r = c.post("/v1/query", content=body, headers={"Authorization": f"Bearer {keys['free']}", "Idempotency-Key": "bad",
                                                    "Content-Type": ctype})
    assert r.status_code == status, r.text
    assert words in r.json()["detail"]
    assert c.get("/v1/usage", headers={"Authorization": f"Bearer {keys['free']}"}).json()["used"] == before


def test_an_oversized_json_body_is_counted_as_it_streams_only_for_a_known_key(api):
    """Without a Content-Length (chunked) and without a content type (JSON by default), a body that grows
    past max_body_bytes is still counted: 422 for too many sequences. An unknown key is refused (401)
    before anything more is read."""
    s, c, keys, db = api
    body = json.dumps({"sequences": np.full((300, 16, D), -1.2345678901234567e-100).tolist()}).encode()
    assert len(body) > 200_000

    def chunks():
        for i in range(0, len(body), 7_000):
            yield body[i:i + 7_000]

    r = c.post("/v1/query", content=chunks(), headers={"Authorization": f"Bearer {keys['free']}"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 422 and r.json()["error"] == "batch_too_large", r.text
    r = c.post("/v1/query", content=body, headers={"Authorization": "Bearer ht_not_a_key"})
    assert r.status_code == 401, r.text


def test_nan_in_a_binary_batch_is_422(api):
    s, c, keys, db = api
    X = batch(4)
    X[1, 0, 2] = np.nan
    r = post(c, keys["free"], X, "nan", npy=True)
    assert r.status_code == 422 and "query 1 has a non-finite entry" in r.json()["detail"]


def test_idempotency_key_semantics(api):
    s, c, keys, db = api
    k = keys["free"]
    used = lambda: c.get("/v1/usage", headers={"Authorization": f"Bearer {k}"}).json()["used"]  # noqa: E731
    u0 = used()
    for i in (1, 2):    # no Idempotency-Key: answered and charged each time it is sent
        r = c.post("/v1/query", json={"sequences": batch(5).tolist()}, headers={"Authorization": f"Bearer {k}"})
        assert r.status_code == 200 and r.json()["charged"] == 3 and r.json()["replayed"] is False
        assert used() == u0 + 3 * i
    for bad in ("", "x" * 256):
        r = c.post("/v1/query", json={"sequences": batch(5).tolist()}, headers={"Authorization": f"Bearer {k}",
                                                                                 "Idempotency-Key": bad})
        assert r.status_code == 400 and r.json()["error"] == "idempotency_key_invalid", bad
    u0 = used()
    X = batch(6, n=5)
    first = post(c, k, X, "idem-1")
    assert first.status_code == 200 and used() == u0 + 5
    again = post(c, k, X, "idem-1")                                   # a retry: the same answer, free
    assert again.status_code == 200 and again.json()["replayed"] is True and again.json()["charged"] == 0
    assert again.json()["values"] == first.json()["values"] and used() == u0 + 5
    binary = post(c, k, X, "idem-1", npy=True)                        # the same payload in the other framing
    assert binary.status_code == 200 and binary.headers["x-headthief-replayed"] == "true"
    assert np.load(io.BytesIO(binary.content)).tolist() == first.json()["values"] and used() == u0 + 5
    S = np.zeros((5, 2, D))
    S[:, 0, 0] = np.arange(1.0, 6.0)
    assert post(c, k, S, "idem-sparse", npy=True).status_code == 200 and used() == u0 + 10
    again = post(c, k, S, "idem-sparse", sparse=True)                 # sparse framing, the same payload: free
    assert again.status_code == 200 and again.headers["x-headthief-replayed"] == "true" and used() == u0 + 10
    S[4, 1, 3] = 1.0
    r = post(c, k, S, "idem-sparse", sparse=True)
    assert r.status_code == 409 and r.json()["error"] == "idempotency_key_reused"
    u0 += 5
    other = post(c, k, batch(7, n=5), "idem-1")                       # the same key, another payload
    assert other.status_code == 409 and other.json()["error"] == "idempotency_key_reused" and used() == u0 + 5
    assert post(c, k, X, "idem-2").status_code == 200 and used() == u0 + 10   # a new key is a new charge


def test_409_while_the_same_key_is_in_flight(tmp_path):
    acc = Accounts(tmp_path / "a.sqlite")
    acc.add_key("k")
    rec = acc.list_keys()[0]
    assert acc.begin(rec, "same", 3) == ("go", None)
    assert acc.begin(rec, "same", 3) == ("inflight", None)
    acc.charge(rec, "same", b"h" * 16, np.ones(3))
    state, stored = acc.begin(rec, "same", 3)
    assert state == "replay" and stored.n == 3 and acc.get(rec.id).used == 3
    assert acc.audit() == []


def test_403_when_the_budget_is_spent(api):
    s, c, keys, db = api
    k = keys["small"]
    assert post(c, k, batch(8, n=8), "b1").status_code == 200
    r = post(c, k, batch(9, n=4), "b2")
    assert r.status_code == 403
    doc = r.json()
    assert doc["error"] == "budget_exceeded" and doc["spent"] == 8 and doc["budget"] == 10 and doc["requested"] == 4
    assert "8 queries spent" in doc["detail"]
    assert post(c, k, batch(8, n=8), "b1").status_code == 200          # a retry of a paid request still answers
    assert post(c, k, batch(10, n=2), "b3").status_code == 200          # what is left can be spent
    assert c.get("/v1/usage", headers={"Authorization": f"Bearer {k}"}).json() | {} == {
        "name": "small", "used": 10, "budget": 10, "rate": None, "flagged_at": None, "output": "value"}


def test_429_with_retry_after(api):
    s, c, keys, db = api
    k = keys["slow"]
    codes = [post(c, k, batch(20 + i, n=1), f"r{i}") for i in range(3)]
    assert codes[0].status_code == 200
    limited = [r for r in codes[1:] if r.status_code == 429]
    assert limited, [r.status_code for r in codes]
    assert limited[0].headers["retry-after"] == "1" and "rate limit" in limited[0].json()["detail"]


def test_keys_cli_stores_only_hashes_and_lists_usage(api):
    s, c, keys, db = api
    raw = b"".join(p.read_bytes() for p in db.parent.glob("s.sqlite*"))
    assert not any(k.encode() in raw for k in keys.values())
    rows = {r["name"]: r for r in json.loads(headthief("keys", "list", "--db", db, "--json").stdout)}
    assert set(rows) == {"free", "small", "slow"} and rows["small"]["used"] == 10 and rows["slow"]["rate"] == 1
    table = headthief("keys", "list", "--db", db).stdout
    assert table.splitlines()[0].split()[:5] == ["name", "prefix", "budget", "rate", "used"]
    r = headthief("keys", "add", "free", "--db", db, check=False)
    assert r.returncode == 2 and "exists already" in r.stderr and r.stdout == ""


def test_ledger_agrees_with_budgets_and_answers(api):
    s, c, keys, db = api
    assert headthief("keys", "audit", "--db", db).returncode == 0
    with sqlite3.connect(db) as con:
        for name, used, total, blob_bytes in con.execute(
                "SELECT k.name, k.used, COALESCE(SUM(l.n), 0), COALESCE(SUM(length(l.answers)), 0) FROM keys k "
                "LEFT JOIN ledger l ON l.key_id = k.id GROUP BY k.id"):
            assert used == total and blob_bytes == 8 * total, name


def test_an_unexpected_error_in_a_query_is_a_logged_500_not_a_dropped_connection(tmp_path, caplog):
    """/v1/query is answered before FastAPI's middleware stack: its own guard turns a bug into a 500 (as
    ServerErrorMiddleware does for the other routes), and logs the traceback."""
    from fastapi.testclient import TestClient

    from headthief.server.app import Service, create_app

    svc = Service(f"random:d={D},seed=1", tmp_path / "s.sqlite")
    key = svc.accounts.add_key("k")

    def broken(*a, **kw):
        raise RuntimeError("a bug")

    svc.query = broken
    with TestClient(create_app(svc), raise_server_exceptions=False) as c:
        r = post(c, key, batch(1), "boom")
        assert r.status_code == 500 and r.json() == {"error": "internal", "detail": "internal server error"}
        assert c.get("/v1/info").json()["d"] == D                   # the other routes are unaffected
    assert any("a bug" in (rec.exc_text or "") or "a bug" in str(rec.exc_info) for rec in caplog.records)


@pytest.mark.parametrize("limits, d, max_body, fitted", [
    ((4096, 4096), 64, 64 * 2**20, (4096, 32)),      # the defaults at d = 64 (issue 17)
    ((4096, 4096), 8, 64 * 2**20, (4096, 256)),
    ((4096, 4096), 384, 64 * 2**20, (682, 32)),      # still room for the exact method's 383-sequence batches
    ((64, 16), D, 200_000, (64, 16)),                # limits that fit are kept (this module's server)
    ((16, 4096), 64, 64 * 2**20, (16, 4096)),        # long sequences in small batches: kept
    ((4096, 4096), 64, 1000, (1, 1)),
])
def test_the_batch_limits_are_fitted_to_the_byte_limit(limits, d, max_body, fitted):
    from headthief.server.app import fit_limits
    assert fit_limits(*limits, d, max_body) == fitted
    b, n = fitted
    assert b * n * d * 8 <= max_body or fitted == (1, 1)
