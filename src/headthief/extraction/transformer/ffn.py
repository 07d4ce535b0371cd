"""Learning a two-layer ReLU network from one-token value queries (the learner A_FFN of Section 4.1).

The paper's FFN ``f(x) = w_o^T ReLU(A^T x)`` has no biases, so it is positively homogeneous, every kink
is a hyperplane through the origin and every linear region is a cone on which ``f(x) = g^T x`` exactly
(Euler). With biases, ``F(x, s) = s f(x / s)`` (``s > 0``) is such a network in ``R^{d+1}`` (the bias is
the weight on ``s``; the output bias is a linear term in ``s``), so one algorithm serves both
(critical points and gradient jumps, Carlini, Jagielski and Mironov 2020, "Cryptanalytic extraction of
neural network models", here in homogeneous coordinates):

1. **Kinks.** A path ``P -> Q -> R`` with ``R = -P`` (bias-free) crosses every hyperplane through the
   origin exactly once: ``h(P)`` and ``h(-P)`` have opposite signs, so exactly one of the two chords
   changes sign. With biases ``P = (-r u, eps)``, ``R = (r u, eps)`` do the same for every hyperplane
   within ``r / eps`` of the origin along ``u`` (so rarely active neurons, whose hyperplanes are far from
   typical inputs, are on the path too). :func:`~headthief.extraction.transformer.kinks.find_kinks` finds
   every kink on both chords.
2. **Gradient jumps.** The gradient of each linear region on the path is read from ``D - 1``
   finite differences (``D = d`` or ``d + 1``) plus Euler's ``g^T y = F(y)``; each is checked on one more
   point and on the path points the search saw in that region. A kink's jump ``c = g_right - g_left`` is
   ``gamma n`` with ``n`` the unit normal of its hyperplane and ``gamma = w |a|`` (sign included: the
   network is convex across a neuron with ``w > 0``).
3. **Refinement.** Each neuron is measured again where it is isolated: a point on its hyperplane far
   from every other recovered hyperplane, gradients on both sides with steps a quarter of that margin
   (a refinement that sees another neuron's kink fails its check and is retried elsewhere).
4. **Completeness.** A fresh path must show exactly the predicted kinks; a kink that no recovered
   neuron explains is a new neuron (two kinks merged on the first path separate here), a recovered
   neuron with no kink is dropped.
5. **Flips.** ``w ReLU(a^T x) = w ReLU(-a^T x) + w a^T x``: local information gives each neuron's
   hyperplane and ``gamma`` but not which way it faces, so the learner first returns
   ``sum gamma_k ReLU(n_k^T z) + l^T z`` (exact; ``m + 2`` ReLU units), then looks for the flip set
   ``S`` with ``sum_{k in S} gamma_k n_k = -l`` (x-part): least squares when the ``gamma_k n_k`` are
   linearly independent (``m <= d``), a box-constrained linear program (whose vertex is the 0/1 flip
   vector when it is unique, which holds with high probability for ``m`` up to about ``2d``) otherwise.
   When neither gives a 0/1 vector, the ``m + 2`` form is kept (it is functionally exact).

**float32 answers** (detected from the raw answers): tolerances scale with that precision, each
hyperplane is fit by least squares to ``D + 5`` kink points located on short lines across it
(:func:`_refine_lines`; finite-difference jumps are only good to ~1e-4 there), and the output weights,
linear term and output bias by least squares over the values read (:func:`_fit_output`); a predicted kink
the search did not report is looked for before its neuron is dropped (:func:`_kink_there`), and when the
values read stay unexplained a path is searched on the residual of the fit for faint neurons
(:func:`_residual_path`, :func:`_fit_faint`); docs/ffn.md.

Query count: about ``D`` per region on the path (``m + 2`` regions), ``2 D + 4`` per neuron for the
refinement, and about ``7`` per kink per path searched (two paths): ``~ 3 D m + 14 m``; d = 32, m = 64 measured
at 7,939 queries (docs/ffn.md).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ...errors import BudgetExceeded, ConvergenceError, ModelMismatch, NotIdentifiable
from ...models.ffn import ReLUFFN, compare_ffn
from ...oracles.base import Oracle
from ..check import FFN, checked
from .ffn_check import ffn_preflight, ffn_verdict
from ..probes import Progress, looks_float32
from ..result import Fidelity
from .kinks import find_kinks
from ...linalg import lstsq, svd


# ---------------------------------------------------------------------------------------------------
# the result


@dataclass(frozen=True, eq=False)
class FFNExtraction:
    """What :func:`extract_ffn` recovered and what it cost.

    Attributes:
        method: ``"ffn"``.
        model: the recovered :class:`~headthief.models.ffn.ReLUFFN` (functionally equal to the target;
            with ``linear`` set when the flips were not resolved).
        queries: oracle queries the extraction spent (the model check's not included).
        seconds: wall time.
        diagnostics: kinks found, regions, paths, flips resolved or not and how, neurons needed, ...
        kinks: (K, d) points of the input space on the recovered hyperplanes, one per neuron, each where
            that neuron is isolated (for verification next to every kink).
        kink_normals, kink_margins: the hyperplanes' unit normals (homogeneous, (K, D)) and each point's
            distance to the nearest other hyperplane (homogeneous, unit sphere).
        kink_points: the same points in homogeneous coordinates (K, D).
        bias: whether the biased network was learned (D = d + 1).
        check: the model check's :class:`~headthief.extraction.check.ModelCheck`.
    """

    method: str
    model: ReLUFFN
    queries: int
    seconds: float
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    kinks: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    kink_normals: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    kink_margins: np.ndarray = field(default_factory=lambda: np.zeros(0))
    kink_points: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    bias: bool = False
    check: Any = None

    def __post_init__(self):
        object.__setattr__(self, "diagnostics", MappingProxyType(dict(self.diagnostics)))
        for name in ("kinks", "kink_normals", "kink_margins", "kink_points"):
            a = np.array(getattr(self, name), dtype=np.float64)
            a.setflags(write=False)
            object.__setattr__(self, name, a)

    @property
    def d(self) -> int:
        return self.model.d

    @property
    def neurons(self) -> int:
        """ReLU units the recovered network needs: m, or m + 2 when a linear term is left."""
        return self.model.neurons

    @property
    def rank(self) -> None:
        return None

    v_scale_known = True

    def predict(self, batch) -> np.ndarray:
        """The recovered FFN at (n, d) points, or on one-token sequences ((n, 1, d) or a list of (1, d))."""
        if isinstance(batch, np.ndarray) and batch.ndim == 2:
            return self.model(batch)
        return self.model.evaluate(batch)

    def near_kink_points(self, *, rng: np.random.Generator | int = 0, per_side: int = 1) -> np.ndarray:
        """Fresh points next to every recovered kink, ``per_side`` on each side of each hyperplane, a
        quarter of the kink's isolation margin away from it (where a wrong neuron shows first)."""
        rng = np.random.default_rng(rng)
        out = []
        for y, n, mg in zip(self.kink_points, self.kink_normals, self.kink_margins):
            for side in (-1.0, 1.0):
                for _ in range(per_side):
                    t = rng.standard_normal(y.shape[0])
                    if self.bias:
                        t[-1] = 0.0
                    t -= (t @ n) * n
                    t /= max(np.linalg.norm(t), 1e-300)
                    z = y + side * 0.25 * mg * n + 0.125 * mg * t
                    out.append(z[:-1] / z[-1] if self.bias else z)
        return np.array(out).reshape(-1, self.d)

    def verify(self, oracle: Oracle, n: int = 256, *, rng: np.random.Generator | int = 0, **_) -> Fidelity:
        """Fidelity against ``oracle`` on ``n`` Gaussian one-token points and next to every kink."""
        from ..result import Fidelity
        g = np.random.default_rng(rng)
        Z = np.vstack([g.standard_normal((n, self.d)), self.near_kink_points(rng=g)])
        before = oracle.queries
        y = oracle.query(Z[:, None, :])
        yh = self.model(Z)
        err = np.abs(yh - y)
        rms = float(np.sqrt(np.mean(y[:n] ** 2))) if n else float(np.sqrt(np.mean(y ** 2)))
        return Fidelity(n=Z.shape[0], queries=oracle.queries - before, max_abs_err=float(err.max()),
                        rms_true=rms, max_rel_err=float(err.max() / max(rms, 1e-300)))

    def errors(self, truth) -> dict[str, Any]:
        """Against a known :class:`ReLUFFN` (or a model whose ``ffn`` is one), up to permutation,
        positive rescaling and flips: see :func:`~headthief.models.ffn.compare_ffn`."""
        t = truth if isinstance(truth, ReLUFFN) else getattr(truth, "ffn", None)
        if not isinstance(t, ReLUFFN) and callable(getattr(truth, "ffn_params", None)):
            t = ReLUFFN(**truth.ffn_params())      # a transformer: what its one-token answers see
        if not isinstance(t, ReLUFFN):
            return {"neuron_rel_err": None, "function_rel_err": None}
        return compare_ffn(self.model, t)

    def save(self, path) -> None:
        """Write the recovered A, w (b1, b2, linear when present) with ``numpy.savez``."""
        m = self.model
        arrays = {"A": m.A, "w": m.w}
        if m.b1 is not None:
            arrays["b1"] = m.b1
        if m.b2 is not None:
            arrays["b2"] = np.float64(m.b2)
        if m.linear is not None:
            arrays["linear"] = m.linear
        np.savez(path, **arrays)


# ---------------------------------------------------------------------------------------------------
# homogeneous view of the oracle


class _Homog:
    """``F(z)`` on homogeneous points: ``f(z)`` (bias-free), or ``s f(x / s)`` for ``z = (x, s)``, s > 0."""

    def __init__(self, oracle: Oracle, bias: bool, max_queries: int | None, progress: Progress):
        self.oracle = oracle
        self.bias = bias
        self.max_queries = max_queries
        self.progress = progress
        self.spent = 0
        self.D = oracle.d + int(bias)
        self.raw: np.ndarray | None = None      # the last answers as the oracle gave them (before * s)

    def __call__(self, Z: np.ndarray) -> np.ndarray:
        Z = np.atleast_2d(np.asarray(Z, dtype=np.float64))
        n = Z.shape[0]
        if self.max_queries is not None and self.spent + n > self.max_queries:
            raise BudgetExceeded(self.spent, self.max_queries, n)
        if self.bias:
            s = Z[:, -1]
            if not np.all(s > 0):
                raise ConvergenceError("internal: a homogeneous point left the half-space s > 0")
            X = Z[:, :-1] / s[:, None]
        else:
            X = Z
        y = self.oracle.query(X[:, None, :])
        self.raw = np.asarray(y)
        self.spent += n
        if self.progress is not None:
            self.progress(n)
        return y * Z[:, -1] if self.bias else y


# ---------------------------------------------------------------------------------------------------
# gradients of linear regions


@dataclass
class _Ctx:
    F: _Homog
    D: int
    bias: bool
    eps: float                 # the answers' relative precision (float64 or float32)
    rng: np.random.Generator
    checks_failed: int = 0
    scale: float = 0.0          # |F| at unit distance from the origin, roughly (from the first answers)
    samples: list = field(default_factory=list)     # (z, F(z)) away from kinks, for the final fit (float32)
    floor: float = 0.0          # a residual's checks: the answers' own scale per unit distance (their rounding)

    @property
    def f32(self) -> bool:
        """Answers rounded to float32 (or coarser): the coarse-answer path (kink points + least squares)."""
        return self.eps > 2.0 ** -40

    @property
    def rel(self) -> float:
        """Relative tolerance of the consistency checks on gradient jumps (finite differences lose about
        ``eps / step`` of the function's scale: 1e-5 is float64's, 0.05 float32's)."""
        return 5e-2 if self.f32 else 1e-5


def _directions(ctx: _Ctx, y: np.ndarray) -> np.ndarray:
    """(D, D-1) orthonormal directions complementing y: y's orthogonal complement (bias-free), or the
    x-subspace (biased: the steps keep s, so s > 0 holds)."""
    D = ctx.D
    if ctx.bias:
        Qd, _ = np.linalg.qr(ctx.rng.standard_normal((D - 1, D - 1)))
        return np.vstack([Qd, np.zeros((1, D - 1))])
    M = np.column_stack([y, ctx.rng.standard_normal((D, D - 1))])
    Qm, _ = np.linalg.qr(M)
    return Qm[:, 1:]


def _gradient(ctx: _Ctx, y: np.ndarray, rho: float, Fy: float | None = None,
              known: list[tuple[np.ndarray, float]] | None = None) -> tuple[np.ndarray, bool, int]:
    """The gradient of the linear region around ``y``: Euler ``g^T y = F(y)`` and D - 1 forward
    differences of step ``rho``; checked on one more point (and on ``known`` (z, F(z)) pairs of the same
    region). Returns ``(g, ok, queries)``."""
    V = _directions(ctx, y)
    r = ctx.rng.standard_normal(ctx.D)
    if ctx.bias:
        r[-1] = 0.0
    r /= np.linalg.norm(r)
    pts = [y + rho * V[:, j] for j in range(V.shape[1])] + [y + rho * r]
    if Fy is None:
        pts.append(y)
    vals = ctx.F(np.array(pts))
    q = len(pts)
    if Fy is None:
        Fy = float(vals[-1])
    k = V.shape[1]
    M = np.vstack([y[None, :], V.T])
    rhs = np.concatenate([[Fy], (vals[:k] - Fy) / rho])
    g = np.linalg.solve(M, rhs)
    ny = float(np.linalg.norm(y))
    scale = max(float(np.linalg.norm(g)) * ny + abs(Fy), ctx.floor * max(ny, 1.0))
    tol = 2.0 ** 10 * ctx.eps * scale * (2.0 + ny / rho)
    ok = abs(vals[k] - g @ pts[k]) <= tol
    for z, Fz in known or ():
        ok = ok and abs(Fz - g @ z) <= tol * (1.0 + float(np.linalg.norm(z - y)) / rho)
    return g, bool(ok), q


# ---------------------------------------------------------------------------------------------------
# neurons


@dataclass
class _Neuron:
    n: np.ndarray          # unit normal (homogeneous), oriented: crossing into n^T z > 0 the gradient jumps by gamma n
    gamma: float
    refined: bool = False
    point: np.ndarray | None = None
    margin: float = 0.0
    suspect: bool = False
    lines: int = 0         # kink points its hyperplane was fit to (float32 answers), 0 otherwise
    tries: int = 0         # kink-point fits attempted (float32 answers)
    nerr: float = 0.0      # float32: noise bound of the gradient-jump normal (:func:`_fd_normal_noise`)

    @property
    def c(self) -> np.ndarray:
        return self.gamma * self.n


def _from_jump(c: np.ndarray, u: np.ndarray) -> _Neuron:
    """The neuron behind a gradient jump ``c`` seen when crossing along ``u``."""
    nc = float(np.linalg.norm(c))
    sg = 1.0 if c @ u >= 0 else -1.0
    return _Neuron(n=sg * c / nc, gamma=sg * nc)


def _path(ctx: _Ctx, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    D = ctx.D
    if not ctx.bias:
        P = rng.standard_normal(D)
        Q = rng.standard_normal(D)
        P *= math.sqrt(D) / np.linalg.norm(P)
        Q *= math.sqrt(D) / np.linalg.norm(Q)
        return P, Q, -P
    d = D - 1
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    x0 = rng.standard_normal(d)
    x0 -= (x0 @ u) * u
    r, eps = math.sqrt(d), 1e-3
    return np.append(-r * u, eps), np.append(x0, 1.0), np.append(r * u, eps)


def _search_path(ctx: _Ctx, P, Q, R, *, max_evals: int):
    """Kinks on both chords of the path; returns a list of segments (A, B, kinks, seen, tau)."""
    out = []
    for A, B in ((P, Q), (Q, R)):
        U = B - A

        def g(ts, A=A, U=U):
            return ctx.F(A[None, :] + np.asarray(ts)[:, None] * U[None, :])

        probe = g(np.linspace(0.0, 1.0, 5))
        S = float(np.max(np.abs(probe)))
        if S == 0.0:
            S = 1e-300
        if ctx.f32:
            # float32: the rounding is a few eps of S, so tau is a small multiple of it (1024 eps would hide
            # every kink whose slope change is below ~1e-2 S); slopes are measured over longer stretches
            # (h0) so their noise tau / h stays small against the slope changes; intervals narrower than
            # min_width cannot be resolved by values that carry ~1e-7 S of noise
            tau = 16.0 * ctx.eps * S
            kinks, _, seen = find_kinks(g, tau=tau, max_evals=max_evals, rng=ctx.rng, h0=1.0 / 16, min_width=4e-6)
        else:
            tau = 2.0 ** 10 * ctx.eps * S
            kinks, _, seen = find_kinks(g, tau=tau, max_evals=max_evals, rng=ctx.rng)
        for t, v in zip(np.linspace(0.0, 1.0, 5), probe):
            seen.setdefault(float(t), float(v))
        out.append((A, B, kinks, seen, tau))
    return out


def _region_jumps(ctx: _Ctx, segs) -> tuple[list[tuple[_Neuron, np.ndarray]], list[np.ndarray], dict]:
    """Pass 1: the gradient of every region on the path; a kink's jump is the difference of its two
    neighbours'. Returns ``[(neuron, kink point)]``, the region gradients' (y, g) and counts."""
    found: list[tuple[_Neuron, np.ndarray]] = []
    grads: list[tuple[np.ndarray, np.ndarray]] = []
    stats = {"regions": 0, "regions_failed": 0, "kinks_unmeasured": 0}
    for A, B, kinks, seen, tau in segs:
        U = B - A
        nu = float(np.linalg.norm(U))
        bounds = [0.0] + [k.t for k in kinks] + [1.0]
        G: list[np.ndarray | None] = []
        R: list[float] = []
        for j in range(len(bounds) - 1):
            lo, hi = bounds[j], bounds[j + 1]
            tm = 0.5 * (lo + hi)
            y = A + tm * U
            hw = 0.5 * (hi - lo) * nu
            # the search's own points strictly inside this region (away from its kinks) check it
            inner = [(A + t * U, v) for t, v in seen.items() if lo + 1e-3 * (hi - lo) < t < hi - 1e-3 * (hi - lo)]
            inner = inner[:4]
            rho = hw / 8.0
            g, ok = None, False
            stats["regions"] += 1
            for _ in range(4):
                if rho <= 0:
                    break
                g, ok, _q = _gradient(ctx, y, rho, known=inner)
                if ok:
                    break
                ctx.checks_failed += 1
                rho /= 16.0
            if not ok:
                stats["regions_failed"] += 1
                g = None
            else:
                grads.append((y, g))
            G.append(g)
            R.append(rho)
        for i, k in enumerate(kinks):
            gl, gr = G[i], G[i + 1]
            z = A + k.t * U
            if gl is None or gr is None:
                stats["kinks_unmeasured"] += 1
                continue
            c = gr - gl
            J = k.jump
            # the jump must show the slope change the search saw, and lie on a hyperplane through z
            nc = float(np.linalg.norm(c))
            r = ctx.rel
            if nc == 0 or abs(c @ U - J) > r * abs(J) + r * nc * nu or abs(c @ z) > r * nc * np.linalg.norm(z):
                stats["kinks_unmeasured"] += 1
                continue
            neu = _from_jump(c, U)
            neu.nerr = _fd_normal_noise(ctx, neu.gamma, min(R[i], R[i + 1]), float(np.linalg.norm(z)))
            found.append((neu, z))
    return found, grads, stats


def _merge(neurons: list[_Neuron], tol: float = 1e-6, gtol: float = 1e-4) -> list[_Neuron]:
    """Neurons with the same hyperplane (either orientation) are one neuron."""
    out: list[_Neuron] = []
    for nu in neurons:
        dup = False
        for o in out:
            if abs(abs(float(nu.n @ o.n)) - 1.0) < tol and abs(abs(nu.gamma) - abs(o.gamma)) <= gtol * abs(o.gamma):
                dup = True
                break
        if not dup:
            out.append(nu)
    return out


def _refine(ctx: _Ctx, neurons: list[_Neuron], k: int, *, candidates: int = 256,
            grads: list | None = None) -> int:
    """Pass 2: measure neuron k again where it is isolated. Returns the queries spent."""
    nu = neurons[k]
    D = ctx.D
    others = np.array([o.n for i, o in enumerate(neurons) if i != k]).reshape(-1, D)
    if ctx.bias:
        es = np.zeros((1, D))
        es[0, -1] = 1.0
        others = np.vstack([others, es])
    spent = 0
    for attempt in range(3):
        C = ctx.rng.standard_normal((candidates, D))
        if ctx.bias:
            C[:, -1] = np.abs(C[:, -1]) + 0.5
        C -= np.outer(C @ nu.n, nu.n)
        C /= np.linalg.norm(C, axis=1, keepdims=True)
        if ctx.bias:
            C = C[C[:, -1] > 0.05]
            if C.shape[0] == 0:
                continue
        marg = np.min(np.abs(C @ others.T), axis=1) if others.shape[0] else np.ones(C.shape[0])
        i = int(np.argmax(marg))
        y, delta = C[i], float(marg[i]) / (2.0 ** attempt)
        if delta <= 0:
            continue
        zp, zm = y + 0.5 * delta * nu.n, y - 0.5 * delta * nu.n
        gp, okp, q1 = _gradient(ctx, zp, 0.25 * delta)
        gm, okm, q2 = _gradient(ctx, zm, 0.25 * delta)
        spent += q1 + q2
        if not (okp and okm):
            ctx.checks_failed += 1
            continue
        c = gp - gm
        new = _from_jump(c, nu.n)
        rt = 0.2 if ctx.f32 else 1e-4     # pass 1's jumps are read over short steps (float32: ~1e-2)
        if float(np.linalg.norm(new.n - nu.n)) > rt or abs(new.gamma - nu.gamma) > rt * abs(nu.gamma):
            nu.suspect = True          # not the neuron pass 1 saw (a merged or phantom kink)
            return spent
        if ctx.f32 and nu.nerr > 0:
            # coarse answers: the isolation ball can be small, and a faint neuron's jump read there may be
            # noisier than the one read on the path's long stretches (measured: 3e-4 -> 5.5e-3 in 1 - cos,
            # torch-transformer:d=16,m=32,seed=116): weigh the two readings by their noise bounds
            e_new = _fd_normal_noise(ctx, new.gamma, 0.25 * delta, 1.0)
            w_old, w_new = 1.0 / nu.nerr ** 2, 1.0 / e_new ** 2
            c = (w_old * nu.c + w_new * new.c) / (w_old + w_new)
            new = _from_jump(c, nu.n)
            new.nerr = 1.0 / math.sqrt(w_old + w_new)
        else:
            new.nerr = 0.0
        nu.n, nu.gamma, nu.refined, nu.point, nu.margin = new.n, new.gamma, True, y, delta
        nu.nerr = new.nerr
        if grads is not None:
            grads.extend([(zp, gp), (zm, gm)])
        return spent
    nu.suspect = True
    return spent


def _fd_normal_noise(ctx: _Ctx, gamma: float, rho: float, radius: float) -> float:
    """Noise bound of a gradient-jump normal read on coarse answers by forward differences of step ``rho``
    at distance ``radius`` from the origin: each value carries ``16 eps`` of ``scale * radius`` (the
    tolerance :func:`_refine_lines` uses), each difference ``16 eps scale radius / rho``, and the normal's
    error is that over ``|gamma|``. 0 on float64 answers (not used there)."""
    if not ctx.f32:
        return 0.0
    return 16.0 * ctx.eps * max(ctx.scale, 1e-300) * max(radius, 1.0) / (max(rho, 1e-300) * max(abs(gamma), 1e-300))


def _jump_normal_noise(ctx: _Ctx, nu: _Neuron) -> float:
    """How far a faint neuron's gradient-jump normal may be from the truth on coarse answers: each forward
    difference of step ``rho`` (a quarter of the isolation margin, :func:`_refine`) carries ``16 eps S /
    rho`` of the function's scale ``S``; against the jump ``gamma`` that is the normal's error. For most
    neurons it is far below 0.05; for one whose output weight is ~1e-3 of the others' (torch default init
    draws a few) it reaches 0.05 to 0.1 (measured 0.054 against this bound's 0.09,
    ``torch-transformer:d=16,m=32,seed=104``), and a hyperplane that kink points then place correctly
    must not be called another neuron's for that."""
    rho = 0.25 * nu.margin if nu.margin > 0 else 1.0 / 16
    return 16.0 * ctx.eps * max(ctx.scale, 1e-300) / (rho * max(abs(nu.gamma), 1e-300))



def _directions_in(ctx: "_Ctx", n: np.ndarray, count: int) -> np.ndarray:
    """``count`` random unit directions inside the hyperplane ``n . x = 0`` (the lifted space with biases:
    those whose last, homogenising coordinate stays clearly positive)."""
    C = ctx.rng.standard_normal((count, ctx.D))
    if ctx.bias:
        C[:, -1] = np.abs(C[:, -1]) + 0.5
    C -= np.outer(C @ n, n)
    C /= np.linalg.norm(C, axis=1, keepdims=True)
    if ctx.bias:
        C = C[C[:, -1] > 0.05]
    return C

def _refine_lines(ctx: _Ctx, neurons: list[_Neuron], k: int, *, extra: int = 6, candidates: int = 512) -> int:
    """Pass 2 for coarse (float32) answers: neuron k's hyperplane from ``D - 1 + extra`` kink points.

    A gradient jump read by finite differences inside the isolation ball (radius ~ the margin) carries
    ``eps S / margin`` of noise, a 1e-4 relative error at float32. A kink's *location* on a line crossing
    the hyperplane is better: intersecting the two pieces' lines puts it within ``~ eps S / gamma`` of
    the truth whatever the pieces' length, and points spread over the whole hyperplane (distance ~1
    apart) then fix its normal to about that. Each point: a line through ``p`` (on the current estimate
    of the hyperplane, chosen where the other recovered hyperplanes are far along the normal) in the
    normal direction, two values on each side, one at ``p`` to check that no other kink is between them;
    a point whose slope change is not ``gamma`` or whose centre value is off is dropped. The normal is
    the least-squares null vector of the points (through the origin), refit without outliers.
    Returns the queries spent; sets ``nu.lines`` (points kept) or leaves the neuron as it was.
    """
    nu = neurons[k]
    D = ctx.D
    n = nu.n
    others = np.array([o.n for i, o in enumerate(neurons) if i != k]).reshape(-1, D)
    C = _directions_in(ctx, n, candidates)
    # along p + t n the other hyperplanes are crossed at t_o = -(n_o . p) / (n_o . n)
    with np.errstate(divide="ignore", invalid="ignore"):
        T = -(C @ others.T) / (others @ n)[None, :] if others.shape[0] else np.full((C.shape[0], 1), np.inf)
    T = np.where(np.isfinite(T), T, np.inf)
    wp = np.min(np.where(T > 0, T, np.inf), axis=1)
    wm = np.min(np.where(T < 0, -T, np.inf), axis=1)
    if ctx.bias and abs(n[-1]) > 0:          # stay in s > 0
        lim = 0.9 * C[:, -1] / abs(n[-1])
        if n[-1] > 0:
            wm = np.minimum(wm, lim)
        else:
            wp = np.minimum(wp, lim)
    wp, wm = np.minimum(wp, 1.0), np.minimum(wm, 1.0)
    w = np.minimum(wp, wm)
    need = D - 1 + extra
    order = np.argsort(-w)[:2 * need]        # lines that fail their checks are replaced, up to need more
    order = order[w[order] > 1e-3]
    spent = 0
    pts, kept, errs = [], [], []
    fr = (0.85, 0.4)
    for i in order:
        if len(pts) >= need:
            break
        p = C[i]
        ts = np.array([-fr[0] * wm[i], -fr[1] * wm[i], 0.0, fr[1] * wp[i], fr[0] * wp[i]])
        Z = p[None, :] + ts[:, None] * n[None, :]
        v = ctx.F(Z)
        spent += 5
        sl = (v[1] - v[0]) / (ts[1] - ts[0])
        sr = (v[4] - v[3]) / (ts[4] - ts[3])
        jump = sr - sl
        noise = 16.0 * ctx.eps * max(float(np.max(np.abs(v))), ctx.scale)
        if jump == 0 or abs(jump - nu.gamma) > 0.2 * abs(nu.gamma):
            ctx.checks_failed += 1
            continue
        # the lines meet at t*: v1 + sl (t - t1) = v3 + sr (t - t3)
        tk = (v[3] - v[1] - sr * ts[3] + sl * ts[1]) / (sl - sr)
        if not (ts[1] < tk < ts[3]):
            ctx.checks_failed += 1
            continue
        pred = v[1] + sl * (0.0 - ts[1]) if tk > 0 else v[3] + sr * (0.0 - ts[3])
        amp = 2.0 + 2.0 * max(abs(ts[1]) / (ts[1] - ts[0]), abs(ts[3]) / (ts[4] - ts[3]))
        if abs(v[2] - pred) > 4.0 * amp * noise:
            ctx.checks_failed += 1
            continue
        pts.append(p + tk * n)
        kept.append((Z, v, tk))
        # how far the lines' noise can move t* (measured: true kink points lie within 0.05 of
        # 4 amp noise / |jump| of the true hyperplane, 99 % within 0.03, float32, d = 16, m = 32)
        errs.append(0.25 * amp * noise / abs(jump))
    keep_min = D + extra // 2                  # the null vector needs D - 1 points; the rest check it
    if len(pts) < keep_min:
        return spent
    P = np.array(pts)
    E = np.array(errs)
    idx = np.arange(len(pts))
    fit = False
    for _ in range(len(pts)):
        _, sv, Vt = svd(P[idx], full_matrices=True)
        nn = Vt[-1]
        if nn @ n < 0:
            nn = -nn
        r = np.abs(P[idx] @ nn) / E[idx]
        worst = int(np.argmax(r))
        if r[worst] <= 3.0:
            fit = True
            break
        if len(idx) <= keep_min:
            break
        idx = np.delete(idx, worst)          # a point of another kink (a neuron not yet recovered)
    if not fit:
        return spent
    if float(np.linalg.norm(nn - n)) > max(0.05, 2.0 * _jump_normal_noise(ctx, nu)):
        nu.suspect = True
        return spent
    nu.n = nn
    nu.lines = len(idx)
    for j in idx:
        Z, v, tk = kept[j]
        for t, z, val in zip((0, 1, 3, 4), Z[[0, 1, 3, 4]], v[[0, 1, 3, 4]]):
            ctx.samples.append((z, float(val)))
    return spent




def _jump_at(ctx: _Ctx, A: np.ndarray, U: np.ndarray, k, nu_: float, div: float):
    """The neuron behind a kink ``k`` of the line ``A + t U`` that no known neuron explains: the gradient
    jump between the two stretches the search certified (finite-difference steps of a ``1/div`` share of
    each). Returns ``(neuron or None, kink point, queries spent)``."""
    z = A + k.t * U
    yl = A + 0.5 * (k.left[0] + k.left[1]) * U
    yr = A + 0.5 * (k.right[0] + k.right[1]) * U
    hl = 0.5 * (k.left[1] - k.left[0]) * nu_
    hr = 0.5 * (k.right[1] - k.right[0]) * nu_
    if hl <= 0 or hr <= 0:
        return None, z, 0
    gl, okl, q1 = _gradient(ctx, yl, hl / div)
    gr, okr, q2 = _gradient(ctx, yr, hr / div)
    if not (okl and okr):
        ctx.checks_failed += 1
        return None, z, q1 + q2
    c = gr - gl
    if float(np.linalg.norm(c)) == 0:
        return None, z, q1 + q2
    nu = _from_jump(c, U)
    nu.nerr = _fd_normal_noise(ctx, nu.gamma, min(hl, hr) / div, float(np.linalg.norm(z)))
    return nu, z, q1 + q2


def _kink_there(ctx: _Ctx, A: np.ndarray, U: np.ndarray, t0: float, J: float, others: np.ndarray,
                tau: float) -> tuple[bool, int]:
    """Coarse answers: is the kink a recovered neuron predicts at ``t0`` on the chord ``A + t U`` (slope
    change ``J``) really there, though the search did not report it? The search can pass over a kink
    whose slope change is small next to its interval's (its secant test sees the sum of the interval's
    kinks, and a faint one between two strong ones merges with them); a neuron dropped for that is
    re-found on a later path, dropped again, and the paths run out with it missing.

    Four values at ``t0 +- h``, ``t0 +- 2 h``, ``h`` below half the distance to every other kink on the
    chord (predicted or found), give the slopes on each side; each slope carries ``2 tau / h`` of noise
    (``tau`` the chord's value tolerance), their difference ``4 tau / h``. The kink is there when the
    slope change is ``J`` to 20 % plus that noise and the two lines meet within ``h`` of ``t0``. When
    ``4 tau / h`` exceeds ``|J| / 2`` the answers cannot tell: the neuron is not called missing (like a
    predicted kink below the search's resolution). Returns ``(there, queries)``."""
    gap = np.abs(others - t0)
    gap = gap[gap > 1e-12]
    h = min(1.0 / 64, 0.2 * float(gap.min())) if gap.size else 1.0 / 64
    noise = 4.0 * tau / max(h, 1e-300)
    if noise > 0.5 * abs(J):
        return True, 0
    ts = np.array([t0 - 2 * h, t0 - h, t0 + h, t0 + 2 * h])
    v = ctx.F(A[None, :] + ts[:, None] * U[None, :])
    sl, sr = (v[1] - v[0]) / h, (v[3] - v[2]) / h
    if abs((sr - sl) - J) > 0.2 * abs(J) + noise:
        return False, 4
    tm = (v[2] - v[1] - sr * ts[2] + sl * ts[1]) / (sl - sr)
    return bool(abs(tm - t0) <= h), 4


def _residual_path(ctx: _Ctx, neurons: list[_Neuron], gam: np.ndarray, lin: np.ndarray, rng: np.random.Generator,
                   *, max_evals: int) -> tuple[list[tuple[_Neuron, np.ndarray]], int]:
    """Coarse answers, when the recovered neurons do not explain the values read: search a fresh path for
    kinks of the *residual* ``F(z) - sum_k gamma_k ReLU(n_k^T z) - l^T z`` of the current fit.

    A neuron whose output weight is ~1e-3 of the others' (torch default init draws some) bends ``F`` by a
    slope change that the search on ``F`` itself often passes over: the secant test of an interval sees
    the sum of its kinks, and a faint one between strong ones merges with them or stays inside the
    tolerance. On the residual the recovered neurons' kinks are gone (what is left of them is their
    error, ~1e-5 of their slope change), so the missing neuron's kink is the only one. The tolerances stay
    those of the answers (their rounding is that of ``F``, not of the small residual): ``tau = 16 eps S``
    with ``S`` the fit's scale on the chord (no queries), and the gradient checks use the answers' scale
    (``floor``). Kinks within ``2e-3`` of a recovered neuron's crossing are that neuron's error, not new
    neurons. The jump of each new kink is read on the residual, between the stretches the search
    certified, and returned as a neuron for the usual refinement. Returns ``([(neuron, point)], queries)``.
    """
    N = np.array([nu.n for nu in neurons]).reshape(-1, ctx.D)
    before = ctx.F.spent

    def model(Z):
        return np.maximum(Z @ N.T, 0.0) @ gam + Z @ lin

    def resid(Z):
        Z = np.atleast_2d(np.asarray(Z, dtype=np.float64))
        return ctx.F(Z) - model(Z)

    rctx = dataclasses.replace(ctx, F=resid, floor=2.0 * ctx.scale)
    out: list[tuple[_Neuron, np.ndarray]] = []
    P, Q, R = _path(ctx, rng)
    for A, B in ((P, Q), (Q, R)):
        U = B - A
        nu_ = float(np.linalg.norm(U))

        def g(ts, A=A, U=U):
            return resid(A[None, :] + np.asarray(ts)[:, None] * U[None, :])

        S = float(np.max(np.abs(model(A[None, :] + np.linspace(0.0, 1.0, 5)[:, None] * U[None, :]))))
        tau = 16.0 * ctx.eps * max(S, 1e-300)
        try:
            kinks, _, _ = find_kinks(g, tau=tau, max_evals=max_evals, rng=ctx.rng, h0=1.0 / 16, min_width=4e-6)
        except ConvergenceError:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            tk = -(N @ A) / (N @ U)
        known = tk[np.isfinite(tk) & (tk > 0) & (tk < 1)]
        for k in kinks:
            if known.size and float(np.min(np.abs(known - k.t))) <= 2e-3:
                continue
            found, z, _q = _jump_at(rctx, A, U, k, nu_, 4)
            if found is not None:
                out.append((found, z))
    ctx.checks_failed += rctx.checks_failed - ctx.checks_failed
    return out, ctx.F.spent - before


def _fit_faint(ctx: _Ctx, neurons: list[_Neuron], cand: _Neuron, *, iters: int = 30) -> tuple[_Neuron | None, float]:
    """Coarse answers: the hyperplane of a faint neuron found on the residual (:func:`_residual_path`),
    from the values already read (no queries).

    Its gradient-jump normal is rough (the jump is ~1e-4 of the answers' scale, so finite differences
    leave it 0.1 to 0.4 off). With the recovered hyperplanes fixed, the values read (``ctx.samples``,
    thousands of points spread over the space, each with ``<= 16 eps`` of rounding) are linear in the
    output weights; the new neuron's normal is found by variable projection: alternately the least
    squares of every output weight, the linear term and the new weight, and a Gauss-Newton step on the new
    normal (the derivative of ``gamma ReLU(n^T z)`` in ``n`` is ``gamma 1[n^T z > 0] z``). Returns the
    neuron and the relative residual of the joint fit (its acceptance is the caller's: the fit must get
    below the answers' limit or at least halve)."""
    Z = np.array([z for z, _ in ctx.samples])
    y = np.array([v for _, v in ctx.samples])
    N = np.array([nu.n for nu in neurons]).reshape(-1, ctx.D)
    B = np.hstack([np.maximum(Z @ N.T, 0.0), Z])
    ymax = max(float(np.max(np.abs(y))), 1e-300)
    n = cand.n.copy()
    best = (float("inf"), None, None)
    for _ in range(iters):
        h = Z @ n
        M = np.hstack([B, np.maximum(h, 0.0)[:, None]])
        cn = np.linalg.norm(M, axis=0)
        cn = np.where(cn > 0, cn, 1.0)
        sol = lstsq(M / cn, y, rcond=None)[0] / cn
        r = y - M @ sol
        res = float(np.max(np.abs(r))) / ymax
        if res < best[0]:
            best = (res, n.copy(), float(sol[-1]))
        g = sol[-1]
        J = g * (h > 0)[:, None] * Z
        step = lstsq(J, r, rcond=None)[0]
        step -= (step @ n) * n
        if float(np.linalg.norm(step)) < 1e-9:
            break
        n = n + step
        n /= np.linalg.norm(n)
    res, nb, gb = best
    if nb is None or not math.isfinite(res):
        return None, float("inf")
    if gb * cand.gamma <= 0:
        return None, float("inf")
    # the normal's noise: every value carries <= 16 eps of the largest, the fit averages len(y) of them
    out = _Neuron(n=nb, gamma=gb, refined=True, nerr=16.0 * ctx.eps * ymax / (abs(gb) * math.sqrt(len(y))))
    C = _directions_in(ctx, nb, 256)
    if C.shape[0] == 0:
        return None, float("inf")
    marg = np.min(np.abs(C @ N.T), axis=1) if N.shape[0] else np.ones(C.shape[0])
    i = int(np.argmax(marg))
    out.point, out.margin = C[i], float(marg[i])
    return out, res


def _check_path(ctx: _Ctx, neurons: list[_Neuron], segs) -> tuple[list[tuple[_Neuron, np.ndarray]], list[int], int]:
    """Match a fresh path's kinks to the neurons. Returns (new neurons from unexplained kinks, indices of
    neurons whose predicted kink is missing, queries spent measuring the new ones)."""
    new: list[tuple[_Neuron, np.ndarray]] = []
    seen_by: dict[int, int] = {}
    predicted: dict[int, int] = {}
    spent = 0
    N = np.array([o.n for o in neurons]).reshape(-1, ctx.D)
    gam = np.array([o.gamma for o in neurons])
    for A, B, kinks, seen, tau in segs:
        U = B - A
        nu_ = float(np.linalg.norm(U))
        hA, hU = N @ A, N @ U
        with np.errstate(divide="ignore", invalid="ignore"):
            tk = -hA / hU
        inside = np.flatnonzero((tk > 0) & (tk < 1) & np.isfinite(tk))
        for i in inside:
            predicted[int(i)] = predicted.get(int(i), 0) + 1
        Jk = gam * np.abs(hU)
        if ctx.f32:
            # coarse answers: a found kink may be two merged ones (closer than the search resolves), and
            # its location is known to ~1e-6 (1e-4 when merged); tiny predicted kinks may stay unseen
            S = tau / (16.0 * ctx.eps)
            matched_any = np.zeros(len(gam), dtype=bool)
            for k in kinks:
                near = [int(i) for i in inside if abs(tk[i] - k.t) <= 2e-3]
                jt = 0.05 * abs(k.jump) + 100 * tau / max(k.right[1] - k.left[0], 1e-12)
                ok = []
                if near and abs(sum(Jk[i] for i in near) - k.jump) <= jt + 0.05 * sum(abs(Jk[i]) for i in near):
                    ok = near
                elif near:
                    i = min(near, key=lambda i: abs(tk[i] - k.t))
                    if abs(tk[i] - k.t) <= 2e-4 and abs(Jk[i] - k.jump) <= jt:
                        ok = [i]
                if ok:
                    for i in ok:
                        seen_by[i] = seen_by.get(i, 0) + 1
                        matched_any[i] = True
                    continue
                found, z, q = _jump_at(ctx, A, U, k, nu_, 4)
                spent += q
                if found is not None:
                    new.append((found, z))
            others_t = np.concatenate([tk[inside], [k.t for k in kinks], [0.0, 1.0]])
            for i in inside:
                # a predicted kink too small to be seen in these answers is not missing, nor is that of a
                # neuron whose hyperplane was fit to kink points (two kinks closer than the search
                # resolves show as one, at neither's place)
                if abs(Jk[i]) < 1e-3 * S or neurons[int(i)].lines:
                    seen_by[int(i)] = seen_by.get(int(i), 0) + 1
                elif not matched_any[i]:
                    # the search did not report it: look where it should be before calling it missing
                    ok, q = _kink_there(ctx, A, U, float(tk[i]), float(Jk[i]), others_t, tau)
                    spent += q
                    if ok:
                        seen_by[int(i)] = seen_by.get(int(i), 0) + 1
            continue
        for k in kinks:
            cand = [int(i) for i in inside if abs(tk[i] - k.t) <= 1e-6 and abs(Jk[i] - k.jump) <= 1e-5 * abs(k.jump) + 10 * tau / max(k.right[1] - k.left[0], 1e-12)]
            if cand:
                i = min(cand, key=lambda i: abs(tk[i] - k.t))
                seen_by[i] = seen_by.get(i, 0) + 1
                continue
            # an unexplained kink: measure its jump between the two stretches the search certified
            found, z, q = _jump_at(ctx, A, U, k, nu_, 8)
            spent += q
            if found is not None:
                new.append((found, z))
    missing = [i for i, cnt in predicted.items() if seen_by.get(i, 0) < cnt]
    return new, missing, spent


def _fit_output(ctx: _Ctx, N: np.ndarray, gam0: np.ndarray, lin0: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Coarse answers: with the hyperplanes known, ``F(z) = sum_k gamma_k ReLU(n_k^T z) + l^T z`` is linear
    in ``(gamma, l)``: least squares over every sample the refinement kept (away from kinks). Falls back to
    the finite-difference values when the system is not well determined. Returns (gamma, l, relative
    residual)."""
    Z = np.array([z for z, _ in ctx.samples])
    y = np.array([v for _, v in ctx.samples])
    M = np.hstack([np.maximum(Z @ N.T, 0.0), Z])
    cn = np.linalg.norm(M, axis=0)
    cn = np.where(cn > 0, cn, 1.0)
    if M.shape[0] < 2 * M.shape[1]:
        return gam0, lin0, float("nan")
    sol, *_ = lstsq(M / cn, y, rcond=None)
    sol = sol / cn
    sv = svd(M / cn, compute_uv=False)
    if sv[-1] < 1e-6 * sv[0]:
        return gam0, lin0, float("nan")
    res = float(np.max(np.abs(M @ sol - y)) / max(float(np.max(np.abs(y))), 1e-300))
    m = N.shape[0]
    return sol[:m], sol[m:], res


# ---------------------------------------------------------------------------------------------------
# flips


def _resolve_flips(Cx: np.ndarray, lx: np.ndarray, rng: np.random.Generator,
                   coarse: bool = False) -> tuple[np.ndarray | None, str]:
    """A 0/1 vector s with ``Cx s = -lx`` (columns of Cx: gamma_k n_k, x-part), or None. ``coarse``:
    Cx and lx carry float32 answers' errors (~1e-6 relative), so the acceptance is looser."""
    m = Cx.shape[1]
    frac, rtol = (0.05, 1e-4) if coarse else (1e-4, 1e-8)
    scale = float(np.linalg.norm(Cx)) + float(np.linalg.norm(lx))
    if m == 0:
        return np.zeros(0), "none needed"

    def accept(s) -> bool:
        if s is None or not np.all(np.isfinite(s)):
            return False
        r = np.round(s)
        if np.max(np.abs(s - r)) > frac or np.any((r != 0) & (r != 1)):
            return False
        return float(np.linalg.norm(Cx @ r + lx)) <= rtol * scale

    if float(np.linalg.norm(lx)) <= (1e-6 if coarse else 1e-12) * scale:
        return np.zeros(m), "none needed"
    sv = svd(Cx, compute_uv=False)
    if m <= Cx.shape[0] and sv[-1] > 1e-8 * sv[0]:
        s = lstsq(Cx, -lx, rcond=None)[0]
        return (np.round(s), "least-squares") if accept(s) else (None, "least-squares failed")
    try:
        from scipy.optimize import linprog
    except ImportError:    # pragma: no cover
        return None, "unresolved"
    for _ in range(6):
        res = linprog(rng.standard_normal(m), A_eq=Cx, b_eq=-lx, bounds=[(0, 1)] * m, method="highs")
        if res.status == 0 and accept(res.x):
            return np.round(res.x), "linear program"
    return None, "unresolved"


# ---------------------------------------------------------------------------------------------------
# the method

MAX_PATHS_F32 = 10
"""Paths searched at most on float32 answers: close kinks merge on a chord more often there, so phantoms
and neurons seen on only some chords take more paths to settle (each costs ~7 queries per kink)."""

QUIET_PATHS_F32 = 2

EXTRA_PATHS_F32 = 4
"""Paths added (float32) while the recovered neurons do not explain the values read to their precision."""

FIT_LIMIT_EPS = 256
"""The values read (kink lines, away from kinks) must be fit to ``FIT_LIMIT_EPS eps`` of their largest
(float32: 1.5e-5). Each carries at most ``16 eps`` of rounding at that scale (the tolerance of
:func:`_refine_lines`), so a fit 16 times worse has a neuron missing or misplaced: a missing neuron of
output weight ``gamma`` leaves ``~gamma`` of residual (measured on d = 16, m = 32: 1.3e-6 when every
neuron is found, 7e-5 to 5e-2 with one missing)."""
"""Consecutive paths that must change nothing before the float32 learner stops (one on float64)."""


def _describe_unexplained(unexplained, ctx) -> str:
    """Which kinks stayed unexplained on the last path, and why, for the error message."""
    if not unexplained:
        return ("the recovered neurons kept changing (a neuron dropped as a phantom came back), so two of them "
                "are probably closer than float32 answers resolve")
    parts = []
    for _, nu in unexplained[:4]:
        parts.append(f"a kink with jump {nu.gamma:.3g} across normal {np.array2string(nu.n[:3], precision=3)}... "
                     "that no hyperplane fit to kink points confirmed")
    more = f" and {len(unexplained) - 4} more" if len(unexplained) > 4 else ""
    return "; ".join(parts) + more


@checked(FFN, preflight=ffn_preflight, verdict=ffn_verdict)
def extract_ffn(
    oracle: Oracle,
    *,
    bias: bool = False,
    rng: np.random.Generator | int = 0,
    max_queries: int | None = None,
    max_paths: int | None = None,
    polish: bool = True,
    progress: Progress = None,
) -> FFNExtraction:
    """Recover a two-layer ReLU network from one-token value queries (Section 4.1's A_FFN).

    Args:
        oracle: answers ``f([x])`` for one-token queries (an FFN target, or a transformer read on one token).
        bias: the FFN may have hidden and output biases (``w^T ReLU(A^T x + b1) + b2``); without, the
            paper's ``w_o^T ReLU(A^T x)``.
        rng: generator (or seed) for the paths and probe directions.
        max_queries: the most queries this extraction may spend (:class:`BudgetExceeded` past it).
        max_paths: paths searched at most (the first, then checks until one shows no new neuron); default
            4, or 6 on float32 answers (close kinks merge more often, so phantoms take a path to clear).
        progress: called with the number of queries answered after each oracle call.

    Returns:
        An :class:`FFNExtraction`: ``model`` equal to the target as a function; ``diagnostics`` say how
        many kinks and neurons were found, whether the flips were resolved (``neurons_needed`` = m) or
        not (m + 2).

    Raises:
        ModelMismatch: no kink at all (the answers are linear or affine in the token: not a ReLU network,
            e.g. an attention head read on one token), or the paths keep showing new kinks.
        NotIdentifiable: the answers do not depend on the token.
    """
    if max_paths is not None and max_paths < 2:
        raise ValueError(f"max_paths must be >= 2 (one path and one check), got {max_paths}")
    if max_queries is not None and max_queries < 1:
        raise ValueError(f"max_queries must be >= 1, got {max_queries}")
    t0 = time.perf_counter()
    q0 = oracle.queries
    rng = np.random.default_rng(rng)
    bias = bool(bias)
    d = oracle.d
    D = d + int(bias)
    F = _Homog(oracle, bias, max_queries, progress)
    Z0 = rng.standard_normal((8, D))
    if bias:
        Z0[:, -1] = np.abs(Z0[:, -1]) + 1.0
    first = F(Z0)
    # the answers' precision, read from the answers themselves (not the homogeneous values s f(x / s))
    eps = 2.0 ** -24 if looks_float32(F.raw) else 2.0 ** -53
    ctx = _Ctx(F=F, D=D, bias=bias, eps=eps, rng=rng,
               scale=float(np.max(np.abs(first)) / np.max(np.linalg.norm(Z0, axis=1))))

    def refine(k: int) -> int:
        q = _refine(ctx, neurons, k, grads=gradients2)
        if ctx.f32 and not neurons[k].suspect:
            q += _refine_lines(ctx, neurons, k)
        return q

    max_evals = 200_000
    if max_paths is None:
        max_paths = MAX_PATHS_F32 if ctx.f32 else 4

    # 1. kinks on the first path; 2. region gradients along it
    P, Q, R = _path(ctx, rng)
    segs = _search_path(ctx, P, Q, R, max_evals=max_evals)
    kinks1 = sum(len(s[2]) for s in segs)
    if kinks1 == 0:
        spread = float(np.max(first) - np.min(first))
        if spread <= 2.0 ** 10 * eps * float(np.max(np.abs(first))):
            raise NotIdentifiable("the one-token answers do not depend on the token: no FFN is visible")
        raise ModelMismatch(
            "the target does not behave like a ReLU network on one-token queries: no kink anywhere on a path "
            "that crosses every neuron's hyperplane, so the answers are " + ("affine" if bias else "linear")
            + " in the token (an attention head read on one token is v^T x + beta: try --method exact)",
            check="kinks", figure=0.0, threshold=1.0,
            hint="one-token answers are linear: an attention head, or a linear model")
    found, grads, stats = _region_jumps(ctx, segs)
    neurons = _merge([nu for nu, _ in found])

    # 3. refinement where each neuron is isolated
    pass2 = 0
    gradients2: list = []
    for k in range(len(neurons)):
        pass2 += refine(k)
        neurons[k].tries += int(ctx.f32)
    neurons = [nu for nu in neurons if not nu.suspect]
    if ctx.f32:
        neurons = _merge(neurons, tol=1e-6, gtol=0.05)

    # 4. completeness on fresh paths
    paths = 1
    added = dropped = 0
    kinks_per_path = [kinks1]
    quiet = 0                  # consecutive paths that changed nothing
    extra = 0                  # paths added because the values read were not explained (float32)
    best = None                # (fit, neurons) at the best quiet stop so far (float32)
    unsettled = ""             # float32: what the last path still showed when max_paths ran out
    unexplained: list = []
    pending: list = []         # neurons found on the residual of the current fit, added with the next path
    residual_found = 0
    while True:
        if paths >= max_paths and best is not None:
            neurons = [dataclasses.replace(nu) for nu in best[1]]     # the extra paths did not do better
            break
        if paths >= max_paths and ctx.f32 and neurons:
            # float32: kinks that keep coming back without a hyperplane fit to kink points are neurons too
            # close to another (or too small) for these answers; keep what was pinned down, say which were
            # not, and let the values read (below) and the model check judge the result
            unsettled = _describe_unexplained(unexplained, ctx)
            break
        if paths >= max_paths:
            raise ConvergenceError(
                f"ffn: {max_paths} paths searched and the last still showed kinks no recovered neuron explains: "
                + _describe_unexplained(unexplained, ctx) + " (raise max_paths, or the target is not a ReLU network)")
        P, Q, R = _path(ctx, rng)
        segs = _search_path(ctx, P, Q, R, max_evals=max_evals)
        paths += 1
        kinks_per_path.append(sum(len(s[2]) for s in segs))
        new, missing, q = _check_path(ctx, neurons, segs)
        if pending:
            neurons = neurons + pending       # fit to the values read (:func:`_fit_faint`)
            added += len(pending)
            pending = []
        changed = False
        if missing:
            keep = [nu for i, nu in enumerate(neurons) if i not in set(missing)]
            dropped += len(neurons) - len(keep)
            neurons = keep
            changed = True
        fresh = _merge(neurons + [nu for nu, _ in new])[len(neurons):]
        if fresh:
            start = len(neurons)
            neurons = neurons + fresh
            for k in range(start, len(neurons)):
                pass2 += _refine(ctx, neurons, k, grads=gradients2) if ctx.f32 else refine(k)
            bad = [nu for nu in neurons[start:] if nu.suspect]
            neurons = [nu for nu in neurons if not nu.suspect]
            added += len(fresh) - len(bad)
            # (float32: a kink that only a phantom explained, e.g. two merged ones, changes nothing)
            changed = changed or not ctx.f32 or len(fresh) > len(bad)
        if ctx.f32:
            # fit every hyperplane not yet fit to kink points, now that more of its neighbours are known;
            # one that fails three times (or disagrees with its jump) is a phantom (two merged kinks)
            for k, nu in enumerate(neurons):
                if not nu.lines and not nu.suspect:
                    pass2 += _refine_lines(ctx, neurons, k)
                    nu.tries += 1
            gone = [nu for nu in neurons if not nu.lines and (nu.suspect or nu.tries >= 3)]
            if gone:
                neurons = [nu for nu in neurons if not any(nu is g for g in gone)]
                dropped += len(gone)
                changed = True
            before = len(neurons)
            neurons = _merge(neurons, tol=1e-6, gtol=0.05)
            dropped += before - len(neurons)
        unexplained = [(k, nu) for k, (nu, _) in enumerate(new)]
        quiet = 0 if changed else quiet + 1
        # float32: one quiet path may be luck (a merged pair or a kink too small for this chord's noise);
        # two in a row, in independent directions, are the stopping rule
        if quiet >= (QUIET_PATHS_F32 if ctx.f32 else 1):
            if ctx.f32 and extra < EXTRA_PATHS_F32 and neurons and ctx.samples:
                # the values read so far must be explained to the answers' precision; a neuron dropped as a
                # phantom, or one whose kinks were too small for the chords seen, shows here: try harder
                gfit, lfit, fit = _fit_output(ctx, np.array([nu.n for nu in neurons]),
                                              np.array([nu.gamma for nu in neurons]), np.zeros(D))
                if math.isfinite(fit) and (best is None or fit < best[0]):
                    best = (fit, [dataclasses.replace(nu) for nu in neurons])
                if math.isfinite(fit) and fit > FIT_LIMIT_EPS * ctx.eps:
                    # a neuron is missing: its kinks may be too faint for a search on the answers, whose
                    # secant tests see it beside much larger slope changes; search the residual instead
                    found_r, q = _residual_path(ctx, neurons, gfit, lfit, rng, max_evals=max_evals)
                    pass2 += q
                    now = fit
                    for cand, z in found_r:
                        if now <= FIT_LIMIT_EPS * ctx.eps:
                            break            # the values read are explained: the other kinks were the same one
                        if any(abs(float(o.n @ z)) <= 0.05 * float(np.linalg.norm(z)) for o in pending):
                            continue         # the same faint neuron, found on another chord
                        fitted, res = _fit_faint(ctx, neurons + pending, cand)
                        # a neuron is added only if it explains the values read at least twice as well
                        if fitted is not None and res <= 0.5 * now:
                            pending.append(fitted)
                            now = res
                    residual_found += len(pending)
                    extra += 1
                    max_paths += 1
                    quiet = 0
                    continue
            break
    if not neurons:
        raise ModelMismatch("the target does not behave like a ReLU network on one-token queries: kinks were "
                            "seen but none is a neuron's hyperplane", check="kinks", figure=0.0, threshold=1.0)

    # a neuron whose refinement was not reached (added, then its check path changed): measure it now
    for k, nu in enumerate(neurons):
        if not nu.refined or (ctx.f32 and not nu.lines and not nu.suspect):
            pass2 += refine(k)
    if ctx.f32 and polish:
        # every hyperplane again, now that all its neighbours are known (first fits were made with some
        # neighbours missing, so their lines were placed where unknown kinks could be)
        for k, nu in enumerate(neurons):
            old = (nu.n, nu.lines, nu.suspect)
            nu.lines = 0
            pass2 += _refine_lines(ctx, neurons, k)
            if not nu.lines or nu.suspect:
                nu.n, nu.lines, nu.suspect = old
    unrefined = sum(1 for nu in neurons if not nu.refined)
    unfit = sum(1 for nu in neurons if ctx.f32 and not nu.lines)

    # 5. the linear term from every gradient measured, then the flips
    Nmat = np.array([nu.n for nu in neurons])
    gam = np.array([nu.gamma for nu in neurons])
    ls = []
    for y, g in gradients2 + grads:
        active = (Nmat @ y) > 0
        ls.append(g - (gam[active, None] * Nmat[active]).sum(axis=0))
    Ls = np.array(ls)
    lin = Ls[: len(gradients2)].mean(axis=0) if gradients2 else np.median(Ls, axis=0)
    lin_spread = float(np.max(np.linalg.norm(Ls[: max(len(gradients2), 1)] - lin, axis=1))) / max(
        float(np.linalg.norm(gam)), 1e-300)
    fit_rel = None
    if ctx.f32 and ctx.samples:
        gam, lin, fit_rel = _fit_output(ctx, Nmat, gam, lin)

    Cx = (gam[:, None] * Nmat[:, :d]).T
    s, how = _resolve_flips(Cx, lin[:d], rng, coarse=ctx.f32)
    A = Nmat[:, :d].T.copy()
    b1 = Nmat[:, d].copy() if bias else None
    b2 = float(lin[d]) if bias else None
    linear = None
    if s is not None:
        flip = s.astype(bool)
        A[:, flip] *= -1.0
        if bias:
            b2 = b2 + float(np.sum(gam[flip] * Nmat[flip, d]))
            b1[flip] *= -1.0
    else:
        linear = lin[:d].copy()
    model = ReLUFFN(A=A, w=gam, b1=b1, b2=b2, linear=linear)

    m_rec = len(neurons)
    pts = np.array([nu.point for nu in neurons if nu.point is not None]).reshape(-1, D)
    nrm = np.array([nu.n for nu in neurons if nu.point is not None]).reshape(-1, D)
    mg = np.array([nu.margin for nu in neurons if nu.point is not None])
    kin = pts[:, :d] / pts[:, d:] if bias else pts
    diagnostics = {
        "bias": bias,
        "neurons": m_rec,
        "neurons_needed": model.neurons,
        "flips_resolved": s is not None,
        "flip_method": how,
        "flipped": int(np.sum(s)) if s is not None else None,
        "kinks_found": int(sum(kinks_per_path)),
        "kinks_path1": kinks1,
        "paths": paths,
        "regions": stats["regions"],
        "regions_failed": stats["regions_failed"],
        "kinks_unmeasured": stats["kinks_unmeasured"],
        "neurons_added_later": added,
        "neurons_dropped": dropped,
        "unrefined": unrefined,
        "checks_failed": ctx.checks_failed,
        "min_margin": float(mg.min()) if mg.size else None,
        "linear_spread": lin_spread,
        "float32_answers": eps > 2.0 ** -40,
    }
    if ctx.f32:
        diagnostics["hyperplanes_from_kink_points"] = m_rec - unfit
        diagnostics["output_fit_rel_residual"] = fit_rel
        diagnostics["output_fit_samples"] = len(ctx.samples)
        diagnostics["extra_paths"] = extra
        diagnostics["neurons_from_residual"] = residual_found
        if fit_rel is not None and math.isfinite(fit_rel) and fit_rel > FIT_LIMIT_EPS * eps:
            diagnostics["warning"] = (f"the recovered neurons fit the values read only to {fit_rel:.2g} of their "
                                      f"largest (the answers allow {FIT_LIMIT_EPS * eps:.2g}) after {paths} paths: a "
                                      "neuron is missing or misplaced (its kinks closer to another's, or smaller, "
                                      "than float32 answers resolve)")
    if unsettled:
        diagnostics["unsettled"] = unsettled
        diagnostics["warning"] = (f"{max_paths} paths searched and the last still showed kinks no recovered neuron "
                                  f"explains: {unsettled}")
    if unfit:
        diagnostics["warning"] = (f"{unfit} neuron(s) kept their gradient-jump hyperplane (too few kink points "
                                  "on it): coarser precision")
    if unrefined:
        diagnostics["warning"] = f"{unrefined} neuron(s) could not be measured where isolated (coarser precision)"
    return FFNExtraction(method="ffn", model=model, queries=oracle.queries - q0, seconds=time.perf_counter() - t0,
                         diagnostics=diagnostics, kinks=kin, kink_normals=nrm, kink_margins=mg, kink_points=pts,
                         bias=bias)
