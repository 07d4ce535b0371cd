"""Benchmark of low-rank extraction: queries, seconds, peak memory and errors of exact, lowrank,
rop-convex and rop-als over d in {20, 40, 100, 400, 1024, 4096} and r in {2, 8, 32, 128}.

Each case runs in its own process (so its peak resident memory can be read) on a seeded random
factored head ``random_head(d, rank=r, rng=1)``. A method runs only where it can finish
(``--full`` lifts the time limits of the default run, not the hard ones):

* exact: d^2 + d queries; d <= 1024 (d = 4096 is 16.8 million queries).
* lowrank: every case.
* rop-convex (m = 3 r(2d - r)) and rop-als (m = 1.5 r(2d - r)): only where m < d^2 (otherwise
  exact recovery is cheaper). rop-convex: d <= 40 (d <= 60 with --full: the semidefinite program at
  d = 60 takes a minute and ~3.4 GB; the solver refuses d > 60). rop-als: where the estimated solve
  cost is moderate (at 1.5 x the degrees of freedom ALS takes ~200 sweeps of O(m d r) work each) and
  the probe pairs fit in 2 GB.

    .venv/bin/python benchmarks/bench_lowrank.py                 # the default grid (~8 minutes)
    .venv/bin/python benchmarks/bench_lowrank.py --d 20 40 100 --r 2 8
    .venv/bin/python benchmarks/bench_lowrank.py --methods lowrank --d 4096 --r 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

METHODS = ("exact", "lowrank", "rop-convex", "rop-als")
DS = (20, 40, 100, 400, 1024, 4096)
RS = (2, 8, 32, 128)


def runnable(method: str, d: int, r: int, full: bool) -> str | None:
    """None when the case runs; otherwise why it is skipped."""
    if r >= d:
        return "r >= d"
    if method == "exact":
        if d > 1024:
            return "d^2 queries"
        return None
    if method == "lowrank":
        return None
    C = 3.0 if method == "rop-convex" else 1.5
    m = C * r * (2 * d - r)
    if m >= d * d:
        return "m >= d^2"            # more measurements than exact recovery's d^2
    if method == "rop-convex":
        limit = 60 if full else 40
        return None if d <= limit else f"d > {limit}"
    flops = 3000 * 4 * m * d * r            # ~200 sweeps x ~15 CG products of 4 m d r flops
    mem = 2 * m * d * 8
    if mem > 2 * 2**30:
        return "probe memory"
    return None if flops <= (2e13 if full else 5e11) else "ALS time"


def one(method: str, d: int, r: int) -> dict:
    """Run one case in this process; return its figures."""
    import numpy as np

    from headthief import ModelOracle, extract_exact, extract_lowrank, extract_rop, random_head

    head = random_head(d, rng=1, rank=r)
    oracle = ModelOracle(head)
    t0 = time.perf_counter()
    if method == "exact":
        res = extract_exact(oracle)
    elif method == "lowrank":
        res = extract_lowrank(oracle, rng=0)
    elif method == "rop-convex":
        res = extract_rop(oracle, rank=r, solver="convex", oversampling=3.0, rng=0)
    else:
        res = extract_rop(oracle, rank=r, solver="als", oversampling=1.5, rng=0)
    seconds = time.perf_counter() - t0
    errs = res.errors(head)
    fid = res.verify(ModelOracle(head), 64, rng=1)
    return {"queries": res.queries, "info_limit": d + r * (2 * d - r), "rank": res.rank,
            "seconds": seconds, "oracle_seconds": float(getattr(oracle, "seconds", float("nan"))),
            "W_rel_err": errs["W_rel_err"], "fidelity": fid.max_rel_err}


def run_case(method: str, d: int, r: int, timeout: float) -> dict:
    """Run one case in a child process; add its peak resident memory."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", method, str(d), str(r)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"status": f"timeout ({timeout:.0f} s)"}
    finally:
        wall = time.perf_counter() - t0
    # the child's own peak RSS (ru_maxrss of the largest child so far would mix cases up)
    row: dict = {"status": "ok" if proc.returncode == 0 else f"failed ({proc.returncode})", "wall": wall}
    if proc.returncode == 0:
        row.update(json.loads(out.strip().splitlines()[-1]))
    else:
        row["error"] = (err.strip().splitlines() or ["?"])[-1][:120]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--d", type=int, nargs="+", default=list(DS))
    p.add_argument("--r", type=int, nargs="+", default=list(RS))
    p.add_argument("--full", action="store_true", help="also the slow cases (rop-convex d = 60, larger ALS)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case (default 600)")
    p.add_argument("--one", nargs=3, metavar=("METHOD", "D", "R"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        import resource
        method, d, r = args.one[0], int(args.one[1]), int(args.one[2])
        row = one(method, d, r)
        row["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(row))
        return
    print(f"# {os.cpu_count()} CPU(s); command: {' '.join(['benchmarks/bench_lowrank.py'] + (argv or sys.argv[1:]))}")
    print("| method | d | r | queries | d + r(2d-r) | rank | seconds | in oracle (s) | peak MB | W_rel_err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d in args.d:
        for r in args.r:
            for method in args.methods:
                why = runnable(method, d, r, args.full)
                if why == "r >= d":
                    continue
                if why is not None:
                    print(f"| {method} | {d} | {r} | skipped: {why} | | | | | | |", flush=True)
                    continue
                row = run_case(method, d, r, args.timeout)
                if row["status"] != "ok":
                    print(f"| {method} | {d} | {r} | {row['status']}: {row.get('error', '')} | | | | | | |",
                          flush=True)
                    continue
                print(f"| {method} | {d} | {r} | {row['queries']:,} | {row['info_limit']:,} | {row['rank']} | "
                      f"{row['seconds']:.2f} | {row['oracle_seconds']:.2f} | {row['peak_mb']:.0f} | "
                      f"{row['W_rel_err']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
