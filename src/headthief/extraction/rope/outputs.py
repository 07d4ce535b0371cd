"""Stage O of ``--method rope`` (imprecise answers): every head's ``O_h = Wo_h V_g`` refined by alternating
least squares over answers to random sequences.

Stage H reads the ``O_h`` from one-coordinate moves of saturated queries, to ~1e-5 with float32 answers
(the answers' rounding over a move of 0.2 lam). Everything after it reads the heads' attention weights
through those ``O_h``, so their error is what limits the spaces and forms (measured: the query spaces come out
at ~1e-3 with stage H's ``O_h`` and at ~5e-5 with the true ones). Here, on sequences that start with the zero
token, the answer at row t is

    y_t - b = sum_h O_h z_{h,t},     z_{h,t} = sum_{i visible} a_{h,t,i} x_i,

bilinear in the ``O_h`` and the weights. Alternating: the weights read through the current ``O_h``
(:class:`~.scores.WeightReader`), then every ``O_h`` by linear least squares given them (one solve, the
normal equations of the H d features ``z_{h,t}``), put back into the shape of the groups (the heads of a
group share ``V_g``: the top d_h right singular vectors of their stacked ``O_h``), and each head's scale fixed
by ``sum_h O_h = M``, the one-token map read from d + 16 one-token queries (the zero token's weight takes
whatever a head's scale leaves, so the sequences alone do not fix it). Measured on
``rope-mha:d=256,heads=8,kv_heads=2,seed=1,dtype=float32`` with 512 sequences: 1.1e-5 -> 3.9e-7 in ten sweeps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...errors import NotIdentifiable
from ...oracles.base import Oracle
from .partitions import Heads
from .scores import EXTRA, WeightReader
from ...linalg import lstsq, svd

SEQUENCES = 512      # random sequences the refinement reads
SWEEPS = 20          # alternating sweeps, at most
STALL = 0.9          # a sweep that keeps more than this of the previous sweep's change ends the refinement,
SETTLED = 0.1        # and so does one that changes the O_h by less than this x the fit's own rms residual
FIT_LIMIT = 1e-2     # heads whose refit leaves more than this (relative rms) do not explain the answers
MAX_FEATURES = 4096  # H d above this: the normal equations (H d)^2 are not built; stage H's O_h are kept


def one_token_map(oracle: Oracle, b: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """``M`` from d + EXTRA one-token queries ``y = M x + b`` (least squares) and the queries spent."""
    d = oracle.d
    X = rng.standard_normal((d + EXTRA, 1, d))
    Y = np.asarray(oracle.query(X), dtype=np.float64)[:, 0] - b
    return lstsq(X[:, 0], Y, rcond=None)[0].T, X.shape[0]


def _shape(O: np.ndarray, group: np.ndarray, dh: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The groups' shape: per group the top d_h right singular vectors of its heads' stacked O_h (V_g,
    orthonormal rows), ``Wo_h = O_h V_g^T``; returns (O, V, Wo)."""
    H, d, _ = O.shape
    G = int(group.max()) + 1
    V = np.zeros((G, dh, d))
    Wo = np.zeros((d, H * dh))
    for g in range(G):
        members = np.flatnonzero(group == g)
        V[g] = svd(np.vstack([O[h] for h in members]), full_matrices=False)[2][:dh]
        for h in members:
            Wo[:, h * dh:(h + 1) * dh] = O[h] @ V[g].T
    return np.stack([Wo[:, h * dh:(h + 1) * dh] @ V[group[h]] for h in range(H)]), V, Wo


def refine_outputs(oracle: Oracle, heads: Heads, rng: np.random.Generator, *, max_len: int,
                   progress=None) -> Heads:
    """Stage O (see the module): ``heads`` with refined ``O``, ``V``, ``Wo`` and the figures in its info."""
    H, d, dh = heads.heads, oracle.d, heads.head_dim
    if H * d > MAX_FEATURES:
        return dataclasses.replace(heads, info={**heads.info, "outputs_refined": False,
                                                "outputs_note": f"H d = {H * d} > {MAX_FEATURES}: kept stage H's"})
    M, q1 = one_token_map(oracle, heads.b, rng)
    N = int(min(max_len, dh))                              # rows with at most d_h - 1 visible tokens
    X = np.zeros((SEQUENCES, N, d))
    X[:, 1:] = rng.standard_normal((SEQUENCES, N - 1, d))
    Y = np.asarray(oracle.query(X), dtype=np.float64)
    if progress is not None:
        progress(q1 + SEQUENCES)
    R = (Y[:, 1:] - heads.b).reshape(-1, d)
    O, V, Wo = heads.O, heads.V, heads.Wo
    change, fits, sweeps = None, [], 0
    for _ in range(SWEEPS):
        a, _ = WeightReader(dataclasses.replace(heads, O=O, V=V, Wo=Wo)).weights(X, Y)
        Z = np.einsum("khti,kid->kthd", np.nan_to_num(a[:, :, 1:]), X, optimize=True).reshape(-1, H * d)
        sol = np.linalg.solve(Z.T @ Z, Z.T @ R)                              # (H d, d): the O_h^T stacked
        fits.append(float(np.sqrt(np.mean((Z @ sol - R) ** 2) / np.mean(R ** 2))))
        On, Vn, Won = _shape(sol.reshape(H, d, d).transpose(0, 2, 1), heads.group, dh)
        c = lstsq(On.reshape(H, -1).T, M.ravel(), rcond=None)[0]   # sum_h c_h O_h = M
        On, Won = On * c[:, None, None], Won * np.repeat(c, dh)[None]
        step = float(np.linalg.norm(On - O) / np.linalg.norm(O))
        O, V, Wo = On, Vn, Won
        sweeps += 1
        if (change is not None and step > STALL * change) or step < SETTLED * fits[-1]:
            break
        change = step
    sum_err = float(np.linalg.norm(O.sum(0) - M) / np.linalg.norm(M))
    if fits[-1] > FIT_LIMIT:
        raise NotIdentifiable(
            f"the {H} heads in {int(heads.group.max()) + 1} key/value groups that stage H found do not explain the "
            f"answers to random sequences (relative rms misfit {fits[-1]:.3g} after {sweeps} sweeps, > {FIT_LIMIT}): "
            "stage H's split of the heads is not the layer's (try --heads H with the true number)")
    info = {**heads.info, "outputs_refined": True, "output_sweeps": sweeps, "output_fit_rms": fits[-1],
            "output_last_change": change, "output_queries": q1 + SEQUENCES, "sum_rel_err_refined": sum_err}
    return dataclasses.replace(heads, O=O, V=V, Wo=Wo, M=M, info=info)


__all__ = ["one_token_map", "refine_outputs"]
