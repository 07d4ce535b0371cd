"""A bounded load test against a real server: 8 concurrent clients for 3 s on one key. No request is
lost or charged twice (the ledger equals the fresh answers received), retries are free and identical,
no 5xx. (The 32 clients x 60 s figure is in benchmarks/bench_http.py.)"""

import json

from _server import Server, add_key, headthief
from headthief.server.load import run_load


def test_concurrent_clients_lose_nothing_and_pay_once(tmp_path):
    db = tmp_path / "s.sqlite"
    key = add_key(db, "load")
    with Server("random:d=16,seed=3", db) as s:
        r = run_load(s.url, key, d=16, clients=8, seconds=3.0, seed=5)
    assert r.requests > 50 and r.retries > 0
    assert r.errors_5xx == 0 and r.other_errors == 0 and r.retry_mismatches == 0
    rows = json.loads(headthief("keys", "list", "--db", db, "--json").stdout)
    assert rows[0]["used"] == r.fresh_queries                        # ledger = answers received
    audit = headthief("keys", "audit", "--db", db)
    assert audit.returncode == 0
    assert f"load: {r.requests - r.retries} requests charged, {r.fresh_queries} queries" in audit.stdout
