"""Stage Q of ``--method rope`` (imprecise answers): every ``W_q^h`` and ``W_k^g`` refitted in full coordinates to
the logit readings of stage S, with theta fixed.

Stage S fits each head's forms ``T_h(D)`` inside the query and key spaces it read first; stage R ties them by the
rotation. With float32 answers the spaces come out at ~5e-5 (their vectors are few for d_h dimensions), and a
form fitted inside a slightly wrong space carries that error at every offset whatever the number of readings
(measured: four times more readings per form changed nothing). Here every reading

    log(a_{h,t,i} / a_{h,t,0}) = x_t^T Q_h^T R(-(t - i) theta) K_g x_i / sqrt(d_h)

is linear in ``Q_h`` for fixed ``K_g`` and in ``K_g`` for fixed ``Q_h``: alternating weighted least squares over
the readings in all of R^d, so the spaces move too. Each solve is conjugate gradients on the normal equations
(``d_h d`` unknowns; the operator is never formed), started at the current value and preconditioned by the
Kronecker product of the two sides' second moments. At most ``SWEEPS`` sweeps of ``CG_STEPS`` iterations each;
a sweep that lowers the weighted residual by less than ``1 - GAIN`` ends it. Then at most ``MIX_STEPS`` exact
Gauss-Newton steps per group on the mixing inside the d_h coordinates (:func:`_mix_step`), the slow planes'
basis, which the alternation hardly moves. Never returns parts that fit the readings worse than the ones it was
given.
"""

from __future__ import annotations

import numpy as np

from .rotation import _rot

SWEEPS = 6           # alternating sweeps (Q then K), at most (20 sweeps: fidelity 2.6e-4 -> 2.3e-4 at d = 256, 4.5 min more)
CG_STEPS = 25        # conjugate-gradient iterations per solve, at most
GAIN = 0.98          # a sweep keeping more than this of the weighted residual ends the refinement
READINGS = 2 ** 15   # readings per head used at most (spread over every offset and design)
MIX_STEPS = 3        # Gauss-Newton steps on each group's mixing inside its d_h coordinates, at most
CHUNK = 2 ** 14      # readings per block of the mixing step's normal equations


def _readings(designs, group, H, rng):
    """Per head: (x_t, x_i, D, logit, weight) arrays of its finite readings, at most READINGS of them (a random
    subset, drawn before any token is copied)."""
    out = []
    for h in range(H):
        idx = []
        for k, (X, L, W) in enumerate(designs):
            live = np.any(X != 0, axis=(0, 2))
            ok = np.isfinite(L[:, h]) & (W[:, h] > 0)                    # (n, N, N)
            ok &= live[None, :, None] & live[None, None, :]
            ok &= np.tril(np.ones(ok.shape[1:], bool), -1)[None] & (np.arange(ok.shape[2]) >= 1)[None, None, :]
            s, t, i = np.nonzero(ok)
            idx.append(np.stack([np.full(len(s), k), s, t, i], axis=1))
        idx = np.concatenate(idx)
        if len(idx) > READINGS:
            idx = idx[np.sort(rng.choice(len(idx), READINGS, replace=False))]
        xt = np.empty((len(idx), designs[0][0].shape[2]))
        xi = np.empty_like(xt)
        ys, ws = np.empty(len(idx)), np.empty(len(idx))
        for k, (X, L, W) in enumerate(designs):
            m = idx[:, 0] == k
            s, t, i = idx[m, 1], idx[m, 2], idx[m, 3]
            xt[m], xi[m], ys[m], ws[m] = X[s, t], X[s, i], L[s, h, t, i], W[s, h, t, i]
        out.append((xt, xi, idx[:, 2] - idx[:, 3], ys, ws))
    return out


def _rotated(Kx: np.ndarray, Ds: np.ndarray, freqs: np.ndarray, dh: int) -> np.ndarray:
    """R(-D theta) applied to each row of Kx (n, dh), D per row."""
    out = np.empty_like(Kx)
    for D in np.unique(Ds):
        m = Ds == D
        out[m] = Kx[m] @ _rot(-D * freqs, dh).T
    return out


