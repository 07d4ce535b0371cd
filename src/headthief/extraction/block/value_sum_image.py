"""Stages V and F of the block method with every query on the previous LayerNorm's image.

Inside an encoder a block's inputs are ``x = G n + beta_p`` (``G = diag(gamma_p)``, n on the sphere of
:mod:`.image`). Stage V (:mod:`.value_sum`) moves tokens freely; here they move along great circles only,
so at a base n the Jacobians are known along the d - 2 tangent directions ``G T`` only:

    Y = J_Phi B G T          (one token),        Z = J_Self - J_Cross = J_Phi G T      (the pair [x, x]),

``J_Phi`` being the Jacobian of LN1 -> FFN -> LN2 at ``p0 = B x + b``. It has rank d - 2 and the null space
``span{1, p0}``; ``Z`` gives it on ``span{G T}`` and the ones, but not along the last direction of R^d
(``G n``: the radial one, never reachable). So each base leaves one unknown vector ``zeta`` (``J_Phi G n`` in
the coordinates of Z's columns) and the equations

    w (B G) T = C,    w (B G n + c) = 0,    w = [I, 0, zeta] [G T, 1, G n]^{-1},    C = Z^+ Y

are bilinear in (``B G``, ``c = B beta_p + b``) and ``zeta``. They are solved jointly from the start
``B = I, b = 0`` (the residual alone) by two solvers, chained (:func:`_solve_routes`): Levenberg-Marquardt
(:meth:`_Fit.solve`, dense: at most :data:`MAX_UNKNOWNS` unknowns, d <= 88) and alternating least squares
(:meth:`_Fit.solve_als`: each half in closed form, O(bases d^3) a sweep; d = 64: 0.15 s against 65 s). Up to
d = :data:`DENSE_FIRST` the dense fit goes first, past it the alternation, and where one stops short the other
takes over (from ``B = I`` or from where the alternation stopped); past d = 88 the alternation alone. Each
reaches the truth on most random blocks alone, the chain on every one measured
(``benchmarks/bench_block_image.py``; :func:`_solve_routes` has the figures).
What is recovered: ``K = P B G`` on mean-zero n (B's action on
the image's directions; ``B gamma_p``, the column along gamma_p, never shows: a genuine symmetry here) and
``P c``, exact up to the stencils' truncation and the answers' rounding. The fit's residual relative to
the stencil's error is the model check (two blocks given as one leave equations no single B satisfies).

Stage F on the image (:mod:`.ffn_image`) reads its Jacobians through ``K`` and ``c``: LN1's normalised input
at an image point is ``m = sqrt(d) P(K n + c) / |P(K n + c)|``, so image-tangent derivatives are LN1-sphere
derivatives composed with the known ``dm/dn``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ConvergenceError, ModelMismatch, NotIdentifiable, SpecError
from ...oracles.answers import Output
from ...oracles.base import Oracle
from .image import LayerNormImage
from .value_sum import BASES, CONSISTENCY, RANK_MARGIN, centre, mean_zero_basis, stencil_derivative
from ...linalg import lstsq, svd

MAX_ITER = 200            # Levenberg-Marquardt steps
MAX_UNKNOWNS = 8192       # the joint fit is dense: (d - 1)^2 + (d - 1) + bases (d - 2) unknowns (d <= 88 at 3 bases)
ALS_SWEEPS = 3000         # past it, alternating least squares: sweeps at most (measured 91 - 277 at d = 12 - 384)


@dataclass(frozen=True)
class ImageValueSum:
    """``K`` (d, d): ``P B G`` on mean-zero n (``K 1 = 0``, rows centred), ``c`` = ``P (B beta_p + b)``,
    the image, and the stage's figures."""

    K: np.ndarray
    c: np.ndarray
    image: LayerNormImage
    residual: float
    conditioning: float
    expected: float
    step: float
    iterations: int
    queries: int

    def pre(self, N: np.ndarray) -> np.ndarray:
        """``P (B x + b)`` for the image tokens with normalised rows N."""
        return np.atleast_2d(N) @ self.K.T + self.c


