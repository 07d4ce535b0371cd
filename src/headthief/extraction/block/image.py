"""The previous LayerNorm's image: the only inputs a block inside an encoder ever sees.

Inside an encoder, block k + 1 reads block k's output ``x = gamma * n + beta`` with ``mean(n) = 0`` and
``|n| = sqrt(d)`` (``gamma, beta``: block k's output LayerNorm, read exactly from the hidden states by
:func:`~headthief.extraction.block.layernorm.fit_output_layernorm`). No query can put any other vector
there, so a method for such a block moves its tokens along great circles of that sphere:

    n(s) = cos(s / sqrt(d)) n + sqrt(d) sin(s / sqrt(d)) u      (u a unit tangent: u . n = 0, u . 1 = 0)

stays on the image for every s, and ``dn/ds = u`` at s = 0: a five-point stencil in s gives the derivative
along ``gamma * u`` in x, to O(s^4), from answers on the image only.

:class:`LayerNormImage` holds ``gamma, beta`` and makes points, tangents and stencils;
:class:`ImageGuard` wraps a black box so that a token off the image is refused (what the encoder does by
construction; tests use it to prove a method never steps off).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import InvalidQuery
from ...oracles.answers import unpack
from ...oracles.base import WrappedOracle
from .value_sum import STENCIL


@dataclass(frozen=True)
class LayerNormImage:
    """``{gamma * n + beta : mean(n) = 0, |n| = sqrt(d)}`` (gamma without zero entries)."""

    gamma: np.ndarray
    beta: np.ndarray

    def __post_init__(self):
        g = np.asarray(self.gamma, dtype=np.float64)
        b = np.asarray(self.beta, dtype=np.float64)
        if g.ndim != 1 or b.shape != g.shape or g.size < 4:
            raise ValueError(f"gamma and beta must be vectors of one length d >= 4, got {g.shape} and {b.shape}")
        if not np.all(np.isfinite(g)) or not np.all(np.isfinite(b)):
            raise ValueError("gamma and beta must be finite")
        if np.min(np.abs(g)) <= 1e-8 * np.max(np.abs(g)):
            raise ValueError("gamma has a zero entry: that coordinate of the image is constant, the image is "
                             "not a (d - 2)-sphere")
        object.__setattr__(self, "gamma", g)
        object.__setattr__(self, "beta", b)

    @property
    def d(self) -> int:
        return int(self.gamma.size)

    def tokens(self, N: np.ndarray) -> np.ndarray:
        """``gamma * n + beta`` for rows n of N."""
        return np.asarray(N, dtype=np.float64) * self.gamma + self.beta

    def normalized(self, X: np.ndarray) -> np.ndarray:
        """``(x - beta) / gamma``: the n of each row (on the sphere exactly when x is on the image)."""
        return (np.asarray(X, dtype=np.float64) - self.beta) / self.gamma

    def distance(self, X: np.ndarray) -> float:
        """The largest ``|mean(n)| + ||n| / sqrt(d) - 1|`` over rows: 0 on the image."""
        n = self.normalized(np.atleast_2d(X))
        return float(np.max(np.abs(n.mean(axis=-1)) + np.abs(np.linalg.norm(n, axis=-1) / np.sqrt(self.d) - 1)))

    def points(self, rng: np.random.Generator, k: int) -> np.ndarray:
        """k random n (rows) on the sphere, uniform."""
        n = rng.standard_normal((k, self.d))
        n -= n.mean(axis=1, keepdims=True)
        return n * (np.sqrt(self.d) / np.linalg.norm(n, axis=1, keepdims=True))

    def tangent(self, n: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A random orthonormal basis (d, d - 2) of the tangent space at n: orthogonal to n and to the ones."""
        d = self.d
        A = np.column_stack([np.ones(d), n, rng.standard_normal((d, d - 2))])
        return np.linalg.qr(A)[0][:, 2:]

    def stencil(self, n: np.ndarray, U: np.ndarray, h: float) -> np.ndarray:
        """(4 k, d) points n(k' h) of the module docstring's great circles, for every column u of U (k of
        them) and k' in STENCIL, direction-major (as :func:`~.value_sum.stencil_tokens` orders them)."""
        d = self.d
        th = np.asarray(STENCIL, dtype=float) * h / np.sqrt(d)
        pts = (np.cos(th)[None, :, None] * n[None, None, :]
               + np.sqrt(d) * np.sin(th)[None, :, None] * U.T[:, None, :])
        return pts.reshape(-1, d)


def random_image(d: int, seed: int = 0) -> LayerNormImage:
    """A previous LayerNorm drawn as :func:`~headthief.models.bert_block.random_block` draws its own: gamma ~
    1 + N(0, 0.1^2), beta ~ N(0, 0.05^2), from ``default_rng(1000 + seed)`` (``bert-block:...,inputs=image``)."""
    rng = np.random.default_rng(1000 + int(seed))
    return LayerNormImage(1.0 + 0.1 * rng.standard_normal(d), 0.05 * rng.standard_normal(d))


class ImageGuard(WrappedOracle):
    """The inner black box, refusing (:class:`InvalidQuery`) any token farther than ``tol`` from ``image``
    (:meth:`LayerNormImage.distance`). Answers pass unchanged; the inner oracle journals and budgets."""

    def __init__(self, inner, image: LayerNormImage, *, tol: float = 1e-9):
        if image.d != inner.d:
            raise ValueError(f"the image has d = {image.d}, the oracle d = {inner.d}")
        super().__init__(inner)
        self.image = image
        self.tol = float(tol)

    def _query(self, X):
        rows = np.concatenate([np.asarray(x).reshape(-1, self.d) for x in X]) if not isinstance(X, np.ndarray) \
            else np.asarray(X).reshape(-1, self.d)
        off = self.image.distance(rows)
        if off > self.tol:
            raise InvalidQuery(f"a token is off the previous LayerNorm's image (by {off:.3g} > {self.tol:g}): "
                               "inside an encoder no input can put it there")
        return unpack(self.output, self.inner.query_packed(X), X)

    def _transform(self, X, y):  # pragma: no cover - _query is overridden
        return y
