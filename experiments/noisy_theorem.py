"""Theorem 6.1 reproduced on measured numbers.

Setting of the theorem: d = 16, ||W||_F <= W = 4, ||v|| <= 1, every non-zero |v_i| >= mu = 0.1,
eps_W = eps_v = 0.05, every answer off by exactly +-tau (adversarial mode: the sign is a keyed hash of
the query) with tau the theorem's prescribed tolerance (constants of its proof, zero entries of v
allowed: tau = min(mu/2, mu eps_W / (160 W^2 d), eps_v / sqrt(d))). Targets: the CLI's
``random:d=16,seed=S,W_norm=4,v_norm=1,v_min=0.1`` (``,sparse_v=0.25`` on odd seeds: 4 zero entries
of v, the e_i + e_p case of the proof). Checks, on every seed: ||W_hat - W||_F <= eps_W,
||v_hat - v|| <= eps_v, queries = d + d^2. Our estimator at the same tolerance is shown beside.

    .venv/bin/python experiments/noisy_theorem.py [--seeds 20]
"""

from __future__ import annotations

import argparse

import numpy as np

from headthief.extraction.robust.noisy import extract_noisy
from headthief.extraction.robust.noisy_paper import L_CLIP, extract_noisy_paper, theorem_tolerance
from headthief.oracles import Tolerance
from headthief.targets import resolve

D, W, MU, EPS_W, EPS_V = 16, 4.0, 0.1, 0.05, 0.05


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    args = p.parse_args(argv)
    tau = theorem_tolerance(D, W, MU, EPS_W, EPS_V)
    print(f"Theorem 6.1: d = {D}, W = {W:g}, mu = {MU:g}, eps_W = {EPS_W:g}, eps_v = {EPS_V:g}")
    print(f"prescribed tolerance tau = min(mu/2, mu eps_W/(160 W^2 d), eps_v/sqrt(d)) = {tau:.4e} "
          f"(adversarial: every answer off by exactly +-tau); L_clip = {L_CLIP:.3f} <= 5")
    print()
    print("| seed | zeros in v | queries | ||W_hat - W||_F | <= eps_W | max entry error (<= eps_W/d) "
          "| ||v_hat - v|| | clipped | ours: ||W_hat - W||_F |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    ok = True
    errs = []
    for seed in range(args.seeds):
        spec = f"random:d={D},seed={seed},W_norm={W:g},v_norm=1,v_min={MU:g}" + (",sparse_v=0.25" if seed % 2 else "")
        target = resolve(spec)
        head = target.truth
        res = extract_noisy_paper(Tolerance(target.make_oracle(input_norm=1.0), tau, "adversarial", key=seed),
                                  W_bound=W, mu=MU)
        o = Tolerance(target.make_oracle(input_norm=1.0), tau, "adversarial", key=seed)
        ours = extract_noisy(o, tau=tau, W_bound=W)
        eW = float(np.linalg.norm(res.W - head.W))
        emax = float(np.abs(res.W - head.W).max())
        ev = float(np.linalg.norm(res.v - head.v))
        eo = float(np.linalg.norm(ours.W - head.W))
        good = eW <= EPS_W and ev <= EPS_V and res.queries == D + D * D and emax <= EPS_W / D
        ok &= good
        errs.append(eW)
        print(f"| {seed} | {int((head.v == 0).sum())} | {res.queries} | {eW:.3e} | {'yes' if eW <= EPS_W else 'NO'} | "
              f"{emax:.2e} | {ev:.2e} | {res.diagnostics['clipped']} | {eo:.2e} |")
    print()
    print(f"worst ||W_hat - W||_F = {max(errs):.3e} (eps_W = {EPS_W:g}: {EPS_W / max(errs):.0f}x margin; the "
          "proof's bound is a worst case); queries = d + d^2 = "
          f"{D + D * D} on every seed: {'all checks pass' if ok else 'SOME CHECK FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
