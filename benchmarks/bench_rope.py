"""``--method rope`` end to end (issue 20): the pipeline as ``headthief extract`` runs it.

    python benchmarks/bench_rope.py                              # rope-mha:d=64,heads=8,kv_heads=2, seeds 1..10
    python benchmarks/bench_rope.py --seeds 1000 1020            # 20 seeds never looked at
    python benchmarks/bench_rope.py --sweep                      # queries against d, H, G and --max-len
    python benchmarks/bench_rope.py --target llama-attn --d 256 --heads 8 --kv 2 --seeds 1 2 --dtype float32

Prints per seed the recovered parts' relative errors up to the symmetries (docs/decoder.md), theta's, the
fidelity on fresh sequences of 1 to 64 tokens (every extraction query had at most 16) and on 256 sequences of
exactly 64 tokens (fid@64), queries and seconds,
and how many seeds have every part and theta within 1e-8.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import headthief as ht

PARTS = ("Q_rel_err", "K_rel_err", "O_rel_err", "theta_rel_err")


def row(spec: str, **kw) -> tuple[object, float]:
    t = time.perf_counter()
    rep = ht.extract(spec, "rope", raise_errors=False, **kw)
    return rep, time.perf_counter() - t


def full_length_fidelity(rep, length: int = 64, n: int = 256, seed: int = 20_000) -> float | None:
    """The pipeline's fidelity draws 1 to 64 tokens per sequence; this one takes every sequence ``length`` tokens
    long (the acceptance line's "sequences of length 64"): the largest error of any answered number over the
    answers' rms, on a fresh oracle of the same target."""
    if rep.result is None or rep.target is None:
        return None
    X = np.random.default_rng(seed).standard_normal((n, length, rep.target.d))
    Y = np.asarray(rep.target.make_oracle().query(X), dtype=np.float64)
    return float(np.max(np.abs(rep.result.layer.forward(X) - Y)) / np.sqrt(np.mean(Y ** 2)))


def seeds_table(args) -> None:
    print("seed      Q_h      K_g      O_h    theta  fidelity  fid@64  G found  queries  longest     sec  exit")
    ok = 0
    seeds = range(*args.seeds)
    for seed in seeds:
        spec = f"{args.target}:d={args.d},heads={args.heads},kv_heads={args.kv},seed={seed}" + (
            f",dtype={args.dtype}" if args.dtype else "")
        rep, sec = row(spec, max_len=args.max_len)
        r = rep.row
        errs = [r.get(k) for k in PARTS]
        good = rep.exit_code == 0 and all(e is not None and e <= 1e-8 for e in errs)
        ok += good
        cells = " ".join(f"{e:8.1e}" if e is not None else "       -" for e in errs)
        fid = r.get("fidelity_max_rel_err")
        full = full_length_fidelity(rep)
        print(f"{seed:4d} {cells}  {'-' if fid is None else f'{fid:8.1e}':>8s} {'-' if full is None else f'{full:7.1e}':>7s} "
              f"{str(r.get('kv_heads_found', '-')):>8s} "
              f"{r.get('queries', r.get('queries_sent', 0)):8d} {str(r.get('longest_extraction_query', '-')):>8s} "
              f"{sec:7.1f}  {rep.exit_code}" + (f"  {rep.error}" if rep.error else ""), flush=True)
    print(f"every part and theta within 1e-8: {ok}/{len(seeds)}")


def sweep(args) -> None:
    print("d    H  G  max_len  queries (stage H, S)  worst part  fidelity   sec")
    for d, H, G, L in [(32, 4, 4, 16), (32, 4, 2, 16), (32, 4, 1, 16), (64, 8, 8, 16), (64, 8, 2, 16),
                       (64, 8, 2, 8), (64, 4, 2, 16), (128, 8, 2, 16), (128, 16, 4, 16)]:
        rep, sec = row(f"rope-mha:d={d},heads={H},kv_heads={G},seed=1", max_len=L)
        r = rep.row
        worst = max((r.get(k) or 0.0) for k in PARTS) if rep.exit_code == 0 else float("nan")
        print(f"{d:<4d} {H:<2d} {G:<2d} {L:7d}  {r.get('queries', 0):7d} ({r.get('queries_stage_H', 0)}, "
              f"{r.get('queries_stage_S', 0)})  {worst:10.1e}  {r.get('fidelity_max_rel_err') or float('nan'):8.1e} "
              f"{sec:5.1f}" + (f"  exit {rep.exit_code}: {rep.error}" if rep.exit_code else ""), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="rope-mha", choices=("rope-mha", "llama-attn"))
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv", type=int, default=2)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-len", type=int, default=16)
    ap.add_argument("--seeds", nargs=2, type=int, default=[1, 11], metavar=("FIRST", "STOP"))
    ap.add_argument("--sweep", action="store_true", help="queries against d, H, G and --max-len (seed 1)")
    args = ap.parse_args()
    sweep(args) if args.sweep else seeds_table(args)


if __name__ == "__main__":
    main()
