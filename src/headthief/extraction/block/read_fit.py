"""Stage A's reads fitted in output space: ``G = [A, a]`` per read from ``S_p = J_p G [x_p; 1]`` at every base token.

Each read of stage A (:mod:`.heads`) is measured in the block's output space, ``S_p = J_Phi(p0) r_p`` at base
token x_p, and ``B^{-1} r_p = A x_p + a`` is affine in x. :func:`.heads._fit_reads` pulls every ``S_p`` back
through its own token's pseudo-inverse of ``J_p`` (``J_Psi(x_p)``) and fits the affine map to the pulled-back
values. That is exact algebra, and right when the answers are exact; with coarse answers it is not: the
pull-back multiplies each token's noise by its Jacobian's inverse singular values. On all-MiniLM-L6-v2's
block 2 these run 3.3 (first), 0.33 (median), 1.3e-4 (the (d-2)-th), and float32 reads whose noise is 0.9 %
of their size came back with a fit residual of 0.65 across the base tokens and every ``G`` wrong by 2.4 to
10.6 times its size (measured, ``benchmarks/research_minilm_stage_a_reads.py``).

Here ``G`` is instead the least-squares fit in output space, where the answers' rounding lies:

    min_G  sum_p |S_p - J_p G [x_p; 1]|^2      (one G per read; every read shares the J_p and x_p),

the maximum-likelihood fit for noise of equal size on every output. Each token's Jacobian weighs the
directions it sees, and together the tokens see every direction but the null space that all of them share
(``B^{-1} 1`` on the left, and the scale gauge ``[I, c0]``, which stage A fixes afterwards). Measured on the
same five MiniLM reads: ``G`` within 1.7 % to 3.1 % of the exact reads' fit.

The normal equations ``N(G) = sum_p (J_p^T J_p) G xh_p xh_p^T = sum_p J_p^T S_p xh_p^T`` have d (d + 1)
unknowns per read (147,840 at d = 384), too many to form; they are solved by conjugate gradients, all reads of
a batch at once (one batched product per token and step), preconditioned by the Kronecker product that
replaces each token's ``J_p^T J_p`` by their mean: ``M^+ R C^{-1}`` with ``M = mean_p J_p^T J_p``,
``C = mean_p xh_p xh_p^T``. Without it, 600 iterations left 3.6 % of the output unexplained on the MiniLM
reads; with it, 50 iterations reach the float32 answers' noise (and 75 take float64 answers below 1e-5).
"""

from __future__ import annotations

import numpy as np

from ...errors import ConvergenceError

MAX_ITER = 1000          # conjugate-gradient iterations at most (a read of MiniLM block 2 settles in about 50 - 75)
WINDOW, STALL = 10, 1e-6  # a read has settled when WINDOW iterations lowered its objective by less than STALL of it
BATCH = 64               # reads solved together (their products are batched; memory ~ 6 BATCH P d doubles)


def _pinv_psd(M: np.ndarray, rcond: float = 1e-12) -> np.ndarray:
    ev, V = np.linalg.eigh(M)
    keep = ev > rcond * ev[-1]
    return (V[:, keep] / ev[keep]) @ V[:, keep].T


