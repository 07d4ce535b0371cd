"""Stage F of the block method with every query on the previous LayerNorm's image.

Stage F (:mod:`.ffn`) reads tangent Jacobians ``dn_out/dm`` of the one-token map on LN1's sphere, at
points m it chooses freely through ``x = B^{-1}(r m - b)``. On the image (:mod:`.image`) a token is
``x = G n + beta_p`` with n on a sphere, and stage V on the image (:mod:`.value_sum_image`) gives
``P(B x + b) = K n + c``, so LN1's normalised input is

    m(n) = sqrt(d) P p / |P p|,    p = K n + c,    dm/dn = (sqrt(d) / |P p|) (I - m m^T / d) P K.

Along the image's great circles (tangent basis T at n) the five-point stencil reads ``J_n = J_m D`` with
``D = dm/dn T`` (d x (d - 2)), whose columns span LN1's tangent at m; so ``J_m = J_n D^+`` on that tangent
and zero on ``{1, m}``: exactly what :func:`.ffn.jacobians` returns, and the rest of stage F (span,
neurons, gamma_1, profiles) runs unchanged. The image maps onto part of LN1's sphere only (a cap, folded
at its rim, when ``c`` is long against K); near the fold D is singular, so points are drawn where D's
condition number is below :data:`MAX_CONDITION` (the Jacobians lose that factor of precision).

The model check is :func:`check_on_image`: fresh image tokens against the prediction of stages L, V, F.
"""

from __future__ import annotations

import numpy as np

import dataclasses

from ...errors import ConvergenceError, ModelMismatch, NotIdentifiable
from ...oracles.base import Oracle
from .ffn import CHECK_FACTOR, FFNPart, FFNTooWide, NearlyLinearFFN, default_points, extract_ffn
from .layernorm import OutputLayerNorm
from .value_sum import COARSE, stencil_derivative
from .value_sum_image import ImageValueSum
from ...linalg import pinv, svd

MAX_CONDITION = 1e3       # largest condition number of dm/dn accepted at a stage-F point
COARSE_CONDITION = 1e2    # the same for coarse (float32) answers: the Jacobians lose that factor of a precision
                          # they do not have (measured: a float32 d = 8 encoder's block 1 failed stage F on
                          # 3 of 3 tries with 1e3, and passed with 1e2)
MAX_DRAWS = 50            # rounds of candidate points before the image is declared too narrow


def condition_cap(precision: float) -> float:
    """The largest condition number of dm/dn accepted at a stage-F point for answers of this precision."""
    return MAX_CONDITION if precision <= COARSE else COARSE_CONDITION


def ln1_input(ivs: ImageValueSum, N: np.ndarray) -> np.ndarray:
    """LN1's normalised input m (rows, ``|m| = sqrt(d)``) at the image points with normalised rows N."""
    p = ivs.pre(N)
    p = p - p.mean(axis=1, keepdims=True)
    return p * (np.sqrt(p.shape[1]) / np.linalg.norm(p, axis=1, keepdims=True))


def _dm(ivs: ImageValueSum, n: np.ndarray, T: np.ndarray) -> np.ndarray:
    """``dm/dn T`` (d, d - 2) at image point n."""
    d = n.size
    p = ivs.pre(n)[0]
    p = p - p.mean()
    m = p * (np.sqrt(d) / np.linalg.norm(p))
    KT = ivs.K @ T
    KT = KT - KT.mean(axis=0, keepdims=True)
    return (np.sqrt(d) / np.linalg.norm(p)) * (KT - np.outer(m, m @ KT) / d)


def best_conditioned(good: list, spare: list, points: int, cap: float, why: str) -> list:
    """``points`` candidates (tuples led by dm/dn's condition number): those within ``cap`` when there are
    enough, else the best conditioned of all within :data:`MAX_CONDITION` (coarse answers: measured, a 1e2 cap
    alone left 2 of 4 float32 d = 8 encoders' block 1 with fewer than the points stage F needs)."""
    if len(good) >= points:
        return good[:points]
    pool = sorted(good + spare, key=lambda c: c[0])
    if len(pool) < points:
        raise NotIdentifiable(f"fewer than {points} of the candidate points have dm/dn conditioned better than "
                              f"{MAX_CONDITION:g}: {why}")
    return pool[:points]


