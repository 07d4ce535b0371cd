"""Benchmark of exact extraction (Theorem 4.1): queries, seconds, errors, and the share of time spent
inside the oracle versus in headthief itself.

    .venv/bin/python benchmarks/bench_exact.py [--d 64 256 1024] [--dtype float64 float32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief import ModelOracle, extract_exact, random_head


def run(d: int, dtype: str, seed: int = 5) -> dict:
    head = random_head(d, rng=seed, dtype=np.float32 if dtype == "float32" else np.float64)
    oracle = ModelOracle(head)
    t0 = time.perf_counter()
    res = extract_exact(oracle)
    total = time.perf_counter() - t0
    errs = res.errors(head)
    fid = res.verify(ModelOracle(head), 256, rng=1)
    return {"d": d, "dtype": dtype, "queries": res.queries, "seconds": total, "oracle_s": oracle.seconds,
            "own_share": (total - oracle.seconds) / total, "W_rel_err": errs["W_rel_err"],
            "fidelity": fid.max_rel_err}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--dtype", nargs="+", default=["float64", "float32"])
    args = p.parse_args(argv)
    print("| d | dtype | queries | seconds | in oracle (s) | headthief's own share | W_rel_err | fidelity |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for d in args.d:
        for dt in args.dtype:
            r = run(d, dt)
            print(f"| {r['d']} | {r['dtype']} | {r['queries']:,} | {r['seconds']:.2f} | {r['oracle_s']:.2f} | "
                  f"{100 * r['own_share']:.1f}% | {r['W_rel_err']:.1e} | {r['fidelity']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
