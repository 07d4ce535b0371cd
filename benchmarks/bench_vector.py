"""Benchmark of vector-answer extraction (extract_vector) against the width d and the head count H.

Random float64 layers (``random_layer(d, H, seed=k, output="all")``, head_dim = d / H, no biases) answer
at every position; ``extract_vector(oracle, heads=None, rng=k)`` finds the head count itself. One row per
case and seed: d, H, head_dim, queries (and per stage: A affine, B head spaces, C scores), heads found,
seconds of the extraction (``res.seconds``; ``wall`` adds the model check on 256 fresh sequences), the worst
matched head's relative errors of W_h, c_h, O_h (``res.errors(truth)``) and the fidelity (the check's
figure: largest error of any answered number on fresh sequences over the answers' rms). A case that
raises prints its error in place of the row.

Grid: d in {32, 64, 128} at H = 4, H in {4, 8, 16} at d = 128, and d = 256 at H = 16. ``--big`` adds
(128, 2), (256, 4), (512, 16), (1024, 16) (minutes to hours: stage C's core fit has head_dim^2 unknowns per head);
``--quick`` keeps d <= 64.

Reference lines in the plot: ``d + 1`` (stage A's one-token queries alone) and the information limit
``dof / (numbers per query)``: dof = H (2 d r - r^2 + d + 2 d r - r^2) + d unknowns (W_h and O_h of rank
r = head_dim, c_h, b), and numbers per query = N d for the method's own mean sequence length N (the
answers it received over its queries), i.e. the fewest queries that could carry as many numbers as there
are unknowns.

    .venv/bin/python benchmarks/bench_vector.py --quick           # d <= 64 (~10 s)
    .venv/bin/python benchmarks/bench_vector.py --plot docs/img/vector_scaling.png --json rows.json

measured on this machine (2 cores; 1 seed; R = the aimed maps of refine.py; 2026-12-04, after stage C's reads were
batched and with headthief.linalg's SVD fallback: the d = 64 row had failed with "SVD did not converge" in stage B
on numpy 2.4.6 / OpenBLAS 0.3.31; one thread, beside another run; (128, 2), (512, 16) and (1024, 16) not run):

        d   H   dh seed queries     A      B     C     R heads     sec    wall    W err    c err    O err fidelity info lim
       32   4    8    0     811    42    336   265   168     4     0.6     0.7 1.3e-14 1.5e-15 2.7e-15 8.7e-14     39.9
       64   4   16    0    1171    74    528   209   360     4     3.3     3.3 2.5e-14 2.0e-15 2.9e-15 1.4e-13     71.9
      128   4   32    0    2178   138   1064   232   744     4    50.8    50.8 3.0e-14 2.8e-15 3.4e-15 1.6e-13    132.1
      128   8   16    0    2971   138   1216   417  1200     8    12.5    12.6 3.8e-14 3.6e-15 4.0e-15 1.8e-13    166.5
      128  16    8    0    4403   138   1216  1033  2016    16    12.9    13.0 1.1e-13 9.9e-15 1.6e-14 4.4e-13    191.9
      256  16   16    0    7371   266   1960   825  4320    16    73.2    73.5 5.6e-14 5.2e-15 6.7e-15 2.4e-13    367.2

(before the batching, earlier session: 0.9 / 6.8 / 70.5 / 39.9 / 41.4 / 123.1 s for the same rows, the same queries.)
"""

from __future__ import annotations

import argparse
import json
import time

from headthief.extraction.vector import extract_vector
from headthief.models.mha import random_layer
from headthief.oracles.base import ModelOracle

CASES = [(d, 4) for d in (32, 64, 128)] + [(128, H) for H in (8, 16)] + [(256, 16)]  # (d, H)
CASES_BIG = [(128, 2), (256, 4), (512, 16), (1024, 16)]     # head_dim >= 64 or d >= 512: minutes each (see the docstring)


def dof(d: int, H: int) -> int:
    r = d // H
    return H * (2 * d * r - r * r + d + 2 * d * r - r * r) + d


