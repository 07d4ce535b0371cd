"""The encoder method's first stage: BERT's embedding LayerNorm, seen through ``hidden_states[0]``.

An encoder API queried with ``inputs_embeds`` (``minilm-encoder:hidden=all``) answers, at position t,
``h_0 = LN_emb(x_t + c_t)`` among its hidden states, with ``c_t = position_embeddings[t] +
token_type_embeddings[0]``. Everything about this stage is exact:

* ``gamma_emb, beta_emb``: :func:`~headthief.extraction.block.layernorm.fit_output_layernorm` on the
  ``h_0`` answers (they lie on LN_emb's ellipsoid);
* ``c_t`` modulo the ones-vector (LN's symmetry): with ``n = (h_0 - beta) / gamma = normalize(x + c_t)``,
  two or more queries with different tokens at position t give ``x_k + c_t = s_k n_k + m_k 1``; their
  differences ``s_k n_k - s_1 n_1 + (m_k - m_1) 1 = x_k - x_1`` fix every scale ``s_k`` (least squares,
  d equations, 2K - 1 unknowns), hence ``c_t = s_1 n_1 - x_1`` up to ``1``;
* gamma_emb's sign, which the ellipsoid leaves open (unlike a block's LN2, whose sign the block's other parts
  absorb): the scales are norms, ``s_k = |P (x_k + c_t)| / sqrt(d) > 0``, so scales solved negative mean that
  n is ``-n`` and gamma_emb is ``-gamma_emb`` (the offsets are the same either way);
* block 0's inputs can then be set at will: for any wanted ``h_0 = gamma n + beta`` on LN_emb's image,
  ``x_t = r n - c_t`` gives exactly that ``h_0`` (any scale ``r > 0``): :meth:`Embeddings.inputs_for`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ...errors import InvalidQuery, ModelMismatch
from ...oracles.base import Oracle
from .layernorm import OutputLayerNorm, fit_output_layernorm
from ...linalg import lstsq

QUERIES = 3            # sequences of random tokens; every position is seen QUERIES times
JOINT_EVALUATIONS = 50  # a LayerNorm eps given: gamma, beta and the offsets fitted jointly, in this many evaluations
EPS_QUERIES = 4         # eps="auto": sequences whose inputs_embeds nearly cancel the offsets, every position...
EPS_SPREAD = (1e-5, 1.0)   # ...LN_emb's input spread per coordinate there, log-uniform (variance 1e-10 to 1)
EPS_GRID = np.logspace(-16, -2, 57)   # eps="auto": the eps tried before the joint fit (4 a decade)


@dataclass(frozen=True)
class Embeddings:
    """Recovered ``LN_emb`` (``ln``) and the offsets ``c_t`` (rows 0..P-1, ones-component removed)."""

    ln: OutputLayerNorm
    offsets: np.ndarray
    residual: float          # relative residual of the offsets' least squares (model check)
    queries: int
    eps: float | None = None  # LN_emb's eps as measured (eps="auto"); None: not measured

    @property
    def positions(self) -> int:
        return int(self.offsets.shape[0])

    def inputs_for(self, H0: np.ndarray, *, scale: float | None = None) -> np.ndarray:
        """``inputs_embeds`` (N, d) whose ``hidden_states[0]`` is ``H0`` (N, d), rows on LN_emb's image."""
        H0 = np.asarray(H0, dtype=np.float64)
        if H0.ndim != 2 or H0.shape[1] != self.offsets.shape[1]:
            raise ValueError(f"H0 must be (N, {self.offsets.shape[1]}), got {H0.shape}")
        N, d = H0.shape
        if N > self.positions:
            raise InvalidQuery(f"{N} positions wanted, the offsets are known for {self.positions}")
        n = self.ln.normalized(H0)
        off = np.max(np.abs(n.mean(axis=1))) + np.max(np.abs(np.linalg.norm(n, axis=1) / np.sqrt(d) - 1))
        if off > 1e-6:
            raise ValueError(f"H0 is not on the embedding LayerNorm's image (normalised rows off by {off:.2g}): "
                             "no inputs_embeds give it")
        r = float(np.sqrt(d)) if scale is None else float(scale)
        return (r / np.sqrt(d)) * n - self.offsets[:N]          # |r n / sqrt(d)| = r


