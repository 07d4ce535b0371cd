"""The block's two float32 refits with and without the Gauss-Newton diagonal scaling (:mod:`headthief.extraction.
block.lbfgs`), from the same start on the same answers: iterations, seconds, the rms left and the fidelity on
fresh queries.

    .venv/bin/python benchmarks/bench_refit_scaling.py --d 16 --heads 4 --ffn 32 --seeds 1 4
    .venv/bin/python benchmarks/bench_refit_scaling.py --d 32 --heads 4 --ffn 128 --seeds 1 3

The start is the float32 block's own parameters (in the refit's gauge) with every number moved by
``--start-error`` relative Gaussian noise (1e-3: about what stages L, V, F and A leave at float32, their rms
1e-5 to 3e-4 at d = 16 and 32), as ``tests/test_block_float32.py`` builds it. The one-token refit fits
``random_queries(d, ffn)`` one-token answers, the block refit sequences of 2 - 16 tokens as ``--method block``
asks them (``refit_counts``) plus those one-token answers. Both stop by the library's own rule (chunks of 500
L-BFGS iterations until one gains less than 10% rms), so "iterations" is what ``--method block`` spends.

Measured (AMD EPYC, one core) in docs/block.md, "Refits in scaled coordinates".
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from headthief.extraction.block import block_refit, one_token_refit
from headthief.extraction.block.extract import parts_from_block
from headthief.extraction.block.ffn import predict_one_token
from headthief.extraction.block.layernorm import fit_output_layernorm
from headthief.models.bert_block import random_block


def _one(args, seed: int) -> list[str]:
    d, H, f = args.d, args.heads, args.ffn
    block32 = random_block(d, H, f, seed=seed, dtype=np.float32)
    truth = block_refit.gauged(block32.astype(np.float64))
    rng = np.random.default_rng(10_000 + seed)

    def noisy(a):
        return np.asarray(a) * (1 + args.start_error * rng.standard_normal(np.shape(a)))

    start = dataclasses.replace(truth, W1=noisy(truth.W1), W2=noisy(truth.W2), b1=noisy(truth.b1),
                                ln1_gamma=noisy(truth.ln1_gamma),
                                attention=dataclasses.replace(truth.attention, Q=noisy(truth.attention.Q),
                                                              K=noisy(truth.attention.K), V=noisy(truth.attention.V),
                                                              Wo=noisy(truth.attention.Wo)))
    scale = float(np.sqrt(d))
    k = one_token_refit.random_queries(d, f)
    X1 = rng.standard_normal((k, 1, d))
    X1 *= scale * rng.uniform(0.5, 1.5, (k, 1, 1)) / np.linalg.norm(X1, axis=2, keepdims=True)
    Y1 = np.asarray(block32.forward(X1), np.float64)
    groups = [(X1, Y1)]
    for T, n in zip(block_refit.REFIT_LENGTHS, block_refit.refit_counts(d, f)):
        X = rng.standard_normal((n, T, d))
        X *= scale / np.linalg.norm(X, axis=2, keepdims=True)
        groups.append((X, np.asarray(block32.forward(X), np.float64)))
    Xf = rng.standard_normal((256, 6, d))
    Xf *= scale / np.linalg.norm(Xf, axis=2, keepdims=True)
    Yf = np.asarray(block32.forward(Xf), np.float64)
    Xo = Xf[:, 0]
    Yo = np.asarray(block32.forward(Xo[:, None]), np.float64)[:, 0]

    # the one-token parts of the start (one_token_refit's parametrisation), LN2 read from the answers (stage L)
    ln = fit_output_layernorm(Y1[:, 0])
    _, vs, part, _ = parts_from_block(start)
    rows = []
    for scaled in (False, True):
        t0 = time.perf_counter()
        p2, l2, v2, info = one_token_refit.refit_one_token(part, ln, vs, X1[:, 0], Y1[:, 0], scaled=scaled,
                                                           rng=np.random.default_rng(seed))
        t1 = time.perf_counter()
        fid1 = float(np.max(np.abs(predict_one_token(p2, l2, v2, Xo) - Yo)) / np.sqrt(np.mean(Yo ** 2)))
        t2 = time.perf_counter()
        b2, binfo = block_refit.refit_block(start, groups, scaled=scaled, rng=np.random.default_rng(seed))
        t3 = time.perf_counter()
        fid2 = float(np.max(np.abs(b2.forward(Xf) - Yf)) / np.sqrt(np.mean(Yf ** 2)))
        rows.append(f"| {seed} | {'scaled' if scaled else 'plain'} | {info['refit_iterations']} | {t1 - t0:.1f} | "
                    f"{info['refit_rms_after']:.2e} | {fid1:.2e} | {binfo['block_refit_iterations']} | {t3 - t2:.1f} | "
                    f"{binfo['block_refit_rms_after']:.2e} | {fid2:.2e} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=32)
    ap.add_argument("--seeds", type=int, nargs=2, default=(1, 4), metavar=("FIRST", "STOP"))
    ap.add_argument("--start-error", type=float, default=1e-3)
    args = ap.parse_args()
    print(f"bert-block:d={args.d},heads={args.heads},ffn={args.ffn},dtype=float32, start error {args.start_error:g}")
    print("| seed | coordinates | F+ iterations | F+ s | F+ rms | one-token fidelity | R iterations | R s | R rms | "
          "fidelity (6 tokens) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed in range(*args.seeds):
        _one(args, seed)


if __name__ == "__main__":
    main()
