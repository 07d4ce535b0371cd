"""The pipeline against a real ``headthief serve`` on 127.0.0.1: the budget bounds every query the key is
charged (verification included), and a key whose answers are bits is refused before the first query."""

import json

import pytest

from _server import Server, add_key, headthief, used

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def d16(tmp_path_factory):
    work = tmp_path_factory.mktemp("d16")
    with Server("random:d=16,seed=1", work / "s.sqlite") as s:
        yield s, work


def run(*args):
    r = headthief("extract", "--json", "--quiet", *args, check=False)
    return r, json.loads(r.stdout.strip().splitlines()[-1])


def test_the_budget_bounds_what_the_key_is_charged_verification_included(d16):
    s, work = d16
    key = add_key(s.db, "bounded")
    budget = 16 * 16 + 16 + 16          # exact's queries and the check's identities: nothing left to verify
    r, row = run("--target", s.url, "--method", "exact", "--api-key", key, "--budget", str(budget))
    assert r.returncode == 0, r.stderr
    assert row["queries"] == 272 and row["verify_queries"] == 0
    assert row["model_check"]["verdict"] == "unchecked"
    assert used(s.db, "bounded") == budget           # was 544: 256 verification queries past the budget
    key2 = add_key(s.db, "bounded2")
    r, row = run("--target", s.url, "--method", "exact", "--api-key", key2, "--budget", str(budget + 100))
    assert r.returncode == 0, r.stderr
    assert used(s.db, "bounded2") <= budget + 100
    assert row["check_queries"] + row["queries"] + row["verify_queries"] == used(s.db, "bounded2")


def test_a_value_method_through_a_sign_only_key_is_refused_before_the_first_query(d16):
    s, work = d16
    key = add_key(s.db, "bits", "--defence", "sign=1")
    r, row = run("--target", s.url, "--method", "exact", "--api-key", key)
    assert r.returncode == 2 and "sign" in r.stderr and "membership" in r.stderr
    assert used(s.db, "bits") == 0
    r, row = run("--target", s.url, "--api-key", key, "--verify", "0")          # auto: the sign-only method
    assert r.returncode in (0, 5), r.stderr
    assert row["method"] == "membership"


MODEL = '''import numpy as np
rng = np.random.default_rng(11)
W = rng.standard_normal((16, 16)) / 4
v = rng.standard_normal(16)
def f(seqs):
    out = []
    for X in seqs:
        s = X @ W @ X[-1]
        p = np.exp(s - s.max())
        out.append(float(p @ (X @ v) / p.sum()))
    return out
'''


def test_a_provider_serving_its_own_model_is_extracted_as_in_process(tmp_path):
    import numpy as np
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    with Server(f"py:{model}:f --d 16", tmp_path / "s.sqlite") as s:
        key = add_key(s.db, "auditor")
        r, remote = run("--target", s.url, "--method", "exact", "--api-key", key, "--save", tmp_path / "http.npz")
        assert r.returncode == 0, r.stderr
        r, local = run("--target", f"py:{model}:f", "--d", "16", "--method", "exact", "--save", tmp_path / "local.npz")
        assert r.returncode == 0, r.stderr
        assert remote["queries"] == local["queries"] == 16 * 16 + 16
        with np.load(tmp_path / "http.npz") as a, np.load(tmp_path / "local.npz") as b:
            assert np.array_equal(a["W"], b["W"]) and np.array_equal(a["v"], b["v"])
        assert used(s.db, "auditor") == remote["queries"] + remote["check_queries"] + remote["verify_queries"]