def _jacobians(oracle: Oracle, image: LayerNormImage, n: np.ndarray, T: np.ndarray, h: float):
    """Y (one-token) and Z (self minus cross, the pair [x, x]) along the columns of T at base n, and queries."""
    k = T.shape[1]
    X = image.tokens(image.stencil(n, T, h))
    x0 = np.broadcast_to(image.tokens(n), X.shape)
    Y = stencil_derivative(np.asarray(oracle.query_packed(X[:, None, :])), k, h)
    if oracle.output is Output.ALL:
        A = np.asarray(oracle.query(np.stack([X, x0], axis=1)))
        Z = stencil_derivative(A[:, 0], k, h) - stencil_derivative(A[:, 1], k, h)
        q = 2 * len(X)
    else:
        cross = np.asarray(oracle.query_packed(np.stack([X, x0], axis=1)))
        own = np.asarray(oracle.query_packed(np.stack([x0, X], axis=1)))
        Z = stencil_derivative(own, k, h) - stencil_derivative(cross, k, h)
        q = 3 * len(X)
    return Y, Z, q


class _Fit:
    """The joint least squares of the module docstring, in ``nu``-coordinates (n = Qm nu): unknowns A
    ((d-1) x (d-1), ``B G Qm = Qm A`` modulo ones), a (``c = Qm a``) and zeta per base."""

    def __init__(self, image: LayerNormImage, bases: list):
        d = image.d
        self.d, self.k, self.P = d, d - 2, len(bases)
        self.Qm = Qm = mean_zero_basis(d)
        G = image.gamma
        self.pre = []
        for n, T, C in bases:
            E = np.column_stack([G[:, None] * T, np.ones(d), G * n])
            self.pre.append((np.linalg.inv(E) @ Qm, C, Qm.T @ T, Qm.T @ n))   # Ei Qm, C, K_p, nu_p

    def zetas(self, A, a):
        out = []
        k = self.k
        for EQ, C, Kp, nu in self.pre:
            al, ga = EQ[:k] @ A @ Kp, EQ[k + 1] @ A @ Kp
            pa = EQ @ (A @ nu + a)
            out.append(((C - al) @ ga - pa[:k] * pa[k + 1]) / (ga @ ga + pa[k + 1] ** 2))
        return out

    def residual(self, A, a, zs, jac: bool = False):
        k, m = self.k, self.d - 1
        nA = m * m
        rows, res = [], []
        for i, ((EQ, C, Kp, nu), z) in enumerate(zip(self.pre, zs)):
            wQ = EQ[:k] + np.outer(z, EQ[k + 1])                              # w Qm: k x (d - 1)
            ga = EQ[k + 1] @ A @ Kp
            g = EQ[k + 1] @ (A @ nu + a)
            res.append((wQ @ A @ Kp - C).ravel())
            res.append(wQ @ (A @ nu + a))
            if jac:
                Jz1 = np.zeros((k * k, self.P * k))
                Jz1[:, i * k:(i + 1) * k] = np.kron(np.eye(k), ga[:, None])
                Jz2 = np.zeros((k, self.P * k))
                Jz2[:, i * k:(i + 1) * k] = g * np.eye(k)
                rows.append(np.hstack([np.kron(wQ, Kp.T), np.zeros((k * k, m)), Jz1]))
                rows.append(np.hstack([np.kron(wQ, nu[None, :]), wQ, Jz2]))
        r = np.concatenate(res)
        return (r, np.vstack(rows), nA) if jac else r

    def scale(self) -> float:
        return float(np.sqrt(sum(np.sum(C * C) for _, C, _, _ in self.pre)))

    def solve(self, A: np.ndarray, a: np.ndarray, max_iter: int = MAX_ITER):
        """Levenberg-Marquardt from (A, a), zeta from its closed form: (A, a, cost, steps, settled)."""
        m, k = self.d - 1, self.k
        zs = self.zetas(A, a)
        lam = 1e-3
        r = self.residual(A, a, zs)
        cost = float(r @ r)
        for it in range(1, max_iter + 1):
            r, J, nA = self.residual(A, a, zs, jac=True)
            g = J.T @ r
            H = J.T @ J
            dH = np.diag(H) + 1e-300
            while True:
                step = np.linalg.solve(H + lam * np.diag(dH), -g)
                A2 = A + step[:nA].reshape(m, m)
                a2 = a + step[nA:nA + m]
                z2 = [z + step[nA + m + i * k: nA + m + (i + 1) * k] for i, z in enumerate(zs)]
                r2 = self.residual(A2, a2, z2)
                c2 = float(r2 @ r2)
                if c2 < cost:
                    break
                lam *= 10
                if lam > 1e16:
                    return A, a, cost, it, True                                # stationary: no step lowers it
            small = np.linalg.norm(step) <= 1e-15 * (1 + np.linalg.norm(A))
            A, a, zs, cost, lam = A2, a2, z2, c2, max(lam / 10, 1e-15)
            if small:
                return A, a, cost, it, True
        return A, a, cost, max_iter, False


    def solve_als(self, A: np.ndarray, a: np.ndarray, max_iter: int = ALS_SWEEPS):
        """The same equations by alternating exact least squares, O(bases d^3) a sweep and no d^2 x d^2 matrix
        (the dense fit's normal matrix at d = 384: 147,985 unknowns, 175 GB). Needs every base's tangent
        basis orthonormal and orthogonal to n (:func:`orthonormal_tangents`); the equations ``w (A nu + a) = 0``
        weigh ``1 / |nu|`` each. Then ``[K_p, nu_p / |nu_p|]`` is orthogonal, so for fixed zetas the
        residual of base p is ``|W_p (A + a nu_p^T / |nu_p|^2) - C_p K_p^T|`` and (A, a) solve in closed form
        (``a = -H_2^{-1} w``, w from one (d-1) x (d-1) system, ``H_2 = sum_p W_p^T W_p / |nu_p|^2``); the
        zetas then solve in closed form for fixed (A, a). Each half lowers the same cost: it ends where a
        sweep lowers it by less than 1e-13 of itself, or after ``max_iter`` sweeps. Returns as :meth:`solve`."""
        k, m = self.k, self.d - 1
        parts = [(EQ[:k], EQ[k + 1], C, Kp, nu, float(nu @ nu)) for EQ, C, Kp, nu in self.pre]

        def zetas(A, a):
            out = []
            for E1, e2, C, Kp, nu, s2 in parts:
                ga, pa = e2 @ A @ Kp, A @ nu + a
                g = e2 @ pa
                out.append(-((E1 @ A @ Kp - C) @ ga + (E1 @ pa) * g / s2) / (ga @ ga + g * g / s2))
            return out

        def cost(A, a, zs):
            c = 0.0
            for (E1, e2, C, Kp, nu, s2), z in zip(parts, zs):
                W = E1 + np.outer(z, e2)
                c += float(np.sum((W @ A @ Kp - C) ** 2) + np.sum((W @ (A @ nu + a)) ** 2) / s2)
            return c

        zs = zetas(A, a)
        prev = cost(A, a, zs)
        for it in range(1, max_iter + 1):
            Ws = [E1 + np.outer(z, e2) for (E1, e2, *_), z in zip(parts, zs)]
            S = [W.T @ W for W in Ws]
            H = sum(S)
            H2 = sum(Sp / q[5] for Sp, q in zip(S, parts))
            G0 = sum(W.T @ q[2] @ q[3].T for W, q in zip(Ws, parts))
            Hi_G0, Hi_S = np.linalg.solve(H, G0), [np.linalg.solve(H, Sp) for Sp in S]
            H2i = np.linalg.inv(H2)
            rhs = sum(Sr @ Hi_G0 @ qr[4] / qr[5] for Sr, qr in zip(S, parts))
            M = np.eye(m)
            for Sr, qr in zip(S, parts):
                for Hs, qp in zip(Hi_S, parts):
                    M -= (qp[4] @ qr[4]) / (qp[5] * qr[5]) * (Sr @ Hs @ H2i)
            w = np.linalg.solve(M, rhs)
            a2 = -H2i @ w
            A2 = Hi_G0 - sum(np.outer(Hs @ a2, qp[4]) / qp[5] for Hs, qp in zip(Hi_S, parts))
            z2 = zetas(A2, a2)                                       # the next sweep's zetas
            c = cost(A2, a2, z2)
            if not np.isfinite(c) or c > prev * (1 + 1e-9) + 1e-300:
                return A, a, prev, it, True                           # rounding: no sweep lowers it further
            A, a, zs = A2, a2, z2
            if prev - c <= 1e-13 * prev:
                return A, a, c, it, True
            prev = c
        return A, a, prev, max_iter, False