def _offsets(ln: OutputLayerNorm, A: np.ndarray, X: np.ndarray) -> tuple[np.ndarray, float, int]:
    """The offsets c_t (rows, ones-component removed) from the answers ``A`` (k, length, d) to tokens ``X`` read
    through ``ln`` (module docstring), the worst relative residual of their least squares, and the sum of the
    scales' signs (negative: ``ln``'s gamma has the wrong sign)."""
    k, length, d = X.shape
    n = ln.normalized(A)                                                 # (k, length, d)
    offsets = np.zeros((length, d))
    worst = 0.0
    signs = 0
    for t in range(length):
        # unknowns: s_1..s_k, m_2 - m_1 .. m_k - m_1; equations s_j n_j - s_1 n_1 + dm_j 1 = x_j - x_1
        rows, rhs = [], []
        for j in range(1, k):
            M = np.zeros((d, 2 * k - 1))
            M[:, 0] = -n[0, t]
            M[:, j] = n[j, t]
            M[:, k - 1 + j] = 1.0
            rows.append(M)
            rhs.append(X[j, t] - X[0, t])
        M, r = np.vstack(rows), np.concatenate(rhs)
        sol, *_ = lstsq(M, r, rcond=None)
        worst = max(worst, float(np.linalg.norm(M @ sol - r) / max(np.linalg.norm(r), 1e-300)))
        c = sol[0] * n[0, t] - X[0, t]
        offsets[t] = c - c.mean()
        signs += int(np.sum(np.sign(sol[:k])))
    return offsets, worst, signs


def _joint_fit(ln: OutputLayerNorm, A: np.ndarray, X: np.ndarray, offsets: np.ndarray, eps: float) -> OutputLayerNorm:
    """``ln`` with gamma and beta fitted, with the offsets, to the answers ``A`` (k, length, d) of tokens ``X``
    under LN_emb's ``eps``: ``A = gamma * LN(X + c_t) + beta``, nonlinear least squares from the given start
    (at most :data:`JOINT_EVALUATIONS` evaluations). Alternating the linear fit of gamma, beta given the
    offsets with the offsets given them converged at x0.87 a round (measured: offsets 7.6e-6 -> 2.8e-7 in 30)."""
    from scipy.optimize import least_squares
    d = X.shape[2]
    leps = np.log(eps)

    def residual(th):
        return (_ln_emb(np.append(th, leps), X, d) - A).ravel()

    th0 = np.concatenate([ln.gamma, ln.beta, offsets.ravel()])
    sol = least_squares(residual, th0, method="trf", x_scale="jac", max_nfev=JOINT_EVALUATIONS)
    return dataclasses.replace(ln, gamma=sol.x[:d].copy(), beta=sol.x[d:2 * d].copy())


def _ln_emb(th: np.ndarray, X: np.ndarray, d: int) -> np.ndarray:
    """``gamma * LN(X + c_t) + beta`` for ``th = (gamma, beta, offsets..., log eps)``, X (k, length, d)."""
    g, b, c, eps = th[:d], th[d:2 * d], th[2 * d:-1].reshape(-1, d), np.exp(th[-1])
    Z = X + c[None]
    Zc = Z - Z.mean(axis=-1, keepdims=True)
    return g * Zc / np.sqrt((Zc * Zc).mean(axis=-1, keepdims=True) + eps) + b


