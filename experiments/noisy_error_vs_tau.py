"""W error against the tolerance tau: Theorem 6.1's estimator, ours, and the theorem's bound.

Targets ``random:d=16,seed=S,W_norm=X,v_norm=1,v_min=0.1`` (the theorem's setting: W = ||W||_F, mu =
0.1), adversarial answers (+-tau exactly), input-norm bound R = 1, d + d^2 = 272 queries for both
estimators. Panels: ||W||_F = 4 (the theorem's reproduction setting) and ||W||_F = 32. The bound is
the eps_W for which tau is the prescribed tolerance, 160 W^2 d tau / mu (valid for tau <= mu/2).
Median over seeds, with the min-max range shaded. Writes ``docs/img/noisy_error_vs_tau.png``
(matplotlib, the ``plot`` extra) and prints the table.

    .venv/bin/python experiments/noisy_error_vs_tau.py [--seeds 5] [--out docs/img/noisy_error_vs_tau.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from headthief.extraction.robust.noisy import extract_noisy
from headthief.extraction.robust.noisy_paper import extract_noisy_paper, theorem_W_bound
from headthief.oracles import Tolerance
from headthief.targets import resolve

D, MU = 16, 0.1
TAUS = np.logspace(-9, -1, 17)
W_NORMS = [4.0, 32.0]


def errors(W_norm: float, tau: float, seeds: int) -> np.ndarray:
    out = []
    for seed in range(seeds):
        target = resolve(f"random:d={D},seed={seed},W_norm={W_norm:g},v_norm=1,v_min={MU:g}")
        W = target.truth.dense_W()
        paper = extract_noisy_paper(Tolerance(target.make_oracle(input_norm=1.0), tau, key=seed),
                                    W_bound=W_norm, mu=MU)
        ours = extract_noisy(Tolerance(target.make_oracle(input_norm=1.0), tau, key=seed), tau=tau,
                             W_bound=W_norm)
        out.append((np.linalg.norm(paper.W - W), np.linalg.norm(ours.W - W)))
    return np.array(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "img" / "noisy_error_vs_tau.png"))
    args = p.parse_args(argv)
    results = {}
    print(f"d = {D}, mu = {MU:g}, adversarial, R = 1, {D + D * D} queries; ||W_hat - W||_F, median of {args.seeds} seeds")
    print()
    print("| ||W||_F | tau | Theorem 6.1 bound | noisy-paper | noisy (ours) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for W_norm in W_NORMS:
        rows = []
        for tau in TAUS:
            e = errors(W_norm, tau, args.seeds)
            bound = theorem_W_bound(tau, D, W_norm, MU)
            rows.append((tau, bound, *np.median(e, axis=0), *e.min(axis=0), *e.max(axis=0)))
            if np.log10(tau) % 2 == 1 or tau == TAUS[0]:
                print(f"| {W_norm:g} | {tau:.0e} | {bound:.2e} | {rows[-1][2]:.2e} | {rows[-1][3]:.2e} | "
                      f"{rows[-1][2] / rows[-1][3]:.0f}x |")
        results[W_norm] = np.array(rows)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'headthief[plot]'): no plot written")
        return
    fig, axes = plt.subplots(1, len(W_NORMS), figsize=(11, 4.2), sharey=True)
    for ax, W_norm in zip(axes, W_NORMS):
        r = results[W_norm]
        ok = np.isfinite(r[:, 1])
        ax.loglog(r[ok, 0], r[ok, 1], "k--", label="Theorem 6.1 bound (160 W² d τ / μ)")
        for col, lo, hi, name, color in [(2, 4, 6, "noisy-paper (Theorem 6.1)", "tab:red"),
                                         (3, 5, 7, "noisy (ours)", "tab:blue")]:
            ax.loglog(r[:, 0], r[:, col], "o-", color=color, ms=3, label=name)
            ax.fill_between(r[:, 0], r[:, lo], r[:, hi], color=color, alpha=0.2)
        ax.axhline(W_norm, color="gray", lw=0.8, ls=":")
        ax.text(r[0, 0], W_norm * 1.3, "‖W‖_F", color="gray", fontsize=8)
        ax.set_title(f"d = {D}, ‖W‖_F = {W_norm:g}, μ = {MU:g}, R = 1, {D + D * D} queries")
        ax.set_xlabel("tolerance τ (adversarial ±τ)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("‖Ŵ − W‖_F")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