def run_case(d: int, H: int, seed: int) -> dict:
    row = {"d": d, "H": H, "head_dim": d // H, "seed": seed}
    t0 = time.perf_counter()
    try:
        layer = random_layer(d, H, seed=seed, output="all")
        res = extract_vector(ModelOracle(layer), heads=None, rng=seed, check=True)
        e = res.errors(layer.canonical())
    except Exception as exc:  # noqa: BLE001 - a benchmark row, not a crash
        row.update(error=f"{type(exc).__name__}: {exc}", wall=time.perf_counter() - t0)
        return row
    dg = res.diagnostics
    row.update(queries=res.queries, A=dg["stage_A_queries"], B=dg["stage_B_queries"], C=dg["stage_C_queries"],
               R=dg.get("stage_R_queries", 0),
               heads=res.heads, sec=res.seconds, wall=time.perf_counter() - t0, W=e["W_rel_err"],
               c=e["c_rel_err"], O=e["O_rel_err"], fid=res.check.figure, verdict=res.check.verdict,
               numbers=dg["numbers_received"], dof=dof(d, H))
    row["info_limit"] = row["dof"] / (row["numbers"] / row["queries"])
    return row


HEAD = (f"{'d':>5} {'H':>3} {'dh':>4} {'seed':>4} {'queries':>7} {'A':>5} {'B':>6} {'C':>5} {'R':>5} {'heads':>5} "
        f"{'sec':>7} {'wall':>7} {'W err':>8} {'c err':>8} {'O err':>8} {'fidelity':>8} {'info lim':>8}")


def fmt_row(r: dict) -> str:
    lead = f"{r['d']:>5} {r['H']:>3} {r['head_dim']:>4} {r['seed']:>4}"
    if "error" in r:
        return f"{lead}  FAILED after {r['wall']:.1f} s: {r['error']}"
    e = lambda x: "-" if x is None else f"{x:.1e}"   # noqa: E731
    return (f"{lead} {r['queries']:>7} {r['A']:>5} {r['B']:>6} {r['C']:>5} {r['R']:>5} {r['heads']:>5} {r['sec']:>7.1f} "
            f"{r['wall']:>7.1f} {e(r['W'])} {e(r['c'])} {e(r['O'])} {e(r['fid'])} {r['info_limit']:>8.1f}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in rows if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, xs_of, title in ((axes[0], "d", lambda r: r["H"] == 4, "H = 4 (head_dim = d/4)"),
                                  (axes[1], "H", lambda r: r["d"] == 128, "d = 128 (head_dim = 128/H)")):
        sel = [r for r in ok if xs_of(r)]
        xs = sorted({r[key] for r in sel})
        if not xs:
            continue
        mean = lambda f: [np.mean([f(r) for r in sel if r[key] == x]) for x in xs]   # noqa: E731 - over seeds
        ax.loglog(xs, mean(lambda r: r["queries"]), "o-", label="queries")
        ax.loglog(xs, mean(lambda r: r["sec"]), "s-", label="seconds")
        ax.loglog(xs, mean(lambda r: r["d"] + 1), "k--", lw=1, label="d + 1")
        ax.loglog(xs, mean(lambda r: r["info_limit"]), "k:", lw=1, label="information limit")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(key)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("extract_vector, random float64 layers, output=all, heads auto")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="d <= 64 only")
    ap.add_argument("--big", action="store_true", help="also d = 1024 (slow, see the docstring)")
    ap.add_argument("--case", action="append", metavar="D:H", help="run only these cases (repeatable)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per case (layer seed and rng = 0..K-1)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--plot", metavar="PATH.png", help="draw queries and seconds vs d and vs H")
    args = ap.parse_args(argv)

    cases = CASES + (CASES_BIG if args.big else [])
    if args.quick:
        cases = [(d, H) for d, H in cases if d <= 64]
    if args.case:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.case]
    print(HEAD, flush=True)
    rows = []
    for d, H in cases:
        for seed in range(args.seeds):
            rows.append(run_case(d, H, seed))
            print(fmt_row(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
