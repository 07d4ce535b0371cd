"""The vector method's refinement: precise output maps chosen with the layer already recovered.

Stage B's maps must be taken blind: small perturbations (1% of the token) so that no head desaturates
across them, which leaves a float32 layer's maps at the answers' noise over 1% (~3.5e-5 on MiniLM, O_h
to ~1e-4, and through the attention weights read with them, W_h to ~2e-3). Once stage C has recovered
every head's scores, the gap ``(x_0 - x_1)^T (W_h x_t + c_h)`` of any two-token query, and how far a
perturbation of radius ``eta |x_0|`` can move it, are known for every head: queries whose every head
stays 40 logits (plus a margin for the model's own error) from its switch can take perturbations up to
half the token's length, and their heads' selections are known in advance. Their maps carry 50x less
noise; the O_h follow by least squares over them, M and stage B's maps (each weighted by its noise).
"""

from __future__ import annotations

import numpy as np

from ...oracles.answers import Output
from ...oracles.base import Oracle

MARGIN = 40.0                     # logits every head keeps from its switch over the whole perturbation
ETAS = (0.5, 0.35, 0.25, 0.18, 0.12)
CANDIDATES = 32                   # (u, v) pairs screened with the model (no query) per map


def _gaps(W, c, x0, x1, t):
    """Every head's score gap (token 0 minus token 1) at position t, and how fast a perturbation of x0 of
    length one can move it (first order) and its curvature bound."""
    xt = x0 if t == 0 else x1
    g = np.einsum("i,hij,j->h", x0 - x1, W, xt) + (c @ (x0 - x1))
    lin = np.linalg.norm(np.einsum("hij,j->hi", W, xt) + c, axis=1)
    if t == 0:
        lin = lin + np.linalg.norm(np.einsum("i,hij->hj", x0 - x1, W), axis=1)
        quad = np.array([np.linalg.norm(w, 2) for w in W])
    else:
        quad = np.zeros(len(W))
    return g, lin, quad


def precise_maps(oracle: Oracle, W: np.ndarray, c: np.ndarray, H: int, rho: float, noise_unit: float,
                 rng: np.random.Generator, *, max_maps: int = 16, rel_model_err: float = 1e-2,
                 progress=None) -> tuple[list, int]:
    """Maps ``O_S`` (d_out x d) with their 0/1 selections and noise, measured where the model says every
    head is saturated with room to spare; stops once the selections (with M's all-ones row) have rank H
    and H + 2 rows. ``noise_unit``: the answers' noise at token length rho (spectral norm per unit
    perturbation is noise_unit / (eta rho))."""
    d = oracle.d
    positions = 2 if oracle.output is Output.ALL else 1
    ts = (0, 1) if positions == 2 else (1,)
    out, queries = [], 0
    rows = [np.ones(H)]
    for _ in range(max_maps):
        best = None
        for _ in range(CANDIDATES):
            u, v = (rng.standard_normal(d) for _ in range(2))
            u *= rho / np.linalg.norm(u)
            v *= rho / np.linalg.norm(v)
            for eta in ETAS:
                r_p = eta * rho
                ok = []
                for t in ts:
                    g, lin, quad = _gaps(W, c, u, v, t)
                    worst = np.abs(g) - r_p * lin - r_p ** 2 * quad - rel_model_err * np.abs(g)
                    ok.append(bool(np.all(worst >= MARGIN)))
                score = eta * sum(ok)
                if sum(ok) and (best is None or score > best[0]):
                    best = (score, u, v, eta, ok)
                if all(ok):
                    break
        if best is None:
            break
        _, u, v, eta, ok = best
        basis = np.linalg.qr(rng.standard_normal((d, d)))[0] * (eta * rho)
        batch = np.concatenate([np.stack([u, v])[None], np.stack([np.stack([u + basis[:, k], v]) for k in range(d)])])
        Y = oracle.query(batch)
        queries += len(batch)
        if progress is not None:
            progress(len(batch))
        if oracle.output is Output.LAST:
            Y = Y[:, None, :]
        inv = np.linalg.inv(basis)
        for i, t in enumerate(ts):
            if not ok[i]:
                continue
            J = (Y[1:, i, :] - Y[0, i, :]).T @ inv
            sel = (_gaps(W, c, u, v, t)[0] > 0).astype(float)
            out.append((J, sel, noise_unit / (eta * rho)))
            rows.append(sel)
        if len(rows) >= H + 3 and np.linalg.matrix_rank(np.array(rows)) == H:
            break
    return out, queries


def solve_output_maps(rows, mats, noises, r: int) -> tuple[np.ndarray | None, int]:
    """``O_h`` (H, d_out, d) from maps ``mats[k] = sum_h rows[k][h] O_h`` by least squares weighted by
    1 / noise, each cut to rank r; None where the selections do not have full column rank."""
    w = 1.0 / np.maximum(np.asarray(noises, dtype=float), 1e-300)
    S = np.asarray(rows, dtype=float) * w[:, None]
    H = S.shape[1]
    rank = int(np.linalg.matrix_rank(S))
    if rank < H:
        return None, rank
    O = np.einsum("hk,kij->hij", np.linalg.pinv(S), np.stack(mats) * w[:, None, None])
    out = []
    for h in range(H):
        U, s, Vt = np.linalg.svd(O[h], full_matrices=False)
        out.append((U[:, :r] * s[:r]) @ Vt[:r])
    return np.stack(out), rank
