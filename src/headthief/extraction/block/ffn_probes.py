"""Stage F from probe Jacobians: LN1 and the GELU FFN with a fraction of the full Jacobians' queries.

Stage F as :mod:`.ffn` builds it reads full tangent Jacobians ``dn/dm`` (4 (d - 2) one-token queries each)
at 5 (ffn + 1) points: 11.75 million queries at all-MiniLM-L6-v2's size (d = 384, ffn = 1536). Every
``K(m) = Gamma_1 + W_2 diag(GELU'(.)) W_1'`` lies in the (ffn + 1)-dimensional span ``W``; so does every
``K(m) V`` for a fixed set of p probe directions V (d x p, orthonormal, off the ones-vector) in the span
``W V`` of ``P Gamma_1 V`` and ``w2_k (V^T a_k)^T`` (``a_k`` neuron k's row of ``W_1'``), as long as
``(d - 1) p`` exceeds ``ffn + 1`` by the nuisance below. Two phases:

1. **Probes everywhere.** At T points m_t on LN1's sphere, five-point derivatives along the probes
   projected on the tangent, ``V - m_t (m_t^T V)`` (4 p queries per point): ``D_t = J_t (V - m_t m_t^T V)``,
   which is ``P K_t V`` up to a scale and the nuisance ``n_t a^T + e (V^T m_t)^T`` (a in R^p, e in R^d).
   The span by :func:`.ffn.span` with that nuisance, the neurons as its rank-one elements ``u_k v_k^T``
   (``u_k`` along ``P w2_k``, ``v_k`` along ``V^T a_k``), gamma_1 as its one diagonal element
   ``P diag(gamma) P V``, and every point's coefficients.
   From d = 32 (:func:`orthogonal_points`) the points other than phase 2's are drawn orthogonal to the probes:
   there ``V^T m_t = 0``, the e-part vanishes and each point's nuisance is p-wide, so a span step solves
   p x p systems instead of (p + d - 1) x (p + d - 1) ones (at MiniLM's size 28.6 s a step on one core
   against 641 s, with :func:`.ffn.top_subspace` for the SVD). The span is iterated on those points only;
   phase 2's points are lifted against it once (:func:`.ffn.lift_against`).
2. **The rest of every a_k.** S of the T points are drawn inside span(V); there every direction of
   ``W_x`` (the d - 1 - p directions orthogonal to V and to the ones-vector) is tangent, and
   ``lambda_s P_n D^x_s = P_n (a_s P diag(gamma) W_x + U diag(c_s) X)``, with ``lambda_s`` the ratio
   of the lifted matrix to the measured one at that point (both with their nuisance projected out), is
   linear in ``X = (W_x^T a_k)_k`` (ffn x (d - 1 - p)): one normal matrix (ffn x ffn) for all columns.
   ``a_k = V v_k + W_x x_k``. S must give at least ffn equations per column: ``2 ffn / (d - 2) + 6``.

Then the profiles and the linear remainder as stage F does (:func:`.ffn.assemble_part`). Queries:
``T (4 p + 1) + 4 S (d - 1 - p)`` against ``(4 (d - 2) + 1) 5 (ffn + 1)``; at MiniLM's size, with
``p = 2 (ffn + d) / d + 2 = 12``, 0.38 million against 11.75 million (and 2,000 probe points' spans of
dimension 1,537 in R^4,596 instead of 7,685 Jacobians of 147,456 entries).

Measured (``benchmarks/research_ffn_probes.py``: :func:`from_derivatives` on exact position-wise maps of
random blocks, float64): every neuron within 1.1e-10 at d = 16 (ffn 32) and d = 32 (ffn 128); with
float32 rounding ~3e-3 (a start: the one-token refit follows). The method is chosen by :func:`use_probes`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...errors import NotIdentifiable, SpecError
from ...oracles.base import Oracle
from .ffn import (FFNPart, _sphere, assemble_part, coefficients, gamma_direction, lift_against, span_and_neurons,
                  tokens_for, tolerances)
from .layernorm import OutputLayerNorm
from .value_sum import COARSE, ValueSum, stencil_derivative, stencil_tokens
from ...linalg import svd


def probe_count(d: int, ffn: int) -> int:
    """p: the span ``W V`` (ffn + 1 dims) and each point's nuisance (d + p) must leave room in (d - 1) p."""
    return min(d - 3, int(np.ceil(2 * (ffn + d) / d)) + 2)