def fit_in_output_space(S: np.ndarray, X: np.ndarray, J: np.ndarray, *, tol: float, c1: np.ndarray | None = None,
                        max_iter: int = MAX_ITER) -> tuple[np.ndarray, np.ndarray]:
    """``G`` (reads, d, d + 1) minimising ``sum_p |S[k, p] - J[p] G_k [X[p]; 1]|^2`` for every read k, from
    ``S`` (reads, P, d_out), base tokens ``X`` (P, d) and one-token Jacobians ``J`` (P, d_out, d); and each
    read's relative output residual ``|S - J G xh| / |S|``. ``c1`` (unit, optional): a left null direction
    every ``J_p`` shares (stage A's ``B^{-1} 1``), kept out of G exactly (measured Jacobians are only nearly
    null there, and a fit would spend the answers' noise on it).

    Preconditioned conjugate gradients from G = 0 (see the module docstring), until each read's
    preconditioned normal residual is ``tol`` of its start, or its objective has settled (``WINDOW``
    iterations lowered it by less than ``STALL`` of itself: with coarse answers the output stops moving long
    before the normal residual reaches their precision, and what is left would fit their noise along the
    Jacobians' weakest directions); the component along the Jacobians' common null space stays out of G.
    Raises :class:`~headthief.errors.ConvergenceError` after ``max_iter`` iterations."""
    S, X, J = np.asarray(S, dtype=float), np.asarray(X, dtype=float), np.asarray(J, dtype=float)
    K, Pn, d = S.shape[0], X.shape[0], X.shape[1]
    if S.shape[1] != Pn or J.shape != (Pn, S.shape[2], d):
        raise ValueError(f"reads {S.shape}, base tokens {X.shape} and Jacobians {J.shape} do not agree")
    Xh = np.hstack([X, np.ones((Pn, 1))])
    Jt = np.ascontiguousarray(J.transpose(0, 2, 1))
    M = np.einsum("pki,pkj->ij", J, J, optimize=True) / Pn
    if c1 is not None:
        P1 = np.eye(d) - np.outer(c1, c1)
        M = P1 @ M @ P1
    Mp = _pinv_psd(M)
    Cinv = np.linalg.inv(Xh.T @ Xh / Pn)

    def forward(G):                                     # (k, d, d+1) -> (k, P, d_out)
        Z = np.ascontiguousarray((G @ Xh.T).transpose(2, 1, 0))              # (P, d, k)
        return np.matmul(J, Z).transpose(2, 0, 1)

    def normal(R):                                      # (k, P, d_out) -> (k, d, d+1), divided by P
        W = np.matmul(Jt, np.ascontiguousarray(R.transpose(1, 2, 0)))       # (P, d, k)
        return np.einsum("pdk,pe->kde", W, Xh, optimize=True) / Pn

    def precondition(R):
        return Mp @ R @ Cinv

    G_all = np.zeros((K, d, d + 1))
    res_all = np.zeros(K)
    for lo in range(0, K, BATCH):
        Sb = S[lo:lo + BATCH]
        r = normal(Sb)
        G = np.zeros_like(r)
        z = precondition(r)
        p = z.copy()
        rz = np.einsum("kij,kij->k", r, z)
        start = np.maximum(rz, 1e-300)
        live = rz > (tol * tol) * start
        f = 0.5 * np.einsum("kpi,kpi->k", Sb, Sb) / Pn          # the objective 0.5 |S - J G xh|^2 / P at G = 0
        gains = []
        for _ in range(max_iter):
            if not live.any():
                break
            Ap = normal(forward(p))
            alpha = np.where(live, rz / np.where(live, np.einsum("kij,kij->k", p, Ap), 1.0), 0.0)
            G += alpha[:, None, None] * p
            r -= alpha[:, None, None] * Ap
            gains.append(0.5 * alpha * rz)                       # the objective's exact decrease in this step
            f = f - gains[-1]
            z = precondition(r)
            rz_new = np.einsum("kij,kij->k", r, z)
            p = z + np.where(live, rz_new / np.maximum(rz, 1e-300), 0.0)[:, None, None] * p
            rz = rz_new
            live &= rz > (tol * tol) * start
            if len(gains) >= WINDOW:                             # settled: the output no longer moves
                live &= ~(np.sum(gains[-WINDOW:], axis=0) < STALL * f)
        else:
            if live.any():
                worst = float(np.sqrt(np.max(rz[live] / start[live])))
                raise ConvergenceError(f"the reads' output-space fit did not settle in {max_iter} conjugate-gradient "
                                       f"iterations: normal residual {worst:.3g} of its start, asked {tol:.3g}")
        fit = forward(G) - Sb
        res_all[lo:lo + BATCH] = (np.linalg.norm(fit.reshape(len(Sb), -1), axis=1)
                                  / np.maximum(np.linalg.norm(Sb.reshape(len(Sb), -1), axis=1), 1e-300))
        G_all[lo:lo + BATCH] = G
    return G_all, res_all
