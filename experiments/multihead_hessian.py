"""Appendix C's conjecture, measured: multi-head extraction from probe Hessians + block diagonalisation.

Targets ``random_multihead(d, H, subspaces="orthogonal", rng=S)`` (Assumption C.1: head h in the h-th
block of a random orthonormal basis, W_h of full rank d_h = d/H, no biases), S = 1..seeds, answered in
float64 or float32 (the layer computes in that precision). The number of heads is *not* given to the
method: it reads it from the commutant. A run succeeds when it finds H heads with worst-head W and v
relative errors below the bar (1e-6 for float64 answers, 1e-3 for float32 answers).

    .venv/bin/python experiments/multihead_hessian.py [--seeds 20] [--dims 8 16 32] [--heads 2 4]
        [--precisions float64 float32] [--no-richardson] [--per-seed]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief.errors import HeadthiefError
from headthief.extraction.multihead.hessian import extract_multihead_hessian
from headthief.models.multihead import random_multihead
from headthief.oracles.base import ModelOracle

BAR = {"float64": 1e-6, "float32": 1e-3}


def run_one(d: int, H: int, seed: int, precision: str, richardson: bool) -> dict:
    model = random_multihead(d, H, subspaces="orthogonal", rng=seed, dtype=getattr(np, precision))
    oracle = ModelOracle(model)
    t0 = time.perf_counter()
    try:
        res = extract_multihead_hessian(oracle, richardson=richardson, rng=seed)
    except HeadthiefError as e:
        return {"ok": False, "why": f"{type(e).__name__}: {e}", "queries": oracle.queries, "W": np.inf,
                "v": np.inf, "K": None, "blocks": None, "seconds": time.perf_counter() - t0}
    e = res.errors(model)
    W, v = e["W_rel_err"], e["v_rel_err"]
    ok = res.heads == H and W <= BAR[precision] and v <= BAR[precision]
    why = "" if ok else (f"blocks {res.diagnostics['blocks']}" if res.heads != H else f"W err {W:.1e}")
    return {"ok": ok, "why": why, "queries": res.queries, "W": W, "v": v, "K": res.diagnostics["hessians"],
            "blocks": res.diagnostics["blocks"], "hq": res.diagnostics["hessian_queries"],
            "noise": res.diagnostics["hessian_noise"], "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--dims", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--heads", type=int, nargs="+", default=[2, 4])
    p.add_argument("--precisions", nargs="+", default=["float64", "float32"], choices=["float64", "float32"])
    p.add_argument("--no-richardson", action="store_true", help="one step size per Hessian entry")
    p.add_argument("--per-seed", action="store_true", help="also print one row per run")
    args = p.parse_args(argv)
    richardson = not args.no_richardson
    print(f"Hessian method, Richardson {'on' if richardson else 'off'}, seeds 1..{args.seeds}; bars: W and v "
          f"rel. err <= {BAR['float64']:g} (float64 answers), <= {BAR['float32']:g} (float32 answers)")
    print()
    print("| d | H | answers | success | Hessians K | queries (median) | W rel. err median | W max | "
          "v max | failures |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    all_ok = True
    for d in args.dims:
        for H in args.heads:
            for prec in args.precisions:
                rows = [run_one(d, H, s, prec, richardson) for s in range(1, args.seeds + 1)]
                if args.per_seed:
                    for s, r in enumerate(rows, 1):
                        print(f"|   seed {s} | K={r['K']} | {r['queries']} | W {r['W']:.2e} | v {r['v']:.2e} | "
                              f"{r['blocks']} | {r['seconds']:.2f}s | {r['why']}")
                n_ok = sum(r["ok"] for r in rows)
                all_ok &= n_ok == len(rows)
                Ks = sorted({r["K"] for r in rows if r["K"] is not None})
                Wf = np.array([r["W"] for r in rows])
                fails = "; ".join(f"S={s}: {r['why']}" for s, r in enumerate(rows, 1) if not r["ok"])[:200]
                print(f"| {d} | {H} | {prec} | {n_ok}/{len(rows)} | {','.join(map(str, Ks))} | "
                      f"{int(np.median([r['queries'] for r in rows]))} | {np.median(Wf):.1e} | {Wf.max():.1e} | "
                      f"{max(r['v'] for r in rows):.1e} | {fails or '-'} |", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
