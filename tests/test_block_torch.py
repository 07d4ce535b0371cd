"""The block method's refits on a torch device (``--refit-device``): the same losses and gradients as numpy's
(checked on the CPU device, where every machine can), the same refits, and clear errors for a bad device."""

from __future__ import annotations

import numpy as np
import pytest

import headthief as ht
from headthief.errors import SpecError
from headthief.extraction.block import block_refit, one_token_refit
from headthief.extraction.block.block_refit import gauged
from headthief.models.bert_block import random_block

torch = pytest.importorskip("torch")
from headthief.extraction.block.torch_losses import BlockLoss, OneTokenLoss, check_device  # noqa: E402


def test_the_block_loss_and_gradient_are_numpys():
    block = gauged(random_block(8, 2, 6, seed=1))
    rng = np.random.default_rng(2)
    p = block_refit.params_of(block)
    shapes = {k: np.shape(p[k]) for k in block_refit.NAMES if k not in ("g1", "bq")}    # two held fixed
    fixed = {k: np.asarray(p[k]) for k in ("g1", "bq")}
    theta = block_refit.pack(p, shapes) + 0.01 * rng.standard_normal(sum(int(np.prod(s)) for s in shapes.values()))
    groups = [(rng.standard_normal((5, 1, 8)), rng.standard_normal((5, 1, 8))),
              (rng.standard_normal((3, 4, 8)), rng.standard_normal((3, 4, 8)))]
    L, G = block_refit.loss_and_grad(theta, shapes, groups, fixed)
    Lt, Gt = BlockLoss(shapes, groups, fixed, "cpu")(theta)
    assert abs(Lt - L) <= 1e-12 * L and np.max(np.abs(Gt - G)) <= 1e-11 * np.max(np.abs(G))
    w = [np.sign(rng.standard_normal(Y.shape)) for _, Y in groups]      # answers shifted, as the scaling asks
    L2, G2 = block_refit.loss_and_grad(theta, shapes, [(X, Y - s) for (X, Y), s in zip(groups, w)], fixed)
    Lt2, Gt2 = BlockLoss(shapes, groups, fixed, "cpu")(theta, w)
    assert abs(Lt2 - L2) <= 1e-12 * L2 and np.max(np.abs(Gt2 - G2)) <= 1e-11 * np.max(np.abs(G2))


def test_the_one_token_loss_and_gradient_are_numpys():
    rng = np.random.default_rng(0)
    d, f = 5, 7
    sh = one_token_refit.shapes(d, f)
    theta = 0.5 * rng.standard_normal(sum(int(np.prod(s)) for s in sh.values()))
    X, Y = rng.standard_normal((11, d)), rng.standard_normal((11, d))
    L, G = one_token_refit.loss_and_grad(theta, X, Y, d, f)
    Lt, Gt = OneTokenLoss(sh, X, Y, "cpu")(theta)
    assert abs(Lt - L) <= 1e-12 * L and np.max(np.abs(Gt - G)) <= 1e-11 * np.max(np.abs(G))


def test_a_refit_on_the_torch_device_reaches_numpys_result(perturbed_block):
    _, start, X, Y = perturbed_block
    a, ia = block_refit.refit_block(start, [(X, Y)], max_iter=300, rng=np.random.default_rng(1))
    b, ib = block_refit.refit_block(start, [(X, Y)], max_iter=300, rng=np.random.default_rng(1), device="cpu")
    assert ib["block_refit_rms_before"] == pytest.approx(ia["block_refit_rms_before"], rel=1e-10)
    # the same L-BFGS path to rounding: both end within 2x of each other, far below the start
    assert ib["block_refit_rms_after"] <= 2 * ia["block_refit_rms_after"] <= 1e-3 * ia["block_refit_rms_before"]
    assert np.max(np.abs(b.forward(X) - Y)) <= 2 * np.max(np.abs(a.forward(X) - Y)) + 1e-12


def test_method_block_with_the_refits_on_the_torch_cpu_device():
    spec = "bert-block:d=12,heads=2,ffn=12,seed=41,dtype=float32"
    rep = ht.extract(spec, "block", verify=64, refit_device="cpu")
    ref = ht.extract(spec, "block", verify=64)
    assert rep.ok and rep.row["refit_device"] == "cpu" and ref.row["refit_device"] is None
    assert rep.row["queries"] == ref.row["queries"]
    for k in ("O_rel_err", "W1_rel_err", "fidelity_max_rel_err"):
        assert rep.row[k] <= max(1e-4, 3 * ref.row[k])


@pytest.mark.parametrize("device, message", [
    ("gpu", "--refit-device must be numpy"), ("cuda:x", "--refit-device must be numpy"),
    ("cuda:99", "CUDA device")])
def test_a_bad_refit_device_is_refused_before_any_query(device, message):
    if device == "cuda:99" and torch.cuda.is_available() and torch.cuda.device_count() > 99:   # pragma: no cover
        pytest.skip("a machine with 100 GPUs")
    with pytest.raises(SpecError, match=message):
        check_device(device)
    rep = ht.extract("bert-block:d=8,heads=2,ffn=8,seed=1,dtype=float32", "block", refit_device=device,
                     raise_errors=False)
    assert rep.exit_code == 2 and message in rep.error and rep.row.get("queries_sent", 0) == 0
    with pytest.raises(SpecError, match="--refit-device does not apply to --method exact"):
        ht.extract("random:d=8,seed=1", "exact", refit_device="cpu")