def _measured_eps(oracle: Oracle, rng: np.random.Generator, ln: OutputLayerNorm, offsets: np.ndarray, A: np.ndarray,
                  X: np.ndarray, dh: int) -> tuple[OutputLayerNorm, float, np.ndarray, np.ndarray]:
    """LN_emb's eps from the answers (``--ln-eps auto``): :data:`EPS_QUERIES` sequences of ``inputs_embeds``
    ``x_t = delta_t - c_t`` (the offsets read without an eps, sent as float32 numbers so that any target reads
    them exactly), where LN_emb's input is ``delta_t`` up to the offsets' error, its spread per coordinate
    log-uniform in :data:`EPS_SPREAD`: there ``eps / var`` runs up to 1e6 for eps 1e-4 and 1e-2 for BERT's
    1e-12. The eps that fits them best on :data:`EPS_GRID` (gamma, beta and the offsets as read), then gamma,
    beta, the offsets and log eps fitted jointly to every answer of stage E (at most :data:`JOINT_EVALUATIONS`
    evaluations). Returns ``(ln, eps, X, A)``, X and A with the new queries and answers appended."""
    from scipy.optimize import least_squares
    k, length, d = X.shape
    delta = rng.standard_normal((EPS_QUERIES, length, d))
    delta -= delta.mean(axis=-1, keepdims=True)
    spread = np.exp(rng.uniform(*np.log(EPS_SPREAD), (EPS_QUERIES, length, 1)))
    delta *= spread / np.sqrt((delta * delta).mean(axis=-1, keepdims=True))
    X2 = (delta - offsets[None]).astype(np.float32).astype(np.float64)
    A2 = np.asarray(oracle.query(X2), dtype=np.float64)[..., :dh]
    X, A = np.concatenate([X, X2]), np.concatenate([A, A2])
    base = np.concatenate([ln.gamma, ln.beta, offsets.ravel()])
    grid = [float(np.sum((_ln_emb(np.append(base, np.log(e)), X2, d) - A2) ** 2)) for e in EPS_GRID]
    th0 = np.append(base, np.log(EPS_GRID[int(np.argmin(grid))]))
    sol = least_squares(lambda th: (_ln_emb(th, X, d) - A).ravel(), th0, method="trf", x_scale="jac",
                        max_nfev=JOINT_EVALUATIONS)
    return dataclasses.replace(ln, gamma=sol.x[:d].copy(), beta=sol.x[d:2 * d].copy()), float(np.exp(sol.x[-1])), X, A


def embedding_stage(oracle: Oracle, rng: np.random.Generator, *, length: int, d_hidden: int | None = None,
                    queries: int = QUERIES, eps: float | str | None = None, negligible: float = 1e-10) -> Embeddings:
    """Stage E (see the module docstring) from ``queries`` random sequences of ``length`` tokens, reading
    ``hidden_states[0]`` as the first ``d_hidden`` (default d) numbers of every position's answer. ``eps``:
    LN_emb's eps where it is not BERT's negligible one (``--ln-eps``): gamma, beta and the offsets are then
    fitted jointly with it (:func:`_joint_fit`), and the offsets read again. ``eps="auto"``: measured
    (:func:`_measured_eps`, ``Embeddings.eps``); above ``negligible`` it is then used as a given one is."""
    d = oracle.d
    dh = d if d_hidden is None else int(d_hidden)
    if queries < 2:
        raise ValueError(f"need at least 2 queries to fix the offsets, got {queries}")
    need = (d + 2 + length - 1) // length
    k = max(queries, need)
    X = rng.standard_normal((k, length, d))
    A = np.asarray(oracle.query(X))[..., :dh]                           # (k, length, d)
    ln = fit_output_layernorm(A.reshape(-1, dh))
    offsets, worst, signs = _offsets(ln, A, X)
    if signs < 0:                                   # the scales are norms: n was -n, gamma_emb is -gamma_emb
        ln = dataclasses.replace(ln, gamma=-ln.gamma)
    measured = None
    if eps == "auto":
        fitted, measured, X2, A2 = _measured_eps(oracle, rng, ln, offsets, A, X, dh)
        k = len(X2)
        eps = measured if measured > negligible else None
        if eps:                                     # the joint fit with the eps is done: the offsets read again
            ln = fitted
            offsets, worst, _ = _offsets(ln, A, X)
    elif eps:
        # a LayerNorm eps puts h_0 inside LN_emb's sphere by ~eps / var, which the ellipsoid fit above leaves in
        # gamma and beta (measured: 6.5e-6 and the offsets 7.6e-6 at eps 1e-5, float32 d = 8): gamma, beta and
        # the offsets fitted jointly to the answers with the eps, then the offsets read again through that LN
        ln = _joint_fit(ln, A, X, offsets, float(eps))
        offsets, worst, _ = _offsets(ln, A, X)
    limit = 1e3 * max(ln.sphere_residual, 1e-15)
    if worst > limit:
        raise ModelMismatch(f"hidden_states[0] is not LN(x + c_t) with one offset per position (relative residual "
                            f"{worst:.3g} > {limit:.2g})", check="embeddings", figure=worst, threshold=limit)
    return Embeddings(ln=ln, offsets=offsets, residual=worst, queries=k, eps=measured)
