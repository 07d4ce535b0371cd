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

    .venv/bin/python benchmarks/research_ffn_probes.py --d 16 --ffn 32 --seeds 1 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief.extraction.block.ffn import _profile_fit, _sphere
from headthief.extraction.block.value_sum import STENCIL, WEIGHTS
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


class Counter:
    def __init__(self, f):
        self.f, self.q = f, 0

    def __call__(self, M):
        self.q += len(M)
        return self.f(M)


def derivatives(f, m, dirs, h):
    """Five-point derivatives of f at m along the rows of dirs (k, d): (d, k)."""
    k, d = dirs.shape
    X = (m[None, None, :] + h * np.asarray(STENCIL, float)[None, :, None] * dirs[:, None, :]).reshape(-1, d)
    Y = f(X).reshape(k, len(STENCIL), -1)
    return np.einsum("s,jso->oj", WEIGHTS, Y) / h


def span_probes(D, ns, rs, E, rank, *, max_iter=300, tol=1e-13, memory=8):
    """Alternating projections with Anderson mixing (as ffn.span), for (T, d, p) data with the nuisance
    n_t a^T (a in R^p) and e r_t^T (e in span E, r_t = V^T m_t)."""
    T, d, p = D.shape
    Y = D.reshape(T, -1)
    Y = Y / np.linalg.norm(Y, axis=1, keepdims=True)
    Nbs = np.stack([np.concatenate([np.einsum("i,jk->kij", ns[t], np.eye(p)).reshape(p, -1),
                                    np.einsum("ik,j->kij", E, rs[t]).reshape(E.shape[1], -1)]).T for t in range(T)])
    # each point's nuisance basis, orthonormalised once
    Qn = np.stack([np.linalg.qr(Nbs[t])[0] for t in range(T)])

    def lift(nu):
        L = Y + np.einsum("tij,tj->ti", Qn, nu)
        return L / np.linalg.norm(L, axis=1, keepdims=True)

    def step(nu):
        L = lift(nu)
        Q = np.linalg.svd(L, full_matrices=False)[2][:rank].T
        out = np.empty_like(nu)
        for t in range(T):
            A = Qn[t] - Q @ (Q.T @ Qn[t])
            out[t], *_ = np.linalg.lstsq(A, -(Y[t] - Q @ (Q.T @ Y[t])), rcond=None)
        return out, Q

    nu = np.zeros((T, Qn.shape[2]))
    xs, fs, first, best, kept = [], [], None, np.inf, None
    for it in range(max_iter):
        g, Q = step(nu)
        f = g - nu
        res = float(np.linalg.norm(f))
        first = first if first is not None else max(res, 1e-300)
        if res <= tol * first or res <= 1e-12 * np.sqrt(T):
            return Q, lift(g), g, Qn, it + 1, res
        if res > 10 * best:
            xs, fs = [], []
        if res < best:
            kept = (Q, lift(g), g, Qn, it + 1, res)
        best = min(best, res)
        xs.append(nu.ravel().copy())
        fs.append(f.ravel().copy())
        xs, fs = xs[-memory - 1:], fs[-memory - 1:]
        if len(fs) > 1:
            dF = np.stack([fs[i + 1] - fs[i] for i in range(len(fs) - 1)], axis=1)
            dX = np.stack([xs[i + 1] - xs[i] for i in range(len(xs) - 1)], axis=1)
            gam, *_ = np.linalg.lstsq(dF, f.ravel(), rcond=None)
            nu = (nu.ravel() + f.ravel() - (dX + dF) @ gam).reshape(nu.shape)
        else:
            nu = g
    return kept


def rank_ones_dp(Q, count, d, p, rng, tol, max_starts=None):
    max_starts = max_starts or 40 * count + 200
    found, starts = [], 0
    while len(found) < count and starts < max_starts:
        starts += 1
        z = Q @ rng.standard_normal(Q.shape[1])
        z /= np.linalg.norm(z)
        for _ in range(2000):
            U, S, Vt = np.linalg.svd(z.reshape(d, p), full_matrices=False)
            zn = Q @ (Q.T @ (S[0] * np.outer(U[:, 0], Vt[0])).ravel())
            zn /= np.linalg.norm(zn)
            done = np.linalg.norm(zn - np.sign(zn @ z) * z) < 1e-9 * tol
            z = zn
            if done:
                break
        U, S, Vt = np.linalg.svd(z.reshape(d, p), full_matrices=False)
        if S[1] > tol * S[0]:
            continue
        u, v = U[:, 0], Vt[0]
        if all(abs(u @ a) * abs(v @ b) < 1 - 1e-6 for a, b in found):
            found.append((u, v))
    return found, starts


