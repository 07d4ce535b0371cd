"""BLAS threads while extracting: one thread (headthief's default) against BLAS's own setting, on an idle
machine and with a competing job (a numpy process multiplying matrices on every core).

    .venv/bin/python benchmarks/bench_blas.py [--d 384] [--method exact] [--repeat 3]

Prints one row per (load, threads): median wall seconds of the whole ``headthief extract`` command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXE = str(Path(sys.executable).with_name("headthief"))
HOG = ("import numpy as np, time\n"
       "a = np.random.default_rng(0).standard_normal((1500, 1500))\n"
       "t = time.time()\n"
       "while time.time() - t < 600: a = a @ a; a /= np.abs(a).max()\n")


def timed(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, timeout=1800)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=384)
    p.add_argument("--method", default="exact")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    cmd = [EXE, "extract", "--target", f"random:d={a.d},seed=1", "--method", a.method, "--verify", "0", "--quiet",
           "--json"]
    rows = []
    for load in ("idle", "busy"):
        hog = None
        if load == "busy":
            hog = subprocess.Popen([sys.executable, "-c", HOG], env={**os.environ})
            time.sleep(2)
        try:
            for threads in ("1", "0"):
                secs = [timed(cmd + ["--blas-threads", threads]) for _ in range(a.repeat)]
                rows.append((load, "1" if threads == "1" else "BLAS default", statistics.median(secs)))
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    print(f"random:d={a.d} --method {a.method}, {os.cpu_count()} cores, median of {a.repeat}")
    print(f"{'machine':<8} {'BLAS threads':<13} {'seconds':>8}")
    for load, th, s in rows:
        print(f"{load:<8} {th:<13} {s:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
