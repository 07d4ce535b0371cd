"""Benchmark of the ReLU FFN learner (``--method ffn``): queries, seconds and errors against d and m, with
and without biases, beside Carlini et al. 2020's figure (2^18.5 queries to 2^-40 error for a ReLU network
of about 4k parameters).

    .venv/bin/python benchmarks/bench_ffn.py [--quick] [--seeds 1 2 3] [--float32]

``--float32``: the targets compute in float32 (``ffn:...,dtype=float32``); the errors are measured against
the same weights computed in float64, cases (16, 32) and (32, 64).

Columns: ``params`` the network's parameter count; ``queries`` the learner's (model check not included);
``neuron_err`` the worst ``|| w^ a^ - w a || / || w a ||`` over neurons (up to permutation, rescaling and
flips); ``fid_rand`` / ``fid_kink`` the worst |error| / RMS on 10,000 Gaussian points / on 4 points next to
every recovered kink; ``needed`` the ReLU units of the recovered network (m, or m + 2 when the flips are
not resolved); ``log2_err`` is log2 of the worst of the three errors, Carlini et al.'s unit.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from headthief.extraction.transformer.ffn import extract_ffn
from headthief.models.ffn import compare_ffn, random_ffn
from headthief.oracles.base import ModelOracle

CASES = [(16, 8), (32, 16), (32, 64), (32, 128), (64, 64), (64, 128)]
QUICK = [(16, 8), (32, 16), (32, 64)]
FLOAT32 = [(16, 32), (32, 64)]


def run(d: int, m: int, *, bias: bool, sparse: float = 0.0, seed: int = 1, float32: bool = False) -> dict:
    oracle = ModelOracle(random_ffn(d, m, seed, bias=bias, sparse=sparse,
                                    dtype=np.float32 if float32 else np.float64))
    truth = random_ffn(d, m, seed, bias=bias, sparse=sparse)
    t0 = time.perf_counter()
    res = extract_ffn(oracle, bias=bias, rng=0)
    seconds = time.perf_counter() - t0
    cmp = compare_ffn(res.model, truth, n=10_000, rng=seed + 100)
    Z = np.random.default_rng(seed + 200).standard_normal((10_000, d))
    yt = truth(Z)
    rms = float(np.sqrt(np.mean(yt ** 2)))
    near = res.near_kink_points(rng=seed, per_side=2)
    fid_rand = float(np.max(np.abs(res.predict(Z) - yt)) / rms)
    fid_kink = float(np.max(np.abs(res.predict(near) - truth(near))) / rms)
    params = d * m + m + (m + 1 if bias else 0)
    worst = max(cmp["neuron_rel_err"] or 0.0, fid_rand, fid_kink)
    return {"d": d, "m": m, "bias": bias, "sparse": sparse, "params": params, "queries": res.queries,
            "seconds": seconds, "neurons": res.diagnostics["neurons"], "needed": res.neurons,
            "flips": res.diagnostics["flip_method"], "neuron_err": cmp["neuron_rel_err"], "fid_rand": fid_rand,
            "fid_kink": fid_kink, "log2_err": math.log2(worst) if worst > 0 else float("-inf")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the three small cases only")
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--float32", action="store_true", help="float32 targets: (16, 32) and (32, 64)")
    a = p.parse_args(argv)
    cases = FLOAT32 if a.float32 else QUICK if a.quick else CASES
    head = (f"{'d':>4} {'m':>4} {'bias':>5} {'sparse':>6} {'params':>7} {'queries':>8} {'log2 q':>6} {'sec':>6} "
            f"{'found':>5} {'needed':>6} {'flips':>15} {'neuron_err':>10} {'fid_rand':>9} {'fid_kink':>9} {'log2 err':>8}")
    print(head)
    print("-" * len(head))
    for seed in a.seeds:
        for bias in (False, True):
            for d, m in cases:
                for sparse in ((0.0, 0.25) if (d, m) == (32, 64) and not a.float32 else (0.0,)):
                    r = run(d, m, bias=bias, sparse=sparse, seed=seed, float32=a.float32)
                    print(f"{r['d']:>4} {r['m']:>4} {str(r['bias']):>5} {r['sparse']:>6.2f} {r['params']:>7} "
                          f"{r['queries']:>8,} {math.log2(r['queries']):>6.1f} {r['seconds']:>6.2f} {r['neurons']:>5} "
                          f"{r['needed']:>6} {r['flips']:>15} {r['neuron_err']:>10.1e} {r['fid_rand']:>9.1e} "
                          f"{r['fid_kink']:>9.1e} {r['log2_err']:>8.1f}")
    print("\nCarlini et al. 2020 (ReLU network with biases, ~4k parameters): 2^18.5 = 370,727 queries, "
          "error 2^-40 (their Table 1)")


if __name__ == "__main__":
    main()
