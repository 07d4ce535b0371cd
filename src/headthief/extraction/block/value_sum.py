"""Stage V of the block method: the attention's summed value-output map from Jacobians.

For one token the block's attention is affine: ``pre(x) = x + W_O attn(x) + b_O = B x + b`` with
``B = I + sum_h O_h V_h`` and ``b = W_O b_V + b_O``, and everything after it is one position-wise map
``Phi`` (LN1, the FFN and its residual, LN2): a one-token answer is ``Psi(x) = Phi(B x + b)``. For a
sequence of N equal tokens every head's weights are uniform and sum to one, so the Jacobian of the answer
at position i with respect to token j is ``J_Phi (delta_ij I + (B - I) / N)``. With N = 2:

    J_self - J_cross = J_Phi,    J_Psi = J_Phi B.

``J_Psi`` and ``J_self``, ``J_cross`` are measured by finite differences (a five-point stencil: d-vectors
of answers, 4 d one-token and 4 d two-token queries per base token). ``J_Phi`` has rank d - 2: LN1 makes
``Phi`` blind to the ones-vector (a shift of pre) and to pre itself (its scale), so one base token fixes
``B`` only off a two-dimensional null space; the base tokens' pre vectors differ and their null spaces share
only the ones-vector, so their least-squares union fixes ``B`` up to ``1 r^T``: exactly LN1's symmetry (a
ones-vector added to pre). The union is solved stacked, ``[J_self,k - J_cross,k] B = [J_Psi,k]``, for ``B``
itself: its conditioning is that of the stacked ``J_Phi`` (LN1, the FFN, LN2), not of ``B``. Solving for
``B^{-1}`` instead (``[J_Psi,k] B^{-1} = [J_Phi,k]``, as this stage was first built) inherits ``B``'s own
conditioning, and the real value-output maps are nearly singular: ``P B``'s smallest of d - 1 singular values
is 1.8e-4 of its largest in all-MiniLM-L6-v2's block 1 and 3.3e-4 in block 3, so that solve refused both
in float32 (stacked conditioning 6.9e-5 and 1.7e-4 against 30x the stencil's error) while ``J_Phi`` stacked
is conditioned at 4.5e-2 - 8.1e-2 there (measured, six base tokens). ``b`` comes the same way:
``J_Phi,k (B x_k + b) = 0`` (pre at base k lies in J_Phi's null space), stacked.

For coarse (float32) answers the stencil's step is measured (:func:`measured_step`), not set by the rule
``eps^0.2`` that assumes curvature on the tokens' own scale: MiniLM block 2's one-token map is smooth on a
larger scale, and its step came out 8 - 16x the rule's, with derivatives 11 - 13x more precise. Six base
tokens instead of three, and ``c0`` (hence b) refined by Newton on the exact scale invariance
(:func:`scale_newton`) where ``|c0|`` is at most the base tokens' norm: after it ``b = B c0`` carries B's error
times ``|c0|``, so where c0 is longer (MiniLM blocks 1 and 3: 5.3x and 2.1x; a random d = 32 block: 1.5x) the
Newton made b worse (MiniLM block 1: 4.4e-5 to 1.6e-4) and the stacked equations' b is kept. MiniLM block 2
in float32, as first built (seeds 10 - 14): ``P B`` within 9.4e-6 - 1.7e-5 and ``P b``
within 1.2e-5 - 2.1e-5 relative (``max |P B|``; 4.2e-5 - 8.3e-5 before the Newton), 18,902 queries, 6 s; the
per-base solve with the rule's step refused it.
With ``b`` and ``B``: ``c0 = B^{-1} b`` (modulo the ones direction ``c1 = B^{-1} 1``), which sets pre to
any vector for the later stages.

What this stage recovers, and how it is compared: ``P B`` and ``P b`` with ``P = I - 1 1^T / d``
(the ones-component is LN1's to ignore), exact up to the finite differences' truncation and the answers'
rounding. The least-squares residual across base tokens is this stage's model check: a target in which
one token's answers are not ``Phi(B x + b)`` for one B (two blocks, positions inside the block) leaves
Jacobians no single B explains; where position 0's Jacobian is then the one-token one (it ignores the token
after it), the refusal names a causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ModelMismatch, NotIdentifiable, SpecError
from ...oracles.answers import Output
from ...oracles.base import Oracle
from ...linalg import lstsq, svd

BASES = 3              # base tokens (at least 2 to fix B off the ones direction)
COARSE_BASES = 6       # for coarse answers: each base adds the directions it sees well (MiniLM block 2: B's error
                       # 7.5e-5 from 3 bases, 3.9e-5 from 6, 2.5e-5 from 12, at one step)
LADDER = 2.0 ** np.arange(-3, 7)   # coarse answers: the steps tried, times the rule's eps^0.2 step
PILOT_DIRECTIONS = 8   # directions the step is measured along (4 one-token queries each a step)
STEP_LIMIT = 0.25      # the stencil's widest offset (2 h) at most this fraction of the base token's norm
SCALES = (2.0, 0.5, 1.5, 1 / 1.5, 3.0, 1 / 3.0, 1.25, 0.8)   # Newton on a scale invariance (c0 here, coarse answers;
                       # the encoder's offsets, encoder_parts) asks these scalings: each is one query a base, and
                       # the result is limited by the answers' rounding in them (all-MiniLM-L6-v2 seed 22,
                       # hidden=last, 2 bases: offsets 6.6e-6 with the first two, 3.3e-6 with all eight)
NEWTON = 4             # its steps, at most (measured: 1 - 3 reach the answers' precision)
STENCIL = (-2, -1, 1, 2)
WEIGHTS = np.array([1.0, -8.0, 8.0, -1.0]) / 12.0
RANK_MARGIN = 30      # the stacked J_Phi's smallest of d - 1 singular values must stand this far above the stencil's error
CONSISTENCY = 1e3      # the union's residual may exceed the stencil's expected error by this before it is a mismatch
COARSE = 1e-12         # answers coarser than this (float32: 6e-8) are "coarse": the block method's algebra is
                       # then a start, refitted to answers (one_token_refit, block_refit); float64 is finer


@dataclass(frozen=True)
class ValueSum:
    """``B`` (d, d) and ``b`` (d,) with their ones-components removed (``P B``, ``P b``), ``c1`` = the unit
    vector along ``B^{-1} 1``, ``c0 = B^{-1} b`` (orthogonal to c1), and the stage's figures."""

    B: np.ndarray
    b: np.ndarray
    Binv: np.ndarray       # B^{-1} (I + 1 q^T) for some q: x = Binv (p - b) gives B x + b = p modulo the ones-vector
    c0: np.ndarray
    c1: np.ndarray
    residual: float        # relative residual of the stacked Jacobian equations (model check)
    conditioning: float    # the stacked J_Phi's (J_self - J_cross) smallest of d - 1 singular values over the largest
    expected: float        # the stencil's expected relative error at this step and precision
    step: float
    queries: int


