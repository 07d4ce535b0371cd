"""Stage C of the vector method: every head's scores ``x_i^T W_h x_t + c_h^T x_i`` read from soft queries.

Once the heads' output spaces are known, the answer at position t splits into the heads' parts
``O_h z_{h,t}``, ``z_{h,t} = sum_i a_{h,t,i} x_i``; with n <= d_h + 1 tokens the coordinates of
``z_{h,t}`` fix the attention weights ``a_{h,t}``, and with them n - 1 score differences
``(x_i - x_j)^T (W_h x_t + c_h)`` per head, per position, per query.

The queries share *anchor* tokens: a query is ``[k_1..k_m, f_1..f_{n-m}]`` (anchors of one group, then
fresh tokens). Over the queries of a group the fresh tokens vary, so at an anchor position the score
gradient ``g_h(k) = W_h k + c_h`` (a vector of the key space ``row(K_h)``) is read along many fresh
directions and solved for; at fresh positions the differences between anchor scores read
``W_h^T (k_i - k_1)`` (vectors of the query space ``row(Q_h)``). A few groups give d_h + a margin
vectors of each; then ``W_h = A_h C_h B_h^T`` and ``c_h = A_h gamma_h`` with A_h, B_h bases of those
spaces, and the small core (C_h, gamma_h) is fitted by least squares to every score difference read.
With answers at the last position only, the two kinds of reads come from two kinds of queries (anchor
last, or fresh last). Causal layers: a position reads only the tokens before it, so anchors go last for
the key space and first for the query space.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import NotIdentifiable
from ...oracles.answers import Output
from ...oracles.base import Oracle
from ...linalg import lstsq, svd

FLOOR = 1e-4        # attention weights below FLOOR * max are not read (their log is noise)


@dataclass(frozen=True)
class Scores:
    A: tuple       # per head (d, r) key-space basis times core: W_h = A_h @ B_h.T
    B: tuple
    C: np.ndarray  # (H, d)
    queries: int
    reads: int
    fit_rms: float          # rms residual of the final score fit (in score units)
    token_norm: float


def _lstsq(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Least squares by column-pivoted QR (LAPACK gelsy): same answer as the SVD solver on these full-rank
    designs, several times faster (stage C solves thousands)."""
    from scipy.linalg import lstsq as scipy_lstsq
    return scipy_lstsq(A, B, lapack_driver="gelsy", check_finite=False)[0]


