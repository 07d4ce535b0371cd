"""Schemathesis (4.x) fuzzes every operation of the served OpenAPI schema, with a valid key and with an
invalid one, in positive and negative modes: zero 5xx, every response conforms to the schema (status
code, content type, headers, body).

(schemathesis.pytest.from_fixture does not run under pytest 9 — it sets ``request.node._nodeid``, which
pytest 9 no longer has — so the test drives ``schema.as_strategy()`` with Hypothesis itself.)
"""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from _server import Server, add_key, py_server


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    db = work / "s.sqlite"
    key = add_key(db, "fuzz")
    with Server("random:d=2,seed=1", db, "--max-batch", "8", "--max-len", "8") as s:
        yield s, key


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
@pytest.mark.parametrize("who", ["valid-key", "invalid-key"])
def test_api_conforms_and_never_5xx(fuzz_server, mode, who):
    server, key = fuzz_server
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.generation.update(with_security_parameters=False)     # the key is ours, below
    assert {op.ok().path for op in schema.get_all_operations()} == {"/v1/info", "/v1/usage", "/v1/query"}
    auth = {"Authorization": f"Bearer {key if who == 'valid-key' else 'ht_invalid_key'}"}
    seen = set()
    calls = []

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        if mode == GenerationMode.POSITIVE and case.operation.path == "/v1/query":
            # a fresh Idempotency-Key per case: the generator reuses keys across bodies, which the API rightly
            # answers 409 (a key reused with another payload; tested in test_server_api.py)
            case.headers = {**(case.headers or {}), "Idempotency-Key": f"fuzz-{who}-{len(calls)}"}
        calls.append(case)
        response = case.call_and_validate(headers=auth)
        seen.add((case.operation.path, response.status_code))

    fuzz()
    assert all(status < 500 for _, status in seen)
    if mode == GenerationMode.POSITIVE:
        assert {path for path, _ in seen} == {"/v1/info", "/v1/usage", "/v1/query"}
        if who == "valid-key":
            assert ("/v1/query", 200) in seen                      # valid batches were answered
    else:
        assert ("/v1/query", 200) not in seen or who == "valid-key"


# Issue 17: `schemathesis run URL/openapi.json -H "Authorization: Bearer KEY" --checks all` against
# `headthief serve --target py:model.py:f --d 64` with the server's default limits. Before, the published
# maxItems (4096 sequences of 4096 tokens) let Schemathesis build a batch one sequence beyond them of
# 1.35 GB, which the server answered 413 unread (ST201: a schema-violating request must get one of
# 400/401/403/404/405/406/409/415/422/428/429) and which took Schemathesis itself to 23.6 GB RSS (killed
# by the OOM killer). The limits are now fitted to max_body_bytes (fit_limits): 4096 sequences of 32 tokens.

MODEL = """
import numpy as np
_rng = np.random.default_rng(0)
W = _rng.normal(size=(64, 64)) / 8
v = _rng.normal(size=64)

def f(seqs):
    out = []
    for X in seqs:
        X = np.asarray(X, dtype=float)
        s = X @ (W @ X[-1])
        a = np.exp(s - s.max())
        out.append(float((a / a.sum()) @ (X @ v)))
    return out
"""


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz64")
    with py_server(work, MODEL, 64, "fuzz") as (s, key):      # the default limits
        yield s, key, work


def test_the_default_limits_are_fitted_to_the_byte_limit(default_server):
    s, key, work = default_server
    info = httpx.get(s.url + "/v1/info").json()
    assert (info["max_batch"], info["max_len"], info["max_body_bytes"]) == (4096, 32, 64 * 2**20)
    assert info["max_batch"] * info["max_len"] * info["d"] * 8 <= info["max_body_bytes"]
    body = httpx.get(s.url + "/openapi.json").json()["paths"]["/v1/query"]["post"]["requestBody"]
    seqs = body["content"]["application/json"]["schema"]["properties"]["sequences"]
    assert (seqs["maxItems"], seqs["items"]["maxItems"]) == (4096, 32)


def _oversized(max_batch, max_len, d=64):
    """A batch one element beyond max_batch as Schemathesis's coverage phase builds it: 15 cover cases of a
    sequence (longest, shortest, and elements that are not sequences at all) repeated to max_batch + 1."""
    tok = [0.0] * d
    pattern = [[tok] * max_len, 0, [tok], False, [tok] * (max_len + 1), [tok] * (max_len - 1), [[1e100] * d]] * 2
    pattern.append([[-0.0] * d] * 2)
    assert len(pattern) == 15
    return (pattern * (max_batch // 15 + 1))[:max_batch + 1]


@pytest.mark.parametrize("shape", ["batch", "sequence"])
def test_one_beyond_the_published_limits_is_422_not_413(default_server, shape):
    s, key, work = default_server
    info = httpx.get(s.url + "/v1/info").json()
    if shape == "batch":
        seqs = _oversized(info["max_batch"], info["max_len"])
    else:
        seqs = [[[0.5] * 64] * (info["max_len"] + 1)]
    body = json.dumps({"sequences": seqs}).encode()
    if shape == "batch":     # above max_json_bytes: counted without parsing, not refused unread
        assert info["max_json_bytes"] < len(body) < info["max_body_bytes"], len(body)
    r = httpx.post(s.url + "/v1/query", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"] == ("batch_too_large" if shape == "batch" else "sequence_too_long")


def test_schemathesis_with_all_checks_passes_with_the_default_limits(default_server):
    """The issue's command, verbatim but for the port (a free one): all checks, Schemathesis's defaults
    (coverage and fuzzing phases). ~10 s here."""
    s, key, work = default_server
    st = Path(sys.executable).parent / "schemathesis"
    if not st.exists():
        pytest.skip("no schemathesis CLI next to this Python")
    r = subprocess.run([str(st), "run", s.url + "/openapi.json", "-H", f"Authorization: Bearer {key}", "--checks", "all"],
                       cwd=work, capture_output=True, text=True, timeout=300)   # cwd: its .schemathesis cache
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "No issues found" in r.stdout, r.stdout[-3000:]
