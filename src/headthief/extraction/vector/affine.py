"""Stage A of the vector method: one-token queries answer ``y = M x + b`` exactly.

With one token the softmax puts all its weight on it, so every head returns that token and the layer's
answer is affine: ``M = sum_h O_h``, ``b = bo + Wo bv``. d + 1 queries fix (M, b); a few extra random
one-token queries measure how precisely the black box answers (the rms of their residual), which is
what every later tolerance is derived from. With every position's answer, one two-token query also
tells whether the layer is causal (position 1 of ``[x1, x2]`` then equals the one-token answer of x1).

A user may declare the mask (``causal=True``, ``headthief extract --causal``). At the last position alone a
causal layer and a bidirectional one with the same weights answer alike, so there the declaration is what
the recovered layer's other positions follow; with every position's answer the two-token query still runs
and a declaration it contradicts is a :class:`ModelMismatch` before any later stage spends a query.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ModelMismatch
from ...oracles.answers import Output
from ...oracles.base import Oracle

EXTRA = 8          # one-token queries beyond d + 1 that measure the answers' precision
AFFINE_LIMIT = 1e-2  # one-token answers further than this (relative) from affine: not an attention layer


@dataclass(frozen=True)
class Affine:
    M: np.ndarray          # (d_out, d)
    b: np.ndarray          # (d_out,)
    sigma: float           # rms residual of the extra one-token answers (the answers' own noise)
    scale: float           # rms of those answers (sigma / scale = relative precision)
    causal: bool | None    # the mask used: declared, else detected; None: neither (last position only)
    queries: int
    detected: bool | None = None   # what the two-token query showed (None: answers at the last position only)
    declared: bool | None = None   # what the user declared (None: nothing)

    @property
    def rel_noise(self) -> float:
        return self.sigma / max(self.scale, 1e-300)


def token_scale(d: int, input_norm: float | None) -> float:
    """The norm of probe tokens: under an input-norm bound R, 0.9 R; else sqrt(d) (unit-variance entries)."""
    return 0.9 * input_norm if input_norm is not None else float(np.sqrt(d))


def affine_part(oracle: Oracle, rng: np.random.Generator, *, causal: bool | None = None) -> Affine:
    """Stage A (see the module); ``causal``: the mask the user declared (None: detected where observable).

    Raises:
        ModelMismatch: one-token answers not affine, or (answers at every position) a declared mask that
            the two-token query contradicts."""
    d = oracle.d
    s = token_scale(d, oracle.input_norm)
    Qb, _ = np.linalg.qr(rng.standard_normal((d, d)))
    extra = rng.standard_normal((EXTRA, d))
    extra *= s / np.linalg.norm(extra, axis=1, keepdims=True)
    tokens = np.vstack([np.zeros((1, d)), s * Qb.T, extra])
    batch = tokens[:, None, :]
    pair = None
    if oracle.output is Output.ALL:
        x1, x2 = extra[0], extra[1]
        pair = np.stack([x1, x2])[None]
    Y = np.asarray(oracle.query_packed(batch))
    b = Y[0]
    M = (Y[1:d + 1] - b).T @ Qb.T / s                  # answers along the orthonormal basis, rotated back
    pred = b + extra @ M.T
    res = Y[d + 1:] - pred
    sigma = float(np.sqrt(np.mean(res ** 2)))
    scale = float(np.sqrt(np.mean(Y[d + 1:] ** 2)))
    if sigma > AFFINE_LIMIT * max(scale, 1e-300):
        raise ModelMismatch(
            f"one-token answers are not affine in the token (relative residual {sigma / max(scale, 1e-300):.3g} > "
            f"{AFFINE_LIMIT:g} on {EXTRA} fresh tokens): a multi-head attention layer answers y = M x + b to a single "
            "token; this target has a nonlinearity after the attention (LayerNorm, an FFN, a second layer) or answers "
            "noisier than the method can use", check="affine", figure=sigma / max(scale, 1e-300), threshold=AFFINE_LIMIT)
    detected = None
    q = len(tokens)
    if pair is not None:
        y2 = np.asarray(oracle.query_packed(pair))      # rows: position 1, position 2
        q += 1
        one = Y[d + 1]                                   # [x1] alone
        both = y2[1] - b - M @ x2                        # nonzero unless every head ignores x1 at position 2
        tol = 50 * max(sigma, 1e-300) + 1e-12 * scale
        moved = float(np.max(np.abs(y2[0] - one)))       # what x2 changed at position 1
        detected = bool(moved <= tol and np.linalg.norm(both) > tol)
        if causal is not None and (moved > tol if causal else detected):
            _contradiction(bool(causal), moved, tol, scale)
    used = bool(causal) if causal is not None else detected
    return Affine(M=M, b=b, sigma=sigma, scale=scale, causal=used, queries=q, detected=detected,
                  declared=None if causal is None else bool(causal))


def _contradiction(declared: bool, moved: float, tol: float, scale: float) -> None:
    """A declared mask that the two-token query contradicts: a ModelMismatch naming what was seen."""
    rel, thr = moved / max(scale, 1e-300), tol / max(scale, 1e-300)
    if declared:
        raise ModelMismatch(
            f"the target was declared causal (--causal), but position 1 of the two-token query [x1, x2] answers "
            f"differently from [x1] alone (largest difference {moved:.3g}, {rel:.3g} of the answers' rms; tolerance "
            f"{tol:.3g}): x1's answer attends to the later token x2, so the box is not causal; leave --causal out "
            "(with answers at every position the mask is detected)", check="causal", figure=rel, threshold=thr)
    raise ModelMismatch(
        f"the target was declared bidirectional (causal=False), but position 1 of the two-token query [x1, x2] "
        f"answers exactly as [x1] alone (difference {moved:.3g} <= tolerance {tol:.3g}) while position 2 depends "
        "on x1: the layer is causal", check="causal", figure=rel, threshold=thr)
