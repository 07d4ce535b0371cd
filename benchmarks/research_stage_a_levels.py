"""Stage A's Richardson levels measured (docs/block.md, "Stage A's levels chosen by pilot reads"): second-order
reads of a few directions at all 2 d + 8 base tokens, from float32 answers, combined over each level set of
``heads.CANDIDATES``, against the reads of float64 answers with the true ``B`` at all three levels; then each
set's output-space fit residual (what ``heads.choose_levels`` compares) and its fit's distance from the fit of
those exact reads (the checkpoint's float64 one-token Jacobians).

    .venv/bin/python benchmarks/research_stage_a_levels.py --target minilm          # all-MiniLM-L6-v2 block 2, ~5 min
    .venv/bin/python benchmarks/research_stage_a_levels.py --target 16,4,32,5       # random_block(16, 4, 32, seed=5)
"""
import argparse
import time

import numpy as np

from headthief.extraction.block import heads as hm
from headthief.models.bert_block import from_minilm, random_block

from bench_minilm_stage_a import stages_l_v, true_jacobian  # (this directory)

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--target", default="minilm", help="minilm (block 2) or D,H,FFN,SEED (a random block)")
ap.add_argument("--directions", type=int, default=5)
args = ap.parse_args()
which, k = args.target, args.directions
t0 = time.perf_counter()
if which == "minilm":
    block, truth = from_minilm(2, dtype=np.float32), from_minilm(2, dtype=np.float64)
else:
    d_, h_, f_, s_ = map(int, which.split(","))
    block, truth = random_block(d_, h_, f_, seed=s_, dtype=np.float32), random_block(d_, h_, f_, seed=s_)
d = block.d
rng = np.random.default_rng(0)
oracle, exact, eps, vs, vs_true = stages_l_v(block, truth, rng)
own = 0.8 * eps ** 0.125
Pn = 2 * d + 8
X = rng.standard_normal((Pn, d)); X *= np.sqrt(d) / np.linalg.norm(X, axis=1, keepdims=True)
E = np.linalg.qr(rng.standard_normal((d, d)))[0].T
e0 = hm._unit(rng.standard_normal(d))
dirs = np.vstack([e0[None], E[:k // 2 + 1], e0[None] + E[:k - k // 2 - 1]])
t = own
S32 = {c: hm.second_order(oracle, vs, X, dirs, c * t) for c in (1.0, 2.0, 3.0)}
S64 = {c: hm.second_order(exact, vs_true, X, dirs, c * t) for c in (1.0, 2.0, 3.0)}
def comb(S, lv):
    w = hm.richardson(lv, t)
    return sum(wi * S[c] for wi, c in zip(w, lv))
ref = comb(S64, (1.0, 2.0, 3.0))
print(f"{which}: d={d} eps={eps:.2g} t={t:.3g}; B within {np.linalg.norm(vs.B - vs_true.B) / np.linalg.norm(vs_true.B):.2e}")
for lv in hm.CANDIDATES:
    r32, r64 = comb(S32, lv), comb(S64, lv)
    e32 = np.linalg.norm(r32 - ref, axis=(1, 2)) / np.linalg.norm(ref, axis=(1, 2))
    e64 = np.linalg.norm(r64 - ref, axis=(1, 2)) / np.linalg.norm(ref, axis=(1, 2))
    print(f"levels {lv}: float32 vs truth median {np.median(e32):.2e} worst {e32.max():.2e}; float64 (truncation alone) worst {e64.max():.2e}")
print(f"{oracle.queries + exact.queries} queries, {time.perf_counter() - t0:.0f} s")

# the output-space fit of each level set's reads (the checkpoint's float64 Jacobians), its residual, and G
# against the fit of the float64 true-B reads
from headthief.extraction.block.read_fit import fit_in_output_space
jac = true_jacobian(truth)
Js = np.stack([jac(X[p]) for p in range(Pn)])
Gref, rref = fit_in_output_space(ref, X, Js, tol=1e-12, c1=vs_true.c1)
print(f"reference fit residual {np.max(rref):.2e}")
def gerr(G):
    out = []
    for g, gr in zip(G, Gref):
        out.append(np.linalg.norm(g - gr) / np.linalg.norm(gr))
    return np.array(out)
for lv in hm.CANDIDATES:
    G, r = fit_in_output_space(comb(S32, lv), X, Js, tol=max(eps, 1e-10), c1=vs.c1)
    print(f"levels {lv}: fit residual median {np.median(r):.2e} worst {np.max(r):.2e}; G vs reference median {np.median(gerr(G)):.2e} worst {np.max(gerr(G)):.2e}", flush=True)
print(f"{time.perf_counter() - t0:.0f} s")