def orthonormal_tangents(image: LayerNormImage, data: list) -> list:
    """Each base's ``(n, T, C)`` with T replaced by an orthonormal basis of the same tangent directions,
    made exactly orthogonal to n and the ones (stencil moves are, to the stencil's error), and C re-expressed
    in it: ``T = T' R`` gives ``C' = R C R^{-1}`` (C maps the directions' coordinates; what
    :meth:`_Fit.solve_als` needs)."""
    out = []
    for n, T, C in data:
        u = np.asarray(n, np.float64) / np.linalg.norm(n)
        Tt = np.asarray(T, np.float64)
        Tt = Tt - Tt.mean(axis=0, keepdims=True)
        Tt = Tt - np.outer(u, u @ Tt)
        Q, R = np.linalg.qr(Tt)
        out.append((n, Q, R @ np.linalg.solve(R.T, np.asarray(C).T).T))
    return out


TRIES = 3                 # stage V on the image: fresh bases after a fit that did not settle


def retrying(attempt, tries: int = TRIES, *, settled_mismatch: bool = False):
    """``attempt()`` again (at fresh random bases: it draws them itself) after a :class:`ConvergenceError`,
    ``tries`` times in all. Measured: the fit from ``B = I`` stalled at a relative residual of 0.015 on 1 of 20
    d = 16 blocks (seed 9218 of ``bench_block_image.py --whole``). When every try stopped far above the
    stencil's error (:func:`solve_bases` attaches the mismatch), no one block explains the answers: a
    :class:`ModelMismatch` (measured: a float32 two-block stack, 0.2 on every try); else the last error.
    ``settled_mismatch``: a fit that settled above the threshold is tried again too, and is a mismatch only
    when every try is (``--method encoder``: behind block 0 the reads carry the paths' conditioning; a float32
    encoder's block 1 settled at 8.3e-3 against the threshold 4.7e-3 at 3 bases, and at 8.5e-4 at fresh ones,
    measured on seed 601)."""
    errors = []
    for _ in range(tries):
        try:
            return attempt()
        except ConvergenceError as e:
            errors.append(e)
        except ModelMismatch as e:
            if not settled_mismatch:
                raise
            errors.append(e)
    mismatches = [e if isinstance(e, ModelMismatch) else getattr(e, "mismatch", None) for e in errors]
    if all(m is not None for m in mismatches):
        if mismatches[-1] is errors[-1]:
            raise errors[-1]
        raise mismatches[-1] from errors[-1]
    raise errors[-1]