def orthogonal_points(d: int, p: int) -> bool:
    """Whether the points outside the probes' span are drawn orthogonal to it (their nuisance p-wide, not
    ``p + d - 1``: the span step's largest cost at MiniLM's size, 22x less a step there), which needs the
    probes' orthogonal complement to hold at least half the directions: at d = 12 (3 of 11 directions left)
    the neurons' one-token fidelity came out 5.7e-10 against 3.5e-10 required, at d = 16 (7 of 15) neurons
    within 3.4e-10 against 7.0e-11 with the points anywhere; from d = 32 (19 of 31) as precise or better
    (measured), and the span settles in fewer steps (d = 32: 50 - 64 against 86 - 114; d = 64: 30 - 36
    against 79)."""
    return 2 * (d - 1 - p) >= d


def inside_count(d: int, ffn: int) -> int:
    """S: points inside span(V) for phase 2 (each gives d - 2 equations per column for ffn unknowns)."""
    return int(np.ceil(2 * ffn / (d - 2))) + 6


def full_queries(d: int, ffn: int) -> int:
    """Stage F's queries with full Jacobians (:func:`.ffn.extract_ffn`, default points)."""
    return (4 * (d - 2) + 1) * max(5 * (ffn + 1), 2 * d)


def probe_queries(d: int, ffn: int) -> int:
    """This route's queries (default sizes)."""
    p, S = probe_count(d, ffn), inside_count(d, ffn)
    return max(5 * (ffn + 1), 2 * d) * (4 * p + 1) + 4 * S * (d - 1 - p)


def use_probes(d: int, ffn: int) -> bool:
    """The probe route where it needs at most a quarter of the full Jacobians' queries (d >= 64 for
    ffn = 4 d; below, the full route, validated on 20 + 10 seeds, stays)."""
    p = probe_count(d, ffn)
    return d > 8 and p < d - 3 and (d - 1) * p > ffn + 1 + d + p and 4 * probe_queries(d, ffn) <= full_queries(d, ffn)


def check_fits(d: int, ffn: int, p: int | None = None, T: int | None = None) -> None:
    """:class:`SpecError` (before any query) where the route does not fit: fewer than 2 probes, or
    ``p >= d - 2`` (no direction left for phase 2), or the span (ffn + 1) and a point's nuisance (d + p)
    not inside (d - 1) p dimensions (a wide FFN at small d), or no point left outside span(V)."""
    p = p or probe_count(d, ffn)
    S, T = inside_count(d, ffn), T or max(5 * (ffn + 1), 2 * d)
    if not 2 <= p < d - 2 or (d - 1) * p <= ffn + 1 + d + p or S >= T:
        raise SpecError(f"--stage-f probes at d = {d}, ffn = {ffn}: {p} probes (need 2 <= p < d - 2 and (d - 1) p > "
                        f"ffn + 1 + d + p) and {S} of {T} points inside their span do not fit; use --stage-f full")


def extract_ffn_probes(oracle: Oracle, ln: OutputLayerNorm, vs: ValueSum, rng: np.random.Generator, *, ffn: int,
                       points: int | None = None, probes: int | None = None, precision: float = 1e-15,
                       r: float | None = None, max_iter: int = 300, progress=None,
                       activation: str = "gelu", found_progress=None) -> FFNPart:
    """Stage F from probe Jacobians (module docstring) for a block of FFN width ``ffn``: one-token queries
    that set LN1's normalised output (:func:`.ffn.tokens_for`), read through stage L's LayerNorm."""
    d = oracle.d
    h = max(float(precision), 1e-16) ** 0.2 * np.sqrt(d)

    def answer(M):                                                            # LN2's normalised inputs at M
        X = tokens_for(vs, M, r, bound=oracle.input_norm)
        return ln.normalized(np.asarray(oracle.query_packed(X[:, None, :])))

    def derivative(m, dirs):                                                  # (d, k) along the rows of dirs
        return stencil_derivative(answer(stencil_tokens(m, dirs, h)), len(dirs), h)

    q0 = oracle.queries
    part = from_derivatives(derivative, lambda m: answer(m[None])[0], d, ffn, rng, points=points, probes=probes,
                            precision=precision, max_iter=max_iter, progress=progress, activation=activation,
                            found_progress=found_progress)
    return dataclasses.replace(part, info={"queries": oracle.queries - q0, **part.info})


