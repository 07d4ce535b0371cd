"""The block refit's loss and gradient as the library runs it (numpy, float64,
:func:`headthief.extraction.block.block_refit.loss_and_grad`) at MiniLM's size: the real block 2's weights
(d = 384, 12 heads, FFN 1536) and the answers ``--method block`` fits there (30,792 one-token answers, then
random sequences of 2, 4, 8 and 16 tokens, ``refit_counts``: 36,944 positions), answered by the block itself
plus noise (the time does not depend on the numbers).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_block_refit_numpy.py [--fraction 0.25] [--repeats 2]
        [--device cpu|cuda]

``--fraction f`` times f of those answers (the time is linear in them) and scales up. Prints seconds per
evaluation (BLAS threads as set by OMP_NUM_THREADS) and the hours 4,500 L-BFGS iterations would take (the
most the float32 refits took at d <= 32). ``--device``: the same loss and gradient as ``--refit-device`` runs
them (:class:`headthief.extraction.block.torch_losses.BlockLoss`, float64 on that torch device, autograd),
after checking them against numpy's on a small share of the answers; the older torch rows (a separate
implementation, for the plan) are ``bench_block_minilm_cost.py``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief.extraction.block import block_refit
from headthief.extraction.block.one_token_refit import random_queries
from headthief.models.bert_block import from_minilm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fraction", type=float, default=0.25, help="time this fraction of the answers, scale up")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default=None, help="a torch device (cpu, cuda, cuda:N) for --refit-device's loss")
    args = ap.parse_args()
    if not 0 < args.fraction <= 1:
        raise SystemExit(f"--fraction must be in (0, 1], got {args.fraction}")
    block = block_refit.gauged(from_minilm(2, dtype=np.float64))
    d, ffn = block.d, block.ffn
    rng = np.random.default_rng(0)
    sizes = [(max(1, int(args.fraction * random_queries(d, ffn))), 1)]
    sizes += [(max(1, int(args.fraction * n)), T) for T, n in zip(block_refit.REFIT_LENGTHS,
                                                                   block_refit.refit_counts(d, ffn))]
    groups = []
    for n, T in sizes:
        X = rng.standard_normal((n, T, d))
        X *= np.sqrt(d) / np.linalg.norm(X, axis=2, keepdims=True)
        groups.append((X, block.forward(X) + 1e-3 * rng.standard_normal((n, T, d))))
    p = block_refit.params_of(block)
    shapes = {k: np.shape(p[k]) for k in block_refit.NAMES}
    theta = block_refit.pack(p, shapes)
    positions = sum(n * T for n, T in sizes)
    evaluate = lambda th: block_refit.loss_and_grad(th, shapes, groups)      # noqa: E731
    label = "block refit, loss + gradient, numpy"
    if args.device is not None:
        from headthief.extraction.block.torch_losses import BlockLoss, check_device
        check_device(args.device)
        small = [(X[:8], Y[:8]) for X, Y in groups]
        L, G = block_refit.loss_and_grad(theta, shapes, small)
        Lt, Gt = BlockLoss(shapes, small, {}, args.device)(theta)
        print(f"{args.device} against numpy on {sum(X.shape[0] * X.shape[1] for X, _ in small)} positions: loss "
              f"{abs(Lt - L) / L:.1e}, gradient {np.max(np.abs(Gt - G)) / np.max(np.abs(G)):.1e} (relative)")
        evaluate = BlockLoss(shapes, groups, {}, args.device)
        label = f"block refit, loss + gradient, torch {args.device}"
    evaluate(theta)                                             # warm
    t = time.perf_counter()
    for _ in range(args.repeats):
        evaluate(theta)
    s = (time.perf_counter() - t) / args.repeats / args.fraction
    print(f"{'what':40s} {'params':>10s} {'positions':>10s} {'s each':>8s} {'hours for 4,500':>16s}")
    print(f"{label:40s} {theta.size:10,d} {int(positions / args.fraction):10,d} "
          f"{s:8.2f} {4500 * s / 3600:16.2f}")


if __name__ == "__main__":
    main()
