"""``--causal`` (issue 20): a ``py:`` black box declared causal, for ``--method vector``.

At the last position a causal layer and a bidirectional one with the same weights answer alike, so with
``output=last`` the declaration cannot be checked: it sets the recovered layer's mask (its other positions).
With ``output=all`` stage A's two-token query checks it, and a contradiction is exit 5 before stage B."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import headthief as ht
from headthief.cli import main
from headthief.errors import ModelMismatch, SpecError
from headthief.extraction.vector import extract_vector
from headthief.models.mha import random_layer
from headthief.oracles.base import ModelOracle
from headthief.targets import resolve


def box(tmp_path, *, causal: bool, output: str, seed: int = 3) -> str:
    """A py: target wrapping mha.random_layer(16, 2): the spec string."""
    f = tmp_path / f"box_{int(causal)}_{output}.py"
    pick = "[-1]" if output == "last" else ""
    f.write_text(
        "import numpy as np\n"
        "from headthief.models.mha import random_layer\n"
        f"L = random_layer(16, 2, seed={seed}, causal={causal}, output='all')\n"
        "def f(seqs):\n"
        f"    return [L.forward(np.asarray(x)[None])[0]{pick} for x in seqs]\n")
    return f"py:{f}:f"


def all_positions_err(layer, truth, X) -> tuple[float, float]:
    """The recovered layer's largest error at every position and at the last one, over the answers' rms."""
    yh = dataclasses.replace(layer, output="all").forward(X)
    y = truth.forward(X)
    rms = float(np.sqrt(np.mean(y ** 2)))
    return float(np.max(np.abs(yh - y))) / rms, float(np.max(np.abs(yh[:, -1] - y[:, -1]))) / rms


def test_output_last_declared_causal_gives_the_causal_layer(tmp_path):
    spec = box(tmp_path, causal=True, output="last")
    truth = random_layer(16, 2, seed=3, causal=True, output="all")
    X = np.random.default_rng(1).standard_normal((8, 6, 16))
    journal = str(tmp_path / "j.sqlite")
    # without the flag (measured): the run succeeds, the weights are right, but the layer is bidirectional
    plain = ht.extract(spec, method="vector", d=16, output="last", verify=64, journal=journal)
    assert plain.ok and plain.row["model_check"]["verdict"] == "pass"
    assert plain.row["causal"] is None and "causal_declared" not in plain.row
    assert plain.result.layer.causal is False
    e = plain.result.errors(truth.canonical())
    assert max(e["W_rel_err"], e["c_rel_err"], e["O_rel_err"], e["b_rel_err"]) < 1e-10
    err_all, err_last = all_positions_err(plain.result.layer, truth, X)
    assert err_last < 1e-10 and err_all > 0.5          # measured 4.7: the earlier positions attend to later tokens
    # with it: the same queries (all replayed from the journal), the same weights, a causal layer
    rep = ht.extract(spec, method="vector", d=16, output="last", causal=True, verify=64, journal=journal)
    assert rep.ok and rep.row["model_check"]["verdict"] == "pass"
    assert rep.row["journal_sent"] == 0 and rep.queries == plain.queries
    assert rep.row["causal"] is True and rep.row["causal_declared"] is True and rep.row["target_causal"] is True
    assert rep.result.layer.causal is True
    e = rep.result.errors(truth.canonical())
    assert e["heads_found"] == 2
    assert max(e["W_rel_err"], e["c_rel_err"], e["O_rel_err"], e["b_rel_err"]) < 1e-10
    assert max(all_positions_err(rep.result.layer, truth, X)) < 1e-10


def test_output_all_contradicted_declaration_is_exit_5_after_stage_a(tmp_path, capsys):
    spec = box(tmp_path, causal=False, output="all")
    code = main(["extract", "--target", spec, "--d", "16", "--output", "all", "--causal", "--method", "vector",
                 "--quiet"])
    err = capsys.readouterr().err
    assert code == 5
    assert "declared causal (--causal)" in err and "position 1 of the two-token query [x1, x2]" in err
    rep = ht.extract(spec, method="vector", d=16, output="all", causal=True, raise_errors=False)
    assert rep.exit_code == 5 and rep.row["model_check"]["check"] == "causal"
    assert rep.row["queries_sent"] == 16 + 1 + 8 + 1      # stage A only: d + 1 tokens, 8 extra, the pair
    with pytest.raises(ModelMismatch, match="declared causal"):       # the library call, and no --no-check bypass
        extract_vector(ModelOracle(random_layer(16, 2, seed=3, output="all")), causal=True, check=False)
    with pytest.raises(ModelMismatch, match="declared bidirectional"):  # the library's causal=False, alike
        extract_vector(ModelOracle(random_layer(16, 2, seed=3, causal=True, output="all")), causal=False)


def test_output_all_causal_box_detected_with_or_without_the_flag(tmp_path):
    spec = box(tmp_path, causal=True, output="all")
    plain = ht.extract(spec, method="vector", d=16, output="all", verify=32)
    flagged = ht.extract(spec, method="vector", d=16, output="all", causal=True, verify=32)
    assert plain.ok and flagged.ok and plain.queries == flagged.queries
    assert plain.row["causal"] is True and "causal_declared" not in plain.row      # detected, as before
    assert flagged.row["causal_declared"] is True and flagged.result.layer.causal


def test_an_oracle_may_be_declared_causal():
    layer = random_layer(16, 2, seed=4, causal=True, output="last")
    rep = ht.extract(ModelOracle(layer), method="vector", causal=True, verify=32)
    assert rep.ok and rep.result.layer.causal and rep.row["target_causal"] is True


@pytest.mark.parametrize("argv,words", [
    (["--target", "mha:d=16,heads=2,causal=1,output=last", "--method", "vector"], "declares a py: black box"),
    (["--target", "random:d=8"], "declares a py: black box"),
    (["--target", "{py}", "--d", "16", "--output", "last", "--method", "multihead"],
     "--causal does not apply to --method multihead"),
    (["--target", "{py}", "--d", "16"], "--causal does not apply to --method exact"),     # scalar py: -> exact
])
def test_usage_errors(tmp_path, capsys, argv, words):
    spec = box(tmp_path, causal=True, output="last")
    argv = [a.replace("{py}", spec) for a in argv]
    assert main(["extract", *argv, "--causal", "--quiet"]) == 2
    assert words in capsys.readouterr().err


def test_a_target_object_of_another_kind_is_refused():
    with pytest.raises(SpecError, match="mha: target"):
        ht.extract(resolve("mha:d=16,heads=2,causal=1"), method="vector", causal=True)


def test_help_and_targets_mention_the_flag(capsys):
    assert main(["targets"]) == 0
    py = [line for line in capsys.readouterr().out.splitlines() if "py:PATH" in line]
    assert py and "--causal" in py[0]
    with pytest.raises(SystemExit):
        main(["extract", "--help"])
    assert "--causal" in capsys.readouterr().out


def test_a_spec_that_states_its_mask_reaches_the_method_at_the_last_position():
    """mha:...,causal=1,output=last: the mask is in the spec (not observable at the last position), so the
    recovered layer is causal; the same spec without causal=1 comes back bidirectional."""
    rep = ht.extract("mha:d=16,heads=2,seed=3,causal=1,output=last", method="vector", verify=32, raise_errors=False)
    assert rep.exit_code == 0 and rep.row["causal"] is True, rep.row
    assert rep.row["W_rel_err"] < 1e-10
    rep = ht.extract("mha:d=16,heads=2,seed=3,output=last", method="vector", verify=32, raise_errors=False)
    assert rep.exit_code == 0 and not rep.row["causal"], rep.row
