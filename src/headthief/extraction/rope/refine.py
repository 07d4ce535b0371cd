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

Last, the mixing once more (:func:`_far_mix`), fitted to every reading at the largest offsets instead of the
subset. Two planes f, f' mixed by e change the form at offset D by about ``e D |theta_f - theta_f'|``: the readings
at the largest offsets see it most, a sequence holds few of them (a random 16-token one: one at offset 14, ten at
11..14) and the most precise readings, which the subset keeps, sit at the small offsets; at 64 tokens the mixing
is multiplied by up to 4.5x the largest turn read. The readings at offsets ``>= FAR_OFFSETS`` x the largest are
used, and not the small offsets, where the other parts' errors dominate the misfit and would pull E to absorb
them (measured on the twin of the llama line, `rope-mha:d=256,heads=8,kv_heads=2,seed=1,dtype=float32`, from
the parts that the alternation and E restricted to the 11 planes turning less than 1 rad over the offsets read
left: offsets >= 11 of 14 brought the form at offset 63 from 2.2e-5 to 1.4e-5 and the fidelity on sequences of
64 tokens from 8.9e-5 to 6.2e-5; offsets >= 9: 7.9e-5). About a minute at d = 256 (normal
equations of d_h^2 unknowns over ~330,000 readings per group).
"""

from __future__ import annotations

import numpy as np

from .rotation import _rot
from ...linalg import lstsq, pinv

SWEEPS = 6           # alternating sweeps (Q then K), at most (20 sweeps: fidelity 2.6e-4 -> 2.3e-4 at d = 256, 4.5 min more)
CG_STEPS = 25        # conjugate-gradient iterations per solve, at most
GAIN = 0.98          # a sweep keeping more than this of the weighted residual ends the refinement
READINGS = 2 ** 15   # readings per head used at most (the most precise ones, over every offset and design)
MIX_STEPS = 3        # Gauss-Newton steps on each group's mixing inside its d_h coordinates, at most
CHUNK = 2 ** 14      # readings per block of the mixing step's normal equations
FAR_OFFSETS = 0.75   # the last mixing step is fitted to every reading at offsets >= this x the largest offset read
FAR_STEPS = 2        # its Gauss-Newton steps, at most (one moves it to what the readings hold)


def _readings(designs, group, H):
    """Per head: (x_t, x_i, D, logit, weight) arrays of its finite readings, at most READINGS of them: those with
    the largest weights (chosen before any token is copied). A reading's weight is the inverse of its standard
    deviation, so these carry most of the information paid for: on the llama line's twin the top 2^15 of 862,000
    readings per head hold 63% of the sum of squared weights, a random 2^15 3.8%; the refit's forms came out
    1.3-3x closer at offsets 0..63 than from a random subset, at the same cost (and closer than from a random
    2^16 at 2.3x the cost). The slow planes, which the largest offsets fix, get every reading there in
    :func:`_far_mix`."""
    out = []
    for h in range(H):
        idx, wts = [], []
        for k, (X, L, W) in enumerate(designs):
            live = np.any(X != 0, axis=(0, 2))
            ok = np.isfinite(L[:, h]) & (W[:, h] > 0)                    # (n, N, N)
            ok &= live[None, :, None] & live[None, None, :]
            ok &= np.tril(np.ones(ok.shape[1:], bool), -1)[None] & (np.arange(ok.shape[2]) >= 1)[None, None, :]
            s, t, i = np.nonzero(ok)
            idx.append(np.stack([np.full(len(s), k), s, t, i], axis=1))
            wts.append(W[s, h, t, i])
        idx = np.concatenate(idx)
        if len(idx) > READINGS:
            idx = idx[np.sort(np.argpartition(-np.concatenate(wts), READINGS)[:READINGS])]
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
    return _cg(apply, rhs, P0, pinv(Cu), pinv(Cx) / max(float(w2.sum()), 1e-300))


def _subset_chunks(data, freqs: np.ndarray, dh: int):
    """The mixing step's readings from stage Q's subset: ``chunks(g, Q, K)`` yields, per member head of group g and
    block of at most ``CHUNK`` readings, ``(q, k, R k, R^T q, logit, weight)`` with ``q = Q_h x_t``,
    ``k = K_g x_i`` and ``R = R(-D theta)`` of each reading's offset."""
    def chunks(g, Q, K, members):
        for h in members:
            xt, xi, Ds, y, w = data[h]
            for o in range(0, len(y), CHUNK):
                sl = slice(o, o + CHUNK)
                q, k = xt[sl] @ Q[h].T, xi[sl] @ K[g].T
                yield q, k, _rotated(k, Ds[sl], freqs, dh), _rotated(q, -Ds[sl], freqs, dh), y[sl], w[sl]
    return chunks


def _far_chunks(designs, freqs: np.ndarray, dh: int, dmin: int):
    """Like :func:`_subset_chunks`, over every finite reading of every design at offsets ``D >= dmin`` (no
    subset: the few readings at the largest offsets are what fix the slow planes)."""
    def chunks(g, Q, K, members):
        for X, L, W in designs:
            Kx = X @ K[g].T
            for h in members:
                Qx = X @ Q[h].T
                for D, t in _offset_rows(X, dmin):
                    R = _rot(-D * freqs, dh)
                    y, w = L[:, h, t, t - D].reshape(-1), W[:, h, t, t - D].reshape(-1)
                    ok = np.flatnonzero(np.isfinite(y) & (w > 0))
                    q, k = Qx[:, t].reshape(-1, dh)[ok], Kx[:, t - D].reshape(-1, dh)[ok]
                    y, w = y[ok], w[ok]
                    for o in range(0, len(ok), CHUNK):
                        sl = slice(o, o + CHUNK)
                        yield q[sl], k[sl], k[sl] @ R.T, q[sl] @ R, y[sl], w[sl]
    return chunks


