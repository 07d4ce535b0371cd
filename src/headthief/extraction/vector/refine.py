"""The vector method's refinement: precise output maps aimed with the layer already recovered.

Stage B's maps must be taken blind: small perturbations (1% of the token) so that no head desaturates
across them, which leaves a float32 layer's maps at the answers' noise over 1% (MiniLM layer 2: ~3.5e-5,
O_h to ~1e-4, and through the attention weights read with them, W_h to ~2e-3). Once stage C has
recovered every head's score gradient, a map can be aimed. At the query position of a two-token query
``[u, v]`` (the last token is the query) head h's score gap is *linear* in u:
``gap_h = (u - v)^T g_h`` with ``g_h = W_h v + c_h``. So

- u = v + delta with delta the least-norm solution of ``g_h^T delta = +-T`` sets every head's gap to the
  chosen side at T = 60 logits (the selections are chosen, not found: any pattern, any input norm);
- perturbations of u orthogonal to every (estimated) ``g_h`` leave every gap unchanged up to the model's
  error, so they can be as long as half the token: the answers' rounding over the perturbation's length
  falls ~50x below stage B's.

Each map is measured on the d - H directions orthogonal to its ``g_h`` (different for every v), and the
``O_h`` follow by one weighted least-squares solve over every measured direction of every map, M's
columns and stage B's maps (:func:`solve_directed`).
"""

from __future__ import annotations

import numpy as np

from ...errors import NotIdentifiable
from ...oracles.answers import Output
from ...oracles.base import Oracle
from ...linalg import lstsq, svd

T_GAP = 60.0          # logits every head is set from its switch (e^-45 after the model error's share)
COUPLING = 15.0       # logits the model's error may move a gap over a perturbation
MODEL_ERR = 2e-2      # relative error of the recovered score gradients assumed when aiming (conservative)


def directed_maps(oracle: Oracle, W: np.ndarray, c: np.ndarray, rel_noise: float, rng: np.random.Generator, *,
                  maps: int | None = None, progress=None) -> tuple[list, int, dict]:
    """Aimed maps (see the module): a list of ``(sel, P, JP, noise)`` with P (d, k) orthonormal directions,
    JP (d_out, k) the measured ``O_S P`` and noise the rms error of one of its entries; the queries sent;
    what was chosen (token length, perturbation length)."""
    d = oracle.d
    H = len(W)
    maps = H + 2 if maps is None else maps
    R = oracle.input_norm
    v0 = rng.standard_normal(d)
    v0 /= np.linalg.norm(v0)
    slope = float(np.max(np.linalg.norm(np.einsum("hij,j->hi", W, v0), axis=1)))   # |g_h| per unit token length
    # token length rho with perturbations of length rho / 2: MODEL_ERR * |g| * rho / 2 <= COUPLING
    rho = float(np.sqrt(2.0 * COUPLING / (MODEL_ERR * max(slope, 1e-12))))
    if R is not None:
        rho = min(rho, R / 1.2)
    out, queries, lengths = [], 0, []
    for sel in _patterns(H, maps, rng):
        for attempt in range(12):                     # under a norm bound: shorter tokens until the map fits
            v = rng.standard_normal(d)
            v *= rho * 0.85 ** attempt / np.linalg.norm(v)
            G = np.einsum("hij,j->hi", W, v) + c                           # (H, d) score gradients at v
            delta = lstsq(G, T_GAP * (2 * sel - 1), rcond=None)[0]   # least norm: gaps +-T
            u = v + delta
            # perturbations orthogonal to every g_h (gaps unchanged) and to u (|u + p|^2 = |u|^2 + L^2)
            Qg = np.linalg.qr(np.column_stack([G.T, u]))[0]
            P = rng.standard_normal((d, d - H - 1))
            P = np.linalg.qr(P - Qg @ (Qg.T @ P))[0]
            L = min(rho / 2.0, COUPLING / (MODEL_ERR * float(np.max(np.linalg.norm(G, axis=1)))))
            if R is not None:
                room = 0.98 * R * R - float(u @ u)
                L = min(L, np.sqrt(room) if room > 0 else 0.0)
            if L >= rho / 8.0 and (R is None or np.linalg.norm(v) <= R):
                break
        else:
            raise NotIdentifiable(f"no aimed map fits the input norm bound {R:.3g}: setting the heads' gaps to "
                                  f"+-{T_GAP:.0f} needs tokens of length {np.linalg.norm(u):.3g}")
        lengths.append(L)
        batch = np.concatenate([np.stack([u, v])[None], np.stack([np.stack([u + L * P[:, k], v]) for k in range(P.shape[1])])])
        Y = oracle.query(batch)
        queries += len(batch)
        if progress is not None:
            progress(len(batch))
        Y = Y[:, -1, :] if oracle.output is Output.ALL else Y
        JP = (Y[1:] - Y[0]).T / L
        scale = float(np.sqrt(np.mean(Y[0] ** 2)))
        out.append((sel, P, JP, np.sqrt(2.0) * rel_noise * scale / L))
    return out, queries, {"token_length": rho, "perturbation_length": float(np.median(lengths)) if lengths else 0.0,
                          "maps": len(out)}


def _patterns(H: int, maps: int, rng: np.random.Generator, candidates: int = 256) -> list[np.ndarray]:
    """0/1 selections (which heads attend to u), chosen greedily so that every two heads differ in as many
    maps as possible: each map measures O_S only off its own g_h, so two heads must be told apart by
    several maps (two random patterns alike but for one map left MiniLM's heads 8 and 9 at 2e8)."""
    rows: list[np.ndarray] = []
    for _ in range(maps):
        best, key = None, None
        for _ in range(candidates):
            sel = (rng.random(H) < 0.5).astype(float)
            if sel.sum() in (0, H):
                continue
            S = np.array(rows + [sel])
            diff = np.abs(S[:, :, None] - S[:, None, :]).sum(0) + np.eye(H) * 1e9   # maps telling h, h' apart
            k = (diff.min(), svd(np.vstack([np.ones(H), S]), compute_uv=False)[-1])
            if key is None or k > key:
                best, key = sel, k
        rows.append(best)
    return rows


def solve_directed(meas, M: np.ndarray, noise_M: float, H: int, r: int) -> np.ndarray | None:
    """``O_h`` (H, d_out, d) by weighted least squares over every measured direction: a map's column
    ``O_S p = sum_h sel_h O_h p`` is one row ``kron(sel, p)`` of the design for the stacked ``O_h^T``; M's
    columns are rows ``kron(1, e_i)``. Each O_h is then cut to rank r. None where the design does not have full column rank."""
    d_out, d = M.shape
    A, Bv = [], []
    sd_M = noise_M / np.sqrt(d_out)
    A.append(np.kron(np.ones((1, H)), np.eye(d)) / sd_M)
    Bv.append(M.T / sd_M)
    for sel, P, JP, nz in meas:
        A.append(np.kron(sel[None], P.T) / nz)
        Bv.append(JP.T / nz)
    A = np.vstack(A)
    Bv = np.vstack(Bv)
    from scipy.linalg import lstsq as scipy_lstsq
    sol, _, rank, _ = scipy_lstsq(A, Bv, lapack_driver="gelsy")
    if rank < H * d:
        return None
    Ofull = sol.reshape(H, d, d_out).transpose(0, 2, 1)
    out = []
    for h in range(H):
        U, s, Vt = svd(Ofull[h], full_matrices=False)
        out.append((U[:, :r] * s[:r]) @ Vt[:r])
    return np.stack(out)
