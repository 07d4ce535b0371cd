"""Sign-only extraction: error against queries, the paper's estimator (Theorem B.1) and ours.

The paper's (``--method membership-paper``): k random sphere queries for v (eq. (14)) plus d^2 bisections
of n steps for W at eps_W = 0.1; k sweeps 10^2 .. 10^7. Ours (``--method membership``): the bisection
tolerance ``tol`` sweeps 1e-1 .. 1e-12. Both on targets that satisfy the theorem's assumptions,
``random:d=D,seed=S,W_norm=W,v_norm=1,v_min=MU`` (d = 8: W = 2, MU = 0.2; d = 16: W = 4, MU = 0.1). The
paper's probes need an input-norm bound R of about sqrt(2/(W MU)) (2.24 for both); ours runs under R = 1.

Prints the table (mean over seeds) and writes ``docs/img/membership_error_vs_queries.png`` (matplotlib).

Run: ``.venv/bin/python experiments/membership_error_vs_queries.py [--seeds 5] [--kmax 10000000]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from headthief import ModelOracle, random_head
from headthief.extraction.robust.membership import extract_membership
from headthief.extraction.robust.membership_paper import extract_membership_paper, paper_probe_norm
from headthief.extraction.result import direction_err
from headthief.oracles import SignOnly

CASES = {8: (2.0, 0.2), 16: (4.0, 0.1)}
OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "membership_error_vs_queries.png"


def run(seeds: int, kmax: int) -> list[dict]:
    rows = []
    for d, (W, mu) in CASES.items():
        heads = [random_head(d, rng=s, W_norm=W, v_norm=1.0, v_min=mu) for s in range(seeds)]
        R = paper_probe_norm(W, mu)
        for k in [k for k in (100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000) if k <= kmax]:
            res = [extract_membership_paper(SignOnly(ModelOracle(h, input_norm=R)), W_bound=W, mu=mu,
                                            eps_W=0.1, k=k, rng=s) for s, h in enumerate(heads)]
            rows.append(_row("paper", d, f"k={k:.0e}", res, heads))
        for tol in (1e-1, 1e-2, 1e-3, 1e-4, 1e-6, 1e-8, 1e-10, 1e-12):
            res = [extract_membership(SignOnly(ModelOracle(h, input_norm=1.0)), tol=tol) for h in heads]
            rows.append(_row("ours", d, f"tol={tol:.0e}", res, heads))
    return rows


def _row(method, d, setting, res, heads):
    return {
        "method": method, "d": d, "setting": setting,
        "queries": float(np.mean([r.queries for r in res])),
        "v_dir_err": float(np.mean([direction_err(r.v, h.v) for r, h in zip(res, heads)])),
        "W_rel_err": float(np.mean([np.linalg.norm(r.W - h.W) / np.linalg.norm(h.W) for r, h in zip(res, heads)])),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {("paper", 8): ("tab:red", "o--"), ("paper", 16): ("tab:red", "s-"),
              ("ours", 8): ("tab:blue", "o--"), ("ours", 16): ("tab:blue", "s-")}
    names = {"paper": "Theorem B.1 (sphere + bisection)", "ours": "ours (bisection)"}
    for ax, key, title in zip(axes, ("v_dir_err", "W_rel_err"),
                              ("direction error of v", "relative error of W")):
        for (method, d), (color, fmt) in styles.items():
            rs = [r for r in rows if r["method"] == method and r["d"] == d]
            ax.loglog([r["queries"] for r in rs], [r[key] for r in rs], fmt, color=color,
                      label=f"{names[method]}, d = {d}")
        ax.set_xlabel("queries (sign-only answers)")
        ax.set_ylabel(title)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_title("v's direction (paper: ~ 1/sqrt(k))")
    axes[1].set_title("W (the paper's bisection at eps_W = 0.1)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--kmax", type=int, default=10_000_000)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    rows = run(args.seeds, args.kmax)
    print(f"Mean over {args.seeds} seeds. Paper: R = 2.24 (its probes need it), eps_W = 0.1; ours: R = 1.\n")
    print("| method | d | setting | queries | v direction error | W relative error |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['d']} | {r['setting']} | {r['queries']:,.0f} | {r['v_dir_err']:.2e} | "
              f"{r['W_rel_err']:.2e} |")
    if not args.no_plot:
        try:
            plot(rows, OUT)
            print(f"\nplot: {OUT.relative_to(OUT.parents[2])}")
        except ImportError:
            print("\n(matplotlib is not installed: no plot; pip install 'headthief[plot]')")


if __name__ == "__main__":
    main()