def joint_weights(G: np.ndarray, vis: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Every head's attention weights over the visible tokens at once: ``y = sum_h G_h[:, vis] a_h`` with
    ``G_h = O_h X^T`` (H, d_out, n) and each ``a_h`` summing to one, by one least-squares solve. Reading all
    heads jointly needs only the directions ``O_h x_i`` to be independent, not the heads' whole spaces: a
    real layer's stacked spaces are far worse conditioned (MiniLM layer 2: 1.6e3) than these few columns."""
    return _stack_weights(G[None][..., vis], y[None, :, None])[0, ..., 0]


def _stack_weights(G: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """:func:`joint_weights` for a stack of queries and answers: ``G`` (q, H, d_out, k) the visible tokens'
    directions, ``Y`` (q, d_out, p) answers minus b (p of them a query, one design for all); (q, H, k, p)
    weights, each summing to one over the k tokens."""
    nq, H, do, k = G.shape
    last = G[..., -1]                                                          # (q, H, d_out)
    F = (G[..., :-1] - last[..., None]).transpose(0, 2, 1, 3).reshape(nq, do, H * (k - 1))
    w = _solve_stack(F, Y - last.sum(1)[..., None]).reshape(nq, H, k - 1, -1)
    return np.concatenate([w, 1.0 - w.sum(2, keepdims=True)], 2)


@dataclass(frozen=True)
class Reads:
    """Stage C's queries and answers, kept so that the fit can be re-run when the O_h improve."""
    groups: tuple      # per group: tuple of (X, idx, answers) with answers (positions, d_out)
    n: int
    m: int
    causal: bool
    last: bool
    token_norm: float
    queries: int


def read_scores(oracle: Oracle, b: np.ndarray, O: np.ndarray, rng: np.random.Generator, *, causal: bool,
                oversample: float = 2.0, progress=None) -> tuple[Scores, Reads]:
    """Stage C (see the module docstring). ``O``: (H, d_out, d), every head's output map ``O_h``."""
    d = oracle.d
    r = int(np.linalg.matrix_rank(O[0], tol=1e-8 * np.linalg.norm(O[0], 2)))
    n = int(min(r // 2 + 1, 16, d + 1))          # half the equations spare: the weights are read well-conditioned
    n = max(n, 3)
    m = max(2, n // 2)
    nf = n - m
    want = r + max(4, r // 2)
    groups = int(np.ceil(want / (m - 1)))          # m - 1 query-space vectors per group (m key-space ones)
    per = int(np.ceil(oversample * (d + 1) / nf))
    R = oracle.input_norm
    # token norm for soft reads: calibrated so that score spreads are O(1)
    norm = 0.5 * R if R is not None else float(np.sqrt(d))
    norm, queries = _calibrate(oracle, b, O, rng, norm, n)
    last = oracle.output is Output.LAST

    def tok(k):
        return rng.standard_normal((k, d)) * (norm / np.sqrt(d))

    kept = []
    for g in range(groups):
        K = tok(m)
        if last:
            layouts = [("key", j) for j in range(m)] + [("qry", None)]
        elif causal:
            layouts = [("key-causal", None), ("qry", None)]
        else:
            layouts = [("qry", None)]                 # every position: anchors and fresh tokens both read
        group = []
        for kind, j in layouts:
            batch = []
            count = per
            if last:       # one read per query: d directions per anchor, d + 1 fresh query tokens per group
                count = int(np.ceil(oversample * d / (n - 1))) if kind == "key" else int(np.ceil(oversample * (d + 1)))
            for _ in range(count):
                Fr = tok(nf)
                if kind == "key":
                    X = np.vstack([np.delete(K, j, 0), Fr, K[j:j + 1]])
                    slots = list(range(j)) + list(range(j + 1, m))
                    idx = {**{p: (slots[p] if p < m - 1 else None) for p in range(m - 1)}, n - 1: j}
                elif kind == "key-causal":
                    X = np.vstack([Fr, K])
                    idx = {nf + i: i for i in range(m)}
                else:
                    X = np.vstack([K, Fr])
                    idx = {i: i for i in range(m)}
                batch.append((X, idx))
            Y = oracle.query(np.stack([X for X, _ in batch]))
            queries += len(batch)
            if progress is not None:
                progress(len(batch))
            for (X, idx), Yq in zip(batch, Y):
                group.append((X, idx, np.atleast_2d(Yq)))
        kept.append(tuple(group))
    reads = Reads(groups=tuple(kept), n=n, m=m, causal=causal, last=last, token_norm=norm, queries=queries)
    return fit_scores(reads, b, O, rng), reads


def _solve_stack(F: np.ndarray, R: np.ndarray) -> np.ndarray:
    """``argmin_w |F_q w - R_q|`` for every q of a stack (F: (q, m, k), full column rank; R: (q, m, p)) by one
    batched QR (the least-squares solution :func:`_lstsq` gives on full-rank designs, to rounding). A design
    whose triangle is nearly singular is solved by :func:`_lstsq` on its own."""
    Qm, Rm = np.linalg.qr(F)
    diag = np.abs(np.diagonal(Rm, axis1=-2, axis2=-1))
    poor = diag.min(-1) <= 1e-12 * np.maximum(diag.max(-1), 1e-300)
    if np.any(poor):
        Rm = Rm.copy()
        Rm[poor] = np.eye(Rm.shape[-1])              # solved below on their own
    w = np.linalg.solve(Rm, Qm.swapaxes(-1, -2) @ R)
    for q in np.flatnonzero(poor):
        w[q] = _lstsq(F[q], R[q])
    return w


def _run_weights(G: np.ndarray, Y: np.ndarray, positions, causal: bool) -> dict:
    """Every head's attention weights at every read position of a stack of queries (:func:`_stack_weights`;
    bidirectional: one design a query for all its positions): ``G`` (q, H, d_out, n), ``Y`` (q, positions,
    d_out) answers minus b; ``{t: (q, H, visible) weights}``."""
    if not causal:
        w = _stack_weights(G, Y.transpose(0, 2, 1))
        return {t: w[..., i] for i, t in enumerate(positions)}
    return {t: _stack_weights(G[..., :t + 1], Y[:, i, :, None])[..., 0] for i, t in enumerate(positions) if t >= 1}


def _runs(group):
    """The consecutive reads of one group that share a layout (the same anchor slots): ``(idx, X, answers)``
    stacked, with the reads' positions in the group."""
    runs, start = [], 0
    for k in range(1, len(group) + 1):
        if k == len(group) or group[k][1] != group[start][1]:
            part = group[start:k]
            runs.append((part[0][1], np.stack([X for X, _, _ in part]), np.stack([Y for _, _, Y in part]), start))
            start = k
    return runs


def fit_scores(reads: Reads, b: np.ndarray, O: np.ndarray, rng: np.random.Generator) -> Scores:
    """Every head's key and query spaces and its score core from the answers of :func:`read_scores`,
    with the output maps ``O``; no query is sent (run again when the ``O_h`` improve). The reads of one
    layout are taken together (one batched solve for their weights, masks for the log ratios); the equations
    come out in the order of one read at a time (query, position, token), so the fit is that order's."""
    H, _, d = O.shape
    r = int(np.linalg.matrix_rank(O[0], tol=1e-8 * np.linalg.norm(O[0], 2)))
    n, m, causal, last = reads.n, reads.m, reads.causal, reads.last
    positions = [n - 1] if last else list(range(n))
    key_rows = [[] for _ in range(H)]     # per head: key-space vectors g_h(k) = W_h k + c_h
    qry_rows = [[] for _ in range(H)]     # per head: query-space vectors W_h^T (k_i - k_0)
    eqs = [[] for _ in range(H)]          # per head: arrays (query, t, i, j, D, weight) of score differences
    Xs = np.stack([X for group in reads.groups for X, _, _ in group])   # (queries, n, d): rows built at the end
    q0 = 0
    nreads = 0
    for group in reads.groups:
        at_anchor = [[[] for _ in range(m)] for _ in range(H)]    # (directions, D, weight) per head per anchor
        anchor_diffs = [[] for _ in range(H)]                      # (query, t, x_t, D(k_i) - D(k_0), weight)
        for idx, X, Yq, first in _runs(group):
            nq = len(X)
            qids = q0 + first + np.arange(nq)
            G = np.einsum("hod,qnd->qhon", O, X)
            W_all = _run_weights(G, Yq - b, positions, causal)
            for t in positions:
                if t not in W_all:
                    continue
                nreads += nq
                aw = W_all[t]                                       # (q, H, visible)
                nv = aw.shape[-1]
                anc = {a_i: p for p, a_i in idx.items() if a_i is not None and p < nv}
                full = all(i in anc for i in range(m))
                for h in range(H):
                    a = aw[:, h]
                    ref = np.argmax(a, axis=1)
                    aref = a[np.arange(nq), ref]
                    ok = a > FLOOR * aref[:, None]
                    with np.errstate(divide="ignore", invalid="ignore"):
                        L = np.where(ok, np.log(np.where(ok, a, 1.0)), np.nan) - np.log(aref)[:, None]
                    sel = ok & (np.arange(nv)[None, :] != ref[:, None])
                    qs, js = np.nonzero(sel)                        # read by read, tokens in order
                    D = L[qs, js]
                    w = a[qs, js] * aref[qs] / (a[qs, js] + aref[qs])     # 1 / std of a log ratio
                    eqs[h].append(np.column_stack([qids[qs], np.full(len(qs), t), js, ref[qs], D, w]))
                    if idx.get(t) is not None:                      # an anchor's position: its g_h read
                        E = X[qs, js] - X[qs, ref[qs]]
                        at_anchor[h][idx[t]].append((E, D, w))
                    if full:                                        # anchor score differences at this position
                        cols = [anc[i] for i in range(m)]
                        vals = L[:, cols[1:]] - L[:, cols[:1]]
                        good = np.all(np.isfinite(vals), axis=1)
                        if np.any(good):
                            anchor_diffs[h].append((qids[good], np.full(int(good.sum()), t), X[good, t], vals[good],
                                                    a[good][:, cols].min(1)))
        q0 += len(group)
        for h in range(H):
            for i in range(m):
                lst = at_anchor[h][i]
                if not lst:
                    continue
                E = np.vstack([e for e, _, _ in lst])
                D = np.concatenate([x for _, x, _ in lst])
                w = np.concatenate([x for _, _, x in lst])
                if E.shape[0] >= d:
                    sol, _, rank_E, _ = lstsq(E * w[:, None], D * w, rcond=None)
                    if rank_E == d:                     # (lstsq's own rank: no second SVD)
                        key_rows[h].append(sol)
            if anchor_diffs[h]:
                qq, tt, xt, V, w = (np.concatenate([x[k] for x in anchor_diffs[h]]) for k in range(5))
                if len(qq) >= d + 1:
                    order = np.lexsort((tt, qq))            # read by read, as the reads were taken
                    Xt = np.hstack([xt[order], np.ones((len(qq), 1))])
                    sol, _, rank_X, _ = lstsq(Xt * w[order, None], V[order] * w[order, None], rcond=None)
                    if rank_X == d + 1:
                        qry_rows[h] += list(sol[:d].T)
    A, B, C, rms = [], [], [], []
    for h in range(H):
        Ka = np.array(key_rows[h]).T if key_rows[h] else np.zeros((d, 0))
        Qa = np.array(qry_rows[h]).T if qry_rows[h] else np.zeros((d, 0))
        if Ka.shape[1] < r or Qa.shape[1] < r:
            raise NotIdentifiable(f"head {h}: only {Ka.shape[1]} key-space and {Qa.shape[1]} query-space vectors "
                                  f"were read (need {r} each)")
        Ak = svd(Ka, full_matrices=False)[0][:, :r]
        Bq = svd(Qa, full_matrices=False)[0][:, :r]
        rows = np.concatenate(eqs[h])
        rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]     # read by read, tokens in order
        ee, DD, ww = rows[:, :4].astype(np.int64), rows[:, 4], rows[:, 5]
        if len(DD) > 20000:
            pick = rng.choice(len(DD), 20000, replace=False)
            ee, DD, ww = ee[pick], DD[pick], ww[pick]
        xx = Xs[ee[:, 0], ee[:, 1]]
        ee = Xs[ee[:, 0], ee[:, 2]] - Xs[ee[:, 0], ee[:, 3]]
        ea, xb = ee @ Ak, xx @ Bq
        Phi = np.hstack([(ea[:, :, None] * xb[:, None, :]).reshape(len(DD), -1), ea])
        sol = _lstsq(Phi * ww[:, None], DD * ww)
        core = sol[:r * r].reshape(r, r)
        rms.append(float(np.sqrt(np.mean((Phi @ sol - DD) ** 2))))
        A.append(Ak @ core)
        B.append(Bq)
        C.append(Ak @ sol[r * r:])
    return Scores(A=tuple(A), B=tuple(B), C=np.array(C), queries=reads.queries, reads=nreads, fit_rms=max(rms),
                  token_norm=reads.token_norm)


def _calibrate(oracle, b, O, rng, norm, n) -> tuple[float, int]:
    """Scale the soft tokens so that the widest score spread of one probe query is about 4."""
    d = oracle.d
    R = oracle.input_norm
    q = 0
    for _ in range(3):
        q += 1
        X = rng.standard_normal((n, d)) * (norm / np.sqrt(d))
        y = oracle.query([X])
        y_t = y[0] if oracle.output is Output.LAST else y[0][-1]
        a = np.clip(joint_weights(np.einsum("hod,nd->hon", O, X), np.arange(n), y_t - b), 1e-12, None)
        spread = float(np.max(np.log(a.max(1) / a.min(1))))
        if 1.0 <= spread <= 8.0:
            break
        factor = np.sqrt(4.0 / max(spread, 1e-3))
        norm *= float(np.clip(factor, 0.25, 4.0))
        if R is not None:
            norm = min(norm, R)
    return norm, q
