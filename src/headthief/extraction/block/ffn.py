"""Stage F of the block method: LN1 and the GELU FFN, once stages L and V have made LN1's output choosable.

After stage L (``n = (y - beta_2) / gamma_2``) and stage V (``B``, ``b`` modulo the ones-vector), a
one-token query ``x = B^{-1}(r m - b)`` makes LN1's normalised output exactly ``m`` (any ``m`` with
``mean(m) = 0``, ``|m| = sqrt(d)``; any ``r > 0``), so what remains is the position-wise map

    n(m) = normalize(u(m)),   u(m) = Gamma_1 m + c + W_2 GELU(W_1' m + b_1')

(``W_1' = W_1 Gamma_1``, ``b_1' = W_1 beta_1 + b_1``, ``c = beta_1 + b_2``). Its Jacobian on the tangent of
LN1's sphere is ``J(m) = P_n K(m) P_m / sigma_u`` with ``K(m) = Gamma_1 + W_2 diag(GELU'(s)) W_1'``: every
``K(m)`` lies in the (ffn + 1)-dimensional span ``W = span{Gamma_1, w2_k w1_k'^T}``, blurred at each point by
a nuisance ``n a^T + e m^T`` and a scale. Steps:

1. ``jacobians``: five-point finite differences along d - 2 tangent directions at T points (4 (d - 2) T
   one-token queries);
2. ``span``: W by alternating projections (lift each J_t by its best nuisance, W = the lifted matrices' top
   principal subspace), with Anderson mixing; where that stalls, L-BFGS on the nuisances (``_polish``);
3. ``rank_ones`` / ``gamma_direction``: W's rank-one elements ``u_k v_k^T`` (projected power iteration from
   random starts) are the neurons; its one diagonal element ``P diag(gamma) P`` (a null space) is gamma_1 up
   to the block's global scale (the canonical choice: ``|gamma| = sqrt(d)``, ``sum(gamma) > 0``);
4. ``profiles``: each point's lifted K_t in that basis gives ``GELU'(alpha_k (v_k . m_t) + b_k) / lambda_k``
   for every neuron: a three-parameter least-squares fit per neuron (alpha_k, b_k, lambda_k). GELU stands
   for the activation assumed (``activation``: :mod:`headthief.models.activations`), whose ``f'`` is fitted;
5. the linear remainder ``c`` (and each point's scale) by least squares on the answers themselves.

Exact algebra except step 2 (an iteration, converging linearly, then a quasi-Newton polish if needed) and
step 4 (a 1-D fit per neuron): the result says which, with the figures. The model check is the fidelity on
fresh one-token queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import scipy.linalg

from ...errors import ConvergenceError, InvalidQuery, ModelMismatch, NotIdentifiable
from ...oracles.base import Oracle
from .layernorm import OutputLayerNorm
from .value_sum import COARSE, ValueSum, mean_zero_basis, stencil_derivative, stencil_tokens
from ...linalg import lstsq, pinv, svd


@dataclass(frozen=True)
class FFNPart:
    """LN1 and the FFN in a canonical form: ``u(m) = gamma * m + c + W2 @ f(W1m @ m + b1m)`` on LN1's
    normalised outputs m. Against a block's truth, with s its global scale (``gamma = s gamma_1``):
    ``W1m = W_1 Gamma_1 P``, ``b1m = W_1 beta_1 + b_1``, ``P W2 = s P W_2``, ``c = s P (beta_1 + b_2)``
    (P removes the ones-component; neurons in any order). ``info`` says what was iterated or fitted;
    ``activation`` names f (:mod:`headthief.models.activations`, BERT's exact GELU by default)."""

    gamma: np.ndarray
    c: np.ndarray
    W1m: np.ndarray
    b1m: np.ndarray
    W2: np.ndarray
    info: dict = field(default_factory=dict)
    activation: str = "gelu"

    def u(self, m: np.ndarray) -> np.ndarray:
        from ...models.activations import activation
        m = np.asarray(m, dtype=np.float64)
        return m * self.gamma + self.c + activation(self.activation).f(m @ self.W1m.T + self.b1m) @ self.W2.T

    def n(self, m: np.ndarray) -> np.ndarray:
        u = self.u(m)
        u = u - u.mean(axis=-1, keepdims=True)
        return u / np.sqrt((u * u).mean(axis=-1, keepdims=True))


RESTARTS = 6           # span: random starts of the polish after the two fixed ones (float32 encoder seed 566's
                       # block 1: 3 of 6 random starts reached the basin of energy 2e-6; zero and Anderson's best
                       # ended at 6e-4)
RESTART_SCALE = 0.5    # their nuisances: this / sqrt(d) times standard normals (the rows of Y are unit)


def _sphere(rng, k: int, d: int) -> np.ndarray:
    m = rng.standard_normal((k, d))
    m -= m.mean(axis=1, keepdims=True)
    return m * (np.sqrt(d) / np.linalg.norm(m, axis=1, keepdims=True))


def tokens_for(vs: ValueSum, M: np.ndarray, r: float | None = None, *, bound: float | None = None) -> np.ndarray:
    """One-token inputs x with LN1's normalised output m (rows of M): ``x = B^{-1}(r m - b)``. LN1 ignores
    r > 0, so each row may take its own: with an input-norm ``bound``, the largest r (at most ``r``, default
    sqrt(d)) whose token has norm <= 0.9 bound. A small r would let LN1's eps and rounding in, so the
    largest is taken, and a row no r > 0 brings inside the bound is an :class:`InvalidQuery`. The tokens
    carry no component along ``B^{-1} 1`` (it would only add a ones-vector to LN1's input)."""
    M = np.atleast_2d(M)
    e = vs.c1                                           # B^{-1} 1: a shift along it only adds ones to pre
    U = M @ vs.Binv.T                                   # B^{-1} m per row
    U = U - np.outer(U @ e, e)
    c = vs.Binv @ vs.b                                  # B^{-1} b
    c = c - (c @ e) * e
    r0 = float(np.sqrt(M.shape[1])) if r is None else float(r)
    rr = np.full(len(M), r0)
    if bound is not None:
        R = 0.9 * float(bound)
        uu, uc, cc = np.einsum("ij,ij->i", U, U), U @ c, float(c @ c)
        disc = uc ** 2 - uu * (cc - R * R)
        top = (uc + np.sqrt(np.maximum(disc, 0.0))) / uu
        if np.any(disc < 0) or np.any(top <= 0):
            raise InvalidQuery(f"no token within the input-norm bound {bound:g} gives the wanted LN1 output: "
                               f"|B^-1 b| = {np.sqrt(cc):.3g} alone is too long")
        rr = np.minimum(rr, top)
    return rr[:, None] * U - c


def jacobians(oracle: Oracle, ln: OutputLayerNorm, vs: ValueSum, rng: np.random.Generator, *, points: int,
              r: float | None, precision: float):
    """(J (T, d, d), ms (T, d) unit, ns (T, d) unit, queries): the tangent Jacobians dn/dm at T random m."""
    d = oracle.d
    eps = max(float(precision), 1e-16)
    h = eps ** 0.2                                                     # relative to |m| = sqrt(d): step h sqrt(d)
    P = np.eye(d) - 1.0 / d
    Ms = _sphere(rng, points, d)
    Js, ms, ns = [], [], []
    q = 0
    for m in Ms:
        mh = m / np.linalg.norm(m)
        # orthonormal tangent basis: complement of {1, m}
        Tb = svd(P - np.outer(mh, mh))[0][:, :d - 2].T       # (d - 2, d)
        X = tokens_for(vs, stencil_tokens(m, Tb, h * np.sqrt(d)), r, bound=oracle.input_norm)
        Y = np.asarray(oracle.query_packed(X[:, None, :]))
        q += len(X)
        J = stencil_derivative(ln.normalized(Y), d - 2, h * np.sqrt(d)) @ Tb   # dn along each tangent vector
        y0 = ln.normalized(np.asarray(oracle.query_packed(tokens_for(vs, m, r, bound=oracle.input_norm)[:, None, :]))[0])
        q += 1
        Js.append(J)
        ms.append(mh)
        ns.append(y0 / np.linalg.norm(y0))
    return np.array(Js), np.array(ms), np.array(ns), q


def span(J: np.ndarray, ms: np.ndarray, ns: np.ndarray, rank: int, *, memory: int = 8, max_iter: int = 300,
         tol: float = 1e-13, progress=None, best_on_stall: bool = False, probes: np.ndarray | None = None,
         polish_iter: int = 3000, restarts: int = RESTARTS, rng: np.random.Generator | None = None,
         on_stall=None):
    """The span W (orthonormal basis, (d^2, rank)), the lifted matrices (T, d^2, unit rows), the iterations
    run and the last fixed-point residual.

    The unknowns are the nuisances nu_t (coefficients of ``n_t a^T + e m_t^T``); one step lifts every J_t
    by its nuisance, takes W as the lifted matrices' top ``rank`` principal subspace and re-solves every
    nuisance against that W (least squares). Plain iteration converges linearly and slowly (measured: a
    factor ~0.93 per step at d = 32); Anderson mixing over the last ``memory`` steps brings it to the
    answers' precision in tens of steps (measured at d = 16, ffn = 32: residual 3e-8 after 40, 1e-13 after 70).
    When ``max_iter`` steps leave the residual above ``tol`` times its start, the best iterate is polished by
    L-BFGS on the nuisances (:func:`_polish`, at most ``polish_iter`` iterations: Anderson stalled on 3 of 3
    point sets of one d = 8 block behind an encoder's first block, while the Jacobians matched the true span
    to 3e-9; the polish settled each in about a second), from zero, from that iterate, then from ``restarts``
    random nuisances (``rng``); the ends are compared by the polish's energy. Raises :class:`ConvergenceError`
    when that too leaves the residual above ``tol`` times its start, unless ``best_on_stall`` (coarse answers,
    where the span is only the start of a refit): then the end with the smallest energy is returned.

    ``probes`` (d, p): J holds the derivatives along the probes only (T, d, p), each projected on its point's
    tangent (:mod:`.ffn_probes`); the nuisance is then ``n_t a^T + e (V^T m_t)^T`` with ``a`` in R^p.
    ``on_stall()``, if given, is called once Anderson has stalled, before the polish (it may raise: stage F
    asks there whether the FFN is nearly linear, which no polish mends: :func:`nearly_linear`)."""
    T, d, _ = J.shape
    E = mean_zero_basis(d)
    Y = J.reshape(T, -1)
    scale = np.linalg.norm(Y, axis=1, keepdims=True)
    Y = Y / scale
    apply, adjoint = _nuisance_maps(Y, ns, ms, E, probes)

    def lift(nu):
        L = Y + apply(nu)
        return L / np.linalg.norm(L, axis=1, keepdims=True)

    if probes is None:
        step = _full(Y, ns, ms, E, rank, lift)
        width = 2 * (d - 1)
    else:
        step = _structured(Y, ns, ms @ probes, E, rank, lift)
        width = probes.shape[1] + d - 1

    def settled(res):
        return res <= tol * first or res <= 1e-12 * np.sqrt(T)

    nu = np.zeros((T, width))
    xs, fs = [], []
    first = None
    best = np.inf
    for it in range(max_iter):
        try:
            g, Q = step(nu)
            astray = not np.all(np.isfinite(g))
        except np.linalg.LinAlgError:
            astray = True
        if astray:
            # Anderson's extrapolation threw the nuisances so far that the lift overflowed (measured: d = 8,
            # ffn = 20, 2 of 3 unseen seeds, "SVD did not converge" at step 40 - 60): on from the best iterate
            if best == np.inf:
                raise ConvergenceError("the Jacobian span's first step failed: the lifted Jacobians are not finite")
            xs, fs = [], []
            nu = kept[1]
            continue
        f = g - nu
        res = float(np.linalg.norm(f))
        first = first if first is not None else max(res, 1e-300)
        if progress is not None:
            progress(it + 1, res)
        if settled(res):
            return Q, lift(g), it + 1, res
        if res > 10 * best:                     # Anderson went astray: restart its history from here
            xs, fs = [], []
        if res < best:
            kept = (Q, g, it + 1, res)
        best = min(best, res)
        xs.append(nu.ravel().copy())
        fs.append(f.ravel().copy())
        xs, fs = xs[-memory - 1:], fs[-memory - 1:]
        if len(fs) > 1:
            dF = np.stack([fs[i + 1] - fs[i] for i in range(len(fs) - 1)], axis=1)
            dX = np.stack([xs[i + 1] - xs[i] for i in range(len(xs) - 1)], axis=1)
            gam, *_ = lstsq(dF, f.ravel(), rcond=None)
            nu = (nu.ravel() + f.ravel() - (dX + dF) @ gam).reshape(nu.shape)
        else:
            nu = g
    # Anderson stalled: L-BFGS on the nuisances (measured: 3 stalled d = 8 spans behind an encoder's first block,
    # residual 3e-3 after 1,500 steps, settle in 130-340 iterations). Ends are compared by the polish's energy,
    # not by the fixed-point residual: behind a float32 encoder's first block a wrong basin kept the smaller
    # residual while its energy was 300x the right one's (measured, seed 566)
    def energy(nu):
        R = _outside(Y + apply(nu), rank)
        return float(np.sum(R * R))

    if on_stall is not None:
        on_stall()
    rng = np.random.default_rng(0) if rng is None else rng
    kept = (energy(kept[1]),) + kept
    starts = [np.zeros_like(kept[2]), kept[2]]          # from zero first: Anderson's best can lie in a poor basin
    starts += [None] * restarts                         # then random starts (drawn only if still needed)
    for nu0 in starts:
        if nu0 is None:
            nu0 = RESTART_SCALE / np.sqrt(d) * rng.standard_normal(kept[2].shape)
        nu = _polish(Y, apply, adjoint, nu0, rank, max_iter=polish_iter)
        try:
            g, _ = step(nu)
            if not np.all(np.isfinite(g)):
                raise np.linalg.LinAlgError("the step's nuisances overflowed")
            g2, Q = step(g)
            res = float(np.linalg.norm(g2 - g))
        except np.linalg.LinAlgError:   # the steps threw the polished end too far (measured: d = 10, ffn = 48,
            res = np.inf                # an unseen seed's "SVD did not converge"); its energy still competes below
        if settled(res):
            return Q, lift(g2), max_iter, res
        e = energy(nu)                  # the polished end itself: where a point's least squares is ill-conditioned
        if e < kept[0]:                 # the steps throw it far (measured: |nu| 5 -> 950 in one step)
            kept = (e, svd(lift(nu), full_matrices=False)[2][:rank].T, nu, max_iter, res)
    if best_on_stall:
        _, Q, g, its, res = kept
        return Q, lift(g), its, res
    raise ConvergenceError(f"the Jacobian span did not settle in {max_iter} steps and an L-BFGS polish from "
                           f"{len(starts)} starts (fixed-point residual {kept[4]:.3g}, from {first:.3g}): the "
                           "Jacobians are not those of LN1 + one GELU FFN of this width, or its neurons are "
                           "structured beyond what the span iteration separates (measured: W1 and W2 block "
                           "diagonal, as in SqueezeBERT's grouped convolutions)")


def _full_apply(ns: np.ndarray, ms: np.ndarray, E: np.ndarray, nu: np.ndarray) -> np.ndarray:
    """Full Jacobians' nuisances ``n_t (E a)^T + (E e) m_t^T`` for ``nu_t = (a, e)``, one row (d^2) a point."""
    k = E.shape[1]
    return (np.einsum("ti,tj->tij", ns, nu[:, :k] @ E.T)
            + np.einsum("ti,tj->tij", nu[:, k:] @ E.T, ms)).reshape(len(ns), -1)


def _full_adjoint(ns: np.ndarray, ms: np.ndarray, E: np.ndarray, R: np.ndarray) -> np.ndarray:
    """:func:`_full_apply`'s adjoint: rows R (d^2 a point) to ``(E^T R^T n_t, E^T R m_t)``."""
    d = ns.shape[1]
    Rr = R.reshape(len(ns), d, d)
    return np.concatenate([np.einsum("tij,ti->tj", Rr, ns) @ E, np.einsum("tij,tj->ti", Rr, ms) @ E], axis=1)


def _nuisance_maps(Y, ns, ms, E, probes):
    """``nu -> N(nu)`` (every point's nuisance matrix, rows as Y's) and its adjoint, as Kronecker products, for
    :func:`span`'s lift and :func:`_polish`. Full Jacobians (``probes`` None): ``n_t (E a)^T + (E e) m_t^T``,
    ``nu_t = (a, e)``; probe Jacobians: ``n_t a^T + (E e) r_t^T`` with ``r_t = V^T m_t``, a in R^p."""
    T = Y.shape[0]
    if probes is None:
        return (lambda nu: _full_apply(ns, ms, E, nu)), (lambda R: _full_adjoint(ns, ms, E, R))
    d, p = ns.shape[1], probes.shape[1]
    rs = ms @ probes

    def apply(nu):
        return (np.einsum("ti,tj->tij", ns, nu[:, :p]) + (nu[:, p:] @ E.T)[:, :, None] * rs[:, None, :]).reshape(T, -1)

    def adjoint(R):
        Rr = R.reshape(T, d, p)
        return np.concatenate([np.einsum("tij,ti->tj", Rr, ns), np.einsum("tij,tj->ti", Rr, rs) @ E], axis=1)

    return apply, adjoint


def _outside(L: np.ndarray, rank: int) -> np.ndarray:
    """L's rows minus their projection on L's top ``rank`` principal subspace (the polish's residual)."""
    Q = svd(L, full_matrices=False)[2][:rank].T
    return L - (L @ Q) @ Q.T


def _polish(Y: np.ndarray, apply, adjoint, nu0: np.ndarray, rank: int, *, max_iter: int) -> np.ndarray:
    """The nuisances minimising the lifted matrices' energy outside their top ``rank`` principal subspace,
    ``f(nu) = |L (I - Q Q^T)|^2`` with ``L = Y + N(nu)``, by L-BFGS from ``nu0``. Q is optimal for L, so the
    gradient is exact without Q's derivative: ``2 N^T L (I - Q Q^T)``. Unlike the alternating step, L-BFGS
    learns how the points' nuisances couple through Q."""
    from .lbfgs import minimize_in_chunks
    shape = nu0.shape

    def fun(x):
        L = Y + apply(x.reshape(shape))
        try:
            R = _outside(L, rank)
        except np.linalg.LinAlgError:   # a line search's trial step far out (measured: d = 8, ffn = 28, 210 points)
            return np.inf, np.zeros_like(x)
        return float(np.sum(R * R)), 2.0 * adjoint(R).ravel()

    x0 = nu0.ravel()
    x, *_ = minimize_in_chunks(fun, x0, fun(x0)[0], max_iter)
    return x.reshape(shape)


def _full(Y: np.ndarray, ns: np.ndarray, ms: np.ndarray, E: np.ndarray, rank: int, lift, chunk: int = 256):
    """:func:`span`'s step (given its ``lift``) for full Jacobians, every point's least squares solved at once.

    Point t's nuisance ``N_t(a, e) = n_t (E a)^T + (E e) m_t^T`` (``2 (d - 1)`` unknowns; :func:`_nuisance_maps`)
    is a Kronecker product, so the normal equations of ``min |(I - Q Q^T)(y_t + N_t x)|`` are formed from
    contractions with the span's basis Q (``rank d^2`` numbers per point) instead of from a stored
    ``d^2 x 2 (d - 1)`` basis. The nuisance has one gauge, ``(a, e) = (E^T m_t, -E^T n_t)`` (``n m^T - n m^T``):
    adding its projector to the normal matrix makes the solution unique and orthogonal to it, the minimum-norm
    one; one step of iterative refinement on the residual, formed without squaring anything, brings it to the
    least squares' own precision. With float32 answers n_t and m_t are mean-zero to ~1e-9 only, and so the gauge
    is null to ~1e-9 only: the per-point solve took it as a direction and put nuisances of 30 - 100 along it
    (measured, d = 16, answers rounded to 6 decimals: the residuals the same to four digits), which then
    dominated the fixed-point residual that Anderson's mixing and the stopping rule read; the projector keeps
    it out (those spans settle in fewer steps: 20 against 33 on that block). A point whose refinement step
    stays above ``REFINED`` of its solution (a normal matrix too ill-conditioned for it) is solved again by
    LAPACK's complete orthogonal factorisation (``gelsy``, with numpy's rank cut-off), as every point was before.
    Measured against that per-point solve: the same nuisances to 3e-15 (random spans, d = 8 - 32), 3x - 10x
    faster, and no ``d^2 x 2 (d - 1)`` basis per point in memory (330 MB at d = 32)."""
    T = Y.shape[0]
    d = ns.shape[1]
    k = d - 1
    w = 2 * k
    u, v = ms @ E, ns @ E                                                  # E^T m_t, E^T n_t
    G0 = np.zeros((T, w, w))
    G0[:, np.arange(w), np.arange(w)] = 1.0                                # |n| = |m| = 1
    G0[:, :k, k:] = u[:, :, None] * v[:, None, :]                          # <n (E a)^T, (E e) m^T> = (a.u)(e.v)
    G0[:, k:, :k] = G0[:, :k, k:].transpose(0, 2, 1)
    gauge = np.concatenate([u, -v], axis=1)
    gauge /= np.linalg.norm(gauge, axis=1, keepdims=True)
    G0 += gauge[:, :, None] * gauge[:, None, :]
    cut = np.finfo(float).eps * max(d * d, w)                              # numpy lstsq's rank cut-off

    def basis(t):                                                          # point t's nuisance basis, d^2 x w
        return _full_apply(np.repeat(ns[t:t + 1], w, axis=0), np.repeat(ms[t:t + 1], w, axis=0), E, np.eye(w)).T

    def against(Q):
        Qm = Q.T.reshape(rank, d, d)
        Qa = Qm.transpose(1, 0, 2).reshape(d, -1)                          # contracted with n_t on the left
        Qe = Qm.reshape(-1, d)                                             # with m_t on the right
        B = Y - (Y @ Q) @ Q.T                                              # -(the right-hand sides)
        out = np.empty((T, w))
        for lo in range(0, T, chunk):
            sl = slice(lo, min(lo + chunk, T))
            n, m = ns[sl], ms[sl]
            C = np.concatenate([(n @ Qa).reshape(-1, rank, d) @ E,         # <Q_r, n (E a)^T>
                                (Qe @ m.T).reshape(rank, d, -1).transpose(2, 0, 1) @ E], axis=2)   # <Q_r, (E e) m^T>
            G = G0[sl] - C.transpose(0, 2, 1) @ C

            def normal_rhs(R, n=n, m=m, C=C):                              # A^T R, A = (I - Q Q^T) N_t
                return _full_adjoint(n, m, E, R) - np.einsum("trw,tr->tw", C, R @ Q)

            try:
                x = -np.linalg.solve(G, normal_rhs(B[sl])[:, :, None])[:, :, 0]
                Nx = _full_apply(n, m, E, x)
                R = -B[sl] - (Nx - (Nx @ Q) @ Q.T)                         # the residual b - A x
                dx = np.linalg.solve(G, normal_rhs(R)[:, :, None])[:, :, 0]
                x += dx
                poor = ~(np.linalg.norm(dx, axis=1) <= REFINED * np.linalg.norm(x, axis=1))
            except np.linalg.LinAlgError:                                  # an exactly singular normal matrix
                x, poor = np.zeros((len(n), w)), np.ones(len(n), dtype=bool)
            out[sl] = x
            for t in np.flatnonzero(poor) + lo:
                A = basis(t)
                A = A - Q @ (Q.T @ A)
                out[t] = scipy.linalg.lstsq(A, -B[t], cond=cut, lapack_driver="gelsy", check_finite=False)[0]
        return out

    def step(nu):
        Q = svd(lift(nu), full_matrices=False)[2][:rank].T
        return against(Q), Q

    step.against = against
    return step


REFINED = 1e-6           # _full: a refinement step above this fraction of its solution: that point by gelsy instead


def _structured(Y: np.ndarray, ns: np.ndarray, rs: np.ndarray, E: np.ndarray, rank: int, lift, chunk: int = 128):
    """:func:`span`'s step (given its ``lift``) for probe Jacobians without storing any nuisance basis: point t's
    nuisance ``n_t a^T + (E e) r_t^T`` (a in R^p, e in R^(d-1)) is a Kronecker product, so its normal
    equations against the span's complement are formed from contractions (``(p + d - 1)^2`` numbers per
    point, in chunks of ``chunk`` points, instead of ``d p (p + d - 1)``). The one direction the two parts
    share (``n_t r_t^T``) is left to the pseudo-inverse, as least squares leaves it. A point orthogonal to the
    probes (``r_t = 0``: :mod:`.ffn_probes` draws all but its inside points so) has no e-part: its equations
    are p x p (at MiniLM's size 12 x 12 instead of 395 x 395, the step's largest cost), its e stays zero."""
    T = Y.shape[0]
    d, p = ns.shape[1], rs.shape[1]
    Yr = Y.reshape(T, d, p)
    En = ns @ E                                                            # (T, d - 1): E^T n_t
    narrow = np.linalg.norm(rs, axis=1) <= 1e-12
    groups = [np.flatnonzero(narrow), np.flatnonzero(~narrow)]

    def solve(sl, Q, Qr, EQr, wide):
        n, Yc = ns[sl], Yr[sl]
        k = len(n)
        QN = (n @ Qr.reshape(d, -1)).reshape(k, p, -1)
        NY = np.einsum("tij,ti->tj", Yc, n)
        w = p
        if wide:
            r = rs[sl]
            QN = np.concatenate([QN, np.einsum("kjc,tj->tkc", EQr, r)], axis=1)
            NY = np.concatenate([NY, np.einsum("ik,tij,tj->tk", E, Yc, r)], axis=1)
            w = p + d - 1
        A = np.zeros((k, w, w))
        A[:, :p, :p] = np.eye(p)
        if wide:
            A[:, :p, p:] = np.einsum("tj,tk->tjk", r, En[sl])
            A[:, p:, :p] = A[:, :p, p:].transpose(0, 2, 1)
            A[:, p:, p:] = np.einsum("t,kl->tkl", np.einsum("tj,tj->t", r, r), np.eye(d - 1))
        A -= QN @ QN.transpose(0, 2, 1)
        QY = Yc.reshape(k, -1) @ Q
        rhs = -(NY - np.einsum("tkc,tc->tk", QN, QY))
        return np.einsum("tkl,tl->tk", pinv(A, rcond=1e-13, hermitian=True), rhs)

    def against(Q):
        Qr = Q.reshape(d, p, -1)
        EQr = np.einsum("ik,ijc->kjc", E, Qr)                           # E^T applied once per step
        out = np.zeros((T, p + d - 1))
        for wide, idx in enumerate(groups):
            for lo in range(0, len(idx), chunk):
                sl = idx[lo:lo + chunk]
                out[sl, :(p + d - 1) if wide else p] = solve(sl, Q, Qr, EQr, bool(wide))
        return out

    def step(nu):
        Q = top_subspace(lift(nu), rank)
        return against(Q), Q

    step.against = against
    return step


def lift_against(J: np.ndarray, ms: np.ndarray, ns: np.ndarray, Q: np.ndarray, probes: np.ndarray) -> np.ndarray:
    """Probe Jacobians ``J`` (T, d, p) at further points lifted against a span Q found without them: each
    point's nuisance solved once against Q (as one step of :func:`span` does), the lifted matrices (T, d p,
    unit rows) returned. :mod:`.ffn_probes` finds the span from its points orthogonal to the probes and lifts
    its points inside their span this way: with those points in the iteration (their nuisance is
    ``p + d - 1`` wide, with a direction shared by its two parts) Anderson's steps stalled at a residual of
    4e-6 on one of 8 d = 32 blocks (research seed 2; 300 steps, then the L-BFGS polish), and settled in 53
    steps without them."""
    T, d, p = J.shape
    E = mean_zero_basis(d)
    Y = J.reshape(T, -1)
    Y = Y / np.linalg.norm(Y, axis=1, keepdims=True)
    apply, _ = _nuisance_maps(Y, ns, ms, E, probes)
    nu = _structured(Y, ns, ms @ probes, E, Q.shape[1], None).against(Q)
    L = Y + apply(nu)
    return L / np.linalg.norm(L, axis=1, keepdims=True)


def top_subspace(L: np.ndarray, rank: int) -> np.ndarray:
    """An orthonormal basis (columns) of the top ``rank`` principal subspace of L's rows: the Gram matrix's
    leading eigenvectors, then one subspace-iteration step through L itself (``orth(L^T L Q)``), which brings
    the basis to the SVD's precision (the Gram alone squares L's condition). About 5x less arithmetic than
    the thin SVD of L (which also forms its left factor) at stage F's probe sizes; the same subspace to
    rounding (tested against the SVD)."""
    import scipy.linalg
    G = L.T @ L
    n = G.shape[0]
    Q = scipy.linalg.eigh(G, subset_by_index=(n - rank, n - 1), check_finite=False)[1]
    return np.linalg.qr(L.T @ (L @ Q))[0][:, ::-1]


BATCH = 64               # rank_ones: starts iterated together at most


def rank_ones(Q: np.ndarray, count: int, d: int, rng: np.random.Generator, *, max_starts: int | None = None,
              tol: float = 1e-6, found_progress=None, batch: int = BATCH):
    """``count`` distinct rank-one elements ``u v^T`` of span(Q) (unit u, v), by projected power iteration;
    ``tol``: how far from rank one (second over first singular value) an element may be, the span's precision.
    ``found_progress(found, count, starts)``, if given, is told of each element found.

    Each random start is iterated on its own (at most 500 steps, to a step below ``1e-9 tol``), then polished
    (:func:`polish_rank_one`) where it is near rank one but not settled, and taken if it is rank one to ``tol``
    and a neuron not yet found. Up to ``batch`` starts are iterated together (one stacked SVD and two matrix
    products a step, not a Python loop per start and step: at d = 8 - 32 the loop's overhead was most of the
    search) and judged in the order they were drawn; the Generator is left where drawing exactly the starts
    used leaves it, so the result and everything drawn after it are those of the one-start-at-a-time search
    (to the rounding of a matrix product against a matrix-vector one)."""
    max_starts = max_starts or 40 * count + 200
    K = Q.shape[1]
    found: list[tuple[np.ndarray, np.ndarray]] = []
    starts = 0
    while len(found) < count and starts < max_starts:
        b = min(max(2 * (count - len(found)), 4), batch, max_starts - starts)
        state = rng.bit_generator.state
        Z = _power_settled(Q, rng.standard_normal((b, K)), d, tol)
        used = 0
        for z in Z:
            used += 1
            starts += 1
            U, S, Vt = svd(z.reshape(d, d))
            if 1e-12 < S[1] / S[0] < POLISH_BELOW:
                z = polish_rank_one(Q, U[:, 0], Vt[0])
                U, S, Vt = svd(z.reshape(d, d))
            if S[1] > tol * S[0]:
                continue
            u, v = U[:, 0], Vt[0]
            if all(abs(u @ a) * abs(v @ b_) < 1 - 1e-6 for a, b_ in found):
                found.append((u, v))
                if found_progress is not None:
                    found_progress(len(found), count, starts)
                if len(found) == count:
                    break
        if used < b:                                   # the starts drawn but not needed: drawn back
            rng.bit_generator.state = state
            rng.standard_normal((used, K))
    if len(found) < count:
        raise NotIdentifiable(f"found {len(found)} of {count} neurons (rank-one elements of the Jacobian span) in "
                              f"{starts} random starts: the span is not that of {count} neurons and LN1's gamma")
    return found, starts


SETTLE = 1e-9            # a power iterate has settled when a step moves it less than this times the tolerance
LOOSE = 1e-6             # rank_ones_batched: a start that moves less than this x tol is judged; only one that is
                         # then plainly a copy of a neuron found (overlap above 1 - 1e-6) or plainly not rank one is
                         # dropped there, every other goes on to SETTLE, and only such a tightly settled element is
                         # taken as a neuron. Settled loosely for everything (2026-12-02) the MiniLM search
                         # (minilm-block-hf:layer=2) took 4 copies of one neuron as distinct (overlap 1 - 2.3e-6
                         # < 1 - 1e-6) and stage F ended in exit 2; most starts end as such copies, and they are
                         # the steps this saves


def _power_step(C: np.ndarray, Q: np.ndarray, d: int, cols: int, tol: float,
                settle: float | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One step of projected power iteration for rows C, coordinates in span(Q) of d x ``cols`` elements: each
    replaced by the (normalised) coordinates of the span's projection of its nearest rank-one element, and
    whether it moved less than ``settle tol`` (up to sign; ``settle`` one number or one per row, by default
    :data:`SETTLE`). Shared by :func:`rank_ones` and :func:`rank_ones_batched`."""
    settle = SETTLE if settle is None else settle
    U, S, Vt = svd((C @ Q.T).reshape(-1, d, cols), full_matrices=False)
    R = S[:, :1, None] * np.einsum("bi,bj->bij", U[:, :, 0], Vt[:, 0, :])
    Cn = R.reshape(len(C), -1) @ Q
    Cn /= np.linalg.norm(Cn, axis=1, keepdims=True)
    sign = np.sign(np.einsum("bk,bk->b", Cn, C))
    return Cn, np.linalg.norm(Cn - sign[:, None] * C, axis=1) < settle * tol


def _power_settled(Q: np.ndarray, G: np.ndarray, d: int, tol: float, steps: int = 500) -> np.ndarray:
    """The starts ``Q g`` (rows g of G, normalised) after steps of :func:`_power_step`, each until it settles,
    at most ``steps`` steps. Rows (n, d^2)."""
    C = G / np.linalg.norm(G, axis=1, keepdims=True)
    live = np.arange(len(C))
    for _ in range(steps):
        if not live.size:
            break
        C[live], settled = _power_step(C[live], Q, d, d, tol)
        live = live[~settled]
    return C @ Q.T


POLISH_BELOW = 1e-2      # a power iterate whose second over first singular value is below this is polished


def polish_rank_one(Q: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The rank-one ``u v^T`` nearest span(Q) (orthonormal columns, d^2 x k) from a start near it: Levenberg-
    Marquardt on ``(I - Q Q^T) vec(u v^T)`` with ``|u| = |v| = 1``, the exact Jacobian. Returns the unit element of
    span(Q) it projects to. Projected power iteration converges linearly, at a rate near 1 where neurons are
    coherent: SqueezeBERT's grouped FFN (each neuron in one 4 x 4 block of a 16 x 16 map) left 79% of the
    starts between 1e-6 and 1e-3 from rank one after 500 steps, and 23 - 25 of 32 neurons were found in 1,480
    starts; polished, all 32 within 1e-12 (synthetic grouped spans, 6 seeds) in 111 - 214 starts."""
    from scipy.optimize import least_squares
    d = u.size
    eye = np.eye(d)

    def away(M):                       # (I - Q Q^T) M for M (d^2, ...)
        return M - Q @ (Q.T @ M)

    def res(x):
        a, b = x[:d], x[d:]
        return np.concatenate([away(np.outer(a, b).ravel()), [a @ a - b @ b, (a @ a + b @ b) / 2 - 1]])

    def jac(x):
        a, b = x[:d], x[d:]
        Ju = away(np.kron(eye, b[:, None]))           # d vec(a b^T) / d a: rows i d + j, column i: b_j
        Jv = away(np.kron(a[:, None], eye))           # d vec(a b^T) / d b: rows i d + j, column j: a_i
        return np.vstack([np.hstack([Ju, Jv]), np.concatenate([2 * a, -2 * b])[None], np.concatenate([a, b])[None]])
    sol = least_squares(res, np.concatenate([u, v]), jac=jac, method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15,
                        max_nfev=100)
    m = np.outer(sol.x[:d], sol.x[d:]).ravel()
    m = Q @ (Q.T @ m)
    return m / np.linalg.norm(m)


def rank_ones_batched(Q: np.ndarray, count: int, d: int, cols: int, rng: np.random.Generator, *,
                      max_starts: int | None = None, tol: float = 1e-6, iterations: int = 2000, batch: int = 64,
                      found_progress=None):
    """:func:`rank_ones` for d x ``cols`` elements, ``batch`` starts at a time in the span's coordinates
    (one batched SVD and two matrix products per step; a start that settles or runs out of ``iterations``
    is replaced by a fresh one). The same test for rank one as there; distinct neurons and both judged in two steps: a
    start that moves less than ``LOOSE tol`` a step and is then plainly a copy of a neuron found (overlap above
    ``1 - max(1e-6, tol^2)``: the span's blur, the same test for every start) or plainly not
    rank one is dropped; any other goes on until it moves less than ``SETTLE tol``, and only such an element is
    taken (most starts end as copies, and their last digits were most of the search). Half of the fresh starts
    are drawn off the neurons already found (orthogonal to their coordinates in the span): a neuron whose basin
    is small is then not left to chance (d = 64, ffn = 256, research seed 3: 255 of 256 in 10,440 uniform
    starts, with the span right to 5e-11). ``found_progress``: as for :func:`rank_ones` (at MiniLM's size
    this search is hours); one with ``keep(key, state)`` is offered the search's state before every step (``state()`` builds it: the caller
    keeps it when due) and one with ``restore(key)`` gives a kept state back (or None): a search cut between
    two of its checkpoints goes on from the last, as it would have gone on (``key``: :func:`span_key`)."""
    max_starts = max_starts or 40 * count + 200
    K = Q.shape[1]
    Qr = Q.reshape(d, cols * K)
    found: list[tuple[np.ndarray, np.ndarray]] = []
    basis = np.zeros((K, 0))                               # found neurons' coordinates, orthonormalised
    restore, keeper = getattr(found_progress, "restore", None), getattr(found_progress, "keep", None)
    key = span_key(Q, count, d, cols) if restore is not None or keeper is not None else None
    kept = restore(key) if restore is not None else None
    if kept is not None and kept["tol"] != tol:
        kept = None                                          # kept at another tolerance: not this search

    def fresh(k):
        nonlocal basis
        for u, v in found[basis.shape[1]:]:                # Gram-Schmidt (twice) for the ones found since
            f = v @ (u @ Qr).reshape(cols, K)
            for _ in range(2):
                f = f - basis @ (basis.T @ f)
            if np.linalg.norm(f) > 1e-8:
                basis = np.hstack([basis, (f / np.linalg.norm(f))[:, None]])
            else:
                basis = np.hstack([basis, np.zeros((K, 1))])
        C = rng.standard_normal((k, K))
        if found and len(found) < K:
            h = k // 2
            C[:h] -= (C[:h] @ basis) @ basis.T
        return C / np.linalg.norm(C, axis=1, keepdims=True)

    if kept is None:
        C = fresh(min(batch, max_starts))
        age = np.zeros(len(C), dtype=int)
        tight = np.zeros(len(C), dtype=bool)
        starts = len(C)
    else:
        # the search as it was kept (between two steps): its elements found, their basis, the starts in flight
        # and their ages, the generator's state; it goes on as the uninterrupted search would have
        found = [(np.asarray(u), np.asarray(v)) for u, v in kept["found"]]
        basis, C, age, tight = (np.array(kept[k]) for k in ("basis", "C", "age", "tight"))
        starts = int(kept["starts"])
        rng.bit_generator.state = kept["rng"]
        if found_progress is not None and found:
            found_progress(len(found), count, starts)

    # two elements are one neuron where their overlap is within the span's blur of 1: elements of a span blurred
    # at tol lie ~tol from their neuron, an overlap ~tol^2 below 1 (MiniLM block 2, tol 0.033: a start that ran
    # to the iteration cap was taken beside its neuron at row cosine 0.99998, and the algebra failed, one-token
    # fidelity 2.5; distinct neurons there overlap at most 0.77)
    same = 1 - max(1e-6, tol * tol)

    fu = np.array([u for u, _ in found]).reshape(len(found), d)     # the neurons found, stacked (grown with found)
    fv = np.array([v for _, v in found]).reshape(len(found), cols)

    def closest(u, v):                                   # the largest overlap with a neuron found
        return float(np.max(np.abs(fu @ u) * np.abs(fv @ v))) if len(fu) else 0.0

    while len(C) and len(found) < count:
        if keeper is not None:
            keeper(key, lambda: {"tol": tol, "found": [(u.copy(), v.copy()) for u, v in found], "basis": basis.copy(),
                               "C": C.copy(), "age": age.copy(), "tight": tight.copy(), "starts": starts,
                               "rng": rng.bit_generator.state})
        C, settled = _power_step(C, Q, d, cols, tol, np.where(tight, SETTLE, LOOSE))
        age = age + 1
        done = settled | (age >= iterations)
        for i in np.flatnonzero(done):
            u_, s_, vt_ = svd((Q @ C[i]).reshape(d, cols), full_matrices=False)
            final = bool(tight[i]) or age[i] >= iterations
            if s_[1] <= tol * s_[0]:
                u, v = u_[:, 0], vt_[0]
                near = closest(u, v)
                if near >= same:
                    continue                             # a copy of a neuron found: dropped, loose or tight
                if final:
                    found.append((u, v))
                    fu, fv = np.vstack([fu, u[None]]), np.vstack([fv, v[None]])
                    if found_progress is not None:
                        found_progress(len(found), count, starts)
                    continue
            elif final or s_[1] > 2 * tol * s_[0]:
                continue                                 # not rank one (loosely settled: plainly not)
            done[i], tight[i] = False, True              # judged on the tightly settled element
        keep = ~done
        room = min(int(done.sum()), max_starts - starts) if len(found) < count else 0
        C = np.concatenate([C[keep], fresh(room)])
        age = np.concatenate([age[keep], np.zeros(room, dtype=int)])
        tight = np.concatenate([tight[keep], np.zeros(room, dtype=bool)])
        starts += room
    if len(found) < count:
        raise NotIdentifiable(f"found {len(found)} of {count} neurons (rank-one elements of the Jacobian span) in "
                              f"{starts} random starts: the span is not that of {count} neurons and LN1's gamma")
    return found[:count], starts


def span_key(Q: np.ndarray, count: int, d: int, cols: int) -> str:
    """A digest of the span (its bytes) and the search's shape: a kept search state is restored only into
    the very span it was searching (:func:`rank_ones_batched`)."""
    import hashlib
    h = hashlib.sha256(np.ascontiguousarray(Q, dtype=np.float64).tobytes())
    h.update(f"{Q.shape},{int(count)},{int(d)},{int(cols)}".encode())
    return h.hexdigest()


def neurons(Q: np.ndarray, ffn: int, d: int, rng: np.random.Generator, tol: float, coarse: bool,
            cols: int | None = None, found_progress=None, on_miss=None):
    """``ffn`` neurons: :func:`rank_ones` (d x d elements) or :func:`rank_ones_batched` (d x ``cols``, the
    probe route); in a span blurred by coarse answers a neuron the search misses is retried at 3x and 10x
    the tolerance (seed 7006 found 31 of 32 at 1x, measured). ``on_miss(error)``, if given, is called once
    after the first miss, before the retries (it may raise: stage F asks there whether the FFN is nearly
    linear, which no wider tolerance mends: :func:`nearly_linear`). A ``found_progress`` with ``restore``
    and ``keep`` keeps the probe route's search (:func:`rank_ones_batched`); a search kept at a wider
    tolerance goes on there, the narrower ones it had already missed not run again."""
    def search(t):
        if cols is None:
            return rank_ones(Q, ffn, d, rng, tol=t, found_progress=found_progress)
        return rank_ones_batched(Q, ffn, d, cols, rng, tol=t, found_progress=found_progress)
    if not coarse:
        return search(tol)
    tols = [min(f * tol, 0.3) for f in (1, 3, 10)]
    restore = getattr(found_progress, "restore", None)
    kept = restore(span_key(Q, ffn, d, cols)) if cols is not None and restore is not None else None
    first = 0
    if kept is not None and kept["tol"] in tols:
        first = tols.index(kept["tol"])             # the kept search's tolerance: the ones before it missed
    for k, t in enumerate(tols):
        if k < first:
            continue
        try:
            return search(t)
        except NotIdentifiable as e:
            if k == 2:
                raise
            if k == 0 and on_miss is not None:
                on_miss(e)
    raise AssertionError("unreachable")


def gamma_direction(Q: np.ndarray, d: int, gap: float = 1e3, probes: np.ndarray | None = None) -> np.ndarray:
    """The gamma with ``P diag(gamma) P`` in span(Q) (a null vector), scaled to ``|gamma| = sqrt(d)``, sum > 0;
    the null direction must be ``gap`` times clearer than the next (1e3 for float64 answers, 30 for a span
    blurred by float32 answers: measured at d = 32, 0.83 against 0.002). With ``probes`` V, the span's
    elements are ``K V``: then ``P diag(gamma) P V``."""
    P = np.eye(d) - 1.0 / d
    R = P if probes is None else P @ probes
    G = np.stack([np.outer(P[:, i], R[i, :]).ravel() for i in range(d)], axis=1)   # gamma -> vec(P diag P V)
    A = G - Q @ (Q.T @ G)
    _, S, Vt = svd(A)
    g = Vt[-1]
    if S[-2] <= gap * max(S[-1], 1e-300):
        raise NotIdentifiable("LN1's gamma is not the one diagonal element of the Jacobian span "
                              f"(two null directions: singular values {S[-2]:.2g}, {S[-1]:.2g})")
    g = g * np.sqrt(d) / np.linalg.norm(g)
    return g if g.sum() > 0 else -g


SCOUT_NFEV = 25           # evaluations for each start of a neuron's profile fit before the best is polished
                          # (the analytic Jacobian: 25 steps, what 100 evaluations gave with numerical ones)
POLISH_NFEV = 500         # ... and for the polish of the best (2,000 with numerical Jacobians)


def _profile_fit(xi: np.ndarray, rho: np.ndarray, starts: int = 8,
                 act: str = "gelu") -> tuple[float, float, float, float]:
    """rho = kappa f'(alpha xi + beta), f the activation ``act`` (GELU, or another of
    :mod:`headthief.models.activations`): (alpha, beta, kappa, relative rms residual). A grid over
    (alpha, beta) (kappa by least squares at each node), then Levenberg-Marquardt from the ``starts / 2`` best
    nodes of each sign of alpha; the best end point is kept (GELU' is not monotone: one start can end in a
    local minimum, measured). Both signs: ``f'(-x) = 1 - f'(x)`` (every ``s g(s)`` gate with ``g(-s) = 1 - g(s)``:
    GELU, its tanh form, SiLU), so over a narrow range of xi the wrong
    sign at another scale fits almost as well (measured: block 1 of the float32 encoder seed 662, a neuron
    read over xi in [-0.16, 1.87] only; the 8 best nodes all had alpha > 0, the fit ended at -3x the weight).
    Each start runs ``SCOUT_NFEV`` steps, the best end is then polished (a wrong-sign start crawls: 2,000
    evaluations where a start in the right basin settles in ~50, measured with numerical Jacobians, which
    cost 4 evaluations a step; the Jacobian is now analytic)."""
    from scipy.optimize import least_squares

    from ...models.activations import activation
    f = activation(act)
    nodes = []
    for a in np.concatenate([-np.geomspace(0.02, 50, 41), np.geomspace(0.02, 50, 41)]):
        F = f.prime(a * xi[None, :] + np.linspace(-6, 6, 49)[:, None])          # (betas, T)
        den = np.einsum("bt,bt->b", F, F)
        k = (F @ rho) / np.maximum(den, 1e-300)
        r = np.linalg.norm(k[:, None] * F - rho[None, :], axis=1)
        for i in np.argsort(r)[:2]:
            nodes.append((float(r[i]), float(a), float(np.linspace(-6, 6, 49)[i]), float(k[i])))
    nodes.sort()

    def res(p):
        return p[2] * f.prime(p[0] * xi + p[1]) - rho

    def jac(p):                                 # GELU''(s) = phi(s) (2 - s^2), and the others' f''
        s = p[0] * xi + p[1]
        g2 = p[2] * f.second(s)
        return np.column_stack([g2 * xi, g2, f.prime(s)])

    half = -(-starts // 2)
    chosen = [n for n in nodes if n[1] < 0][:half] + [n for n in nodes if n[1] > 0][:half]
    best = None
    for _, a, b, k in chosen:                   # a scout of every start; a start in the wrong sign's basin crawls
        sol = least_squares(res, [a, b, k], jac=jac, method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15,
                            max_nfev=SCOUT_NFEV)
        r = float(np.linalg.norm(sol.fun))
        if best is None or r < best[0]:
            best = (r, sol.x)
    sol = least_squares(res, best[1], jac=jac, method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=POLISH_NFEV)
    r, (a, b, k) = min(best, (float(np.linalg.norm(sol.fun)), sol.x), key=lambda t: t[0])
    return float(a), float(b), float(k), r / max(float(np.linalg.norm(rho)), 1e-300)


def tolerances(precision: float, d: int) -> tuple[float, float]:
    """The span iteration's stopping tolerance and the rank-one test's, from the answers' precision. float64
    answers (precision <= COARSE; validated at a floor of 1e-15): 1e-13 and 1e-6. Coarser answers (float32): the
    Jacobians are good to the stencil's error ``eps^0.8 sqrt(d)`` only, and the span is blurred by it and by
    stage V's B: the iteration stops at 30x that error, and a rank-one element may keep a second singular
    value up to 1e3x it (measured at float32, d = 16: ~1e-3 of the first). Those parts are a start only:
    the one-token refit (:mod:`.one_token_refit`) fits them to the answers."""
    expected = max(float(precision), 1e-16) ** 0.8 * np.sqrt(d)
    if precision <= COARSE:
        return 1e-13, 1e-6
    return 30 * expected, min(1e3 * expected, 0.1)


def span_constraints(d: int, ffn: int) -> int:
    """What one tangent Jacobian tells about the span W beyond the point's own unknowns: it shows (d - 2)^2
    numbers (d - 2 tangent directions in; out, LN2 hides n and the ones, as LN1 hides m and the ones) and W
    takes ffn + 1 of them as the point's coefficients, so ``(d - 2)^2 - (ffn + 1)``. W itself has
    ``(ffn + 1) ((d - 1)^2 - ffn - 1)`` degrees of freedom, which the points must outnumber together."""
    return (d - 2) ** 2 - (ffn + 1)


TIGHT = 19             # span_constraints below this (d = 8: ffn >= 17): stage F's first read often fails
                       # (measured, float64, 85 - 145 points: ffn 16 9/10, 18 4/5, 20 3/4, 22 2/4, 24 0/4,
                       # 26 1/4, 28 0/3), and a failure says so (tight_note)


class FFNTooWide(NotIdentifiable):
    """A FFN too wide for stage F's span at this d (:func:`check_span_fits`): a property of the sizes, so
    fresh points do not help."""


def check_span_fits(d: int, ffn: int) -> None:
    """:class:`FFNTooWide` (before any query) where tangent Jacobians cannot fix the span at all: ``ffn + 1 >=
    (d - 2)^2`` (:func:`span_constraints` <= 0; any (ffn + 1)-dimensional W fits every point)."""
    if span_constraints(d, ffn) <= 0:
        raise FFNTooWide(f"a FFN of width {ffn} at d = {d} is beyond the block method: a tangent Jacobian shows "
                         f"(d - 2)^2 = {(d - 2) ** 2} numbers and the FFN's span takes ffn + 1 = {ffn + 1} of them "
                         f"as each point's own coefficients, so no point constrains the span (the method needs "
                         f"ffn + 1 < (d - 2)^2, and a few to spare: measured at d = 8 on unseen seeds, ffn = 28 with "
                         f"7 to spare 3 of 3 extracted, ffn = 30 with 5 2 of 3, ffn = 32 with 3 none)")


def tight_note(d: int, ffn: int) -> str:
    """Said with a span or neuron failure where :func:`span_constraints` is below TIGHT ('' otherwise)."""
    c = span_constraints(d, ffn)
    if c >= TIGHT:
        return ""
    return (f"; this width is near the method's limit at d = {d}: each tangent Jacobian leaves (d - 2)^2 - (ffn + 1) "
            f"= {c} constraint{'s' if c != 1 else ''} on the span beyond its own coefficients (measured, float64, "
            "stage F read from up to 4x its points, unseen random bert-blocks: d = 8 with ffn 18 - 28, 17 down to 7 "
            "constraints, 22 of 22 extracted; ffn 30, 5 constraints, 2 of 3; ffn 32, 3 constraints, 0 of 3; an FFN "
            "of weaker curvature needs more: transformers' BertLayer with PyTorch's init, d = 8, ffn 20 yes, 24 no); "
            "it is not an error of the target")


def default_points(d: int, ffn: int) -> int:
    """Stage F's Jacobian points by default: ``max(5 (ffn + 1), 2 d)`` (3 (ffn + 1) left a d = 16 seed
    unsettled, measured)."""
    return max(5 * (ffn + 1), 2 * d)


def extract_ffn(oracle: Oracle, ln: OutputLayerNorm, vs: ValueSum, rng: np.random.Generator, *, ffn: int,
                points: int | None = None, precision: float = 1e-15, r: float | None = None,
                max_iter: int = 300, progress=None, reader=None, start: bool = False,
                activation: str = "gelu", found_progress=None) -> FFNPart:
    """Stage F (see the module docstring) for a block of FFN width ``ffn``. ``reader(rng, T)``, if given,
    reads the T Jacobians instead of :func:`jacobians` (same returns; the image route:
    :func:`~.ffn_image.image_reader`). ``start``: the result is only the start of a fit, so a span that
    stalls above its tolerance is kept (its best iterate) instead of refused. ``activation``: the FFN's
    (:mod:`headthief.models.activations`), whose derivative every neuron's profile is fitted with.
    ``progress(step, residual)`` is told of the span's steps, ``found_progress(found, ffn, starts)`` of each
    neuron found."""
    d = oracle.d
    check_span_fits(d, ffn)                         # before the Jacobians' queries
    T = points or default_points(d, ffn)
    J, ms, ns, q = (jacobians(oracle, ln, vs, rng, points=T, r=r, precision=precision) if reader is None
                    else reader(rng, T))
    span_tol, rank_tol = tolerances(precision, d)
    coarse = precision > COARSE
    try:
        # a start (behind an earlier block: a span good to ~1e-9) gets the neuron search's wider tolerances too,
        # as float32 spans do (unseen encoder seed 15015, FFN 16: 14 of 16 neurons on 3 tries at the strict one)
        Q, lifted, iters, change, pairs, starts = span_and_neurons(
            J, ms, ns, ffn, rng, tol=span_tol, rank_tol=rank_tol, coarse=coarse or start,
            best_on_stall=coarse or start, max_iter=max_iter, progress=progress, found_progress=found_progress)
        gam = gamma_direction(Q, d, gap=30.0 if coarse else 1e3)
    except NearlyLinearFFN:
        raise
    except (ConvergenceError, NotIdentifiable) as e:
        note = tight_note(d, ffn)
        if not note:
            raise
        raise type(e)(f"{e}{note}") from e
    coef = coefficients(lifted, gam, pairs)
    info = {"queries": q, "points": T, "span_iterations": iters, "span_change": change, "starts": starts,
            "fitted": ["span (iterated)", "neuron profiles (1-D fits)"]}
    return assemble_part(gam, [u for u, _ in pairs], [v for _, v in pairs], coef, ms, ns, info, activation)


class NearlyLinearFFN(NotIdentifiable):
    """Stage F's failure on an FFN that acts almost linearly on LN1's sphere (:func:`nearly_linear`): a
    property of the block, so fresh points do not help."""


EARLY_LINEAR_D = 64    # span_and_neurons: the probe route asks nearly_linear once Anderson stalls up to this d
                       # (its rank-(d - p + 1) fit: seconds there; at MiniLM's d = 384, up to 300 steps of a
                       # 373-wide span), beyond it only after the polish fails
LINEAR = 1e-3          # nearly_linear: a quadratic FFN's span leaves less than this of the Jacobians outside it
                       # (measured: BertModel's init 5.2e-8 - 5.1e-5 at d = 8 - 32, float64 and float32; a
                       # trained-scale block, d = 8, 0.057)


def nearly_linear(J: np.ndarray, ms: np.ndarray, ns: np.ndarray, ffn: int, error: Exception, *, tol: float,
                  max_iter: int, probes: np.ndarray | None = None) -> Exception:
    """Why stage F's span or neuron search failed, where it can say: ``error`` itself, or a
    :class:`NearlyLinearFFN` (:class:`NotIdentifiable`) naming an FFN that acts almost linearly on LN1's sphere.

    With pre-activations near 0 (transformers' ``BertModel`` as built from a config: weights N(0, 0.02^2),
    biases 0), ``GELU(s) ~ s/2 + s^2/sqrt(2 pi)`` and ``GELU'(s) ~ 1/2 + 0.80 s - 0.27 s^3``: every Jacobian
    is then ``K_0 + L(m)`` with L linear in m, a d-dimensional span (the constant and the d - 1 directions of
    m: a quadratic FFN's), and the other ``ffn + 1 - d`` directions of the neurons' span show only through
    the cubic term, ``~s^2`` below the linear one. The span at rank d is fitted (as :func:`span` does, its
    best iterate where it does not settle); where the lifted Jacobians (unit rows) keep an rms below
    ``LINEAR`` outside it, the neurons beyond d are that far below everything else the Jacobians hold: a
    measured property of the answers. The span's rank is 1 + the points' own dimension (d on the full route;
    ``d - p`` on the probe route, whose points lie off the ``probes`` V, where ``J`` is ``K(m) V``). A block
    with ``ffn + 1`` no larger keeps ``error``."""
    T, d = J.shape[:2]
    rank = 1 + int(np.linalg.matrix_rank(ms - ms.mean(axis=1, keepdims=True), tol=1e-8))
    if ffn + 1 <= rank:
        return error
    _, L, _, _ = span(J, ms, ns, rank, max_iter=max_iter, tol=tol, best_on_stall=True, restarts=0, probes=probes)
    s = svd(L, compute_uv=False)
    outside = float(np.sqrt(np.sum(s[rank:] ** 2) / T))
    if not outside < LINEAR:
        return error
    return NearlyLinearFFN(
        f"the FFN acts almost linearly on LN1's sphere: a quadratic FFN's {rank}-dimensional Jacobian span (GELU's "
        f"first two terms) leaves {outside:.2g} of the Jacobians outside it (below {LINEAR:g}; a trained block's "
        f"leave ~0.06), so the other {ffn + 1 - rank} direction{'s' if ffn > rank else ''} of the {ffn} neurons' "
        "span show only through GELU's higher terms and are not separated (pre-activations near 0, as in "
        f"BertModel's own initialisation, weights N(0, 0.02^2)). Stage F stopped: {error}")


def span_and_neurons(J, ms, ns, ffn: int, rng: np.random.Generator, *, tol: float, rank_tol: float, coarse: bool,
                     best_on_stall: bool, max_iter: int, progress=None, probes: np.ndarray | None = None,
                     found_progress=None):
    """:func:`span` at rank ffn + 1, then :func:`neurons` (``cols``: the probes' count on the probe route;
    ``coarse``: its wider tolerances after a miss; ``found_progress``: told of each neuron found):
    ``(Q, lifted, iterations, change, pairs, starts)``. A failure of either is asked :func:`nearly_linear`
    (once; on the full route already when Anderson stalls, before the polish: at d = 32 that polish is most
    of an hour), and a nearly linear FFN is raised as such."""
    asked = []

    def linear(error):
        if not asked:
            asked.append(nearly_linear(J, ms, ns, ffn, error, tol=tol, max_iter=max_iter, probes=probes))
        return asked[0] if isinstance(asked[0], NearlyLinearFFN) else error

    def missed(error):
        e = linear(error)
        if isinstance(e, NearlyLinearFFN):
            raise e

    def stalled():
        missed(ConvergenceError("the Jacobian span's alternating projections stalled"))

    d = J.shape[1]
    try:
        # asked early on the full route (small d: the rank-d fit costs seconds). Coarse answers need it there:
        # their span keeps its best iterate, whose "neurons" then failed stage F's check as "not a GELU block"
        # (float32 init=bert, d = 8, seed 14302: exit 5). The probe route asks early up to EARLY_LINEAR_D only
        # (a nearly linear d = 12 FFN was refused after the whole polish, 8 starts: 41 s, against 9 s asked
        # early), so no run that succeeds pays for it at MiniLM's size. Where the span settles, it is asked as
        # early when the neuron search first misses, before the wider tolerances' searches (seed 14302's span
        # settled once its float32 gauge was projected out, ffn._full: three searches of 840 starts, 45 s, then
        # the same exit 2)
        early = probes is None or d <= EARLY_LINEAR_D
        Q, lifted, iters, change = span(J, ms, ns, ffn + 1, max_iter=max_iter, tol=tol, progress=progress,
                                        best_on_stall=best_on_stall, rng=rng, probes=probes,
                                        on_stall=stalled if early else None)
        pairs, starts = neurons(Q, ffn, d, rng, rank_tol, coarse, cols=None if probes is None else probes.shape[1],
                                found_progress=found_progress, on_miss=missed if early else None)
    except NearlyLinearFFN:
        raise
    except (ConvergenceError, NotIdentifiable) as e:
        raise linear(e) from e
    return Q, lifted, iters, change, pairs, starts


def coefficients(lifted: np.ndarray, gam: np.ndarray, pairs, probes: np.ndarray | None = None) -> np.ndarray:
    """Each point's lifted matrix in the basis ``P diag(gamma) P [V]``, ``u_k v_k^T``: (ffn + 1, T); row 0
    (gamma's) must not vanish anywhere (it scales the neurons at that point)."""
    d = gam.size
    P = np.eye(d) - 1.0 / d
    G = P @ np.diag(gam) @ P
    basis = np.stack([(G if probes is None else G @ probes).ravel()] + [np.outer(u, v).ravel() for u, v in pairs],
                     axis=1)
    coef, *_ = lstsq(basis, lifted.T, rcond=None)
    if np.min(np.abs(coef[0])) <= 1e-9 * np.max(np.abs(coef[0])):
        raise NotIdentifiable("a Jacobian has no gamma component: cannot scale the neurons at that point")
    return coef


AUTO = ("gelu", "gelu_tanh", "silu")   # activation="auto": one of each class (quick_gelu is silu's, rescaled)
AMBIGUOUS = 3.0                         # auto: candidates whose profile fits end within this factor of the best


def assemble_part(gam: np.ndarray, us, zs, coef: np.ndarray, ms: np.ndarray, ns: np.ndarray, info: dict,
                  activation: str = "gelu") -> FFNPart:
    """Steps 4 and 5 of the module docstring: neuron k's output direction ``us[k]`` and input direction
    ``zs[k]`` (any scale), its coefficient ``coef[k + 1]`` over gamma's ``coef[0]`` at every point (unit ``ms``,
    answers' unit ``ns``) -> its profile ``f'`` (scale, bias; f the ``activation``), then the linear remainder
    ``c``. ``activation="auto"``: the profiles fitted with each of :data:`AUTO`, the part of the best fit kept
    (worst relative residual over the neurons; ``info["activation_fits"]`` has every candidate's), and the
    parts of candidates within :data:`AMBIGUOUS` of it in ``info["activation_alternatives"]`` (float32
    profiles do not separate GELU from its tanh form: the one-token refit decides, :mod:`.extract`)."""
    if activation == "auto":
        parts = {name: assemble_part(gam, us, zs, coef, ms, ns, info, name) for name in AUTO}
        fits = {name: float(p.info["profile_fit_worst"]) for name, p in parts.items()}
        best = min(fits, key=fits.get)
        close = {n: p for n, p in parts.items() if n != best and fits[n] <= AMBIGUOUS * fits[best]}
        return replace(parts[best], info={**parts[best].info, "activation_alternatives": close,
                                          "activation_fits": ", ".join(f"{n} {v:.2g}" for n, v in fits.items())})
    from ...models.activations import activation as act_of
    gelu = act_of(activation).f
    T, d = ms.shape
    ffn = len(us)
    a_t = coef[0]
    P = np.eye(d) - 1.0 / d
    M = ms * np.sqrt(d)
    W1m = np.zeros((ffn, d))
    b1m = np.zeros(ffn)
    W2 = np.zeros((d, ffn))
    fits = []
    for k, (u, v) in enumerate(zip(us, zs)):
        rho = coef[k + 1] / a_t
        xi = M @ v
        alpha, beta, kappa, rel = _profile_fit(xi, rho, act=activation)
        fits.append(rel)
        W1m[k] = alpha * v
        b1m[k] = beta
        W2[:, k] = kappa * u / alpha
    # the linear remainder: P (gam m + W2 g + c) = zeta_t n_t, least squares in (c, zeta). Each zeta_t's
    # optimum is the projection on n_t, so c solves sum_t (P - n_t n_t^T)(G_t + c) = 0 (d unknowns, not d + T)
    # The neurons' output scale rides on their coefficients over gamma's, which float32 answers leave biased
    # alike (measured: unseen seed 22221, d = 12, FFN 24: every W2 column 1.2% long, every direction within
    # 1e-3); where c dominates u, that bias was amplified into c (144% off) and F+ stalled above its check (a
    # false exit 5; with the true c it reached the answers' floor). So one common factor k on the neurons' output
    # is solved with c: sum_t R_t (P gam m_t + k P F_t + c) = 0, R_t = P - n_t n_t^T (d + 1 unknowns)
    F = gelu(M @ W1m.T + b1m) @ W2.T                                    # (T, d)
    PF, PGa = F - F.mean(axis=1, keepdims=True), M * gam - (M * gam).mean(axis=1, keepdims=True)

    def R(V):                                   # R_t on each (centred) row of V: the n_t are centred too
        return V - ns * np.einsum("td,td->t", ns, V)[:, None]
    RF, RG = R(PF), R(PGa)
    A = np.zeros((d + 1, d + 1))
    A[:d, :d] = T * P - ns.T @ ns
    A[:d, d] = A[d, :d] = RF.sum(axis=0)
    A[d, d] = float(np.sum(PF * RF))
    rhs = -np.concatenate([RG.sum(axis=0), [float(np.sum(PF * RG))]])
    sol, *_ = lstsq(A, rhs, rcond=None)
    c, k = P @ sol[:d], float(sol[d])
    if not 0.5 <= k <= 2.0:                     # not a small bias: c alone, the neurons' scale as read
        sol, *_ = lstsq(A[:d, :d], -RG.sum(axis=0) - RF.sum(axis=0), rcond=None)
        c, k = P @ sol, 1.0
    W2 = W2 * k
    # gamma's sign was fixed by sum > 0 (gamma_direction). The pair (LN1, FFN) with u's sign flipped is the
    # same block with LN2's gamma negated (the module's symmetry): the answers' unit n_t must point along u_t,
    # not against it (zeta_t > 0), else stage L's sign rule chose the other representative (measured: a block
    # with sum(gamma_2) < 0 answered fresh one-token queries at fidelity 5.3 before this)
    PG = k * PF + PGa                                                   # P (k F_t + gam m_t)
    if np.median(np.einsum("td,td->t", ns, PG + c)) < 0:
        gam, W2, c = -gam, -W2, -c
    return FFNPart(gamma=gam, c=c, W1m=W1m, b1m=b1m, W2=W2, activation=activation,
                   info={**info, "profile_fit_worst": float(max(fits)), "output_scale_factor": k})


def predict_one_token(part: FFNPart, ln: OutputLayerNorm, vs: ValueSum, X: np.ndarray) -> np.ndarray:
    """Answers to one-token queries X (k, d) from stages L, V, F."""
    p = np.atleast_2d(X) @ vs.B.T + vs.b
    p = p - p.mean(axis=1, keepdims=True)
    m = p * (np.sqrt(p.shape[1]) / np.linalg.norm(p, axis=1, keepdims=True))
    return part.n(m) * ln.gamma + ln.beta


CHECK_FACTOR = 100     # one-token fidelity allowed: this many times the stencil's expected error


def check_one_token(oracle: Oracle, part: FFNPart, ln: OutputLayerNorm, vs: ValueSum, rng: np.random.Generator, *,
                    count: int = 64, precision: float = 1e-15, scale: float | None = None) -> dict:
    """Stages L, V, F's model check: ``count`` fresh one-token queries against :func:`predict_one_token`.
    The fidelity (largest error over the answers' rms) must be within ``CHECK_FACTOR`` times the five-point
    stencil's expected error (``eps^0.8 sqrt(d)``, the Jacobians' precision), else :class:`ModelMismatch`.
    Returns the fidelity, the threshold, the queries and the ``tokens`` and ``answers`` (fitted by nothing: a
    later map of the same block is judged on them again at no query, :func:`.extract.one_token_fidelity`)."""
    d = oracle.d
    s = float(np.sqrt(d)) if scale is None else float(scale)
    X = rng.standard_normal((count, d))
    X *= s / np.linalg.norm(X, axis=1, keepdims=True)
    Y = np.asarray(oracle.query_packed(X[:, None, :]))
    fid = float(np.max(np.abs(predict_one_token(part, ln, vs, X) - Y)) / np.sqrt(np.mean(Y ** 2)))
    limit = CHECK_FACTOR * max(float(precision), 1e-16) ** 0.8 * np.sqrt(d)
    if fid > limit:
        raise ModelMismatch(f"the recovered LN1 + FFN + LN2 answer fresh one-token queries with fidelity {fid:.3g} > "
                            f"{limit:.2g} ({CHECK_FACTOR}x the Jacobians' precision): not a post-LN {part.activation} "
                            "block of this width", check="one-token fidelity", figure=fid, threshold=limit)
    return {"fidelity": fid, "threshold": limit, "queries": count, "tokens": X, "answers": Y}
