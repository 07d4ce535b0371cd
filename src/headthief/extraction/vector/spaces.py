"""Stage B of the vector method: the heads' output spaces ``S_h = col(O_h)`` from saturated two-token queries.

For a two-token query ``[u, v]`` whose scores are far apart for every head, each head attends to one
token only, so near ``u`` the answer at a position is *exactly linear* in u: ``y(u + p) - y(u) = O_S p``
with ``O_S = sum_{h in S} O_h`` over the heads S that attend to u there. ``O_S M^+`` is then the oblique
projector onto ``(+)_{h in S} S_h`` along the other heads' spaces (``M = sum_h O_h``), and all such
projectors commute. Each one splits every current part of ``col(M)`` into its 1- and 0-eigenspaces, so a
handful of random (u, v) separates the heads: two heads stay together only if every map saw them attend
alike. With answers at every position, one map per position comes from the same d + 1 queries.

Saturation needs scores far apart (|score gap| >~ 20 in float32): without an input-norm bound the
tokens are simply long; under ``--input-norm R`` a position is used only where a second-difference test
(3 queries per candidate) shows the answer linear in u, and a map only where its projector is
idempotent to the answers' precision. Heads whose scores stay soft are left out of that map.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import NotIdentifiable
from ...oracles.answers import Output
from ...oracles.base import Oracle
from .affine import Affine

CANDIDATES = 8       # two-token configurations screened per map (3 queries each)
ETA = 0.02           # perturbation of u, relative to the token norm
SPLIT_TOL = 0.1      # a part is split only where every eigenvalue of the map on it is within this of 0 or 1


@dataclass(frozen=True)
class Spaces:
    bases: tuple          # one (d_out, r_h) orthonormal basis per head
    rank: int             # rank of M
    maps: int             # clean maps used
    rejected: int         # maps or positions refused as not saturated
    queries: int
    idempotency: float    # worst ||P^2 - P|| of the maps used
    history: list = field(default_factory=list)


def _rank(M: np.ndarray, rel_noise: float) -> tuple[np.ndarray, int, np.ndarray]:
    U, s, Vt = np.linalg.svd(M, full_matrices=False)
    tol = s[0] * max(30 * rel_noise * np.sqrt(M.shape[0]), 1e-10)     # 30 x the noise one answer carries
    r = int(np.sum(s > tol))
    return U[:, :r], r, s


def _split(parts: list[np.ndarray], P: np.ndarray) -> tuple[list[np.ndarray], bool]:
    """Split each part (an r x m basis of a sum of heads' spaces, in col(M) coordinates) into its
    1- and 0-eigenspaces under the projector P (r x r)."""
    out, split = [], False
    for B in parts:
        m = B.shape[1]
        Pb = np.linalg.lstsq(B, P @ B, rcond=None)[0]                       # P restricted to the part
        ev = np.linalg.eigvals(Pb).real
        k = int(np.sum(ev > 0.5))
        if k <= 0 or k >= m or np.max(np.minimum(np.abs(ev), np.abs(ev - 1))) > SPLIT_TOL:
            out.append(B)                     # no split, or not clearly a projector on this part: keep it whole
            continue
        U1 = np.linalg.svd(Pb)[0][:, :k]
        U0 = np.linalg.svd(np.eye(m) - Pb)[0][:, :m - k]
        out += [np.linalg.qr(B @ U1)[0], np.linalg.qr(B @ U0)[0]]
        split = True
    return out, split


def _tokens(rng, d, norm, k):
    x = rng.standard_normal((k, d))
    return x * (norm / np.linalg.norm(x, axis=1, keepdims=True))


def head_spaces(oracle: Oracle, aff: Affine, rng: np.random.Generator, *, heads: int | None = None,
                max_maps: int = 40, patience: int = 4, progress=None) -> Spaces:
    """Separate the heads' output spaces (see the module docstring); ``heads`` None: find how many."""
    d = oracle.d
    Ub, r, sv = _rank(aff.M, aff.rel_noise)
    if heads is not None and r % heads:
        raise NotIdentifiable(f"M = sum_h O_h has rank {r}, which {heads} heads of equal size cannot make "
                              "(give --heads auto, or check --heads)")
    Mp = np.linalg.pinv(aff.M, rcond=1e-12) if r == min(aff.M.shape) else \
        np.linalg.lstsq(aff.M, Ub, rcond=None)[0] @ Ub.T
    R = oracle.input_norm
    rho = 0.97 * R if R is not None else 30.0 * np.sqrt(d)
    eta = ETA
    sigma = max(aff.sigma, 1e-300)
    tol_lin = 30.0 * sigma * np.sqrt(aff.M.shape[0]) + 1e-13 * aff.scale
    cond = float(sv[0] / sv[r - 1]) if r else 1.0
    # a map's error: the answers' noise over the perturbation, through M^+ (cond); a soft head's share
    # a(1 - a) shows as the same kind of departure from a projector
    tol_idem = max(1e3 * aff.rel_noise * cond / eta, 1e-9)
    parts = [np.eye(r)]
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
        for pos in range(positions):
            if not clean[best, pos]:
                rejected += 1
                continue
            J = (Yb[:, pos, :] - y0[best, pos]).T @ np.linalg.inv(basis)
            P = Ub.T @ J @ Mp @ Ub
            err = float(np.linalg.norm(P @ P - P) / np.sqrt(r))
            if err > tol_idem:
                rejected += 1
                continue
            maps += 1
            worst = max(worst, err)
            parts, split = _split(parts, P)
            split_any |= split
            history.append({"map": maps, "parts": [int(B.shape[1]) for B in parts], "idempotency": err})
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
                              f"{r // heads} after {maps} saturated maps ({queries} queries): parts of dimensions "
                              f"{dims} ({rejected} maps or positions were not saturated)")
    if heads is None and len(set(dims)) != 1:
        raise NotIdentifiable(f"the heads' output spaces split into parts of unequal dimensions {dims} after "
                              f"{maps} saturated maps ({queries} queries); give --heads H, or more --budget")
    bases = tuple(Ub @ B for B in parts)
    return Spaces(bases=bases, rank=r, maps=maps, rejected=rejected, queries=queries, idempotency=worst,
                  history=history)