def run(d, ffn, seed, p, float32, T=None, S=None):
    block = random_block(d, 2, ffn, seed=seed)
    f = Counter(truth_map(block, float32))
    rng = np.random.default_rng(seed + 1000)
    eps = 6e-8 if float32 else 1e-15
    h = eps ** 0.2 * np.sqrt(d)
    Pm = np.eye(d) - 1.0 / d
    E = np.linalg.svd(Pm)[0][:, :d - 1]
    V = np.linalg.qr(E @ rng.standard_normal((d - 1, p)))[0]               # p probes, orthonormal, off 1
    Wx = np.linalg.svd(Pm - V @ V.T)[0][:, :d - 1 - p]                       # the rest of 1's complement
    T = T or 5 * (ffn + 1)
    S = S or int(np.ceil(2 * ffn / (d - 2))) + 6
    # S points inside span(V) (phase 2 reads every direction of Wx there), then T - S anywhere
    A = rng.standard_normal((S, p))
    Min = A @ V.T
    Min *= np.sqrt(d) / np.linalg.norm(Min, axis=1, keepdims=True)
    Ms = np.concatenate([Min, _sphere(rng, T - S, d)])
    t0 = time.perf_counter()
    D, ns, rs = [], [], []
    for m in Ms:
        mh = m / np.sqrt(d)
        dirs = (V - np.outer(mh, mh @ V)).T                                  # probes on the tangent
        D.append(derivatives(f, m, dirs, h))
        n0 = f(m[None])[0]
        ns.append(n0 / np.linalg.norm(n0))
        rs.append(V.T @ mh)
    D, ns, rs = np.array(D), np.array(ns), np.array(rs)
    q1 = f.q
    span_tol = 1e-13 if not float32 else 30 * eps ** 0.8 * np.sqrt(d)
    Q, L, nu, Qn, iters, res = span_probes(D, ns, rs, E, ffn + 1, tol=span_tol)
    t_span = time.perf_counter() - t0
    rank_tol = 1e-6 if not float32 else min(1e3 * eps ** 0.8 * np.sqrt(d), 0.1)
    pairs, starts = rank_ones_dp(Q, ffn, d, p, rng, rank_tol)
    out = {"d": d, "ffn": ffn, "p": p, "seed": seed, "T": T, "S": S, "iters": iters, "span_res": res,
           "found": len(pairs), "starts": starts}
    if len(pairs) < ffn:
        out.update(queries=f.q, seconds=time.perf_counter() - t0)
        return out
    # gamma: P diag(g) P V in the span
    G = np.stack([np.outer(Pm[:, i], Pm[i, :] @ V).ravel() for i in range(d)], axis=1)
    _, Sg, Vg = np.linalg.svd(G - Q @ (Q.T @ G))
    gam = Vg[-1] * np.sqrt(d) / np.linalg.norm(Vg[-1])
    gam = gam if gam.sum() > 0 else -gam
    out["gamma_gap"] = float(Sg[-2] / max(Sg[-1], 1e-300))
    basis = np.stack([(Pm @ np.diag(gam) @ Pm @ V).ravel()] + [np.outer(u, v).ravel() for u, v in pairs], axis=1)
    coef, *_ = np.linalg.lstsq(basis, L.T, rcond=None)                      # (ffn + 1, T)
    a_t = coef[0]
    U = np.stack([u for u, _ in pairs], axis=1)                              # (d, ffn)
    # phase 2: every Wx direction at the S points inside span(V)
    lhs = np.zeros((ffn, ffn))
    rhs = np.zeros((ffn, d - 1 - p))
    for s in range(S):
        Dx = derivatives(f, Ms[s], Wx.T, h)                                  # (d, q)
        Pn = Pm - np.outer(ns[s], ns[s])
        # lambda_s: the lifted L_s against the measured D_s, both with n and the e-term removed
        rr = rs[s] / np.linalg.norm(rs[s])
        Pi = np.eye(p) - np.outer(rr, rr)
        Ls = (Pn @ L[s].reshape(d, p) @ Pi).ravel()
        Ds = (Pn @ D[s] @ Pi).ravel()
        lam = float(Ls @ Ds / (Ds @ Ds))
        C = U * coef[1:, s]
        Cn = Pn @ C
        lhs += Cn.T @ Cn
        rhs += Cn.T @ (Pn @ (lam * Dx - a_t[s] * (Pm @ np.diag(gam) @ Wx)))
    X = np.linalg.solve(lhs, rhs)                                            # (ffn, q)
    out["phase2_cond"] = float(np.linalg.cond(lhs))
    Z = np.stack([V @ v for _, v in pairs]) + X @ Wx.T                      # (ffn, d): every a_k direction
    W1m = np.zeros((ffn, d))
    W2 = np.zeros((d, ffn))
    b1m = np.zeros(ffn)
    fits = []
    for k, (u, v) in enumerate(pairs):
        alpha, beta, kappa, rel = _profile_fit(Ms @ Z[k], coef[k + 1] / a_t)
        fits.append(rel)
        W1m[k], b1m[k], W2[:, k] = alpha * Z[k], beta, kappa * u / alpha
    # against the truth (stage F's comparison)
    W1t = block.W1 @ np.diag(block.ln1_gamma) @ Pm
    out["neuron"] = max(float(np.min(np.linalg.norm(W1t - w, axis=1)) / np.linalg.norm(w)) for w in W1m)
    s_ = float(np.mean(gam / block.ln1_gamma))
    out["gamma1"] = float(np.max(np.abs(gam - s_ * block.ln1_gamma)) / np.sqrt(d))
    out["profile_worst"] = float(max(fits))
    out.update(queries=f.q, queries_phase1=q1, stage_f_full=(4 * (d - 2) + 1) * 5 * (ffn + 1),
               seconds=time.perf_counter() - t0, seconds_span=t_span)
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
    p = a.p or int(np.ceil(2 * (a.ffn + a.d) / a.d)) + 2
    for seed in range(*a.seeds):
        print(run(a.d, a.ffn, seed, p, a.float32, T=a.T or None), flush=True)


if __name__ == "__main__":
    main()
