"""Defences of the server (without HTTP: the Service behind the API): noise within a tolerance, rounding,
sign-only answers, the input-norm bound, per-key settings over server-wide ones, and the PRADA detector
(flags an extraction's probes, not natural queries; refuse mode answers 403)."""

import json

import numpy as np
import pytest

from headthief.errors import SpecError
from headthief.models.attention import random_head
from headthief.server.app import Problem, Service
from headthief.server.defences import Defence, Prada, parse_defence

D = 6


def ask(svc, key, X, idem):
    body = json.dumps({"sequences": np.asarray(X).tolist()}).encode()
    out, _, _ = svc.query(f"Bearer {key}", idem, "application/json", body, None)
    return np.asarray(json.loads(out)["values"])


@pytest.fixture
def svc(tmp_path):
    return Service(f"random:d={D},seed=2", tmp_path / "s.sqlite")


def test_noise_rounding_and_sign_defences_per_key(svc):
    head = random_head(D, rng=2)
    X = np.random.default_rng(0).normal(size=(40, 3, D))
    truth = head.evaluate(X)
    keys = {name: svc.accounts.add_key(name, defence=parse_defence(spec).settings()) for name, spec in [
        ("clean", ""), ("noisy", "noise=1e-3,mode=uniform"), ("adv", "noise=1e-3"), ("round", "mode=round:2"),
        ("sign", "sign=1")]}
    assert np.array_equal(ask(svc, keys["clean"], X, "a"), truth)
    y = ask(svc, keys["noisy"], X, "a")
    assert np.abs(y - truth).max() <= 1e-3 and not np.array_equal(y, truth)
    assert np.array_equal(ask(svc, keys["noisy"], X, "b"), y)             # deterministic: asking again is no help
    assert np.allclose(np.abs(ask(svc, keys["adv"], X, "a") - truth), 1e-3, rtol=1e-6)
    assert np.array_equal(ask(svc, keys["round"], X, "a"), np.round(truth, 2))
    assert np.array_equal(ask(svc, keys["sign"], X, "a"), (truth > 0).astype(float))


def test_noise_is_keyed_with_the_server_secret(tmp_path):
    X = np.random.default_rng(1).normal(size=(5, 2, D))
    answers = []
    for i in range(2):
        s = Service(f"random:d={D},seed=2", tmp_path / f"s{i}.sqlite", defence=Defence(noise=1e-3, mode="uniform"))
        answers.append(ask(s, s.accounts.add_key("k"), X, "x"))
    assert not np.array_equal(*answers)          # two servers, two secrets: the noise cannot be predicted


def test_input_norm_bound_refuses_and_info_publishes_it(tmp_path):
    s = Service(f"random:d={D},seed=2", tmp_path / "s.sqlite", defence=Defence(norm=1.0))
    key = s.accounts.add_key("k")
    assert s.info()["input_norm"] == 1.0
    X = np.full((1, 1, D), 0.1)
    ask(s, key, X, "ok")
    with pytest.raises(Problem) as e:
        ask(s, key, np.full((1, 1, D), 1.0), "far")
    assert e.value.status == 422 and "input-norm bound violated" in e.value.detail
    assert s.accounts.get(s.accounts.lookup(key).id).used == 1


def test_bad_defence_settings_are_spec_errors():
    for bad in ["noise=-1", "mode=uniform", "prada=maybe", "max_batch=0", "colour=red", "noise"]:
        with pytest.raises(SpecError):
            parse_defence(bad)


def test_prada_flags_basis_probes_not_natural_queries():
    rng = np.random.default_rng(0)
    natural = Prada(0.9, 100)
    for _ in range(150):
        natural.observe([rng.normal(size=(int(rng.integers(1, 6)), 16)) for _ in range(8)])
    assert natural.seen == 1200 and natural.flagged_at is None and natural.last_W > 0.9
    probes = Prada(0.9, 100)
    E = np.eye(16)
    for l in range(16):                                            # exact's probes: e_l, e_l + e_p, scaled
        probes.observe(np.stack([np.stack([E[l], E[l] + E[p]]) for p in range(16)]))
    assert probes.flagged_at is not None and probes.flagged_at <= 256 and probes.last_W < 0.9


def test_prada_refuse_answers_403_once_flagged(tmp_path):
    s = Service("random:d=16,seed=2", tmp_path / "s.sqlite", defence=Defence(prada="refuse", prada_min=50))
    key = s.accounts.add_key("thief")
    E = np.eye(16)
    refused = None
    for l in range(16):
        try:
            ask(s, key, np.stack([np.stack([E[l], 2 * E[l] + E[p]]) for p in range(16)]), f"b{l}")
        except Problem as e:
            refused = (l, e)
            break
    assert refused is not None, "the detector never flagged the basis probes"
    l, e = refused
    assert e.status == 403 and e.error == "flagged"
    rec = s.accounts.lookup(key)
    assert rec.flagged_at is not None and rec.flagged_at <= 16 * l and rec.used == 16 * l
    assert s.accounts.audit() == []


def test_a_restarted_server_keeps_the_prada_detectors_state(tmp_path):
    """What each request adds to the detector is stored with its charge: a server restarted halfway
    through an extraction flags it at the same query as one that ran throughout."""
    E = np.eye(16)
    batches = [np.stack([np.stack([E[l], 2 * E[l] + E[p]]) for p in range(16)]) for l in range(12)]

    def run(db, restart_after):
        s = Service("random:d=16,seed=2", db, defence=Defence(prada="flag"))
        key = s.accounts.add_key("thief")
        for i, X in enumerate(batches):
            if i == restart_after:
                s.accounts.close()
                s = Service("random:d=16,seed=2", db, defence=Defence(prada="flag"))      # a new process
            ask(s, key, X, f"b{i}")
        rec = s.accounts.lookup(key)
        det = s._prada[rec.id]
        return rec.flagged_at, det._D, {k: G.shape for k, G in det._G.items()}, s

    flagged, D, G, _ = run(tmp_path / "a.sqlite", None)
    flagged_r, D_r, G_r, s = run(tmp_path / "b.sqlite", 5)      # 80 queries before the restart: no test yet
    assert flagged is not None and 80 < flagged <= 192
    assert flagged_r == flagged and D_r == D and G_r == G
    rec = s.accounts.lookup(s.accounts.add_key("other"))
    assert s.accounts.prada_state(rec.id, 5000) == ([], [])                 # per key


def test_stored_prada_distances_are_pruned_to_the_last_D_MAX(tmp_path):
    from headthief.server.accounts import Accounts
    from headthief.server.defences import D_MAX
    acc = Accounts(tmp_path / "a.sqlite")
    acc.add_key("k")
    rec = acc.list_keys()[0]
    for i in range(3):
        acc.begin(rec, f"i{i}", 1)
        acc.charge(rec, f"i{i}", b"h" * 16, np.zeros(1), prada={"distances": [float(j) for j in range(i * D_MAX, (i + 1) * D_MAX)],
                                                           "points": [(2, np.ones(2).tobytes())]})
    points, dists = acc.prada_state(rec.id, D_MAX)
    assert dists == [float(j) for j in range(2 * D_MAX, 3 * D_MAX)] and len(points) == 3
    assert acc._db.execute("SELECT COUNT(*) FROM prada_distances").fetchone()[0] <= 2 * D_MAX
    assert acc.audit() == []
