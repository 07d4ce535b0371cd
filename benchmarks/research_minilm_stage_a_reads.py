"""Why stage A's reads are not affine in x on the real MiniLM block 2 in float32 (docs/block.md, "Stage A on
the real MiniLM block"): a few of stage A's directions at all its 2 d + 8 base tokens, read from float32 and
from float64 answers at a ladder of steps t, pulled back through the checkpoint's one-token Jacobians and fitted
across the base tokens as ``heads._fit_reads`` does.

    .venv/bin/python benchmarks/research_minilm_stage_a_reads.py --steps 0.093 0.2 0.4 0.7

Draws the base tokens and directions as ``extract_heads`` does after stages L and V (seed 0, as
``bench_minilm_stage_a.py``). Prints ``B``'s error and condition number, one base token's Jacobian singular
values, then per step: the float32 reads' error against float64 answers at that step, and the affine fit's
relative residual (worst over the directions) for float32 answers, float64 answers with stage V's ``B``, and
float64 answers with the true ``B`` (at the method's own step only). About 10 minutes on one core, 35,000
queries per step and answer type.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief.extraction.block import heads as hm
from headthief.models.bert_block import from_minilm

from bench_minilm_stage_a import stages_l_v, true_jacobian  # (this directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--steps", type=float, nargs="+", default=[0.0, 0.2, 0.4, 0.7],
                    help="steps t (0: the method's own, 0.8 eps^0.125 at tokens of norm sqrt(d))")
    ap.add_argument("--directions", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    block, truth = from_minilm(args.layer, dtype=np.float32), from_minilm(args.layer, dtype=np.float64)
    d = block.d
    rng = np.random.default_rng(0)
    oracle, exact, eps, vs, vs_true = stages_l_v(block, truth, rng)
    Bt = truth.value_output_sum()[0]
    own = 0.8 * eps ** 0.125                                   # extract_heads' step at tokens of norm sqrt(d)
    Pn = 2 * d + 8
    X = rng.standard_normal((Pn, d))
    X *= np.sqrt(d) / np.linalg.norm(X, axis=1, keepdims=True)
    for _ in range(Pn):                                        # extract_heads draws a stencil basis per token
        rng.standard_normal((d, d))
    E = np.linalg.qr(rng.standard_normal((d, d)))[0].T
    e0 = hm._unit(rng.standard_normal(d))
    k = args.directions
    dirs = np.vstack([e0[None], E[:k // 2 + 1], e0[None] + E[:k - k // 2 - 1]])
    print(f"B within {np.linalg.norm(vs.B - vs_true.B) / np.linalg.norm(vs_true.B):.2e} (stage V), condition number "
          f"{np.linalg.cond(Bt):.0f}; answers' precision {eps:.2g}, the method's step {own:.3g}", flush=True)

    jacobian = true_jacobian(truth)
    Js = np.stack([jacobian(X[p]) for p in range(Pn)])
    S = np.linalg.svd(Js[0], compute_uv=False)
    print(f"J_Psi at base token 0: singular values {S[0]:.3g} (first), {np.median(S):.3g} (median), "
          f"{S[d - 3]:.3g} (the (d-2)-th)", flush=True)
    pulls = hm._pull_backs(Js)                                 # as extract_heads(fit="pullback") pulls back

    def residual(R, v):
        P1, _ = hm._gauge(v.c1)
        return max(r for _, r in hm._fit_reads(np.einsum("pij,kpj->kpi", pulls, R), X, v.c0, P1))

    print(" step t   float32 vs float64   fit float32   fit float64 (stage V's B)   fit float64 (true B)")
    for t in args.steps:
        t = own if t <= 0 else t
        R32, R64 = hm.reads(oracle, vs, X, dirs, t), hm.reads(exact, vs, X, dirs, t)
        true_b = f"{residual(hm.reads(exact, vs_true, X, dirs, t), vs_true):.2e}" if t == own else "-"
        print(f"{t:7.3f}   {np.linalg.norm(R32 - R64) / np.linalg.norm(R64):18.2e}   {residual(R32, vs):11.3g}   "
              f"{residual(R64, vs):25.3g}   {true_b:>20s}", flush=True)
    print(f"{oracle.queries + exact.queries} queries, {(time.perf_counter() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