def image_reader(oracle: Oracle, ln: OutputLayerNorm, ivs: ImageValueSum, *, precision: float):
    """A ``reader(rng, T)`` for :func:`.ffn.extract_ffn`: T tangent Jacobians ``dn_out/dm`` from stencils on
    the image (4 (d - 2) + 1 one-token queries each; see the module docstring)."""
    image = ivs.image
    d = image.d
    h = max(float(precision), 1e-16) ** 0.2
    cap = condition_cap(precision)

    def read(rng: np.random.Generator, points: int):
        good, spare = [], []                       # (condition, n, T, D): within the cap / within MAX_CONDITION
        for _ in range(MAX_DRAWS):
            for n in image.points(rng, points):
                T = image.tangent(n, rng)
                D = _dm(ivs, n, T)
                S = svd(D, compute_uv=False)
                cond = S[0] / max(S[-1], 1e-300)
                if cond <= cap:
                    good.append((cond, n, T, D))
                elif cond <= MAX_CONDITION:
                    spare.append((cond, n, T, D))              # near the fold: used only if too few are better
                if len(good) == points:
                    break
            if len(good) == points:
                break
        chosen = best_conditioned(good, spare, points, cap, "the image reaches too little of LN1's sphere")
        Js, ms, ns, q = [], [], [], 0
        for _, n, T, D in chosen:
            X = image.tokens(np.vstack([image.stencil(n, T, h), n]))
            Y = ln.normalized(np.asarray(oracle.query_packed(X[:, None, :])))
            q += len(X)
            Jn = stencil_derivative(Y[:-1], d - 2, h)              # (d, d - 2)
            Js.append(Jn @ pinv(D))
            m = ln1_input(ivs, n[None])[0]
            ms.append(m / np.linalg.norm(m))
            ns.append(Y[-1] / np.linalg.norm(Y[-1]))
        return np.array(Js), np.array(ms), np.array(ns), q

    return read


TRIES = 3                 # stage F on the image: fresh points after a span or neuron search that fails


def extract_ffn_on_image(oracle: Oracle, ln: OutputLayerNorm, rng: np.random.Generator, *, ffn: int, reader,
                         start: bool = False, precision: float = 1e-15, tries: int = TRIES,
                         points: int | None = None, activation: str = "gelu") -> FFNPart:
    """:func:`.ffn.extract_ffn` with ``reader``, tried again at fresh points, 2x then 4x as many, when its span
    does not settle or its neuron search fails (measured: 1 of 8 draws at d = 8, ffn = 8 on one block, the
    image's reachable cap making some point sets poor; and at d = 8, ffn = 24 three draws of 125 points failed
    on one block, where each point leaves 11 constraints on the span: docs/block.md, "Small d").
    ``info["attempts"]`` says how many were needed; the last error is raised after ``tries``."""
    last = None
    base = points or default_points(oracle.d, ffn)
    for attempt in range(1, tries + 1):
        try:
            part = extract_ffn(oracle, ln, None, rng, ffn=ffn, reader=reader, start=start, precision=precision,
                               points=base * 2 ** (attempt - 1), activation=activation)
        except (NearlyLinearFFN, FFNTooWide):   # a property of the block: fresh points do not help
            raise
        except (ConvergenceError, NotIdentifiable) as e:
            last = e
            continue
        return dataclasses.replace(part, info={**part.info, "attempts": attempt})
    raise last


def predict_on_image(part: FFNPart, ln: OutputLayerNorm, ivs: ImageValueSum, N: np.ndarray) -> np.ndarray:
    """One-token answers at the image points with normalised rows N, from stages L, V and F on the image."""
    return part.n(ln1_input(ivs, N)) * ln.gamma + ln.beta


def check_on_image(oracle: Oracle, part: FFNPart, ln: OutputLayerNorm, ivs: ImageValueSum,
                   rng: np.random.Generator, *, count: int = 64, precision: float = 1e-15) -> dict:
    """The model check of stages L, V, F on the image: ``count`` fresh one-token queries at random image
    points against :func:`predict_on_image`, within ``CHECK_FACTOR`` times the stencil's expected error
    (``eps^0.8 sqrt(d)``) times ``MAX_CONDITION`` (the Jacobians' precision on the image), else
    :class:`ModelMismatch`."""
    N = ivs.image.points(rng, count)
    Y = np.asarray(oracle.query_packed(ivs.image.tokens(N)[:, None, :]))
    fid = float(np.max(np.abs(predict_on_image(part, ln, ivs, N) - Y)) / np.sqrt(np.mean(Y ** 2)))
    d = ivs.image.d
    limit = CHECK_FACTOR * MAX_CONDITION * max(float(precision), 1e-16) ** 0.8 * np.sqrt(d)
    if fid > limit:
        raise ModelMismatch(f"the recovered LN1 + FFN + LN2 answer fresh image tokens with fidelity {fid:.3g} > "
                            f"{limit:.2g}: not a post-LN {part.activation} block of this width",
                            check="one-token fidelity (image)", figure=fid, threshold=limit)
    return {"fidelity": fid, "threshold": limit, "queries": count}
