"""Research measurement (issue 19, the FFN stage not yet built): can the FFN's neurons be read from
Jacobians that LayerNorms have blurred? On *exact* Jacobians computed from a random block's truth (no
queries; what finite differences of one-token answers would measure once stages L and V have made LN1's
output m choosable), this script runs the two steps planned for the FFN stage and prints how close each
gets to the truth.

The Jacobian of the block's normalised answer n with respect to LN1's output m, on the tangent of LN1's
sphere, is ``J_t = P_n K(m_t) P_m / sigma_u`` with ``K(m) = Gamma_1 + W_2 diag(GELU'(s(m))) W_1 Gamma_1``:
every ``K(m_t)`` lies in one (ffn + 1)-dimensional space of matrices ``W = span{Gamma_1, w2_k w1_k^T}``,
but each measured ``J_t`` is blurred by its own nuisance ``n a^T + e m^T`` (the projectors) and scale.

1. **The span W**: alternating projections: given W, lift each J_t by the nuisance that brings it
   closest to W (least squares over ``n a^T + e m^T``, over-relaxed by omega); given the lifted matrices,
   W = their top (ffn + 1) principal subspace. Printed: the largest principal angle (sine) to the true W.
2. **The neurons**: rank-one elements of W by projected power iteration from random starts
   (``Z <- P_W(s1 u1 v1^T)``), kept when the second singular value vanishes. Printed: neurons found and
   the worst ``1 - |cos|`` to the true ``w2_k w1_k^T``.

    .venv/bin/python benchmarks/research_ffn_subspace.py --points 400 --iterations 300

measured on this machine (d = 32, ffn = 128, seed 1, 400 points; shared 2 cores):

    step 1, omega = 1: sine 0.36 after 10 iterations, 0.013 after 100, 6.0e-4 after 190 (rate ~0.967 per
      iteration); omega = 4 diverges; omega = 2 (the default): 0.25 after 10, 4.1e-4 after 100, 2.0e-7
      after 210, then a floor near 4e-8 (4.2e-8 after 300; 1.6 s an iteration, 483 s in all)
    step 2 on that span: 128/128 neurons, worst 1 - |cos| 7.8e-16 (an angle of ~4e-8), 790 random starts,
      6.1 s; on the true span: 128/128, 4.4e-16, 735 starts
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief.models.bert_block import gelu, gelu_prime, random_block


def jacobians(block, T: int, rng):
    d = block.d
    P = np.eye(d) - np.ones((d, d)) / d
    g1, be1, W1, b1, W2, b2 = block.ln1_gamma, block.ln1_beta, block.W1, block.b1, block.W2, block.b2
    J, ms, ns = [], [], []
    for _ in range(T):
        m = rng.standard_normal(d)
        m -= m.mean()
        m *= np.sqrt(d) / np.linalg.norm(m)
        z = g1 * m + be1
        s = W1 @ z + b1
        u = z + W2 @ gelu(s) + b2
        n = (u - u.mean()) / u.std()
        K = np.diag(g1) + W2 @ (gelu_prime(s)[:, None] * W1 * g1[None, :])
        mh, nh = m / np.linalg.norm(m), n / np.linalg.norm(n)
        J.append((P - np.outer(nh, nh)) @ K @ (P - np.outer(mh, mh)) / u.std())
        ms.append(mh)
        ns.append(nh)
    truth = np.array([(P @ np.outer(W2[:, k], W1[k] * g1) @ P).ravel() for k in range(block.ffn)]
                     + [(P @ np.diag(g1) @ P).ravel()])
    return np.array(J).reshape(T, -1), ms, ns, truth


def sine(Q, Qt) -> float:
    s = np.linalg.svd(Qt.T @ Q, compute_uv=False)
    return float(np.sqrt(max(0.0, 1.0 - s.min() ** 2)))


def span(Y, ms, ns, r, d, iterations, omega, Qt):
    E = np.linalg.svd(np.eye(d) - np.ones((d, d)) / d)[0][:, :d - 1]
    Q = np.linalg.svd(Y, full_matrices=False)[2][:r].T
    nus = [None] * len(Y)
    t0 = time.perf_counter()
    for it in range(iterations):
        lifted = []
        for t, y in enumerate(Y):
            Nb = np.concatenate([np.einsum("i,jk->kij", ns[t], E).reshape(d - 1, -1),
                                 np.einsum("ik,j->kij", E, ms[t]).reshape(d - 1, -1)]).T
            A = Nb - Q @ (Q.T @ Nb)
            nu, *_ = np.linalg.lstsq(A, -(y - Q @ (Q.T @ y)), rcond=None)
            if nus[t] is not None:
                nu = nus[t] + omega * (nu - nus[t])
            nus[t] = nu
            k = y + Nb @ nu
            lifted.append(k / np.linalg.norm(k))
        Q = np.linalg.svd(np.array(lifted), full_matrices=False)[2][:r].T
        if it % 10 == 9 or it == iterations - 1:
            print(f"  iteration {it + 1:4d}: sine to the true span {sine(Q, Qt):.2e}   {time.perf_counter() - t0:6.1f} s",
                  flush=True)
    return Q


def neurons(Q, truth, d, rng):
    """Stage F's own rank-one search (``headthief.extraction.block.ffn.rank_ones``) on span(Q), matched to
    the true neurons: {true index: 1 - |cos|} and the random starts it took."""
    from headthief.errors import NotIdentifiable
    from headthief.extraction.block.ffn import rank_ones
    M = truth.shape[0] - 1
    Rn = truth[:M] / np.linalg.norm(truth[:M], axis=1, keepdims=True)
    try:
        pairs, starts = rank_ones(Q, M, d, rng)
    except NotIdentifiable as e:
        print(f"  {e}")
        return {}, 0
    found: dict[int, float] = {}
    for u, v in pairs:
        c = np.abs(Rn @ np.outer(u, v).ravel())
        k = int(np.argmax(c))
        found[k] = min(found.get(k, 1.0), float(1 - c[k]))
    return found, starts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--points", type=int, default=400)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--omega", type=float, default=2.0)
    args = ap.parse_args()
    d, ffn = 32, 128
    block = random_block(d, 4, ffn, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    Y, ms, ns, truth = jacobians(block, args.points, rng)
    Qt = np.linalg.qr(truth.T)[0]
    print(f"d={d} ffn={ffn} seed={args.seed} points={args.points} omega={args.omega}")
    print("step 1 (the span W):")
    Q = span(Y, ms, ns, ffn + 1, d, args.iterations, args.omega, Qt)
    print("step 2 (neurons = rank-one elements of the recovered span):")
    t0 = time.perf_counter()
    found, runs = neurons(Q, truth, d, rng)
    worst = max(found.values()) if found else float("nan")
    print(f"  {len(found)}/{ffn} neurons, worst 1 - |cos| {worst:.2e}, {runs} random starts, "
          f"{time.perf_counter() - t0:.1f} s")
    found_t, runs_t = neurons(Qt, truth, d, rng)
    print(f"  on the true span: {len(found_t)}/{ffn}, worst 1 - |cos| {max(found_t.values()):.2e}, {runs_t} starts")


if __name__ == "__main__":
    main()