def _far_count(designs, dmin: int) -> int:
    """How many readings :func:`_far_chunks` yields over every head."""
    return sum(int(np.sum(np.isfinite(L[:, :, t, t - D]) & (W[:, :, t, t - D] > 0)))
               for X, L, W in designs for D, t in _offset_rows(X, dmin))


def _offset_rows(X: np.ndarray, dmin: int):
    """(D, t) for each offset D >= dmin that design X reads: the rows t whose key t - D (>= 1, after the zero
    token) and query are tokens that are not zero in every sequence."""
    N = X.shape[1]
    live = np.any(X != 0, axis=(0, 2))
    for D in range(int(dmin), N):
        t = np.arange(D + 1, N)
        t = t[live[t] & live[t - D]]
        if len(t):
            yield D, t


def _members(group: np.ndarray, g: int) -> list[int]:
    return [h for h in range(len(group)) if group[h] == g]


def _chunks_cost(chunks, Q: np.ndarray, K: np.ndarray, group: np.ndarray, dh: int) -> float:
    """The weighted squared misfit of every reading that ``chunks`` yields, over every group."""
    sq = np.sqrt(dh)
    return sum(float(np.sum((w * (np.einsum("re,re->r", q, Rk) / sq - y)) ** 2))
               for g in range(K.shape[0]) for q, _, Rk, _, y, w in chunks(g, Q, K, _members(group, g)))


def _mix_step(Q: np.ndarray, K: np.ndarray, group: np.ndarray, chunks, dh: int):
    """One Gauss-Newton step, per group, on the mixing E inside the d_h coordinates: ``K_g -> (I + E) K_g`` and
    every ``Q_h`` of the group ``-> (I + E)^{-T} Q_h``. To first order the logit changes by
    ``q^T (R E - E R) k / sqrt(d_h)`` (q = Q_h x_t, k = K_g x_i, R = R(-D theta)): linear in E's entries,
    solved exactly from the normal equations (minimum norm: the E that commute with every R are the symmetries).
    This is the direction the alternation moves slowly: the slow planes' basis, which only their small turn
    over the offsets read fixes. ``chunks`` as :func:`_subset_chunks` (or :func:`_far_chunks`)."""
    Q, K = Q.copy(), K.copy()
    sq = np.sqrt(dh)
    for g in range(K.shape[0]):
        members = _members(group, g)
        A = np.zeros((dh * dh, dh * dh))
        rhs = np.zeros(dh * dh)
        for q, k, Rk, Rtq, y, w in chunks(g, Q, K, members):
            r = np.einsum("re,re->r", q, Rk) / sq - y
            F = (np.einsum("ra,rb->rab", Rtq, k) - np.einsum("ra,rb->rab", q, Rk)).reshape(len(r), -1) / sq
            F *= w[:, None]
            A += F.T @ F
            rhs -= F.T @ (w * r)
        M = np.eye(dh) + lstsq(A, rhs, rcond=1e-12)[0].reshape(dh, dh)
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


def refine_scores(Q: np.ndarray, K: np.ndarray, theta: float, group: np.ndarray,
                  designs) -> tuple[np.ndarray, np.ndarray, dict]:
    """Stage Q (see the module). ``designs``: per form design (X, L, W) with L, W (n, H, N, N) the logits and
    their weights. Returns (Q, K, info)."""
    H, dh, d = Q.shape
    G = K.shape[0]
    freqs = float(theta) ** (-2.0 * np.arange(dh // 2) / dh)
    data = _readings(designs, group, H)
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
            members = _members(group, g)
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
    subset = _subset_chunks(data, freqs, dh)
    Q, K, best, mixes = _descend(lambda Q, K: _mix_step(Q, K, group, subset, dh), Q, K, best, cost, MIX_STEPS)
    n = sum(len(r[3]) for r in data)
    info = {"score_refit_sweeps": sweeps, "score_refit_mix_steps": mixes,
            "score_refit_rms_before": float(np.sqrt(start / n)), "score_refit_rms_after": float(np.sqrt(best / n)),
            "score_refit_readings": n}
    Q, K, far = _far_mix(Q, K, group, designs, freqs, dh)
    return Q, K, {**info, **far}


def _far_mix(Q: np.ndarray, K: np.ndarray, group: np.ndarray, designs, freqs: np.ndarray, dh: int):
    """The mixing inside the d_h coordinates once more, fitted to every reading at offsets >= ``FAR_OFFSETS`` x the
    largest offset read (see the module). Kept only where it lowers their misfit."""
    Dmax = max(X.shape[1] for X, _, _ in designs) - 2
    dmin = int(np.ceil(FAR_OFFSETS * Dmax))
    if dmin < 1 or dmin > Dmax:
        return Q, K, {"far_mix_steps": 0}
    far = _far_chunks(designs, freqs, dh, dmin)

    def cost(Qc, Kc):
        return _chunks_cost(far, Qc, Kc, group, dh)

    start = cost(Q, K)
    Q, K, best, steps = _descend(lambda Q, K: _mix_step(Q, K, group, far, dh), Q, K, start, cost, FAR_STEPS)
    n = _far_count(designs, dmin)
    return Q, K, {"far_mix_steps": steps, "far_mix_offsets": [dmin, Dmax], "far_mix_readings": n,
                  "far_mix_rms_before": float(np.sqrt(start / max(n, 1))),
                  "far_mix_rms_after": float(np.sqrt(best / max(n, 1)))}


__all__ = ["refine_scores"]
