"""Research: stage F from partial Jacobians (p probe directions) instead of full ones.

Stage F as built measures full tangent Jacobians dn/dm (4 (d - 2) one-token queries each) at
5 (ffn + 1) points: 11.75 million queries at MiniLM's size (d = 384, ffn = 1536). This script measures
a route that needs far fewer, on the position-wise map alone (LN1's normalised output m -> LN2's
normalised input n, from a random block's truth; answers rounded to float32 with --float32):

phase 1: at T points, derivatives along p fixed probe directions V (projected on each point's tangent):
    D_t = (P_n K_t V + nuisance) / sigma_t, K_t = Gamma_1 + W_2 diag(GELU') W_1'
  every K_t V lies in span{Gamma_1 V, w2_k (V^T a_k)^T} (ffn + 1 dims in (d - 1) p); the nuisance is
  n_t a^T (p unknowns) and e_t (V^T m_t)^T (d - 1 unknowns). Span by alternating projections, neurons
  as its rank-one elements u_k v_k^T (w2_k and V^T a_k), gamma_1 as its diagonal element, and each
  point's coefficients.
phase 2: at S of the T points, chosen inside span(V), every direction W_x orthogonal to V and 1 is
  tangent: D_t W_x = P_n (a_t Gamma W_x + U diag(c_t) X) / lambda_t: linear least squares for
  X = the rest of every a_k (ffn x (d - 1 - p)), one normal matrix for all columns.
Then the profiles and the linear remainder as stage F does.

Queries: T * 4 p + S * 4 (d - 1 - p) + T, against (4 (d - 2) + 1) * 5 (ffn + 1).

The route itself is the library's (:func:`headthief.extraction.block.ffn_probes.from_derivatives`); this
script only feeds it the exact map instead of an oracle, so stage F is measured alone.

    .venv/bin/python benchmarks/research_ffn_probes.py --d 16 --ffn 32 --seeds 1 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief.errors import HeadthiefError
from headthief.extraction.block.ffn_probes import from_derivatives, full_queries, probe_count
from headthief.extraction.block.value_sum import stencil_derivative, stencil_tokens
from headthief.models.bert_block import gelu, random_block


def truth_map(block, float32: bool):
    """m (k, d) on LN1's sphere -> n (k, d) LN2's normalised input (unit rms), the block's truth."""
    g, be = block.ln1_gamma, block.ln1_beta

    def f(M):
        z = M * g + be
        u = z + gelu(z @ block.W1.T + block.b1) @ block.W2.T + block.b2
        u = u - u.mean(axis=1, keepdims=True)
        n = u / np.sqrt((u * u).mean(axis=1, keepdims=True))
        if float32:
            y = (n * block.ln2_gamma + block.ln2_beta).astype(np.float32).astype(np.float64)
            n = (y - block.ln2_beta) / block.ln2_gamma
        return n
    return f


def run(d, ffn, seed, p, float32, T=None):
    block = random_block(d, 2, ffn, seed=seed)
    f = truth_map(block, float32)
    queries = [0]

    def answer(M):
        queries[0] += len(M)
        return f(M)

    eps = 6e-8 if float32 else 1e-15
    h = eps ** 0.2 * np.sqrt(d)
    t0 = time.perf_counter()
    out = {"d": d, "ffn": ffn, "p": p, "seed": seed, "T": T or 5 * (ffn + 1)}
    try:
        part = from_derivatives(lambda m, dirs: stencil_derivative(answer(stencil_tokens(m, dirs, h)), len(dirs), h),
                                lambda m: answer(m[None])[0], d, ffn, np.random.default_rng(seed + 1000),
                                points=T, probes=p, precision=eps)
    except HeadthiefError as e:
        out.update(error=f"{type(e).__name__}: {e}", queries=queries[0], seconds=time.perf_counter() - t0)
        return out
    Pm = np.eye(d) - 1.0 / d
    W1t = block.W1 @ np.diag(block.ln1_gamma) @ Pm                         # stage F's comparison
    out["neuron"] = max(float(np.min(np.linalg.norm(W1t - w, axis=1)) / np.linalg.norm(w)) for w in part.W1m)
    s_ = float(np.mean(part.gamma / block.ln1_gamma))
    out["gamma1"] = float(np.max(np.abs(part.gamma - s_ * block.ln1_gamma)) / np.sqrt(d))
    out.update({k: part.info[k] for k in ("inside_points", "span_iterations", "starts", "phase2_conditioning",
                                          "profile_fit_worst")})
    out.update(queries=queries[0], stage_f_full=full_queries(d, ffn), seconds=time.perf_counter() - t0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=32)
    ap.add_argument("--p", type=int, default=0, help="probes (default 2 (ffn + d) / d + 2)")
    ap.add_argument("--T", type=int, default=0)
    ap.add_argument("--seeds", type=int, nargs=2, default=[1, 2])
    ap.add_argument("--float32", action="store_true")
    a = ap.parse_args()
    p = a.p or probe_count(a.d, a.ffn)
    for seed in range(*a.seeds):
        print(run(a.d, a.ffn, seed, p, a.float32, T=a.T or None), flush=True)


if __name__ == "__main__":
    main()