def from_derivatives(derivative, answer, d: int, ffn: int, rng: np.random.Generator, *, points: int | None = None,
                     probes: int | None = None, precision: float = 1e-15, max_iter: int = 300,
                     progress=None, activation: str = "gelu", found_progress=None) -> FFNPart:
    """The probe route on any position-wise map m -> n: ``derivative(m, dirs)`` its (d, k) derivatives at m
    along the rows of dirs, ``answer(m)`` its value at m (the normalised LN2 input, any scale)."""
    p = probes or probe_count(d, ffn)
    S = inside_count(d, ffn)
    T = points or max(5 * (ffn + 1), 2 * d)
    check_fits(d, ffn, p, T)
    Pm = np.eye(d) - 1.0 / d
    E = svd(Pm)[0][:, :d - 1]
    V = np.linalg.qr(E @ rng.standard_normal((d - 1, p)))[0]                 # (d, p) orthonormal, off 1
    Wx = svd(Pm - V @ V.T)[0][:, :d - 1 - p]                         # the rest of 1's complement
    inside = rng.standard_normal((S, p)) @ V.T
    outside = _sphere(rng, T - S, d)
    narrow = orthogonal_points(d, p)
    if narrow:                                                                # orthogonal to the probes: V is
        outside -= (outside @ V) @ V.T                                        # tangent there, no e-nuisance
        outside *= np.sqrt(d) / np.linalg.norm(outside, axis=1, keepdims=True)
    Ms = np.concatenate([inside * (np.sqrt(d) / np.linalg.norm(inside, axis=1, keepdims=True)), outside])
    D, ms, ns = [], [], []
    for m in Ms:
        mh = m / np.sqrt(d)
        D.append(derivative(m, (V - np.outer(mh, mh @ V)).T))
        y0 = answer(m)
        ms.append(mh)
        ns.append(y0 / np.linalg.norm(y0))
    D, ms, ns = np.array(D), np.array(ms), np.array(ns)
    span_tol, rank_tol = tolerances(precision, d)
    coarse = precision > COARSE
    first = S if narrow else 0                    # narrow: the span from the orthogonal points, the inside ones lifted
    Q, lifted, iters, change, pairs, starts = span_and_neurons(D[first:], ms[first:], ns[first:], ffn, rng,
                                                               tol=span_tol, rank_tol=rank_tol, coarse=coarse,
                                                               best_on_stall=coarse, max_iter=max_iter,
                                                               progress=progress, probes=V,
                                                               found_progress=found_progress)
    if narrow:
        lifted = np.concatenate([lift_against(D[:S], ms[:S], ns[:S], Q, V), lifted])
    gam = gamma_direction(Q, d, gap=30.0 if coarse else 1e3, probes=V)
    coef = coefficients(lifted, gam, pairs, probes=V)
    U = np.stack([u for u, _ in pairs], axis=1)                               # (d, ffn)
    G = Pm @ np.diag(gam) @ Wx
    lhs = np.zeros((ffn, ffn))
    rhs = np.zeros((ffn, d - 1 - p))
    for s in range(S):                                                        # phase 2
        Dx = derivative(Ms[s], Wx.T)                                          # (d, d - 1 - p), all tangent
        Pn = Pm - np.outer(ns[s], ns[s])
        rr = ms[s] @ V
        Pi = np.eye(p) - np.outer(rr, rr) / (rr @ rr)
        Ls, Ds = (Pn @ lifted[s].reshape(d, p) @ Pi).ravel(), (Pn @ D[s] @ Pi).ravel()
        lam = float(Ls @ Ds / (Ds @ Ds))
        C = Pn @ (U * coef[1:, s])
        lhs += C.T @ C
        rhs += C.T @ (Pn @ (lam * Dx - coef[0, s] * G))
    w = np.linalg.eigvalsh(lhs)
    if w[0] <= 1e-12 * w[-1]:
        raise NotIdentifiable(f"the {S} points inside the probes' span do not fix every neuron's input direction "
                              f"(normal matrix conditioning {w[0] / w[-1]:.2g})")
    X = np.linalg.solve(lhs, rhs)
    zs = [V @ v + Wx @ x for (_, v), x in zip(pairs, X)]
    info = {"points": T, "probes": p, "inside_points": S, "span_iterations": iters, "span_change": change,
            "starts": starts, "phase2_conditioning": float(w[0] / w[-1]),
            "fitted": ["span of probe Jacobians (iterated)", "neuron profiles (1-D fits)"]}
    return assemble_part(gam, [u for u, _ in pairs], zs, coef, ms, ns, info, activation)