def _cg(apply, rhs: np.ndarray, x0: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Preconditioned conjugate gradients for apply(X) = rhs (matrices), preconditioner X -> left X right."""
    x = x0.copy()
    r = rhs - apply(x)
    z = left @ r @ right
    p = z.copy()
    rz = float(np.sum(r * z))
    for _ in range(CG_STEPS):
        Ap = apply(p)
        den = float(np.sum(p * Ap))
        if den <= 0 or rz <= 0:
            break
        alpha = rz / den
        x += alpha * p
        r -= alpha * Ap
        z = left @ r @ right
        rz_new = float(np.sum(r * z))
        p = z + (rz_new / rz) * p
        rz = rz_new
    return x


def _solve(U: np.ndarray, Xs: np.ndarray, y: np.ndarray, w2: np.ndarray, P0: np.ndarray) -> np.ndarray:
    """argmin_P sum_r w2_r ((P x_r) . u_r - y_r)^2 over P (dh x d), from P0: the normal equations
    sum_r w2_r u_r (u_r^T P x_r) x_r^T = sum_r w2_r y_r u_r x_r^T by preconditioned CG."""
    def apply(P):
        s = np.einsum("re,re->r", Xs @ P.T, U)
        return (U * (w2 * s)[:, None]).T @ Xs

    rhs = (U * (w2 * y)[:, None]).T @ Xs
    Cu = (U * w2[:, None]).T @ U / max(float(w2.sum()), 1e-300)
    Cx = Xs.T @ Xs / len(Xs)
    return _cg(apply, rhs, P0, np.linalg.pinv(Cu), np.linalg.pinv(Cx) / max(float(w2.sum()), 1e-300))


def _mix_step(Q: np.ndarray, K: np.ndarray, group: np.ndarray, data, freqs: np.ndarray, dh: int):
    """One Gauss-Newton step, per group, on the mixing E inside the d_h coordinates: ``K_g -> (I + E) K_g`` and
    every ``Q_h`` of the group ``-> (I + E)^{-T} Q_h``. To first order the logit changes by
    ``q^T (R E - E R) k / sqrt(d_h)`` (q = Q_h x_t, k = K_g x_i, R = R(-D theta)): linear in E's d_h^2 entries,
    solved exactly from the normal equations (minimum norm: the E that commute with every R are the symmetries).
    This is the direction the alternation moves slowly: the slow planes' basis, which only their small turn
    over the offsets read fixes."""
    Q, K = Q.copy(), K.copy()
    sq = np.sqrt(dh)
    for g in range(K.shape[0]):
        members = [h for h in range(Q.shape[0]) if group[h] == g]
        A = np.zeros((dh * dh, dh * dh))
        rhs = np.zeros(dh * dh)
        for h in members:
            xt, xi, Ds, y, w = data[h]
            for o in range(0, len(y), CHUNK):
                sl = slice(o, o + CHUNK)
                q, k = xt[sl] @ Q[h].T, xi[sl] @ K[g].T
                Rk = _rotated(k, Ds[sl], freqs, dh)                    # R(-D) k
                Rtq = _rotated(q, -Ds[sl], freqs, dh)                  # R(-D)^T q = R(D) q
                r = np.einsum("re,re->r", q, Rk) / sq - y[sl]
                F = (np.einsum("ra,rb->rab", Rtq, k) - np.einsum("ra,rb->rab", q, Rk)).reshape(len(r), -1) / sq
                F *= w[sl, None]
                A += F.T @ F
                rhs -= F.T @ (w[sl] * r)
        E = np.linalg.lstsq(A, rhs, rcond=1e-12)[0].reshape(dh, dh)
        M = np.eye(dh) + E
        K[g] = M @ K[g]
        for h in members:
            Q[h] = np.linalg.solve(M.T, Q[h])
    return Q, K


def _descend(step, Q: np.ndarray, K: np.ndarray, best: float, cost, limit: int):
    """At most ``limit`` steps ``(Q, K) -> step(Q, K)``, each kept only if it lowers ``cost``; stops at the first
    that does not, or after one that keeps more than ``GAIN`` of it. Returns (Q, K, cost, steps kept)."""
    kept = 0
    for _ in range(int(limit)):
        Qn, Kn = step(Q, K)
        new = cost(Qn, Kn)
        if new >= best:
            break
        gain = new / best
        Q, K, best = Qn, Kn, new
        kept += 1
        if gain > GAIN:
            break
    return Q, K, best, kept


def refine_scores(Q: np.ndarray, K: np.ndarray, theta: float, group: np.ndarray, designs, *,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, dict]:
    """Stage Q (see the module). ``designs``: per form design (X, L, W) with L, W (n, H, N, N) the logits and
    their weights. Returns (Q, K, info)."""
    H, dh, d = Q.shape
    G = K.shape[0]
    freqs = float(theta) ** (-2.0 * np.arange(dh // 2) / dh)
    data = _readings(designs, group, H, rng)
    sq = np.sqrt(dh)

    def cost(Qc, Kc):
        tot = 0.0
        for h, (xt, xi, Ds, y, w) in enumerate(data):
            u = _rotated(xi @ Kc[group[h]].T, Ds, freqs, dh) / sq
            tot += float(np.sum((w * (np.einsum("re,re->r", xt @ Qc[h].T, u) - y)) ** 2))
        return tot

    def sweep(Q, K):
        """One alternation: every Q_h given K, then every K_g given the new Q_h of its group."""
        Qn = np.stack([_solve(_rotated(xi @ K[group[h]].T, Ds, freqs, dh) / sq, xt, y, w ** 2, Q[h])
                       for h, (xt, xi, Ds, y, w) in enumerate(data)])
        Kn = K.copy()
        for g in range(G):
            members = [h for h in range(H) if group[h] == g]
            # the key side: (R(-D) K x_i) . (Q x_t) = (K x_i) . (R(D) Q x_t)
            U = np.concatenate([_rotated(data[h][0] @ Qn[h].T, -data[h][2], freqs, dh) / sq for h in members])
            Xs = np.concatenate([data[h][1] for h in members])
            y = np.concatenate([data[h][3] for h in members])
            w2 = np.concatenate([data[h][4] for h in members]) ** 2
            Kn[g] = _solve(U, Xs, y, w2, K[g])
        return Qn, Kn

    Q, K = np.array(Q, dtype=np.float64), np.array(K, dtype=np.float64)
    start = cost(Q, K)
    Q, K, best, sweeps = _descend(sweep, Q, K, start, cost, SWEEPS)
    Q, K, best, mixes = _descend(lambda Q, K: _mix_step(Q, K, group, data, freqs, dh), Q, K, best, cost, MIX_STEPS)
    n = sum(len(r[3]) for r in data)
    info = {"score_refit_sweeps": sweeps, "score_refit_mix_steps": mixes,
            "score_refit_rms_before": float(np.sqrt(start / n)), "score_refit_rms_after": float(np.sqrt(best / n)),
            "score_refit_readings": n}
    return Q, K, info


__all__ = ["refine_scores"]
