"""`headthief serve` of a target that answers vectors (``mha:...,output=all|last``) against a real uvicorn
process on 127.0.0.1: ``/v1/info`` publishes the answer kind and d_out, every framing carries the vectors
bit for bit, one query is still one sequence (budgets, ledger, idempotency), defences apply per
coordinate, sign-only is refused, and a journal resumes an interrupted run."""

import io

import httpx
import numpy as np
import pytest

from _server import Server, headthief
from headthief.errors import BudgetExceeded, InvalidQuery, OracleError
from headthief.oracles.http import HTTPOracle, sparse_form, sparse_parts
from headthief.oracles.journal import Journal
from headthief.server.accounts import Accounts
from headthief.targets import resolve

pytest.importorskip("fastapi")

D = 16
ALL = f"mha:d={D},heads=2,seed=3,output=all"
LAST = f"mha:d={D},heads=2,seed=3,output=last"
FRAMINGS = ["auto", "npy", "sparse", "json"]


def keys(db, **specs) -> dict[str, str]:
    """Keys made in-process (faster than `headthief keys add`): name -> key; ``specs``: name -> dict of
    add_key settings."""
    acc = Accounts(db)
    try:
        return {name: acc.add_key(name, **kw) for name, kw in specs.items()}
    finally:
        acc.close()


def used(db, name) -> int:
    acc = Accounts(db)
    try:
        return {r.name: r.used for r in acc.list_keys()}[name]
    finally:
        acc.close()


@pytest.fixture(scope="module")
def all_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("vec-all")
    db = work / "s.sqlite"
    k = keys(db, plain={}, framings={}, budget={"budget": 5}, journal={}, noisy={"defence": {"noise": 1e-3, "mode": "uniform"}},
             rounded={"defence": {"mode": "round:3"}}, bits={"defence": {"sign": True}}, raw={}, split={})
    with Server(ALL, db, "--max-batch", "64", "--max-json-bytes", "100000") as s:
        yield s, k, work


@pytest.fixture(scope="module")
def last_server(tmp_path_factory):
    work = tmp_path_factory.mktemp("vec-last")
    db = work / "s.sqlite"
    k = keys(db, framings={}, raw={})
    with Server(LAST, db) as s:
        yield s, k, work


def batches(seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(5, 4, D))                                          # one (n, N, d) array
    ragged = [rng.normal(size=(N, D)) for N in (1, 3, 2, 3, 5)]             # sequences of different lengths
    return X, ragged


