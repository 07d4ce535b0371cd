"""The block refit R with glibc's heap as a fresh process has it, and with :func:`headthief.heap.keep_freed_memory`'s
thresholds: the same start, the same answers, a fixed number of L-BFGS iterations, each setting in its own process.

    .venv/bin/python benchmarks/bench_heap.py --d 16 --heads 4 --ffn 32 --iterations 300 --repeats 2
    .venv/bin/python benchmarks/bench_heap.py --d 32 --heads 4 --ffn 128 --iterations 100

The problem is ``bert-block:d=D,heads=H,ffn=M,dtype=float32`` (seed 1): its parameters moved by 1e-3 relative
noise as the start, answers of ``refit_counts`` sequences of 2 - 16 tokens as ``--method block`` asks them. Printed:
seconds and milliseconds a loss evaluation, and the child's peak memory. Measured in docs/block.md ("glibc's heap
thresholds").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import dataclasses, json, resource, sys, time
import numpy as np
from headthief.heap import keep_freed_memory
from headthief.extraction.block import block_refit
from headthief.models.bert_block import random_block
d, H, f, iters = (int(x) for x in sys.argv[1:5])
tuned = keep_freed_memory()
block32 = random_block(d, H, f, seed=1, dtype=np.float32)
truth = block_refit.gauged(block32.astype(np.float64))
rng = np.random.default_rng(7)
noisy = lambda a: np.asarray(a) * (1 + 1e-3 * rng.standard_normal(np.shape(a)))
start = dataclasses.replace(truth, W1=noisy(truth.W1), W2=noisy(truth.W2), attention=dataclasses.replace(
    truth.attention, Q=noisy(truth.attention.Q), K=noisy(truth.attention.K), V=noisy(truth.attention.V)))
groups = []
for T, n in zip(block_refit.REFIT_LENGTHS, block_refit.refit_counts(d, f)):
    X = rng.standard_normal((n, T, d))
    X *= np.sqrt(d) / np.linalg.norm(X, axis=2, keepdims=True)
    groups.append((X, np.asarray(block32.forward(X), np.float64)))
t0 = time.perf_counter()
_, info = block_refit.refit_block(start, groups, max_iter=iters, rng=np.random.default_rng(0),
                                  progress=lambda k, rms: None)
sec = time.perf_counter() - t0
print(json.dumps({"tuned": tuned, "seconds": sec, "iterations": info["block_refit_iterations"],
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"bert-block:d={args.d},heads={args.heads},ffn={args.ffn},dtype=float32: block refit R, "
          f"{args.iterations} L-BFGS iterations at most, one BLAS thread")
    print("| heap | seconds | iterations | ms an iteration | peak MB |")
    print("|---|---|---|---|---|")
    for _ in range(args.repeats):
        for setting in ("system", "keep_freed_memory"):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
            env["HEADTHIEF_MALLOC"] = "system" if setting == "system" else ""
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.d), str(args.heads), str(args.ffn),
                                  str(args.iterations)], env=env, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            name = "glibc as started" if not r["tuned"] else "thresholds 32 / 64 MiB"
            per = 1e3 * r["seconds"] / max(r["iterations"], 1)
            print(f"| {name} | {r['seconds']:.1f} | {r['iterations']} | {per:.1f} | {r['peak_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
