"""Stage L of the block method: the output LayerNorm's gamma and beta from the answers alone.

Every answer of a post-LN block is ``y = gamma * n + beta`` with ``n = (u - mean u) / std(u)``, so
``mean(n) = 0`` and ``|n|^2 = d`` (up to LayerNorm's eps: ``d var / (var + eps)``). Two facts follow
(the same ellipsoid fit the logit-vector attacks on production language models use for a final norm):

* **a hyperplane**: ``sum_j (y_j - beta_j) / gamma_j = 0``, i.e. ``a . y = k`` for every answer with
  ``a = 1 / gamma`` (up to scale) and ``k = a . beta``: ``a`` is the smallest right singular vector of the
  centred answers;
* **an ellipsoid inside it**: ``sum_j a_j^2 (y_j - beta_j)^2 = d s^2`` is linear in ``v = a^2 beta`` and
  one constant: a least-squares fit over the answers, with the one direction the hyperplane leaves
  free (``v + alpha a``) fixed by ``a . beta = k``.

Together they give gamma up to one global sign (a genuine symmetry of the whole block: negating gamma_2
is undone by negating z + FFN(z), i.e. gamma_1, beta_1, W_1, W_2, b_2) and beta exactly; the sign is
fixed by ``sum(gamma) > 0``. Any ``d + 2`` answers in general position suffice; every position of every
query is one. The two fits' residuals are the model check of this stage: answers that do not lie on a
(d - 2)-dimensional ellipsoid did not come out of a LayerNorm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ModelMismatch, NotIdentifiable
from ...linalg import lstsq, svd

SPHERE_PRECISION = 10   # the answers' distance from the ellipsoid allowed: 10x their precision (measured 1.1 - 1.7x
SPHERE_EPS = 100        # in float32) or 100x the eps the block models use (BERT's 1e-12: 0.1x of it measured)
PLANE_LIMIT = 1e-3   # relative distance of the answers from their best hyperplane: beyond it, no final LayerNorm


@dataclass(frozen=True)
class OutputLayerNorm:
    """A recovered output LayerNorm: ``gamma``, ``beta`` (d,), with the fit's own precision."""

    gamma: np.ndarray
    beta: np.ndarray
    plane_residual: float    # rms of a.y - k over the answers, relative to rms |a| |y - mean y| / sqrt(d)
    sphere_residual: float   # rms of |n|^2 / d - 1 over the answers
    answers: int

    @property
    def d(self) -> int:
        return int(self.gamma.shape[0])

    def normalized(self, Y: np.ndarray) -> np.ndarray:
        """``n = (y - beta) / gamma`` for answers ``Y`` (..., d): the normalised ``u`` under the LayerNorm."""
        return (np.asarray(Y, dtype=np.float64) - self.beta) / self.gamma


FLAT = 64 * float(np.finfo(np.float32).eps)   # a spread below this fraction of a coordinate's own size: constant


def constant_coordinates(Y: np.ndarray) -> np.ndarray:
    """Output coordinates that do not move over the answers Y (k, d), to float32's precision (spread at most
    ``FLAT`` x their largest magnitude): gamma = 0 there, or so small against beta that the answers' numbers
    do not resolve it. The normalised vector is not seen there."""
    Y = np.asarray(Y, np.float64)
    return np.flatnonzero(Y.std(axis=0) <= FLAT * np.abs(Y).max(axis=0))


def ellipsoid_limit(precision: float, ln_eps: float | None = None) -> float:
    """The distance from the ellipsoid (rms of ``|n|^2 / d - 1``) that answers of relative ``precision`` may
    keep under a LayerNorm of eps ``ln_eps`` (None: BERT's 1e-12): :func:`check_on_ellipsoid`'s limit."""
    from ...models.bert_block import BERT_EPS
    return max(SPHERE_PRECISION * float(precision), SPHERE_EPS * (BERT_EPS if ln_eps is None else float(ln_eps)))


def check_on_ellipsoid(ln: OutputLayerNorm, precision: float, *, where: str = "",
                       ln_eps: float | None = None) -> None:
    """Stage L's model check against the answers' precision: ``|n|^2 / d - 1`` (rms, ``ln.sphere_residual``)
    within the larger of :data:`SPHERE_PRECISION` x ``precision`` (the answers' relative precision) and
    :data:`SPHERE_EPS` x the LayerNorm eps assumed (``ln_eps``; None: BERT's 1e-12), else
    :class:`ModelMismatch`.

    A LayerNorm with eps not negligible against its input's variance puts ``|n|^2 = d var / (var + eps)``
    off the sphere by about eps / var. Measured with transformers' ``BertLayer`` (d = 16), float64: eps 1e-12
    leaves 1.3e-13, eps 1e-9 1.3e-10, eps 1e-5 1.3e-6; float32 answers: 1.1 - 1.7x their precision 6e-8 with
    eps 1e-12, 24x with 1e-5. Unchecked, eps 1e-5 (RoBERTa's and many others') ended at stage F's neuron
    search in float64, refused as "not identifiable", and in float32 was reported extracted at fidelity
    1.1e-5 (6.0e-7 with eps 1e-12); eps 1e-9 ended at stage F's check, as "not a GELU block". The block
    method takes another eps (``--ln-eps``, :mod:`.extract`)."""
    from ...models.bert_block import BERT_EPS
    limit = ellipsoid_limit(precision, ln_eps)
    assumed = f"BERT's {BERT_EPS:g}" if ln_eps is None else f"{float(ln_eps):g}"
    if ln.sphere_residual > limit:
        raise ModelMismatch(
            f"{where}the answers are off the LayerNorm's ellipsoid: rms of |n|^2 / d - 1 is "
            f"{ln.sphere_residual:.3g} > {limit:.2g} (the larger of {SPHERE_PRECISION}x the answers' precision "
            f"{precision:.2g} and {SPHERE_EPS}x the LayerNorm eps assumed, {assumed}). A LayerNorm with a larger "
            "eps (1e-5 in RoBERTa and many others) puts them off by about eps / var (--method block takes the eps "
            "as --ln-eps). Answers with undeclared noise (a defence's) are off it too",
            check="output-layernorm ellipsoid", figure=ln.sphere_residual, threshold=limit)


