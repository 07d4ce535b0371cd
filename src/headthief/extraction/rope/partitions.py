"""Stage H of ``--method rope``: every head's ``O_h = Wo_h V_g`` from saturated causal queries, the key/value
groups, and the one-token map ``M = sum_h O_h`` with the output bias ``b``.

Long tokens make every head attend to one token only (its largest score wins by a gap that grows as the
square of the length), and then the answer at row t is *exactly linear* in the tokens::

    y_t = sum_{j <= t} J_{t,j} x_j + b,      J_{t,j} = sum_{h : head h picks token j at row t} O_h.

One base sequence of N long tokens and N d one-coordinate perturbations (plus a few random ones that test the
linearity) give every ``J_{t,j}``: at each row t a partition of the heads into t + 1 classes, N partitions from
one set of queries. ``J_{0,0} = M`` (position 0 sees only itself), and ``J_{t,j} = 0`` for j > t is the causal
mask, checked on every row (a bidirectional layer fails here).

From the classes:

* the head dimension d_h is the smallest rank of a class; a class of rank d_h holds the heads of one key/value
  group (heads of one group share ``V_g``: ``sum_{h in S} Wo_h V_g`` has rank d_h), so those classes' row
  spaces are the groups' value spaces ``row(V_g)``;
* every class splits over the groups with the dual basis of the stacked ``V_g``: ``J = sum_g W_g V_g``;
* inside a group the classes are 0/1 sums of the heads' ``Wo_h``: the heads are the atoms, found as the r
  observed classes (r the rank of the group's classes) in which every class is a 0/1 sum (a search over the
  most frequent classes; non-GQA groups have r = 1).

Rows where a head was not saturated (the linearity test fails) are left out; further rounds with fresh base
tokens run until the split is complete (at most ``max_rounds``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ...errors import ModelMismatch, NotIdentifiable
from ...oracles.base import Oracle
from ...linalg import lstsq, pinv, svd

CHECKS = 4            # random perturbations per round that test the exact linearity of every row
LAM32 = 100.0        # float32 answers: stage H's token scale (entries ~ lam)
ETA32 = 0.2          # float32 answers: the first round's moves, x lam (reads the O_h most precisely)
ETA32_RETRY = 0.05   # and every later round's, and a second stage H's: a move of 0.2 lam changes which token a
                     # head picks on most rows at d = 64 (45 of 72 rows rejected, 6 of 20 seeds 4000..4019 did not
                     # split or split wrongly); 0.05 lam split all of them, at 4x the O_h error stage O starts from
SEARCH_CANDIDATES = 20   # most frequent distinct classes tried as a group's heads (combinations of r of them)


@dataclass(frozen=True)
class Heads:
    """What stage H found. ``O`` (H, d, d): every head's ``Wo_h V_g``; ``group`` (H,): its key/value group;
    ``V`` (G, d_h, d): an orthonormal basis of each group's value space; ``Wo`` (d, H d_h): ``O_h = Wo_h V_g``;
    ``M``, ``b``: the one-token map and the output bias."""

    O: np.ndarray
    group: np.ndarray
    V: np.ndarray
    Wo: np.ndarray
    M: np.ndarray
    b: np.ndarray
    queries: int
    info: dict = field(default_factory=dict)

    @property
    def heads(self) -> int:
        return int(self.O.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.V.shape[1])


def _rank(A: np.ndarray, tol: float) -> int:
    s = svd(A, compute_uv=False)
    return int(np.sum(s > tol * max(s[0], 1e-300))) if s.size else 0


def _row_basis(A: np.ndarray, r: int) -> np.ndarray:
    return svd(A, full_matrices=False)[2][:r]


def _subspace_gap(P: np.ndarray, Q: np.ndarray) -> float:
    """Sine of the largest principal angle between the row spaces of two orthonormal bases (r x d)."""
    s = svd(P @ Q.T, compute_uv=False)
    return float(np.sqrt(max(0.0, 1.0 - float(np.min(s)) ** 2)))


def measure_round(oracle: Oracle, N: int, lam: float, eta: float, rng: np.random.Generator, tol: float):
    """One base sequence of N tokens of entries ~ lam, every coordinate moved by eta, and CHECKS random
    moves: the classes ``J_{t,j}`` of every row whose answers are linear in the tokens to ``tol`` (relative).
    Returns (rows: {t: [J_{t,0}, ..., J_{t,t}]}, future: largest |dy_t/dx_j| over j > t relative to the
    answers' Jacobian scale, M (J_00), rejected rows, queries)."""
    d = oracle.d
    base = lam * rng.standard_normal((N, d))
    moves = np.repeat(base[None], N * d + 1 + CHECKS, axis=0)
    for k in range(N * d):
        moves[1 + k, k // d, k % d] += eta
    Z = rng.standard_normal((CHECKS, N, d)) * (eta / np.sqrt(N * d))
    moves[1 + N * d:] += Z
    before = oracle.queries
    Y = np.asarray(oracle.query(moves), dtype=np.float64)            # (n, N, d)
    y0 = Y[0]
    J = (Y[1:1 + N * d] - y0[None]).reshape(N, d, N, d) / eta         # [j, c, t, :] = dy_t / dx_{j,c}
    J = J.transpose(2, 3, 0, 1)                                       # [t, :, j, c]
    scale = float(np.max(np.abs(J[0, :, 0, :]))) or 1.0
    future = 0.0
    for t in range(N - 1):
        future = max(future, float(np.max(np.abs(J[t, :, t + 1:, :]))) / scale)
    rows, rejected = {}, []
    pred = y0[None] + np.einsum("tajc,kjc->kta", J, Z)
    for t in range(N):
        err = float(np.max(np.abs(pred[:, t] - Y[1 + N * d:, t])))
        ref = float(np.max(np.abs(Y[:, t] - y0[t]))) or 1.0
        if err > tol * ref:
            rejected.append((t, err / ref))
            continue
        rows[t] = [J[t, :, j, :].copy() for j in range(t + 1)]
    return rows, future, J[0, :, 0, :].copy(), rejected, oracle.queries - before


def _atoms(points: list[np.ndarray], counts: list[int], total: np.ndarray, tol: float):
    """The r atoms of a group: the first r observed classes (d x d_h each), most frequent first, of which every
    class and the group's total are 0/1 sums (singletons recur most). Returns (atoms, None) or (None, reason)."""
    P = np.stack([p.ravel() for p in points])
    s = svd(P, compute_uv=False)
    r = int(np.sum(s > tol * s[0]))
    targets = np.vstack([P, total.ravel()[None]]).T                    # every class and the total, (n, m + 1)
    scale = float(np.max(np.abs(P)))
    order = np.argsort(-np.asarray(counts), kind="stable")[:SEARCH_CANDIDATES]
    for combo in itertools.combinations(order, r):
        A = P[list(combo)].T                                          # (n, r)
        if _rank(A, tol) < r:
            continue
        bits = np.round(lstsq(A, targets, rcond=None)[0])
        if np.any((bits != 0) & (bits != 1)) or not np.all(bits[:, -1] == 1):
            continue
        if float(np.max(np.abs(A @ bits - targets))) / scale <= 10 * tol:
            return [points[i] for i in combo], None
    return None, f"no {r} classes of which every class is a 0/1 sum"


def _refit(atoms: list[np.ndarray], obs: list[np.ndarray]) -> list[np.ndarray]:
    """The atoms by least squares over every class (and the group's total) as its 0/1 sum of them; classes
    that fit ten times worse than the median (a nearly unsaturated head leaked into them) are left out."""
    A = np.stack([a.ravel() for a in atoms]).T                        # (n, r)
    Y = np.stack([o.ravel() for o in obs]).T                          # (n, m)
    bits = np.round(lstsq(A, Y, rcond=None)[0])             # (r, m)
    keep = np.ones(Y.shape[1], bool)
    for _ in range(2):
        X = lstsq(bits[:, keep].T, Y[:, keep].T, rcond=None)[0]    # (r, n)
        res = np.linalg.norm(Y - X.T @ bits, axis=0)
        keep = res <= 10 * np.median(res[keep]) + 1e-300
        if np.linalg.matrix_rank(bits[:, keep]) < len(atoms):
            break
    return [x.reshape(atoms[0].shape) for x in X]


def split_heads(all_rows: list[dict], M: np.ndarray, tol: float, heads: int | None):
    """Groups and heads from the classes of every accepted row (see the module). Raises NotIdentifiable when
    the classes seen so far do not split (the caller runs another round)."""
    classes = [Jc for rows in all_rows for t, Js in rows.items() if t > 0 for Jc in Js]
    mscale = float(np.linalg.norm(M, 2))
    nz = [Jc for Jc in classes if np.linalg.norm(Jc, 2) > tol * mscale]
    if not nz:
        raise NotIdentifiable("no row attended to a single token per head")
    ranks = [_rank(Jc, tol) for Jc in nz]
    dh = min(ranks)
    # a class whose rank is not a multiple of d_h holds a head that was nearly unsaturated: left out
    keep = [r % dh == 0 for r in ranks]
    nz = [Jc for Jc, k in zip(nz, keep) if k]
    ranks = [r for r, k in zip(ranks, keep) if k]
    bases = [_row_basis(Jc, dh) for Jc, r in zip(nz, ranks) if r == dh]
    groups: list[list[np.ndarray]] = []
    for B in bases:
        for g in groups:
            if _subspace_gap(g[0], B) < np.sqrt(tol):       # halfway (log scale) between the noise and 1
                g.append(B)
                break
        else:
            groups.append([B])
    V = np.stack([_row_basis(np.vstack(g), dh) for g in groups])      # (G, dh, d)
    G = V.shape[0]
    Vs = V.reshape(G * dh, -1)
    D = pinv(Vs)                                            # (d, G dh): V_g D_g' = delta
    # every class must lie in the groups' value spaces
    worst = 0.0
    for Jc in nz:
        worst = max(worst, float(np.linalg.norm(Jc - Jc @ D @ Vs, 2)) / mscale)
    if worst > 30 * tol:
        raise NotIdentifiable(f"the classes leave the value spaces found so far (residual {worst:.2g}): some "
                              "group never attended alone")
    O, grp, Wo_cols = [], [], []
    for g in range(G):
        Dg = D[:, g * dh:(g + 1) * dh]
        pts, cnt = [], []
        for Jc in nz:
            W = Jc @ Dg
            if np.linalg.norm(W, 2) <= tol * mscale:
                continue
            for i, p in enumerate(pts):
                if np.linalg.norm(p - W, 2) <= 10 * tol * max(np.linalg.norm(W, 2), 1e-300):
                    cnt[i] += 1
                    break
            else:
                pts.append(W)
                cnt.append(1)
        total = M @ Dg
        atoms, why = _atoms(pts, cnt, total, tol)
        if atoms is None:
            raise NotIdentifiable(f"group {g}: {why}")
        atoms = _refit(atoms, [Jc @ Dg for Jc in nz] + [total])
        for a in atoms:
            O.append(a @ V[g])
            grp.append(g)
            Wo_cols.append(a)
    if heads is not None and len(O) != heads:
        raise NotIdentifiable(f"found {len(O)} heads so far, {heads} given")
    return np.stack(O), np.asarray(grp), V, np.concatenate(Wo_cols, axis=1), {"head_dim": dh, "kv_heads": G}


def round_tokens(max_len: int) -> int:
    """Tokens of stage H's base sequence: a round costs round_tokens * d + 1 + CHECKS queries."""
    return int(min(max_len, 12))


def find_heads(oracle: Oracle, rng: np.random.Generator, *, precision: float, heads: int | None = None,
               max_len: int = 16, max_rounds: int = 6, lam: float | None = None, retry: bool = False,
               progress=None) -> Heads:
    """Stage H (see the module). ``precision``: the answers' relative precision (eps of float32/float64).
    ``retry``: float32 answers, every round with the smaller moves (``ETA32_RETRY``; without it the first round
    moves by ``ETA32`` and the later ones by ``ETA32_RETRY``)."""
    d = oracle.d
    N = round_tokens(max_len)
    # long tokens: scores ~ lam^2 apart; a one-coordinate move eta changes them by ~ lam eta. The classes are
    # read to ~ precision * (lam / eta) * sqrt(d) relative (the answers' rounding over the move)
    # float32: lam = 100 (30 left rows unsaturated: rope-mha d=64 float32 seeds 5003 and 5006 did not split in 6
    # rounds, 5007 split into 6 heads; at 100 all three split right, and no seed measured lost O_h precision)
    lam = float(lam if lam is not None else (200.0 if precision < 1e-10 else LAM32))
    # float32: eta = 0.2 lam first (0.5 read O_h twice as precisely at d = 256, but changed which token a head
    # picks on so many rows at d = 64 that 3 of 8 seeds did not split; measured, docs/decoder.md), then 0.05 lam
    def eta_of(rnd):
        return lam * (0.01 if precision < 1e-10 else ETA32 if rnd == 0 and not retry else ETA32_RETRY)

    all_rows, rejected, queries, last = [], [], 0, None
    M = None
    b = np.asarray(oracle.query(np.zeros((1, 1, d))), dtype=np.float64)[0, 0]     # the zero token: y = b exactly
    queries += 1
    for rnd in range(max_rounds):
        eta = eta_of(rnd)
        tol = 100.0 * precision * (lam / eta) * np.sqrt(d)       # the loosest so far: rounds are pooled
        rows, future, M_r, rej, q = measure_round(oracle, N, lam, eta, rng, tol)
        queries += q
        if progress is not None:
            progress(q)
        if future > 100 * tol:
            raise ModelMismatch(
                f"position t's answer moves with tokens after t (|dy_t/dx_j|, j > t, up to {future:.3g} of the "
                "one-token map): the layer is not causal (a bidirectional layer); --method rope needs a causal "
                "decoder layer", check="causal mask", figure=future, threshold=100 * tol)
        M = M_r if M is None else M
        all_rows.append(rows)
        rejected += [(rnd, t, e) for t, e in rej]
        try:
            O, grp, V, Wo, info = split_heads(all_rows, M, tol, heads)
        except NotIdentifiable as e:
            last = e
            continue
        sum_err = float(np.linalg.norm(O.sum(0) - M)) / float(np.linalg.norm(M))
        if sum_err > 10 * tol:
            last = NotIdentifiable(f"the heads found do not add up to the one-token map (error {sum_err:.2g})")
            continue
        info.update({"rounds": rnd + 1, "rows_rejected": len(rejected), "tokens_per_query": N, "lam": lam,
                     "eta": eta, "linearity_tol": tol, "sum_rel_err": sum_err, "stage_h_retry": bool(retry)})
        return Heads(O=O, group=grp, V=V, Wo=Wo, M=M, b=b, queries=queries, info=info)
    raise NotIdentifiable(f"the heads did not split after {max_rounds} rounds of saturated queries "
                          f"({queries} queries; {len(rejected)} rows not saturated): {last}")


__all__ = ["Heads", "find_heads", "measure_round", "split_heads"]
