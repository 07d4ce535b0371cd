"""Phase transition of low-rank recovery: success rate against m / (r(2d - r)).

For each ratio m / (r(2d - r)) and each method, ``--trials`` seeded random rank-r heads are extracted
with m rank-one measurements (queries beyond the d of the value phase), and a trial succeeds when
``W_rel_err <= 1e-6``:

* lowrank (adaptive, rank given): run under a query budget of d + m; it needs exactly
  m = r(2d - r), so it succeeds from ratio 1 on and stops with BudgetExceeded below.
* rop-convex: m Gaussian rank-one measurements, nuclear-norm minimisation (cvxpy), d = 20 only.
* rop-als: the same measurements, alternating least squares (at most ``--max-iter`` sweeps).

Exact recovery (Theorem 4.1) needs m = d^2, a ratio of d / (2r - r^2/d) (5.3 at d = 20, r = 2),
drawn as a dashed line. The plot goes to docs/img/phase_transition.png.

    .venv/bin/python experiments/phase_transition.py            # ~2 minutes
    .venv/bin/python experiments/phase_transition.py --trials 4 --ratios 0.5 1 1.5 2 3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from headthief import (BudgetExceeded, ConvergenceError, ModelOracle, extract_lowrank, extract_rop,
                       random_head)

RATIOS = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 4.0)
OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "phase_transition.png"


def trial(method: str, d: int, r: int, ratio: float, seed: int, max_iter: int) -> bool:
    head = random_head(d, rng=1000 + seed, rank=r)
    dof = r * (2 * d - r)
    m = max(1, int(round(ratio * dof)))
    try:
        if method == "lowrank":
            res = extract_lowrank(ModelOracle(head, budget=d + m), rank=r, rng=seed)
        elif method == "rop-convex":
            res = extract_rop(ModelOracle(head), rank=r, solver="convex", measurements=m, rng=seed)
        else:
            res = extract_rop(ModelOracle(head), rank=r, solver="als", measurements=m, rng=seed,
                              max_iter=max_iter)
    except (BudgetExceeded, ConvergenceError):
        return False
    return bool(res.errors(head)["W_rel_err"] <= 1e-6)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--max-iter", type=int, default=400, help="ALS sweep cap per trial")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    panels = [(20, 2, ("lowrank", "rop-convex", "rop-als")), (100, 4, ("lowrank", "rop-als"))]
    results: dict = {}
    for d, r, methods in panels:
        print(f"\nd = {d}, r = {r}: success rate over {args.trials} trials (W_rel_err <= 1e-6)")
        print("| method | " + " | ".join(f"{x:g}" for x in args.ratios) + " | seconds |")
        print("|---|" + "---:|" * (len(args.ratios) + 1))
        for method in methods:
            t0 = time.perf_counter()
            rates = [np.mean([trial(method, d, r, x, s, args.max_iter) for s in range(args.trials)])
                     for x in args.ratios]
            results[(d, r, method)] = rates
            print(f"| {method} | " + " | ".join(f"{v:.2f}" for v in rates)
                  + f" | {time.perf_counter() - t0:.0f} |", flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'headthief[plot]'): no plot")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), sharey=True)
    styles = {"lowrank": ("C0", "o"), "rop-convex": ("C1", "s"), "rop-als": ("C2", "^")}
    for ax, (d, r, methods) in zip(axes, panels):
        for method in methods:
            color, marker = styles[method]
            ax.plot(args.ratios, results[(d, r, method)], marker=marker, color=color, label=method)
        exact = d * d / (r * (2 * d - r))
        xmax = max(args.ratios) * 1.15
        if exact <= xmax:
            ax.axvline(exact, color="0.5", ls="--", lw=1)
            ax.text(exact, 0.5, " exact\n (m = d²)", color="0.4", fontsize=8, va="center")
        else:
            ax.text(0.98, 0.5, f"exact (m = d²)\nneeds ratio {exact:.1f}", transform=ax.transAxes,
                    color="0.4", fontsize=8, ha="right", va="center")
        ax.axvline(1.0, color="0.8", lw=1)
        ax.set_xlabel("m / (r(2d − r))")
        ax.set_title(f"d = {d}, r = {r}")
        ax.set_xscale("log")
        hi = max(xmax, exact * 1.15) if exact <= xmax else xmax
        ax.set_xlim(min(args.ratios) / 1.1, hi)
        ax.set_xticks([x for x in (0.5, 1, 1.5, 2, 3, 4, 6) if x <= hi])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"success rate ({args.trials} trials)")
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