def _dense(d: int, bases: int) -> bool:
    """Whether the dense joint fit's ``(d - 1)^2 + (d - 1) + bases (d - 2)`` unknowns are within MAX_UNKNOWNS."""
    return (d - 1) ** 2 + (d - 1) + bases * (d - 2) <= MAX_UNKNOWNS


def value_sum_on_image(oracle: Oracle, image: LayerNormImage, rng: np.random.Generator, *, precision: float,
                       bases: int = BASES, max_iter: int = MAX_ITER) -> ImageValueSum:
    """Stage V with every query on ``image`` (see the module docstring). ``precision``: the answers'
    relative precision (e.g. the output LayerNorm fit's sphere residual)."""
    if not oracle.output.vector:
        raise SpecError(f"the block method needs vector answers, got output={oracle.output.value}")
    d = oracle.d
    if image.d != d:
        raise ValueError(f"the image has d = {image.d}, the oracle d = {d}")
    if bases < 2:
        raise ValueError(f"need at least 2 base tokens, got {bases}")
    eps = max(float(precision), 1e-16)
    h = eps ** 0.2                                     # the old stage's step (|x| ~ sqrt(d), unit directions)
    expected = eps ** 0.8 * np.sqrt(d)
    data, q, cond = [], 0, np.inf
    for n in image.points(rng, bases):
        T = image.tangent(n, rng)
        Y, Z, qq = _jacobians(oracle, image, n, T, h)
        q += qq
        S = svd(Z, compute_uv=False)
        if S[-1] <= RANK_MARGIN * expected * S[0]:
            raise NotIdentifiable(
                f"the pair Jacobian's smallest of d - 2 singular values ({S[-1] / S[0]:.3g} of the largest) is not "
                f"{RANK_MARGIN}x above the finite differences' error ({expected:.2g}) at this answer precision")
        cond = min(cond, float(S[-1] / S[0]))
        data.append((n, T, lstsq(Z, Y, rcond=None)[0]))
    return solve_bases(image, data, expected=float(expected), conditioning=cond, step=float(h), queries=q,
                       max_iter=max_iter)


DENSE_FIRST = 24          # up to this width the dense fit is the cheaper first route (measured below)