def with_map(vs: "ValueSum", B: np.ndarray, b: np.ndarray) -> "ValueSum":
    """``vs`` with a full-rank value-output map ``B`` and bias ``b`` put in (each with what follows from
    them: ``Binv``, ``c1`` the unit ``B^{-1} 1``, ``c0 = B^{-1} b`` off c1; ``B, b`` stored centred)."""
    import dataclasses
    Binv = np.linalg.inv(B)
    c1 = Binv @ np.ones(B.shape[0])
    c1 = c1 / np.linalg.norm(c1)
    c0 = Binv @ b
    return dataclasses.replace(vs, B=centre(B), b=centre(b), Binv=Binv, c0=c0 - c1 * (c1 @ c0), c1=c1)


def mean_zero_basis(d: int) -> np.ndarray:
    """An orthonormal basis (d, d - 1) of the mean-zero vectors (fixed, so results do not depend on a draw)."""
    return svd(np.eye(d) - 1.0 / d)[0][:, :d - 1]


def centre(A: np.ndarray) -> np.ndarray:
    """``P A`` with ``P = I - 1 1^T / d``: the ones-component along the first axis removed."""
    A = np.asarray(A, dtype=np.float64)
    return A - A.mean(axis=0, keepdims=True)


def stencil_tokens(x: np.ndarray, Qb: np.ndarray, h: float) -> np.ndarray:
    """(4 d, d): x + k h q for every direction q (rows of Qb) and k in STENCIL, direction-major."""
    return (x[None, None, :] + h * np.asarray(STENCIL, float)[None, :, None] * Qb[:, None, :]).reshape(-1, x.size)


def stencil_derivative(Y: np.ndarray, d: int, h: float) -> np.ndarray:
    """The stencil's derivative from answers (4 d, d_out) ordered as :func:`stencil_tokens` for d directions:
    (d_out, d)."""
    Y = Y.reshape(d, len(STENCIL), -1)
    return np.einsum("k,jko->oj", WEIGHTS, Y) / h