def same(a, b) -> bool:
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(
            x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and np.array_equal(a, b)


def test_info_and_the_resolved_target_carry_the_answer_kind(all_server, last_server):
    for (s, k, _), kind in ((all_server, "all"), (last_server, "last")):
        info = httpx.get(s.url + "/v1/info").json()
        assert info["answer_kind"] == kind and info["d_out"] == D and info["output"] == "value"
        assert info["max_answer_numbers"] >= info["max_batch"] and info["max_json_answer_numbers"] >= info["max_batch"]
        t = resolve(s.url, api_key=k["framings"])
        assert t.output == kind and t.d_out == D and t.d == D
        assert t.info["server_answer_kind"] == kind and t.info["server_d_out"] == D
        with t.make_oracle() as o:
            assert o.output == kind and o.d_out == D


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("kind", ["all", "last"])
def test_answers_are_bit_identical_to_the_in_process_target(all_server, last_server, kind, framing):
    s, k, _ = all_server if kind == "all" else last_server
    local = resolve(ALL if kind == "all" else LAST).make_oracle()
    X, ragged = batches(1)
    before = used(s.db, "framings")
    with HTTPOracle(s.url, api_key=k["framings"], framing=framing) as o:
        assert same(o.query(X), local.query(X))
        assert same(o.query(ragged), local.query(ragged))                  # all: a list of (N_i, d_out) arrays
        rows = 5 * 4 + 14 if kind == "all" else 10
        assert o.numbers == rows * D and o.stats()["numbers_received"] == rows * D
        assert o.stats()["received_bytes"] >= rows * D * 8 and o.server_replays == 0
    assert used(s.db, "framings") - before == 10                             # one query per sequence


def post(s, key, X, idem, *, ctype="npy", accept=None):
    h = {"Authorization": f"Bearer {key}", "Idempotency-Key": idem}
    if accept:
        h["Accept"] = accept
    if ctype == "json":
        seqs = [np.asarray(x).tolist() for x in X]
        return httpx.post(s.url + "/v1/query", json={"sequences": seqs}, headers=h)
    X = np.asarray(X, dtype=np.float64)
    if ctype == "sparse":
        body = b"".join(bytes(p) for p in sparse_parts(X.shape, *sparse_form(X, max_density=1.0)))
        return httpx.post(s.url + "/v1/query", content=body,
                          headers={**h, "Content-Type": "application/x-headthief-sparse"})
    buf = io.BytesIO()
    np.save(buf, X)
    return httpx.post(s.url + "/v1/query", content=buf.getvalue(), headers={**h, "Content-Type": "application/x-npy"})


def test_the_wire_formats_of_vector_answers(all_server, last_server):
    X, ragged = batches(2)
    s, k, _ = all_server
    truth = resolve(ALL).make_oracle()
    r = post(s, k["raw"], X, "npy")                                          # .npy in, .npy (n, N, d_out) out
    assert r.status_code == 200 and r.headers["x-headthief-charged"] == "5", r.text
    assert same(np.load(io.BytesIO(r.content)), truth.query(X))
    r = post(s, k["raw"], X, "sparse", ctype="sparse")
    assert r.status_code == 200 and same(np.load(io.BytesIO(r.content)), truth.query(X))
    r = post(s, k["raw"], ragged, "json", ctype="json")                      # JSON: one list of vectors per sequence
    doc = r.json()
    assert r.status_code == 200 and doc["charged"] == 5 and doc["replayed"] is False
    assert same([np.asarray(v) for v in doc["values"]], truth.query(ragged))
    r = post(s, k["raw"], ragged, "json-npy", ctype="json", accept="application/x-npy")    # ragged as .npy: packed
    assert r.status_code == 200 and r.headers["x-headthief-lengths"] == "1,3,2,3,5"
    assert same(np.load(io.BytesIO(r.content)), np.concatenate(truth.query(ragged)))
    again = post(s, k["raw"], ragged, "json-npy", ctype="json", accept="application/x-npy")  # a retry: free
    assert again.headers["x-headthief-replayed"] == "true" and again.headers["x-headthief-charged"] == "0"
    assert again.content == r.content
    again = post(s, k["raw"], ragged, "json-npy", ctype="json")              # the stored answer, now as JSON
    assert again.json()["values"] == doc["values"] and again.json()["charged"] == 0
    assert used(s.db, "raw") == 20
    s, k, _ = last_server
    truth = resolve(LAST).make_oracle()
    r = post(s, k["raw"], X, "npy")
    assert r.status_code == 200 and same(np.load(io.BytesIO(r.content)), truth.query(X))      # (n, d_out)
    r = post(s, k["raw"], ragged, "json", ctype="json")
    assert r.status_code == 200 and same(np.asarray(r.json()["values"]), truth.query(ragged))
    assert used(s.db, "raw") == 10
    acc = Accounts(s.db)
    assert acc.audit() == []
    acc.close()


def test_one_query_is_one_sequence_for_the_budget(all_server):
    s, k, _ = all_server
    with HTTPOracle(s.url, api_key=k["budget"]) as o:
        o.query([np.ones((7, D)) * 0.1, np.ones((2, D)) * 0.2])             # 9 vectors, 2 queries
        o.query(np.full((3, 6, D), 0.3))                                     # 18 vectors, 3 queries
        assert used(s.db, "budget") == 5
        with pytest.raises(BudgetExceeded):
            o.query([np.ones((1, D))])
    assert used(s.db, "budget") == 5


def test_defences_apply_per_coordinate_and_sign_only_is_refused(all_server, tmp_path):
    s, k, _ = all_server
    X, ragged = batches(3)
    truth = resolve(ALL).make_oracle().query(X)
    with HTTPOracle(s.url, api_key=k["noisy"]) as o:
        assert o.server_output == "noisy:0.001" and o.answer_tau == 1e-3 and o.output == "all"
        y = o.query(X)
        err = np.abs(y - truth)
        assert err.max() <= 1e-3 and (err > 0).mean() > 0.99                # every number moved, within tau
        assert len(np.unique(np.round((y - truth).ravel() / 1e-3, 6))) > 100  # independent per coordinate
    with HTTPOracle(s.url, api_key=k["noisy"]) as o:                          # another run: the same noise
        assert np.array_equal(o.query(X), y)
    with HTTPOracle(s.url, api_key=k["rounded"]) as o:
        assert o.server_output == "rounded:3"
        assert np.array_equal(o.query(X), np.round(truth, 3))
    r = post(s, k["bits"], X, "bits")                                        # a key made for value targets
    assert r.status_code == 403 and r.json()["error"] == "defence_unsupported"
    with pytest.raises(OracleError, match="sign-only"):
        HTTPOracle(s.url, api_key=k["bits"])
    r = headthief("serve", "--target", ALL, "--db", tmp_path / "x.sqlite", "--port", "0", "--sign-only", check=False)
    assert r.returncode == 2 and "sign-only" in r.stderr and "vector" in r.stderr, r.stderr
    assert not (tmp_path / "x.sqlite").exists() and not (tmp_path / "x.sqlite.lock").exists()


def test_answers_too_large_for_one_body_are_refused_and_the_client_splits(all_server):
    s, k, _ = all_server
    info = httpx.get(s.url + "/v1/info").json()
    most = info["max_json_answer_numbers"]
    X = np.random.default_rng(4).normal(size=(10, 32, D))                    # 5120 numbers > most as JSON
    assert X.shape[0] * X.shape[1] * D > most
    r = post(s, k["split"], X, "big", accept="application/json")
    assert r.status_code == 422 and r.json()["error"] == "answer_too_large", r.text
    assert used(s.db, "split") == 0                                          # refused before it was charged
    r = post(s, k["split"], X, "big-npy")                                    # as .npy it fits
    assert r.status_code == 200 and np.load(io.BytesIO(r.content)).shape == (10, 32, D)
    local = resolve(ALL).make_oracle()
    with HTTPOracle(s.url, api_key=k["split"], framing="json") as o:
        o.max_json_answer = 3 * 32 * D                                       # a smaller limit: 3 sequences a request
        assert same(o.query(X), local.query(X)) and o.requests == 4
        o.max_json_answer = 32 * D - 1
        with pytest.raises(InvalidQuery, match="framing=npy"):
            o.query(X[:1])
    assert used(s.db, "split") == 20


def test_a_journal_resumes_an_interrupted_run(all_server, tmp_path):
    s, k, _ = all_server
    local = resolve(ALL).make_oracle()
    rng = np.random.default_rng(5)
    A, B = rng.normal(size=(3, 4, D)), [rng.normal(size=(N, D)) for N in (2, 5)]
    C = rng.normal(size=(2, 3, D))
    path = tmp_path / "run.journal"
    fp = {"target": s.url, "method": "test"}
    journal = Journal(path, fp)
    with HTTPOracle(s.url, api_key=k["journal"], transcript=journal) as o:
        ya, yb = o.query(A), o.query(B)
        run_id = o.run_id
    journal.close()
    # the run died with C in flight: the server answered and charged it, the journal never saw it
    with HTTPOracle(s.url, api_key=k["journal"], run_id=run_id) as o:
        o.query(C)
    assert used(s.db, "journal") == 3 + 2 + 2
    journal = Journal(path, fp)                                              # resumed
    assert len(journal) == 2
    with HTTPOracle(s.url, api_key=k["journal"], transcript=journal) as o:
        assert o.run_id == run_id
        assert same(o.query(A), ya) and same(o.query(B), yb)
        assert o.replayed == 5 and o.requests == 0                          # from the journal: nothing sent
        yc = o.query(C)
        assert o.requests == 1 and o.server_replays == 1                    # answered from the ledger, free
    assert len(journal) == 3
    journal.close()
    assert used(s.db, "journal") == 7
    assert same(ya, local.query(A)) and same(yb, local.query(B)) and same(yc, local.query(C))


WIDE = '''import numpy as np
M = np.random.default_rng(7).standard_normal((4, 64))
def f(seqs):
    return [np.tanh(np.asarray(X) @ M) * np.arange(1, len(X) + 1)[:, None] for X in seqs]
'''


def test_a_provider_function_with_wide_answers_is_split_by_its_answers(tmp_path):
    """d_out = 64 > d = 4: the answers, not the requests, set the limits."""
    (tmp_path / "wide.py").write_text(WIDE)
    db = tmp_path / "s.sqlite"
    k = keys(db, wide={})
    spec = f"py:{tmp_path / 'wide.py'}:f"
    with Server(f"{spec} --d 4 --output all --d-out 64", db, "--max-batch", "64", "--max-json-bytes", "100000") as s:
        info = httpx.get(s.url + "/v1/info").json()
        assert info["answer_kind"] == "all" and info["d_out"] == 64
        assert info["max_len"] == 2048            # fitted so that a full batch's answer fits max_body_bytes
        local = resolve(spec, d=4, output="all", d_out=64).make_oracle()
        X = np.random.default_rng(8).normal(size=(20, 8, 4))
        ragged = [np.random.default_rng(9).normal(size=(N, 4)) for N in (3, 1, 4)]
        with HTTPOracle(s.url, api_key=k["wide"], framing="json") as o:
            assert same(o.query(X), local.query(X))
            assert o.requests == 3                 # 8 sequences of 8 x 64 numbers fit one JSON answer, not 9
            assert same(o.query(ragged), local.query(ragged))
        with HTTPOracle(s.url, api_key=k["wide"], framing="npy") as o:
            assert same(o.query(X), local.query(X)) and o.requests == 1
        assert used(db, "wide") == 20 + 3 + 20
