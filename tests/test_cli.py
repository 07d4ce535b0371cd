import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from headthief.cli import main


def run_json(capsys, *argv):
    code = main(["extract", *argv, "--json", "--quiet"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


KEYS = {"target", "method", "d", "rank", "queries", "W_rel_err", "v_rel_err", "c_rel_err", "beta_abs_err",
        "fidelity_max_rel_err", "seconds"}


def test_exact_json_has_every_key_and_exact_count(capsys):
    code, row, _ = run_json(capsys, "--target", "random:d=16,seed=1", "--method", "exact")
    assert code == 0
    assert KEYS <= set(row)
    assert row["queries"] == 16 * 16 + 16
    assert row["W_rel_err"] <= 1e-10 and row["fidelity_max_rel_err"] <= 1e-10
    assert row["c_rel_err"] is None and row["beta_abs_err"] is None


def test_biased_target(capsys):
    code, row, _ = run_json(capsys, "--target", "random:d=12,seed=3,bias=1,sparse_v=0.5")
    assert code == 0 and row["queries"] == 12 * 12 + 2 * 12 + 1
    assert max(row["W_rel_err"], row["v_rel_err"], row["c_rel_err"], row["beta_abs_err"]) <= 1e-10


def test_v_zero_exits_2_with_reason(capsys):
    code, _, err = run_json(capsys, "--target", "random:d=8,v=zero")
    assert code == 2 and "not identifiable" in err and err.count("\n") == 1


def test_budget_exits_3_and_says_spent(capsys):
    code, _, err = run_json(capsys, "--target", "random:d=16,seed=1", "--budget", "100")
    assert code == 3 and "queries spent" in err


@pytest.mark.parametrize("spec, match", [
    ("random:seed=1", "d= is required"),
    ("random:d=8,rank=9", "larger than d"),
    ("random:d=8,colour=red", "unknown option"),
    ("nosuch:d=3", "unknown target kind"),
    ("py:missing.py:f", "needs --d"),
])
def test_bad_specs_exit_2(capsys, spec, match):
    code, _, err = run_json(capsys, "--target", spec)
    assert code == 2 and match in err


def test_py_target_recovers_the_callables_parameters(tmp_path, capsys):
    src = tmp_path / "mymodel.py"
    src.write_text(textwrap.dedent("""
        import numpy as np
        _rng = np.random.default_rng(42)
        Q = _rng.standard_normal((3, 6)); K = _rng.standard_normal((3, 6)); vo = _rng.standard_normal(6)
        def head(seqs):
            out = []
            for X in seqs:
                s = (X @ K.T) @ (Q @ X[-1]) / np.sqrt(3)
                a = np.exp(s - s.max()); a /= a.sum()
                out.append(float(a @ (X @ vo)))
            return out
    """))
    save = tmp_path / "out.npz"
    code, row, _ = run_json(capsys, "--target", f"py:{src}:head", "--d", "6", "--save", str(save))
    assert code == 0 and row["W_rel_err"] is None and row["fidelity_max_rel_err"] <= 1e-10
    rng = np.random.default_rng(42)
    Q, K, vo = rng.standard_normal((3, 6)), rng.standard_normal((3, 6)), rng.standard_normal(6)
    z = np.load(save)
    np.testing.assert_allclose(z["W"], K.T @ Q / np.sqrt(3), atol=1e-10)
    np.testing.assert_allclose(z["v"], vo, atol=1e-12)
    assert "c" not in z


def test_transcript_resume(tmp_path, capsys):
    t = tmp_path / "t.npz"
    code, _, err = run_json(capsys, "--target", "random:d=16,seed=1", "--budget", "150", "--transcript", str(t))
    assert code == 3 and str(t) in err
    code, row, _ = run_json(capsys, "--target", "random:d=16,seed=1", "--transcript", str(t))
    assert code == 0 and row["queries"] == 272 and row["W_rel_err"] <= 1e-10
    # nothing paid for is paid twice: the first run's answers (a whole number of calls, <= 150) are replayed
    assert 0 < row["transcript_replayed"] <= 150
    # everything the oracle answered: the check's identities, the method's queries, the fidelity verdict
    assert row["transcript_replayed"] + row["transcript_sent"] == 272 + row["check_queries"] + row["verify_queries"]


def test_transcript_resume_through_a_threat_model(tmp_path, capsys):
    t = tmp_path / "t.npz"
    args = ["--target", "random:d=32,seed=1,rank=3", "--method", "lowrank", "--rank", "3", "--noise", "1e-9",
            "--transcript", str(t)]
    code, _, _ = run_json(capsys, *args, "--budget", "120")
    assert code == 3
    code, row, _ = run_json(capsys, *args)
    assert code == 0 and row["W_rel_err"] <= 1e-5
    assert row["transcript_replayed"] > 0
    assert row["transcript_replayed"] + row["transcript_sent"] == row["queries"] + row["check_queries"] + row["verify_queries"]


def test_installed_entry_point_and_table():
    r = subprocess.run([sys.executable, "-m", "headthief.cli", "extract", "--target", "random:d=8,seed=2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "W_rel_err" in r.stdout and "queries" in r.stdout and "72" in r.stdout


def test_targets_lists_kinds(capsys):
    assert main(["targets"]) == 0
    assert "random:d=D" in capsys.readouterr().out


def test_import_is_light():
    code = ("import sys, headthief; heavy = [m for m in ('torch', 'transformers', 'cvxpy', 'matplotlib', "
            "'safetensors', 'rich') if m in sys.modules]; print(heavy)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
