"""Stage B of the vector method: the heads' output spaces ``S_h = col(O_h)`` from saturated two-token queries.

For a two-token query ``[u, v]`` whose scores are far apart for every head, each head attends to one
token only, so near ``u`` the answer at a position is *exactly linear* in u: ``y(u + p) - y(u) = O_S p``
with ``O_S = sum_{h in S} O_h`` over the heads S that attend to u there. Its column space is
``(+)_{h in S} S_h`` and the column space of ``M - O_S`` (``M = sum_h O_h``) is the other heads' sum; the
oblique projector onto the first along the second splits every current part of ``col(M)`` into its 1- and
0-eigenspaces, so a handful of random (u, v) separates the heads: two heads stay together only if every
map saw them attend alike. The projector is built from the two column spaces (ranks read from the maps'
singular values against the answers' measured noise), never from ``M^+``: a real layer's M is far worse
conditioned than its heads' spaces (MiniLM layer 2: condition 5.6e5 against 1.6e3), and ``O_S M^+``
drowns in rounding there. With answers at every position, one map per position comes from the same
d + 1 queries.

Saturation needs scores far apart (|score gap| >~ 20 in float32): without an input-norm bound the
tokens are simply long; under ``--input-norm R`` a position is used only where a second-difference test
(3 queries per candidate) shows the answer linear in u, and a map only where its two column spaces
have clean ranks that add up to rank M. Heads whose scores stay soft are left out of that map.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import NotIdentifiable
from ...oracles.answers import Output
from ...oracles.base import Oracle
from .affine import Affine, token_scale
from ...linalg import lstsq, pinv, svd

CANDIDATES = 8       # two-token configurations screened per map (3 queries each)
ETA = 0.01           # perturbation of u, relative to the token norm: small, so no head desaturates across it
GAP = 30.0           # a map's column spaces are used only where their singular values drop by this factor
SPLIT_TOL = 0.1      # a part is split only where every eigenvalue of the map on it is within this of 0 or 1


@dataclass(frozen=True)
class Spaces:
    bases: tuple          # one (d_out, r_h) orthonormal basis per head
    rank: int             # rank of M
    maps: int             # clean maps used
    rejected: int         # maps or positions refused as not saturated
    queries: int
    idempotency: float    # worst distance of a split part's eigenvalues from 0 or 1
    history: list = field(default_factory=list)
    maps_used: tuple = ()  # (J, P, noise, (u, v, basis, position)) of every clean map: J = O_S measured, P the
    noise_M: float = 0.0   # projector onto its heads' spaces, noise the spectral norm of J's error; noise_M: M's (same)


def _rank(M: np.ndarray, rel_noise: float) -> tuple[np.ndarray, int, np.ndarray]:
    U, s, Vt = svd(M, full_matrices=False)
    tol = s[0] * max(30 * rel_noise * np.sqrt(M.shape[0]), 1e-10)     # 30 x the noise one answer carries
    r = int(np.sum(s > tol))
    return U[:, :r], r, s


def _split(parts: list[np.ndarray], P: np.ndarray) -> tuple[list[np.ndarray], bool, float]:
    """Split each part (an r x m basis of a sum of heads' spaces, in col(M) coordinates) into its
    1- and 0-eigenspaces under the projector P (r x r); also the worst eigenvalue deviation of a split."""
    out, split, dev = [], False, 0.0
    for B in parts:
        m = B.shape[1]
        Pb = lstsq(B, P @ B, rcond=None)[0]                       # P restricted to the part
        ev = np.linalg.eigvals(Pb).real
        k = int(np.sum(ev > 0.5))
        off = float(np.max(np.minimum(np.abs(ev), np.abs(ev - 1))))
        if k <= 0 or k >= m or off > SPLIT_TOL:
            out.append(B)                     # no split, or not clearly a projector on this part: keep it whole
            continue
        dev = max(dev, off)
        U1 = svd(Pb)[0][:, :k]
        U0 = svd(np.eye(m) - Pb)[0][:, :m - k]
        out += [np.linalg.qr(B @ U1)[0], np.linalg.qr(B @ U0)[0]]
        split = True
    return out, split, dev


def _col_rank(J: np.ndarray, noise: float) -> tuple[np.ndarray, int, float]:
    """Left singular vectors of J, its rank and the gap there. The rank is the widest ratio gap among the
    singular values above 10x the noise's spectral norm (a head that is nearly but not wholly saturated
    leaks small rank-one terms above the noise; the heads' own singular values sit orders higher)."""
    U, s, _ = svd(J, full_matrices=False)
    floor = max(noise, 1e-300)
    above = int(np.sum(s > 10.0 * floor))
    if above == 0:
        return U, 0, float("inf")
    nxt = np.maximum(np.append(s[1:], 0.0), floor)
    ratio = s[:above] / nxt[:above]
    k = int(np.argmax(ratio)) + 1
    return U, k, float(ratio[k - 1])


def _projector(Ub: np.ndarray, J: np.ndarray, M: np.ndarray, noise_J: float, noise_M: float):
    """The oblique projector (in col(M) coordinates) onto col(J) along col(M - J), or None where the two
    column spaces do not have clean ranks adding up to rank M (a soft head, a map that is not an O_S)."""
    r = Ub.shape[1]
    U1, k1, g1 = _col_rank(J, noise_J)
    U0, k0, g0 = _col_rank(M - J, noise_J + noise_M)
    if k1 + k0 != r or min(g1, g0) < GAP:
        return None, (k1, k0, min(g1, g0))
    T = np.hstack([Ub.T @ U1[:, :k1], Ub.T @ U0[:, :k0]])
    if np.linalg.cond(T) > 1e8:
        return None, (k1, k0, min(g1, g0))
    D = np.zeros(r)
    D[:k1] = 1.0
    return (T * D) @ np.linalg.inv(T), (k1, k0, min(g1, g0))


def _tokens(rng, d, norm, k):
    x = rng.standard_normal((k, d))
    return x * (norm / np.linalg.norm(x, axis=1, keepdims=True))


def head_spaces(oracle: Oracle, aff: Affine, rng: np.random.Generator, *, heads: int | None = None,
                max_maps: int = 40, patience: int = 4, progress=None) -> Spaces:
    """Separate the heads' output spaces (see the module docstring); ``heads`` None: find how many."""
    d = oracle.d
    Ub, r, sv = _rank(aff.M, aff.rel_noise)
    if heads is not None and r % heads and min(aff.M.shape) % heads:     # (rank M may still be revised up)
        raise NotIdentifiable(f"M = sum_h O_h has rank {r}, which {heads} heads of equal size cannot make "
                              "(give --heads auto, or check --heads)")
    Uall = svd(aff.M, full_matrices=False)[0]
    R = oracle.input_norm
    rho = 0.97 * R if R is not None else 30.0 * np.sqrt(d)
    eta = ETA
    sigma = max(aff.sigma, 1e-300)
    tol_lin = 30.0 * sigma * np.sqrt(aff.M.shape[0]) + 1e-13 * aff.scale
    dO, dI = aff.M.shape
    spec = np.sqrt(dO) + np.sqrt(dI)
    noise_M = sigma * spec / token_scale(dI, R) + 1e-15 * sv[0]        # spectral norm of M's error
    parts = [np.eye(r)]
    used = []
    ranks_seen = {}
    queries, maps, rejected, still, worst = 0, 0, 0, 0, 0.0
    history = []
    positions = 2 if oracle.output is Output.ALL else 1
    rounds = 0
    while maps < max_maps and rounds < 4 * max_maps:
        rounds += 1
        # screen candidates: [u, v], [u + p, v], [u - p, v]
        U_ = _tokens(rng, d, rho * (1 - eta), CANDIDATES)
        V_ = _tokens(rng, d, rho, CANDIDATES)
        P_ = _tokens(rng, d, eta * rho, CANDIDATES)
        seqs = np.concatenate([np.stack([U_, V_], 1), np.stack([U_ + P_, V_], 1), np.stack([U_ - P_, V_], 1)])
        Y = oracle.query(seqs)
        queries += len(seqs)
        if oracle.output is Output.LAST:
            Y = Y[:, None, :]
        y0, yp, ym = Y[:CANDIDATES], Y[CANDIDATES:2 * CANDIDATES], Y[2 * CANDIDATES:]
        second = np.max(np.abs(yp + ym - 2 * y0), axis=2)               # (candidates, positions)
        clean = second <= tol_lin
        best = int(np.argmax(clean.sum(axis=1)))
        if not clean[best].any():
            rejected += 1
            if R is None:
                rho *= 2.0                                             # unbounded: longer tokens saturate more
            continue
        u, v = U_[best], V_[best]
        basis = np.linalg.qr(rng.standard_normal((d, d)))[0] * (eta * rho)
        batch = np.stack([np.stack([u + basis[:, k], v]) for k in range(d)])
        Yb = oracle.query(batch)
        queries += d
        if oracle.output is Output.LAST:
            Yb = Yb[:, None, :]
        split_any = False
        noise_J = np.sqrt(2.0) * sigma * spec / (eta * rho) + 1e-15 * sv[0]
        for pos in range(positions):
            if not clean[best, pos]:
                rejected += 1
                continue
            J = (Yb[:, pos, :] - y0[best, pos]).T @ np.linalg.inv(basis)
            if maps == 0 and not used:
                # a float32 layer's M can be numerically rank-deficient at the answers' noise while its heads'
                # spaces are not (MiniLM: 378 of 384): the first clean map's two column spaces tell rank M
                k1 = _col_rank(J, noise_J)[1]
                k0 = _col_rank(aff.M - J, noise_J + noise_M)[1]
                ranks_seen[k1 + k0] = ranks_seen.get(k1 + k0, 0) + 1
                if r < k1 + k0 <= min(dO, dI) and ranks_seen[k1 + k0] >= 2:
                    r = k1 + k0
                    Ub = Uall[:, :r]
                    parts = [np.eye(r)]
            P, info = _projector(Ub, J, aff.M, noise_J, noise_M)
            if P is None:
                rejected += 1
                continue
            maps += 1
            used.append((J, P, noise_J * max(rho / token_scale(dI, R), 1.0),     # rounding grows with |u|
                         (u, v, basis, pos if positions == 2 else 1)))   # the token position read
            parts, split, dev = _split(parts, P)
            worst = max(worst, dev)
            split_any |= split
            history.append({"map": maps, "parts": [int(B.shape[1]) for B in parts], "ranks": info[:2],
                            "gap": info[2]})
        if progress is not None:
            progress(len(seqs) + d)
        dims = sorted({int(B.shape[1]) for B in parts})
        still = 0 if split_any else still + 1
        if heads is not None:
            if len(parts) == heads and dims == [r // heads]:
                break
        elif len(dims) == 1 and len(parts) > 1 and still >= patience:
            break
    dims = [int(B.shape[1]) for B in parts]
    if maps == 0:
        from ...errors import ModelMismatch
        raise ModelMismatch(
            f"the target does not behave like one attention layer: none of {rounds} two-token configurations "
            f"({queries} queries) gave an answer that is linear in one token and a projector through M = sum_h O_h "
            f"({rejected} refused); a deeper model, or scores too soft to saturate under the input-norm bound",
            check="saturated maps", figure=float(rejected), threshold=0.0)
    if heads is not None and not (len(parts) == heads and set(dims) == {r // heads}):
        raise NotIdentifiable(f"the heads' output spaces were not separated into {heads} parts of dimension "
                              f"{r // heads} after {maps} saturated maps (the stage's cap is {max_maps}; {queries} "
                              f"queries): parts of dimensions {dims} ({rejected} maps or positions were not saturated); "
                              "two heads that no map saturated apart stay merged")
    if heads is None and len(set(dims)) != 1:
        raise NotIdentifiable(f"the heads' output spaces split into parts of unequal dimensions {dims} after "
                              f"{maps} saturated maps (the stage's cap is {max_maps}; {queries} queries); give --heads H "
                              "if the head count is known")
    bases = tuple(Ub @ B for B in parts)
    return Spaces(bases=bases, rank=r, maps=maps, rejected=rejected, queries=queries, idempotency=worst,
                  history=history, maps_used=tuple((J, Ub @ P @ Ub.T, nz, at) for J, P, nz, at in used), noise_M=noise_M)


def _leak(at, sel, W, c, O) -> np.ndarray:
    """What the heads that are nearly but not wholly saturated add to a measured map (d_out x d), under the
    current model (W, c, O): the map is ``sum_h O_h dZ_h basis^-1`` with ``dZ_h`` the change of head h's
    attended vector; the saturated part is ``sel_h O_h``, the rest is ``e^-gap``-small and is this."""
    from scipy.special import expit
    u, v, basis, pos = at
    P = basis.T                                                          # (d, d) rows: the perturbations
    Xu = u[None] + P                                                     # token 0 of every perturbed query
    out = np.zeros((O.shape[1], P.shape[0]))
    for h in range(len(O)):
        def gap(x0):                                                     # score of token 0 minus token 1
            xt = x0 if pos == 0 else np.broadcast_to(v, x0.shape)
            return np.einsum("...i,ij,...j->...", x0 - v, W[h], xt) + (x0 - v) @ c[h]
        g0, gj = gap(u), gap(Xu)
        if sel[h] > 0.5:
            da = -expit(-gj)[:, None] * P + (expit(-g0) - expit(-gj))[:, None] * (u - v)[None]
        else:
            da = expit(gj)[:, None] * P + (expit(gj) - expit(g0))[:, None] * (u - v)[None]
        out += O[h] @ da.T
    return out @ np.linalg.inv(basis)


def output_maps(sp: Spaces, M: np.ndarray, model=None) -> tuple[np.ndarray, int]:
    """Every head's ``O_h`` (H, d_out, d) and the rank of the selection design used.

    Each clean map is a measured ``O_S = sum_{h in S} O_h`` whose heads S are read off its projector, and
    ``M`` is the sum of all: where the 0/1 selections have full column rank H, the ``O_h`` follow by weighted
    least squares over all of them, without inverting the heads' stacked spaces (their conditioning does
    not enter); each is then cut to its rank. Otherwise ``O_h = P_h M`` with ``P_h`` the oblique projector
    onto ``S_h`` along the other heads' spaces. ``model`` (W, c, O) in the heads' order: each map is first
    cleared of what the not-wholly-saturated heads add to it under that model (float32 layers: a head
    20 logits from the switch still adds ~1e-4 through the long tokens; see :func:`_leak`)."""
    bases = sp.bases
    H = len(bases)
    r = bases[0].shape[1]
    rows, mats, wts = [np.ones(H)], [M], [1.0 / max(sp.noise_M, 1e-300)]
    for J, P, nz, at in sp.maps_used:
        sel = np.array([np.linalg.norm(P @ B) / np.linalg.norm(B) for B in bases])
        if np.any(np.abs(sel - np.round(sel)) > 0.25):
            continue                                  # a map whose heads are not clearly in or out
        if model is not None:
            J = J - _leak(at, np.round(sel), *model)
        rows.append(np.round(sel))
        mats.append(J)
        wts.append(1.0 / max(nz, 1e-300))
    O, rank = solve_output_maps(rows, mats, [1.0 / w for w in wts], r)
    if O is not None:
        return O, rank
    Ball = np.hstack(bases)
    Binv = pinv(Ball)
    return np.stack([bases[h] @ (Binv[h * r:(h + 1) * r] @ M) for h in range(H)]), rank


def solve_output_maps(rows, mats, noises, r: int) -> tuple[np.ndarray | None, int]:
    """``O_h`` (H, d_out, d) from maps ``mats[k] = sum_h rows[k][h] O_h`` by least squares weighted by
    1 / noise, each cut to rank r; None where the selections do not have full column rank."""
    w = 1.0 / np.maximum(np.asarray(noises, dtype=float), 1e-300)
    S = np.asarray(rows, dtype=float) * w[:, None]
    H = S.shape[1]
    rank = int(np.linalg.matrix_rank(S))
    if rank < H:
        return None, rank
    O = np.einsum("hk,kij->hij", pinv(S), np.stack(mats) * w[:, None, None])
    out = []
    for h in range(H):
        U, s, Vt = svd(O[h], full_matrices=False)
        out.append((U[:, :r] * s[:r]) @ Vt[:r])
    return np.stack(out), rank