def _solve_routes(image: LayerNormImage, data: list, expected: float, max_iter: int):
    """The joint fit by up to three routes, each ending the search once its relative residual is within
    ``CONSISTENCY x expected``: (residual, settled, A, a, steps in all, the last route's step cap).

    - d <= :data:`DENSE_FIRST`: Levenberg-Marquardt from ``B = I`` (0.02 - 0.06 s at d = 12 - 16), then
      alternating least squares from ``B = I``, then Levenberg-Marquardt from where the alternation stopped;
    - d <= 88 (the dense fit within :data:`MAX_UNKNOWNS`): the alternation first (d = 32: 0.2 - 0.45 s against
      the dense fit's 1.7 - 2.2 s; d = 64: 0.15 s against 65 s), then Levenberg-Marquardt from its end;
    - past it: the alternation alone.

    Measured on 20 unseen d = 12 blocks (float64, seeds 47100 - 47119, the same answers each route): the dense
    fit alone did not settle on 4 (relative residual 0.07 - 0.11), the alternation alone on 3 (two of them
    within 1.5e-6 of the answers, one at 0.1); each of the 7 was one of the three routes, every one settled at
    the stencil's precision (K within 1.4e-11). The returned residual and ``settled`` are the best route's
    (lowest residual): a two-block stack leaves every route far above the threshold."""
    dense = _dense(image.d, len(data))
    fits = {}

    def fit(kind):
        if kind not in fits:
            fits[kind] = _Fit(image, data if kind == "lm" else orthonormal_tangents(image, data))
        return fits[kind]

    Qm = mean_zero_basis(image.d)
    start = (Qm.T @ (image.gamma[:, None] * Qm), Qm.T @ image.beta)
    if dense and image.d <= DENSE_FIRST:
        routes = [("lm", "start"), ("als", "start"), ("lm", "als")]
    elif dense:
        routes = [("als", "start"), ("lm", "als")]
    else:
        routes = [("als", "start")]
    ends, best, total, cap = {}, None, 0, max_iter
    for kind, origin in routes:
        A0, a0 = start if origin == "start" else ends[origin]
        f = fit(kind)
        if kind == "lm":
            A, a, cost, iters, settled = f.solve(A0, a0, max_iter)
            cap = max_iter
        else:
            cap = max(max_iter, ALS_SWEEPS)
            A, a, _, iters, settled = f.solve_als(A0, a0, cap)
            r = f.residual(A, a, f.zetas(A, a))                      # the residual as the dense fit's
            cost = float(r @ r)
        total += int(iters)
        ends[kind] = (A, a)
        res = float(np.sqrt(cost) / max(f.scale(), 1e-300))
        if best is None or res < best[0]:
            best = (res, settled, A, a)
        if res <= CONSISTENCY * expected:
            break
    res, settled, A, a = best
    return res, settled, A, a, total, cap


def solve_bases(image: LayerNormImage, data: list, *, expected: float, conditioning: float, step: float, queries: int,
                max_iter: int = MAX_ITER, where: str = "", check: str = "value-sum (image)") -> ImageValueSum:
    """The joint fit of the module docstring over the bases ``data`` (``(n, T, C)`` each: the base, a basis of
    its tangent in n-coordinates, ``Z^+ Y`` in that basis) from ``B = I, b = 0``, with its model check:
    :class:`ConvergenceError` if it did not settle, :class:`ModelMismatch` if it settled above
    ``CONSISTENCY x expected``. ``where``: a prefix for the messages (the encoder's block)."""
    res, settled, A, a, iters, cap = _solve_routes(image, data, expected, max_iter)
    Qm = mean_zero_basis(image.d)
    if res > CONSISTENCY * expected:
        if not settled:
            e = ConvergenceError(f"{where}stage V on the image did not settle ({iters} steps in all, at most {cap} "
                                 f"a route; relative "
                                 f"residual {res:.3g})")
            e.mismatch = ModelMismatch(
                f"{where}stage V's fit at fresh image points stopped far from any one value-output map B each time "
                f"(last relative residual {res:.3g} > {CONSISTENCY:g} x the stencil's {expected:.2g}): not one "
                "post-LN block", check=check, figure=res, threshold=CONSISTENCY * expected)
            raise e
        raise ModelMismatch(
            f"{where}the tangent Jacobians at {len(data)} image points are not J_Phi (delta_ij I + (B - I)/2) G T for "
            f"one value-output map B (relative residual {res:.3g} > {CONSISTENCY:g} x the stencil's {expected:.2g}): "
            "not one post-LN block", check=check, figure=res, threshold=CONSISTENCY * expected)
    return ImageValueSum(K=centre(Qm @ A @ Qm.T), c=centre(Qm @ a), image=image, residual=res,
                         conditioning=conditioning, expected=expected, step=step, iterations=int(iters),
                         queries=queries)
