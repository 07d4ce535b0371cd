"""Benchmark of one-layer transformer extraction (Section 4.1 and beyond it).

Prints one row per case: the target, the method, d, m, heads, the attention part's queries (the paper's
reduction: exactly 2 (d^2 + d)), the FFN learner's queries, seconds, W's relative error (worst matched
head with several heads) and the fidelity (max abs error / RMS of the answers) on random sequences and on
sequences whose attended token lies next to every recovered FFN kink. For scale: Carlini et al. (2020)
report 2^18.5 (about 370,000) queries to 2^-40 error for a 4k-parameter ReLU network with biases.

    .venv/bin/python benchmarks/bench_transformer.py            # the acceptance grid
    .venv/bin/python benchmarks/bench_transformer.py --quick    # the two d = 16 acceptance rows only
"""

from __future__ import annotations

import argparse
import math
import time

from headthief.errors import HeadthiefError
from headthief.extraction.transformer.paper import extract_transformer_heads, extract_transformer_paper
from headthief.extraction.transformer.recovered import verify_transformer
from headthief.extraction.transformer.through_ffn import extract_transformer
from headthief.targets import resolve

CASES = [  # (target spec, method, heads)
    ("transformer:d=16,m=32,seed=1", "transformer-paper", 1),
    ("transformer:d=16,m=32,seed=1,bias=1", "transformer", 1),
    ("transformer:d=16,m=32,seed=1", "transformer", 1),
    ("transformer:d=16,m=32,heads=2,seed=1", "transformer-paper", 2),
    ("transformer:d=8,m=32,seed=2", "transformer-paper", 1),
    ("transformer:d=32,m=16,seed=1", "transformer-paper", 1),
    ("transformer:d=32,m=64,seed=1", "transformer-paper", 1),
    ("transformer:d=32,m=64,seed=1,bias=1", "transformer", 1),
    ("torch-transformer:d=16,m=32,seed=1", "transformer", 1),
]


def run_case(spec: str, method: str, heads: int, *, n_verify: int = 10_000) -> dict:
    target = resolve(spec)
    oracle = target.make_oracle()
    t0 = time.perf_counter()
    if heads > 1:
        res = extract_transformer_heads(oracle, heads=heads, rng=0)
    elif method == "transformer-paper":
        res = extract_transformer_paper(oracle, rng=0)
    else:
        res = extract_transformer(oracle, bias=target.bias, rng=0)
    secs = time.perf_counter() - t0
    f = verify_transformer(res, target.make_oracle(), n=n_verify, rng=1)
    return {"target": spec, "method": method, "d": target.d, "m": target.info["m"], "heads": heads,
            "att_q": res.attention_queries, "ffn_q": res.ffn_queries, "seconds": secs,
            "W": res.errors(target.truth)["W_rel_err"], "fid": f.random.max_rel_err,
            "kinks": f.kinks.max_rel_err if f.kinks else float("nan")}


def _log2(q: int) -> str:
    return f"2^{math.log2(q):.1f}" if q > 0 else "-"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the two d = 16 acceptance rows")
    ap.add_argument("--verify", type=int, default=10_000, help="random sequences for the fidelity (default 10,000)")
    args = ap.parse_args(argv)
    cases = CASES[:2] if args.quick else CASES
    head = (f"{'target':<40} {'method':<18} {'H':>2} {'att q':>6} {'ffn q':>7} {'(log2)':>7} {'sec':>6} "
            f"{'W err':>9} {'fid rand':>9} {'fid kinks':>9}")
    print(head)
    print("-" * len(head))
    for spec, method, heads in cases:
        try:
            r = run_case(spec, method, heads, n_verify=args.verify)
        except HeadthiefError as e:
            print(f"{spec:<40} {method:<18} {heads:>2} failed: {type(e).__name__}: {e}")
            continue
        print(f"{r['target']:<40} {r['method']:<18} {r['heads']:>2} {r['att_q']:>6} {r['ffn_q']:>7} "
              f"{_log2(r['att_q'] + r['ffn_q']):>7} {r['seconds']:>6.2f} {r['W']:>9.2e} {r['fid']:>9.2e} "
              f"{r['kinks']:>9.2e}")
    print("(heads > 1: fidelity of the antisymmetric part VQ(X) - VQ(-X); the per-head FFN maps are not recovered)")
    print("Carlini et al. 2020: 2^18.5 queries to 2^-40 error for a 4k-parameter ReLU network with biases")


if __name__ == "__main__":
    main()