def fit_output_layernorm(Y: np.ndarray) -> OutputLayerNorm:
    """gamma and beta of the LayerNorm that produced the answers ``Y`` (k, d), k >= d + 2 in general
    position (see the module docstring). Raises :class:`NotIdentifiable` for too few or degenerate
    answers and :class:`ModelMismatch` when the answers do not lie on a hyperplane's ellipsoid.

    The fit runs in units of each coordinate's spread ``s_j`` over the answers (``y / s`` is the output of
    the LayerNorm ``(gamma / s, beta / s)``; gamma and beta come back multiplied by ``s``): an error in beta_j
    then weighs as ``n_j``'s error, whatever gamma_j. Unscaled, beta's error is absolute and n_j's is that
    over gamma_j: measured, gamma_2 x 1e-3 at two coordinates of a float64 d = 12 block left n 3e-9 off there
    and stage F's span unsettled; and all-MiniLM-L6-v2's last LayerNorm (gamma -6.0e-33, -4.8e-33 and -1.5e-9
    at coordinates 127, 223 and 319, beta -8.6e-33, 1.6e-32 and -8.7e-8, resolved by float32's 7 digits
    there) lost its hyperplane under the other coordinates' rounding. Coordinates that do not move at all
    (:func:`constant_coordinates`) leave the LayerNorm unfixed: refused, naming them."""
    Y = np.asarray(Y, dtype=np.float64)
    if Y.ndim != 2:
        raise ValueError(f"answers must be a (k, d) array, got shape {Y.shape}")
    k, d = Y.shape
    if d < 3:
        raise NotIdentifiable(f"a LayerNorm over d={d} < 3 coordinates leaves no ellipsoid to fit")
    if k < d + 2:
        raise NotIdentifiable(f"fitting a LayerNorm over d={d} needs at least d + 2 = {d + 2} answers, got {k}")
    const = constant_coordinates(Y)
    if const.size:
        raise NotIdentifiable(f"output coordinates {', '.join(map(str, const[:8]))} are constant over {k} answers "
                              "(the LayerNorm's gamma is ~0 there): the normalised vector is not seen there, so "
                              "the hyperplane and the ellipsoid that fix gamma and beta are lost")
    spread = Y.std(axis=0)
    s = spread / np.median(spread)
    fit = _fit_in_units(Y / s)
    gamma = fit.gamma * s
    return OutputLayerNorm(gamma=gamma if gamma.sum() >= 0 else -gamma, beta=fit.beta * s,
                           plane_residual=fit.plane_residual, sphere_residual=fit.sphere_residual, answers=k)


def _fit_in_units(Y: np.ndarray) -> OutputLayerNorm:
    """The hyperplane and the ellipsoid of the module docstring, on answers ``Y`` (k, d) already checked."""
    k, d = Y.shape
    mu = Y.mean(axis=0)
    C = Y - mu
    _, sv, Vt = svd(C, full_matrices=False)
    if sv[-2] <= 1e-9 * sv[0]:
        raise NotIdentifiable(f"the {k} answers span fewer than d - 1 = {d - 1} directions: they do not fix the "
                              "LayerNorm (use more varied queries)")
    a = Vt[-1]
    a = a * np.sign(a.sum()) if a.sum() != 0 else a
    spread = float(np.sqrt(np.mean(C ** 2)))
    plane = float(sv[-1] / np.sqrt(k)) / max(spread, 1e-300)
    if plane > PLANE_LIMIT:
        raise ModelMismatch(
            f"the answers are not on a hyperplane (relative distance {plane:.3g} > {PLANE_LIMIT:g}): a LayerNorm's "
            "outputs satisfy sum((y - beta) / gamma) = 0; this target has no LayerNorm at its output",
            check="output-layernorm", figure=plane, threshold=PLANE_LIMIT)
    kk = float(mu @ a)
    # sum_j a_j^2 y_j^2 = 2 v.y - c  with v = a^2 beta, c = sum a^2 beta^2 - d s^2
    A = np.hstack([2.0 * Y, -np.ones((k, 1))])
    rhs = (Y ** 2) @ (a ** 2)
    sol, *_ = lstsq(A, rhs, rcond=None)
    vp, cp = sol[:d], sol[d]
    if np.min(np.abs(a)) <= 1e-12 * np.max(np.abs(a)):
        raise NotIdentifiable("a coordinate of 1/gamma is zero: that output coordinate is constant (gamma = inf?)")
    alpha = (kk - float(np.sum(vp / a))) / d
    beta = vp / a ** 2 + alpha / a
    c = cp + 2.0 * alpha * kk
    s2 = (float(np.sum(a ** 2 * beta ** 2)) - c) / d
    if not s2 > 0:
        raise ModelMismatch("the answers' ellipsoid has a non-positive radius: not a LayerNorm's output",
                            check="output-layernorm", figure=s2, threshold=0.0)
    gamma = np.sqrt(s2) / a                           # its global sign: the caller's (beta does not depend on it)
    n = (Y - beta) / gamma
    sphere = float(np.sqrt(np.mean((np.sum(n ** 2, axis=1) / d - 1.0) ** 2)))
    return OutputLayerNorm(gamma=gamma, beta=beta, plane_residual=plane, sphere_residual=sphere, answers=k)