def one_token_jacobian(oracle: Oracle, x: np.ndarray, Qb: np.ndarray, h: float) -> np.ndarray:
    """``J_Psi`` at one token x (d_out, d): the five-point stencil along the rows of Qb (orthonormal), rotated
    back (4 d one-token queries)."""
    T = stencil_tokens(x, Qb, h)
    return stencil_derivative(np.asarray(oracle.query_packed(T[:, None, :])), x.size, h) @ Qb


def jacobians(oracle: Oracle, x: np.ndarray, Qb: np.ndarray, h: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``J_Psi``, ``J_self``, ``J_cross`` at base token x (each (d_out, d), in the coordinates of Qb's rows
    rotated back), and the queries spent."""
    d = x.size
    J_psi = one_token_jacobian(oracle, x, Qb, h)
    T = stencil_tokens(x, Qb, h)
    base = np.broadcast_to(x, T.shape)
    if oracle.output is Output.ALL:
        Y = np.asarray(oracle.query(np.stack([T, base], axis=1)))        # (4d, 2, d_out)
        J_self = stencil_derivative(Y[:, 0], d, h) @ Qb
        J_cross = stencil_derivative(Y[:, 1], d, h) @ Qb
        q = 2 * len(T)
    else:                                                                # the last position only
        J_cross = stencil_derivative(np.asarray(oracle.query_packed(np.stack([T, base], axis=1))), d, h) @ Qb
        J_self = stencil_derivative(np.asarray(oracle.query_packed(np.stack([base, T], axis=1))), d, h) @ Qb
        q = 3 * len(T)
    return J_psi, J_self, J_cross, q


def ladder_step(derivative, h0: float, *, limit: float) -> tuple[float, float, float, int]:
    """The five-point step for coarse answers, measured: ``derivative(h)`` (a matrix of derivatives along a
    few fixed directions at step h; it asks its own queries) at every step of ``h0 * LADDER`` up to
    ``limit``, each compared with the next rung's. The change between rungs j and j + 1 is modelled as
    rounding plus truncation, ``change_j^2 = 1.25 a / h_j^2 + 225 b h_j^8`` (a derivative's rounding error
    ``sqrt(a) / h`` halves from one rung to the next; its truncation ``sqrt(b) h^4`` grows 16x), fitted with
    ``a, b >= 0`` on the relative misfit; the step is the rung where ``a / h^2 + b h^8`` is least, and that is
    its error. Measured against float64 twins (MiniLM block 2, random float32 blocks at d = 16 and 32): the
    model's error within 0.8 - 1.3x the true one at every rung; the rule's step ``h0`` (which assumes
    curvature on the tokens' own scale) was 4 - 16x worse than the one picked on MiniLM. Returns ``(h,
    relative error, rms of one derivative's entries, rungs asked)``; ``(h0, nan, nan, 0)`` where fewer than
    three rungs fit under ``limit``."""
    from scipy.optimize import nnls
    hs = h0 * LADDER
    hs = hs[2 * hs <= limit]
    if len(hs) < 3:
        return float(h0), float("nan"), float("nan"), 0
    D = [np.asarray(derivative(float(h))) for h in hs]
    change = np.array([np.linalg.norm(D[i + 1] - D[i]) / max(np.linalg.norm(D[i]), 1e-300)
                       for i in range(len(hs) - 1)])
    change = np.maximum(change, 1e-300)
    M = np.stack([1.25 / hs[:-1] ** 2, 225.0 * hs[:-1] ** 8], axis=1) / change[:, None] ** 2
    (a, b), _ = nnls(M, np.ones(len(change)))
    err = np.sqrt(a / hs ** 2 + b * hs ** 8)
    j = int(np.argmin(err[:-1]))                # a rung with a change measured on both sides of it, or below
    return float(hs[j]), float(err[j]), float(np.sqrt(np.mean(D[j] ** 2))), len(hs)


def measured_step(oracle: Oracle, x: np.ndarray, rng: np.random.Generator, h0: float, *,
                  limit: float) -> tuple[float, float, float, int]:
    """:func:`ladder_step` at base token x along ``PILOT_DIRECTIONS`` random directions (one-token answers):
    ``(h, relative error, rms of one derivative's entries, queries)``."""
    d = x.size
    k = min(PILOT_DIRECTIONS, d)
    Qp = np.linalg.qr(rng.standard_normal((d, k)))[0].T

    def derivative(h):
        Y = np.asarray(oracle.query_packed(stencil_tokens(x, Qp, h)[:, None, :]))
        return stencil_derivative(Y, k, h)

    h, err, rms, rungs = ladder_step(derivative, h0, limit=limit)
    return h, err, rms, rungs * len(STENCIL) * k


def scale_newton(oracle: Oracle, xs: list, Js: list, c0: np.ndarray, c1: np.ndarray,
                 steps: int = NEWTON, through: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """``c0 = B^{-1} b`` refined on an exact invariance, for coarse answers. A one-token answer depends on x
    only through LN1's input direction, ``P B (x + c0)`` normalised, so it does not move when x is scaled about
    ``-c0``: with c0 off by e, the twin ``a (x + c0) - c0`` answers ``Psi(x) + ((a - 1) / a) J_Psi(x) e`` to first
    order. Newton on the twins' answers at the base tokens ``xs`` (their Jacobians ``Js`` from stage V) and the
    ``SCALES`` reads e at the answers' own precision, not a finite difference's (as the encoder's offsets are
    read, :mod:`.encoder_parts`). With ``through`` (a d x d map) the ``Js`` are Jacobians in pre's coordinates
    (``J_Phi``, stage V's stacked equations) and the correction found there is mapped to x by ``through``
    (``B^{-1}``), so a nearly singular B does not enter the normal equations. c0 stays orthogonal to c1 (the ones-shift of pre, LN1's symmetry). Steps go
    on while the twins' disagreement halves, at most ``steps``. Under an input-norm bound only the scalings
    whose twins stay inside it are asked (none asked, c0 kept, where fewer than two do). Returns ``(c0,
    queries)``. Measured: from a
    start 1e-3 off, c0 within 1.7e-7 - 3.4e-7 in 2 - 3 steps (random float32 blocks at d = 32); MiniLM block 2
    in float32, ``P b`` from 4.2e-5 - 8.3e-5 (the null-space equations) to 1.2e-5 - 2.1e-5 of ``max |P B|``,
    where B's own error now limits ``b = B c0``; 150 queries."""
    X = np.stack(xs)
    a = np.asarray(SCALES)
    if oracle.input_norm is not None:              # only the scalings whose twins stay inside the bound
        far = np.linalg.norm(a[None, :, None] * (X[:, None, :] + c0) - c0, axis=2).max(axis=0)
        a = a[far <= 0.99 * oracle.input_norm]
        if len(a) < 2:
            return c0, 0
    w = (a - 1.0) / a
    base = np.asarray(oracle.query_packed(X[:, None, :]), np.float64)
    GN = sum(float(w @ w) * (J.T @ J) for J in Js)
    q, best, best_c = len(X), np.inf, c0
    for _ in range(steps + 1):
        twins = a[None, :, None] * (X[:, None, :] + c0) - c0                     # (bases, scalings, d)
        Y = np.asarray(oracle.query_packed(twins.reshape(-1, 1, X.shape[1])), np.float64).reshape(len(X), len(a), -1)
        q += len(X) * len(a)
        dis = float(np.sqrt(np.mean((Y - base[:, None]) ** 2)) / np.sqrt(np.mean(base ** 2)))
        halved = dis < 0.5 * best
        if dis < best:
            best, best_c = dis, c0
        if not halved:
            break
        rhs = sum(J.T @ (w @ (Y[k] - base[k])) for k, J in enumerate(Js))
        e = lstsq(GN, rhs, rcond=None)[0]
        c0 = c0 - (e if through is None else through @ e)
        c0 = c0 - c1 * (c1 @ c0)
    return best_c, q


def value_sum(oracle: Oracle, rng: np.random.Generator, *, precision: float, scale: float | None = None,
              bases: int | None = None) -> ValueSum:
    """Stage V (see the module docstring). ``precision`` is the answers' relative precision (e.g. the
    output LayerNorm fit's sphere residual); ``scale`` the base tokens' norm (default sqrt(d)); ``bases``
    the base tokens (default ``BASES``, ``COARSE_BASES`` for coarse answers).

    The base tokens' equations ``(J_self,k - J_cross,k) B = J_Psi,k`` are solved stacked, for B, by least
    squares: their conditioning is the stacked ``J_Phi``'s (MiniLM blocks 0 - 4 in float32: 4.2e-2 - 1.7e-1),
    not B's (module docstring). For coarse
    answers the stencil's step is measured (:func:`measured_step`) rather than set by the rule
    ``eps^0.2`` (which assumes curvature on the tokens' own scale), and so is its error."""
    if not oracle.output.vector:
        raise SpecError(f"the block method needs vector answers, got output={oracle.output.value}")
    eps = max(float(precision), 1e-16)
    coarse = eps > COARSE
    bases = (COARSE_BASES if coarse else BASES) if bases is None else int(bases)
    if bases < 2:
        raise ValueError(f"need at least 2 base tokens, got {bases}")
    d = oracle.d
    s = float(np.sqrt(d)) if scale is None else float(scale)
    h = s * eps ** 0.2 / np.sqrt(d)                     # balances rounding (eps / h) and truncation (h^4)
    expected = eps ** 0.8 * np.sqrt(d)
    Js, Ds, nrhs, xs, selfs = [], [], [], [], []
    q = 0
    measured = None
    for k in range(bases):
        x = rng.standard_normal(d)
        x *= s / np.linalg.norm(x)
        if coarse and k == 0:
            h, change, rms, qq = measured_step(oracle, x, rng, h, limit=STEP_LIMIT * s)
            q += qq
            measured = change
        Qb, _ = np.linalg.qr(rng.standard_normal((d, d)))
        J_psi, J_self, J_cross, qq = jacobians(oracle, x, Qb, h)
        q += qq
        if measured is not None and k == 0 and np.isfinite(measured):
            # the derivative's entries carry ~ change x rms each: a (d_out, d) matrix of such errors has a
            # spectral norm ~ 2 sqrt(d) times that, relative to J_Psi's largest singular value
            expected = 2.0 * np.sqrt(d) * measured * rms / np.linalg.norm(J_psi, 2)
        Js.append(J_psi)
        xs.append(x)
        Ds.append(J_self - J_cross)
        selfs.append(J_self)
        nrhs.append(-J_psi @ x)                         # J_Phi (B x + b) = J_Psi x + J_Phi b = 0 (the scale of pre)
    A = np.vstack(Js)
    R = np.vstack(Ds)
    Sr = svd(R, compute_uv=False)
    cond = float(Sr[d - 2] / Sr[0])
    if cond <= RANK_MARGIN * expected:
        raise NotIdentifiable(
            f"the Jacobians J_self - J_cross at {bases} base tokens, stacked, have their smallest of d - 1 singular values "
            f"at {cond:.3g} of the largest, not {RANK_MARGIN}x above the finite differences' error ({expected:.2g}): at "
            "this answer precision the value-output map is not determined by them (a direction LN1 and the FFN nearly "
            "ignore)")
    PB = centre(lstsq(R, A, rcond=None)[0])     # R's null space is the ones-vector: B modulo 1 r^T
    res = float(np.linalg.norm(R @ PB - A) / max(np.linalg.norm(A), 1e-300))
    if res > CONSISTENCY * expected:
        # a causal mask: position 0 of (x + dx, x) then answers as the one token x + dx does, J_self = J_Psi
        # (bidirectional: they differ by position 0's derivative along token 1, ~ (B - I) / 2)
        blind = max(float(np.linalg.norm(S - J) / max(np.linalg.norm(J), 1e-300)) for S, J in zip(selfs, Js))
        if oracle.output is Output.ALL and blind <= CONSISTENCY * expected:
            raise ModelMismatch(
                f"position 0's answer does not depend on the token after it (its Jacobian at {bases} base tokens is "
                f"the one-token one to {blind:.3g}, within {CONSISTENCY:g} x the stencil's {expected:.2g}): a causal "
                "mask (a decoder's block); the block method assumes bidirectional attention", check="value-sum",
                figure=res, threshold=CONSISTENCY * expected)
        raise ModelMismatch(
            f"the Jacobians at {bases} base tokens are not J_Phi (delta_ij I + (B - I)/2) for one value-output map B "
            f"(relative residual {res:.3g} > {CONSISTENCY:g} x the stencil's {expected:.2g}): this target is not one "
            "post-LN block (two blocks? positions inside the block: position embeddings, relative positions or a "
            "convolution over positions?)", check="value-sum", figure=res, threshold=CONSISTENCY * expected)
    c1 = svd(PB)[2][-1]                         # along B^{-1} 1: P B's one null direction
    c1 = c1 * np.sign(c1.sum()) if c1.sum() != 0 else c1
    Bfull = PB + np.outer(np.ones(d), c1) * (np.linalg.norm(PB, 2) / np.sqrt(d))
    X = np.linalg.inv(Bfull)                              # B^{-1} (I + 1 q^T) for some q
    Pb = centre(lstsq(R, np.concatenate(nrhs), rcond=None)[0])   # J_Phi,k (B x_k + b) = 0
    c0 = X @ Pb
    c0 = c0 - c1 * (c1 @ c0)
    if coarse and np.linalg.norm(c0) <= max(np.linalg.norm(x) for x in xs):
        c0, qq = scale_newton(oracle, xs, Ds, c0, c1, through=X)
        q += qq
    return ValueSum(B=PB, b=centre(Bfull @ c0), Binv=X, c0=c0, c1=c1, residual=res, conditioning=cond,
                    expected=float(expected), step=float(h), queries=q)
