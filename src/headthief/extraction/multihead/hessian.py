"""Multi-head extraction without knowing the subspaces: the paper's conjecture (Appendix C), built.

Appendix C conjectures that under Assumption C.1 the head subspaces can be found from Hessians of a
probe function, by a finest simultaneous block diagonalisation. This module does exactly that, from
value queries only, then hands the subspaces to Proposition C.2's procedure
(:func:`~headthief.extraction.multihead.subspaces.extract_multihead_subspaces`).

**The probe function.** For a query token ``q`` and a probe ``z`` ask ``X = [z + q ; q]``. Head h's two
scores differ by ``z^T a_h`` with ``a_h = W_h q + c_h``, so

    f(z) = beta + q^T sum_h v_h + sum_h sigma(z^T a_h) (z^T v_h).

The paper takes ``q = e_j`` and ``F(z) = f(z) - e_j^T sum_h v_h``; its Hessian at ``z = 0`` is
``M(q) / 4`` with

    M(q) = sum_h (a_h v_h^T + v_h a_h^T),

block diagonal in any basis adapted to ``U_1 (+) ... (+) U_H`` (both ``a_h`` and ``v_h`` lie in ``U_h``).
We read ``M(q)`` from the *even part* ``E(z) = (f(z) + f(-z)) / 2 - f(0)``, which is exactly
``sum_h (z^T v_h)(sigma(z^T a_h) - 1/2) = z^T M z / 8 + O(|z^T a|^2)`` relative: the linear term cancels
exactly (``sigma - 1/2`` is odd). Diagonal entries come from ``z = t e_i``, off-diagonal ones by
polarisation from ``z = t (e_i + e_j)``; each value of ``E`` costs two queries, and Richardson
extrapolation over the step pair ``(t, t/2)`` removes the ``O(t^2)`` term (``richardson=True``, twice the
queries, about 50x smaller errors). Scales: the logit ``z^T a_h`` is kept near ``step`` (1e-3 for float64
answers, 0.3 for float32 answers with Richardson) by a small query token ``q = step * q^``, ``|z| ~ 1``
(paper's model), or, with biases (``a_h ~ c_h`` whatever q is), by a small ``z``.

**How many Hessians.** On ``U_h`` each ``M(q)`` has rank 2 (it lives on ``span(a_h, v_h)``): one Hessian
cannot reveal a subspace of dimension above 2. ``K`` Hessians with random ``q_1..q_K`` span
``span(v_h, W_h q_1, ..., W_h q_K)``, which is ``U_h`` once ``K >= d_h - 1`` (``W_h`` of full rank on
``U_h``). By default ``K`` grows one Hessian at a time until the common kernel of the ``M(q_k)`` is
empty or stops shrinking, *and* the singular values (of the stacked matrices and of the commutator map) split
clearly into noise and signal: a factor 30 between them, the noise ones within a factor 4 of each other
(a block that is nearly reducible with few Hessians, e.g. a 2 x 2 block seen by two nearly commuting
matrices under float32 noise, shows a singular value among or just above the noise ones, and asks for
one more Hessian); the paper's
``q = e_1..e_d`` (``tokens="basis"``) costs d Hessians.

**Finest simultaneous block diagonalisation** (:func:`block_diagonalize`), after Murota, Kanno, Kojima
and Kojima (2010) and the error-controlled variant of Maehara and Murota (2011): restrict to the range of
the matrices (their common kernel is seen by no head); compute the commutant ``{X = X^T : X M_k = M_k X}``
as the near-null space of the linear map ``X -> (X M_k - M_k X)_k`` (an SVD; its dimension is the number
of blocks when the blocks are irreducible and pairwise inequivalent, which holds generically, and is
spanned by the blocks' orthogonal projectors); diagonalise a random element of it; group its eigenvectors
by their "signature" ``(q^T N_i q)_i`` on an orthonormal basis ``N_i`` of the commutant (equal within a
block, orthogonal across blocks, whatever the random element's eigen-gaps); refine each group by
projecting its projector back onto the commutant; and, with an error tolerance, merge blocks whose
coupling ``sqrt(sum_k ||B_g^T M_k B_h||^2)`` exceeds it. Thresholds are ``3 sqrt(K / d)`` times the
estimated relative noise of the Hessians (rounding of the answers plus the extrapolation's remainder, a
worst-case sum that runs 20 to 50 times above the measured error).

**Float32 answers: refit** (:func:`refit_heads`). The Hessians' error (~1e-5 relative: the Richardson
remainder ``-x^4/480``, which is not block diagonal, against rounding that grows as ``u / t^2`` at smaller
steps) tilts the found subspaces by ~1e-5 / gap, enough for fidelity up to 9e-4 where the true subspaces
give 3e-6. So with float32 answers (read from the pilot) every answer already paid for (pilot, Hessian
probes, Proposition C.2) is refitted by least squares to the *exact* model under Assumption C.1: a
rotation of the found bases plus each head's ``W~_h, v~_h`` (``c~_h, beta``). The exact softmax has no
truncation error, so only the answers' rounding is left. Levenberg-Marquardt with an analytic Jacobian,
at most ``REFIT_ITERATIONS`` trial steps, a step kept only when it lowers the residual; no query. The
float64 path does not refit (bit for bit as before).

Query count: ``K L d (d + 1)`` probes for the Hessians (``L = 2`` levels with Richardson, else 1), one
``f([q_k; q_k])`` per Hessian (at least 4, the precision pilot read first; for the paper's model
``f([rho q; rho q]) = rho f([q; q])``, so the pilot's unit-scale answers serve), plus Proposition C.2's
``sum_h (d_h^2 + d_h)`` (``+ d_h`` per head ``+ 1`` with biases). For d = 16, H = 4 with Richardson:
``K = 3`` or 4 Hessians of 544 probes each, 4 pilot queries and 80: 1716 or 2260.

References:
    K. Murota, Y. Kanno, M. Kojima, S. Kojima, "A numerical algorithm for block-diagonal decomposition
    of matrix *-algebras with application to semidefinite programming", Japan J. Indust. Appl. Math. 27
    (2010) 125-160. T. Maehara, K. Murota, "Error-controlling algorithm for simultaneous
    block-diagonalization and its application to independent component analysis", JSIAM Letters 2
    (2010) 131-134; "Algorithm for error-controlled simultaneous block-diagonalization of matrices",
    SIAM J. Matrix Anal. Appl. 32 (2011) 605-620.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import scipy.linalg

from ...errors import ConvergenceError, ModelMismatch, NotIdentifiable, SpecError
from ...oracles.base import Oracle
from ..probes import Progress, all_float32, chunk_for
from .result import MultiHeadExtraction
from .subspaces import extract_multihead_subspaces
from ...linalg import svd

PILOT = 4                 # f(0) answers read before choosing the step (precision detection)
SAFETY = 3.0              # thresholds: this many times the estimated noise's singular values
GAP = 30.0                # noise and signal singular values must be this far apart ...
SPREAD = 4.0              # ... and the noise ones within this factor of each other, else add a Hessian
REFIT_ITERATIONS = 20     # float32 answers: Levenberg-Marquardt trial steps of the refit, at most;
REFIT_GAIN = 1e-4         # ... it stops once a step lowers the squared residuals by less than this fraction
REFIT_CHUNK = 2048        # answers per block of the Jacobian (memory: chunk x parameters floats)


# ----------------------------------------------------------------------------------------------------
# Hessians of the probe function from value queries


def _patterns(d: int) -> np.ndarray:
    """Rows e_i (i < d), then e_i + e_j (i < j): the polarisation probes."""
    iu, ju = np.triu_indices(d, k=1)
    P = np.zeros((d + len(iu), d))
    P[np.arange(d), np.arange(d)] = 1.0
    P[d + np.arange(len(iu)), iu] = 1.0
    P[d + np.arange(len(iu)), ju] = 1.0
    return P


def _ask(oracle: Oracle, X: np.ndarray, progress: Progress) -> np.ndarray:
    chunk = chunk_for(oracle.d)
    out = np.empty(X.shape[0])
    for s in range(0, X.shape[0], chunk):
        out[s:s + chunk] = oracle.query(X[s:s + chunk])
        if progress:
            progress(min(chunk, X.shape[0] - s))
    return out


def default_step(float32_answers: bool, richardson: bool) -> float:
    """The target logit of the probes: where truncation and rounding errors of ``M`` balance."""
    if float32_answers:
        return 0.3 if richardson else 3e-2
    return 1e-3 if richardson else 2e-5


def probe_hessian(oracle: Oracle, q: np.ndarray, f0: float, *, scale: float, richardson: bool,
                  unit: float, logit: float = 1e-3, progress: Progress = None) -> tuple[np.ndarray, float]:
    """One ``M(q)`` from ``d (d + 1)`` (twice that with Richardson) queries; returns (M, noise).

    Args:
        oracle: the black box.
        q: the query token (already scaled).
        f0: the answer to ``[q ; q]``.
        scale: the probe scale t (levels t and t/2 with Richardson).
        richardson: extrapolate over the two levels.
        unit: unit roundoff of the answers (for the noise estimate).
        logit: the target logit (for the noise estimate's truncation part).
        progress: progress callback.
    """
    d = oracle.d
    P = _patterns(d)
    levels = [scale, scale / 2] if richardson else [scale]
    Z = np.concatenate([s * t * P for t in levels for s in (1.0, -1.0)])      # (2 L n, d)
    X = np.empty((Z.shape[0], 2, d))
    X[:, 0] = Z + q
    X[:, 1] = q
    y = _ask(oracle, X, progress).reshape(len(levels), 2, -1)
    R, Rnoise = [], []
    for li, t in enumerate(levels):
        E = (y[li, 0] + y[li, 1]) / 2 - f0
        R.append(8 * E / t ** 2)
        Rnoise.append(8 * unit * (np.abs(y[li, 0]) + np.abs(y[li, 1]) + 2 * abs(f0)) / t ** 2)
    if richardson:
        Rv = (4 * R[1] - R[0]) / 3
        # left after extrapolation: rounding, and an O(t^4) remainder ~ the O(t^2) term times logit^2
        noise = (4 * Rnoise[1] + Rnoise[0]) / 3 + np.abs(R[1] - R[0]) * logit ** 2
    else:
        Rv, noise = R[0], Rnoise[0] + np.abs(R[0]) * logit ** 2 / 12
    diag = Rv[:d]
    M = np.diag(diag)
    iu, ju = np.triu_indices(d, k=1)
    off = (Rv[d:] - diag[iu] - diag[ju]) / 2
    M[iu, ju] = off
    M[ju, iu] = off
    en = np.zeros((d, d))
    en[np.arange(d), np.arange(d)] = noise[:d]
    en[iu, ju] = en[ju, iu] = (noise[d:] + noise[iu] + noise[ju]) / 2
    return M, float(np.linalg.norm(en))


# ----------------------------------------------------------------------------------------------------
# Finest simultaneous block diagonalisation


@dataclass(frozen=True, eq=False)
class BlockDiagonalization:
    """A finest simultaneous block diagonalisation of symmetric matrices.

    Attributes:
        bases: one (d, d_b) orthonormal basis per block, mutually orthogonal.
        kernel: (d, k) orthonormal basis of the common kernel (in no block).
        commutant_sv: the smallest singular values of the commutator map (ascending, normalised).
        blocks_detected: the commutant dimension the threshold found.
        coupling: largest normalised coupling ``sqrt(sum_k ||B_g^T M_k B_h||^2)`` between blocks.
        diagnostics: thresholds and the like.
    """

    bases: tuple
    kernel: np.ndarray
    commutant_sv: np.ndarray
    blocks_detected: int
    coupling: float
    diagnostics: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "diagnostics", MappingProxyType(dict(self.diagnostics)))

    @property
    def dims(self) -> list[int]:
        return [int(B.shape[1]) for B in self.bases]


def _commutant(A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Singular values (ascending) and right singular vectors, as symmetric matrices, of the map
    ``X -> (X A_k - A_k X)_k`` on symmetric X.

    ``X A - A X`` is antisymmetric for symmetric X and A, so only its strict upper triangle (times
    sqrt(2), to keep the map's norm) is kept; the stacked map is reduced by a QR factorisation, one
    matrix at a time, before the SVD.
    """
    import scipy.linalg
    K, r, _ = A.shape
    if r == 1:      # a one-dimensional range: every 1x1 X commutes; the commutant is the line of X = [1]
        return np.zeros(1), np.ones((1, 1, 1))
    iu, ju = np.triu_indices(r, k=1)               # rows: the strict upper triangle of X A - A X
    du, dv = np.triu_indices(r)                    # columns: X's upper triangle
    off = du != dv
    n = len(iu)
    Rf = np.zeros((0, len(du)))
    for Ak in A:
        # d(X A - A X)_ij / dX_pq = delta_ip A_qj - A_ip delta_jq (X treated as unconstrained)
        T = np.zeros((n, r, r))
        T[np.arange(n), iu, :] += Ak[:, ju].T
        T[np.arange(n), :, ju] -= Ak[iu, :]
        cols = T[:, du, dv] + np.where(off, T[:, dv, du], 0.0)
        cols[:, off] /= np.sqrt(2)                 # X_pq = X_qp = x_pq / sqrt(2) off the diagonal
        Lk = np.sqrt(2) * cols
        Rf = scipy.linalg.qr(np.concatenate([Rf, Lk]), mode="r", check_finite=False)[0][:len(du)]
    _, s, Vt = svd(Rf, full_matrices=False)
    order = np.argsort(s)
    s, vecs = s[order], Vt[order]
    iu, ju = np.triu_indices(r)
    mats = np.zeros((len(s), r, r))
    scale = np.where(iu == ju, 1.0, 1 / np.sqrt(2))
    mats[:, iu, ju] = vecs * scale
    mats[:, ju, iu] = vecs * scale
    return s, mats


def _group_by_signature(Q: np.ndarray, N: np.ndarray, cos: float = 0.5) -> list[list[int]]:
    """Group eigenvectors whose signatures (q^T N_i q)_i point the same way (greedy, in order)."""
    S = np.einsum("ak,ikl,al->ai", Q.T, N, Q.T)
    S /= np.maximum(np.linalg.norm(S, axis=1, keepdims=True), 1e-300)
    groups: list[list[int]] = []
    free = list(range(Q.shape[1]))
    while free:
        a = free[0]
        g = [b for b in free if S[a] @ S[b] > cos]
        if a not in g:
            g = [a] + g
        groups.append(g)
        free = [b for b in free if b not in g]
    return groups


def _ambiguous(values: np.ndarray, tau: float) -> int:
    """1 when the split of ``values`` at ``tau`` into noise and signal is unclear, else 0: the signal's
    smallest is within GAP of the noise's largest (or within 3 tau when there is no noise part), or the
    noise part spreads over more than SPREAD (a real singular value hiding among noise ones)."""
    noise, signal = values[values <= tau], values[values > tau]
    if len(signal) and signal.min() < (GAP * noise.max() if len(noise) else 3 * tau):
        return 1
    if len(noise) > 1 and noise.max() > SPREAD * max(noise.min(), 1e-300):
        return 1
    return 0


def _coupling(A: np.ndarray, Bs: list[np.ndarray]) -> np.ndarray:
    n = len(Bs)
    C = np.zeros((n, n))
    for g in range(n):
        for h in range(g + 1, n):
            C[g, h] = C[h, g] = np.sqrt(sum(np.linalg.norm(Bs[g].T @ Ak @ Bs[h]) ** 2 for Ak in A))
    return C


def _components(adj: np.ndarray) -> list[list[int]]:
    n = adj.shape[0]
    seen, comps = set(), []
    for s in range(n):
        if s in seen:
            continue
        stack, comp = [s], []
        seen.add(s)
        while stack:
            a = stack.pop()
            comp.append(a)
            for b in np.flatnonzero(adj[a]):
                if int(b) not in seen:
                    seen.add(int(b))
                    stack.append(int(b))
        comps.append(sorted(comp))
    return comps


def block_diagonalize(
    matrices: np.ndarray,
    *,
    blocks: int | None = None,
    noise: float | None = None,
    rng: np.random.Generator | int = 0,
    max_tries: int = 16,
) -> BlockDiagonalization:
    """Finest simultaneous block diagonalisation of symmetric matrices, tolerant to errors.

    Args:
        matrices: (K, d, d), symmetric up to noise (symmetrised here).
        blocks: the number of blocks, if known (else read from the commutant's singular values).
        noise: estimated absolute error of the matrices (Frobenius, largest over k); None: 1e-12
            relative. Thresholds (kernel, commutant, merging) are ``3 sqrt(K / d)`` times the relative
            noise (the size of the singular values of a noise of that Frobenius norm).
        rng: generator or seed for the random element of the commutant.
        max_tries: random elements tried before giving up on a grouping with ``blocks`` groups.

    Returns:
        A :class:`BlockDiagonalization`.

    Raises:
        ModelMismatch: ``blocks`` given, but the commutant has fewer dimensions (no such decomposition).
        NotIdentifiable: the matrices are zero within noise.
        ConvergenceError: no random element of the commutant gave the expected number of groups.
    """
    rng = np.random.default_rng(rng)
    M = np.asarray(matrices, dtype=np.float64)
    if M.ndim != 3 or M.shape[1] != M.shape[2]:
        raise ValueError(f"matrices must be (K, d, d), got {M.shape}")
    M = (M + M.transpose(0, 2, 1)) / 2
    d = M.shape[1]
    scale = max(float(np.linalg.norm(M.reshape(len(M), -1), axis=1).max()), 1e-300)
    M = M / scale
    rel_noise = 1e-12 if noise is None else max(noise / scale, 1e-16)
    K = M.shape[0]
    # 1. common kernel
    U, s, _ = svd(np.concatenate(list(M), axis=1), full_matrices=True)
    s_all = np.concatenate([s, np.zeros(d - len(s))])
    tau_k = SAFETY * rel_noise * np.sqrt(K / d)
    r = int(np.sum(s_all > tau_k))
    R, kernel = U[:, :r], U[:, r:]
    if r == 0:
        raise NotIdentifiable("every probe Hessian is zero (within noise): no head is visible")
    A = np.einsum("ia,kij,jb->kab", R, M, R)
    # 2. commutant
    sv, N_all = _commutant(A)
    sv_n = sv / max(sv[-1], 1e-300)
    tau_c = SAFETY * rel_noise * np.sqrt(K / d)
    detected = max(1, int(np.sum(sv_n < tau_c)))
    m = detected if blocks is None else int(blocks)
    if not 1 <= m <= r:
        raise NotIdentifiable(f"{m} blocks asked for, but the matrices' range has dimension {r}")
    if blocks is not None and sv_n[m - 1] > tau_c:
        raise ModelMismatch(
            f"the probe Hessians have no common block diagonalisation into {m} blocks: the commutant's "
            f"{m}-th singular value is {sv_n[m - 1]:.3g} > {tau_c:.3g} (it has {detected} dimension(s)); the "
            "target's heads do not live in mutually orthogonal subspaces (Assumption C.1)",
            check="block diagonalisation", figure=float(sv_n[m - 1]), threshold=float(tau_c),
            hint="multi-head attention without orthogonal head subspaces, or fewer heads")
    N = N_all[:m]
    # 3. random element, eigenvectors grouped by signature
    groups = None
    for _ in range(max_tries):
        X = np.einsum("i,iab->ab", rng.standard_normal(m), N)
        _, Q = np.linalg.eigh(X)
        g = _group_by_signature(Q, N)
        if len(g) == m:
            groups = g
            break
    if groups is None:
        raise ConvergenceError(f"no random element of the {m}-dimensional commutant split the space into {m} "
                               f"blocks in {max_tries} tries (noise too large for the commutant's gap?)")
    # 4. refine: project each group's projector onto the commutant, keep its top eigenvectors
    Bs = []
    for g in groups:
        P = Q[:, g] @ Q[:, g].T
        Y = np.einsum("i,iab->ab", np.einsum("iab,ab->i", N, P), N)
        _, Vy = np.linalg.eigh(Y)
        Bs.append(Vy[:, -len(g):])
    allB = np.concatenate(Bs, axis=1)
    u, _, vt = svd(allB, full_matrices=False)          # Loewdin: nearest orthonormal set
    allB = u @ vt
    Bs = np.split(allB, np.cumsum([len(g) for g in groups])[:-1], axis=1)
    # 5. error control: merge blocks coupled beyond the tolerance (when the count is not imposed)
    C = _coupling(A, Bs)
    tau_m = SAFETY * rel_noise * np.sqrt(K / d)
    merged = 0
    if blocks is None and len(Bs) > 1 and C.max() > tau_m:
        comps = _components(C > tau_m)
        merged = len(Bs) - len(comps)
        Bs = [np.concatenate([Bs[i] for i in comp], axis=1) for comp in comps]
        C = _coupling(A, Bs)
    bases = tuple(R @ B for B in Bs)
    amb = _ambiguous(s_all, tau_k) + _ambiguous(sv_n[1:], tau_c)
    return BlockDiagonalization(
        bases=bases, kernel=kernel, commutant_sv=sv_n[:min(len(sv_n), m + 4)], blocks_detected=detected,
        coupling=float(C.max()) if len(Bs) > 1 else 0.0,
        diagnostics={"range_dim": r, "kernel_sv": s_all[r - 1:r + 1].tolist() if r < d else [float(s_all[-1])],
                     "tau_kernel": float(tau_k), "tau_commutant": float(tau_c), "tau_merge": float(tau_m),
                     "merged": merged, "ambiguous": amb, "scale": scale, "rel_noise": rel_noise,
                     "commutant_gap": float(sv_n[m] / max(sv_n[m - 1], 1e-300)) if m < len(sv_n) else None})


# ----------------------------------------------------------------------------------------------------
# Float32 answers: refit every answer already paid for (no query)


class _Recorder(Oracle):
    """Forwards every batch to the black box and keeps the sequences with their answers (the refit
    reuses them; the black box's own counters, budget and transcript are untouched)."""

    def __init__(self, inner: Oracle):
        super().__init__(inner.d, input_norm=inner.input_norm)
        self.inner = inner
        self.keep = True                 # off once the answers are known to be float64 (no refit)
        self.seqs: list[np.ndarray] = []
        self.answers: list[np.ndarray] = []

    def __repr__(self) -> str:
        return f"_Recorder({self.inner!r})"

    def _query(self, X):
        y = self.inner.query(X)
        if not self.keep:
            return y
        self.seqs.extend(np.asarray(x, dtype=np.float64) for x in X)
        self.answers.append(np.asarray(y, dtype=np.float64))
        return y


def _by_length(seqs: list[np.ndarray], y: np.ndarray, chunk: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The sequences as (n, N, d) arrays of one length each, at most ``chunk`` per array, with answers."""
    lengths = np.array([len(x) for x in seqs])
    out = []
    for N in np.unique(lengths):
        idx = np.flatnonzero(lengths == N)
        for s in range(0, len(idx), chunk):
            part = idx[s:s + chunk]
            out.append((np.stack([seqs[i] for i in part]), y[part]))
    return out


def _fit_terms(X: np.ndarray, Q: np.ndarray, W: np.ndarray, v: np.ndarray, c: np.ndarray | None,
               jac: bool):
    """One head seen through ``Q`` (d, d_h) on sequences X (n, N, d): its answers and, with ``jac``, the
    derivatives with respect to W~ (n, d_h^2), v~ (n, d_h), c~ (n, d_h) and Q (n, d, d_h)."""
    Z = X @ Q                                                        # (n, N, d_h)
    zN = Z[:, -1]
    a = zN @ W.T + (0.0 if c is None else c)                         # W~ z_N + c~
    s = np.einsum("nkb,nb->nk", Z, a)
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    o = Z @ v
    f = np.einsum("nk,nk->n", p, o)
    if not jac:
        return f, None
    g = p * (o - f[:, None])                                         # df/ds_k
    G = np.einsum("nk,nkb->nb", g, Z)
    dW = (G[:, :, None] * zN[:, None, :]).reshape(len(X), -1)
    dv = np.einsum("nk,nkb->nb", p, Z)
    dZ = g[:, :, None] * a[:, None, :] + p[:, :, None] * v[None, None, :]
    dZ[:, -1] += G @ W
    dQ = np.einsum("nkd,nkb->ndb", X, dZ)
    return f, (dW, dv, G if c is not None else None, dQ)


def refit_heads(seqs: list[np.ndarray], answers: np.ndarray, bases: list[np.ndarray], W: np.ndarray,
                V: np.ndarray, C: np.ndarray | None, beta: float | None, *,
                iterations: int = REFIT_ITERATIONS) -> tuple[list[np.ndarray], np.ndarray, np.ndarray,
                                                             np.ndarray | None, float | None, dict]:
    """Least-squares refit of a layer under Assumption C.1 to answers already paid for.

    The parameters are the heads' subspaces (a rotation ``exp(A)`` of the found bases, A antisymmetric
    with no entries inside a block: those are the heads' own coordinates) and each head's ``W~_h, v~_h``
    (``c~_h`` and ``beta`` with biases). The model is the exact softmax, so the truncation error of the
    finite-difference Hessians that placed the subspaces is gone; what is left is the answers' rounding.
    Levenberg-Marquardt, at most ``iterations`` trial steps; a step is kept only when it lowers the sum of
    squared residuals, so the result never fits worse than the start.

    Returns:
        (bases, W, V, C, beta, diagnostics), W (H, d, d) etc. lifted back to R^d.
    """
    d = bases[0].shape[0]
    dims = [B.shape[1] for B in bases]
    Bh = np.concatenate(bases, axis=1)
    comp = scipy.linalg.null_space(Bh.T) if Bh.shape[1] < d else np.zeros((d, 0))
    Q0 = np.concatenate([Bh, comp], axis=1)
    group = np.repeat(np.arange(len(dims) + 1), dims + [comp.shape[1]])
    iu, ju = np.triu_indices(d, k=1)
    cross = group[iu] != group[ju]
    iu, ju = iu[cross], ju[cross]
    starts = np.concatenate([[0], np.cumsum(dims)])
    bias = C is not None
    heads = [{"W": B.T @ Wh @ B, "v": B.T @ vh, "c": (B.T @ ch if bias else None)}
             for B, Wh, vh, ch in zip(bases, W, V, C if bias else [None] * len(bases))]
    b0 = float(beta) if bias and beta is not None else 0.0
    groups = _by_length(seqs, answers, REFIT_CHUNK)
    y = np.concatenate([yy for _, yy in groups])

    def normal_equations(Q, hd, b, jac):
        """Sum of squared residuals and, with ``jac``, J^T J and J^T r, a chunk of answers at a time."""
        cost, JtJ, Jtr = 0.0, 0.0, 0.0
        for X, yy in groups:
            r = np.full(len(X), b) - yy
            dQ = np.zeros((len(X), d, d)) if jac else None
            parts = []
            for h in range(len(dims)):
                cols = slice(starts[h], starts[h + 1])
                fh, J = _fit_terms(X, Q[:, cols], hd[h]["W"], hd[h]["v"], hd[h]["c"], jac)
                r += fh
                if jac:
                    parts += [J[0], J[1]] + ([J[2]] if bias else [])
                    dQ[:, :, cols] = J[3]
            cost += float(r @ r)
            if jac:
                GA = np.einsum("da,nde->nae", Q, dQ)                  # d f / d A at A = 0 (Q -> Q exp(A))
                Jc = np.concatenate([GA[:, iu, ju] - GA[:, ju, iu]] + parts
                                    + ([np.ones((len(X), 1))] if bias else []), axis=1)
                JtJ = JtJ + Jc.T @ Jc
                Jtr = Jtr + Jc.T @ r
        return cost, JtJ, Jtr

    def step(Q, hd, b, x):
        A = np.zeros((d, d))
        A[iu, ju] = x[:len(iu)]
        A[ju, iu] = -x[:len(iu)]
        Qn = Q @ scipy.linalg.expm(A)
        pos, hn = len(iu), []
        for h, k in enumerate(dims):
            W_ = hd[h]["W"] + x[pos:pos + k * k].reshape(k, k)
            pos += k * k
            v_ = hd[h]["v"] + x[pos:pos + k]
            pos += k
            c_ = None
            if bias:
                c_ = hd[h]["c"] + x[pos:pos + k]
                pos += k
            hn.append({"W": W_, "v": v_, "c": c_})
        return Qn, hn, (b + x[pos] if bias else b)

    Q, hd, b = Q0, heads, b0
    cost, JtJ, Jtr = normal_equations(Q, hd, b, True)
    cost0 = cost
    lam, accepted, tried, reason = 1e-6, 0, 0, "iterations"
    for tried in range(1, iterations + 1):
        D = np.maximum(np.diag(JtJ), 1e-300)
        try:
            x = -scipy.linalg.solve(JtJ + lam * np.diag(D), Jtr, assume_a="pos", check_finite=False)
        except (np.linalg.LinAlgError, ValueError):
            lam *= 100
            continue
        Qn, hn, bn = step(Q, hd, b, x)
        cn = normal_equations(Qn, hn, bn, False)[0]
        if cn < cost:
            gain = (cost - cn) / cost
            Q, hd, b, cost, accepted = Qn, hn, bn, cn, accepted + 1
            lam = max(lam / 10, 1e-12)
            if gain < REFIT_GAIN:
                reason = "converged"
                break
            cost, JtJ, Jtr = normal_equations(Q, hd, b, True)
        else:
            lam *= 100
    out_bases = [Q[:, starts[h]:starts[h + 1]] for h in range(len(dims))]
    Wl = np.stack([B @ hd[h]["W"] @ B.T for h, B in enumerate(out_bases)])
    Vl = np.stack([B @ hd[h]["v"] for h, B in enumerate(out_bases)])
    Cl = np.stack([B @ hd[h]["c"] for h, B in enumerate(out_bases)]) if bias else None
    rms = max(float(np.sqrt(np.mean(y ** 2))), 1e-300)
    diag = {"answers": len(y), "parameters": len(Jtr), "steps_tried": tried, "steps_kept": accepted,
            "stopped": reason, "residual_before": float(np.sqrt(cost0 / len(y)) / rms),
            "residual_after": float(np.sqrt(cost / len(y)) / rms),
            "rotation": float(np.linalg.norm(np.concatenate(out_bases, 1) - Bh, 2))}
    return out_bases, Wl, Vl, Cl, (b if bias else beta), diag


# ----------------------------------------------------------------------------------------------------
# The extraction


def hessian_query_count(d: int, hessians: int, *, richardson: bool = True) -> int:
    """Queries of the Hessian phase: ``K L d (d + 1)`` probes and one ``f([q; q])`` per Hessian (at least
    4: the precision pilot)."""
    L = 2 if richardson else 1
    return hessians * L * d * (d + 1) + max(hessians, min(PILOT, d))


def extract_multihead_hessian(
    oracle: Oracle,
    *,
    heads: int | None = None,
    bias: bool = False,
    step: float | None = None,
    hessians: int | None = None,
    tokens: str = "random",
    richardson: bool = True,
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
) -> MultiHeadExtraction:
    """Recover a multi-head layer under Assumption C.1 without knowing its subspaces (Appendix C's
    conjecture): probe Hessians, finest block diagonalisation, then Proposition C.2 per block.

    Args:
        oracle: the black box (value answers, float64 or float32).
        heads: the number of heads, if known (else found from the commutant's dimension).
        bias: the target has score biases and an output bias.
        step: target logit of the Hessian probes (default :func:`default_step` for the answers'
            precision).
        hessians: number of Hessians K (default: grow until the common kernel stops shrinking; at most
            d). ``tokens="basis"`` uses the paper's ``q = e_1..e_d`` (K = d).
        tokens: ``"random"`` (Gaussian unit directions) or ``"basis"``.
        richardson: extrapolate each Hessian over two step sizes.
        rng: generator or seed (query tokens, random commutant element, probe design).
        progress: called with the number of queries answered after each oracle call.

    Returns:
        A :class:`MultiHeadExtraction` (``method="hessian"``); ``queries`` covers both phases and the
        diagnostics split them (``hessian_queries``, ``subspace_queries``) with the block
        diagonalisation's figures.

    Raises:
        NotIdentifiable: no head visible, or every found block is silent.
        ModelMismatch: ``heads`` given, but the Hessians split into fewer blocks (not Assumption C.1).
        ConvergenceError: the block diagonalisation could not split the commutant.
    """
    t0 = time.perf_counter()
    if tokens not in ("random", "basis"):
        raise SpecError(f"tokens must be 'random' or 'basis', got {tokens!r}")
    if heads is not None and not 1 <= heads <= oracle.d:
        raise SpecError(f"heads must be in 1..d = {oracle.d}, got {heads}")
    if hessians is not None and not 1 <= hessians <= oracle.d:
        raise SpecError(f"hessians must be in 1..d = {oracle.d}, got {hessians}")
    if step is not None and not step > 0:
        raise SpecError(f"step must be > 0, got {step}")
    rng = np.random.default_rng(rng)
    d = oracle.d
    q0 = oracle.queries
    black_box, oracle = oracle, _Recorder(oracle)     # counts stay on the black box
    if tokens == "basis":
        dirs = np.eye(d)
        hessians = d
    else:
        dirs = rng.standard_normal((d, d))
        dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    K_max = hessians or d
    # precision pilot: f([q; q]) for the first tokens, at unit scale
    n_pilot = min(PILOT, d)
    pilot = np.empty((n_pilot, 2, d))
    pilot[:, 0] = pilot[:, 1] = dirs[:n_pilot]
    y_pilot = _ask(oracle, pilot, progress)
    single = all_float32(y_pilot) and n_pilot >= PILOT
    unit = 2.0 ** -24 if single else 2.0 ** -53
    if not single:
        oracle.keep, oracle.seqs, oracle.answers = False, [], []
    s = float(step) if step is not None else default_step(single, richardson)
    rho, t = (1.0, s) if bias else (s, 1.0)

    Ms, noises = [], []
    kernel_dims: list[int] = []
    ambiguous: list[int] = []
    bd = None
    for k in range(K_max):
        q = rho * dirs[k]
        if k < n_pilot:      # f([q; q]) = beta + q^T sum_h v_h: linear in q when beta = 0 (rho < 1)
            f0 = float(rho * y_pilot[k]) if not bias else float(y_pilot[k])
        else:
            f0 = float(_ask(oracle, q[None, None].repeat(2, axis=1), progress)[0])
        Mk, nk = probe_hessian(oracle, q, f0, scale=t, richardson=richardson, unit=unit, logit=s,
                               progress=progress)
        Ms.append(Mk)
        noises.append(nk)
        if hessians is not None or k == 0:
            continue
        # adaptive K: stop once the common kernel is empty or stopped shrinking, and the singular values
        # (of the stacked matrices and of the commutator map) split clearly into noise and signal
        try:
            bd = block_diagonalize(np.stack(Ms), blocks=None, noise=max(noises), rng=rng)
        except ConvergenceError:
            if k == K_max - 1:
                raise
            bd = None                   # the commutant did not split cleanly: one more Hessian
            ambiguous.append(1)
            continue
        kernel_dims.append(bd.kernel.shape[1])
        ambiguous.append(int(bd.diagnostics["ambiguous"]))
        settled = kernel_dims[-1] == 0 or (len(kernel_dims) >= 2 and kernel_dims[-1] >= kernel_dims[-2])
        if settled and not ambiguous[-1]:
            break
    hq = black_box.queries - q0
    if heads is not None or bd is None:
        bd = block_diagonalize(np.stack(Ms), blocks=heads, noise=max(noises), rng=rng)
    sub = extract_multihead_subspaces(oracle, list(bd.bases), bias=bias, progress=progress, rng=rng)
    W, V, C, beta, refit = sub.W, sub.V, sub.C, sub.beta, None
    if single:
        kept = [B for h, B in enumerate(bd.bases) if h not in sub.diagnostics["silent"]]
        _, W, V, C, beta, refit = refit_heads(oracle.seqs, np.concatenate(oracle.answers), kept, W, V, C, beta)
    diagnostics = {
        "hessians": len(Ms), "hessian_queries": hq, "subspace_queries": sub.queries,
        "kernel_dims": kernel_dims, "ambiguous": ambiguous, "step": s, "richardson": richardson,
        "float32_answers": single,
        "hessian_noise": float(max(noises)), "blocks": bd.dims, "blocks_detected": bd.blocks_detected,
        "commutant_sv": bd.commutant_sv.tolist(), "coupling": bd.coupling, "kernel_dim": bd.kernel.shape[1],
        **{f"bd_{k}": v for k, v in bd.diagnostics.items()},
        "silent": sub.diagnostics["silent"], "requeried": sub.diagnostics["requeried"],
        "refit": refit is not None,
        **{f"refit_{k}": v for k, v in (refit or {}).items()},
    }
    return MultiHeadExtraction(method="hessian", W=W, V=V, C=C, beta=beta,
                               queries=black_box.queries - q0, seconds=time.perf_counter() - t0,
                               diagnostics=diagnostics)
