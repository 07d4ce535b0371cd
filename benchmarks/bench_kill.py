"""Kill test: an extraction killed with SIGKILL at N random moments, resumed from its journal each time.

Prints the queries one uninterrupted run pays, the fresh queries paid over all attempts, the overhead
(their difference: answers lost in flight) and whether the final result is bit-identical.

    .venv/bin/python benchmarks/bench_kill.py [--d 256] [--kills 20] [--method exact] [--seed 0]
"""

from __future__ import annotations

import argparse
import tempfile

from headthief.testing import kill_resume


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--method", default="exact")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        r = kill_resume(tmp, d=a.d, method=a.method, kills=a.kills, rng=a.seed)
    width = max(len(k) for k in r)
    for k, v in r.items():
        print(f"{k:<{width}}  {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k:<{width}}  {v}")
    return 0 if r["bit_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
