"""Canonical form of a multi-head layer, and Proposition 7.1's equivalent parameter sets.

Proposition 7.1 (paper, Section 7): a multi-head layer is not identified by its function. Heads that
share their score parameters ``(W_h, c_h)`` have the same attention weights, so only the *sum* of their
value vectors matters:

    sum_{h in G} alpha(X, W_G)^T (X v_h) = alpha(X, W_G)^T (X sum_{h in G} v_h),

and a head with ``v_h = 0`` contributes nothing whatever its ``W_h`` is. :func:`canonical_form` removes
both freedoms (merge equal-score heads, summing their ``v_h``; drop heads with ``v_h = 0``), which is
what any extraction can hope to recover (up to the order of the heads).
:func:`equivalent_parameters` goes the other way: it builds a *different* parameter set computing the
same function, by redistributing each group's summed ``v`` among copies of its head (the paper's proof
splits ``b`` as ``lambda_h b`` over identical heads).
"""

from __future__ import annotations

import numpy as np

from ...errors import ConvergenceError
from ...models.multihead import MultiHeadAttention


def _score_groups(model: MultiHeadAttention, tol: float) -> list[list[int]]:
    """Heads grouped by equal (W_h, c_h), relative to the larger of the two norms (first-seen order)."""
    W = model.dense_W()
    C = model.C.astype(np.float64) if model.C is not None else np.zeros((model.heads, model.d))
    groups: list[list[int]] = []
    for h in range(model.heads):
        for g in groups:
            r = g[0]
            sW = max(np.linalg.norm(W[h]), np.linalg.norm(W[r]))
            sC = max(np.linalg.norm(C[h]), np.linalg.norm(C[r]))
            if (np.linalg.norm(W[h] - W[r]) <= tol * sW and np.linalg.norm(C[h] - C[r]) <= tol * sC):
                g.append(h)
                break
        else:
            groups.append([h])
    return groups


def _subset(model: MultiHeadAttention, heads: list[int], V: np.ndarray) -> MultiHeadAttention:
    """The heads ``heads`` of ``model`` (score parameters as stored) with value vectors ``V``."""
    idx = np.asarray(heads, dtype=int)
    kw: dict = {}
    if model.W is not None:
        kw["W"] = model.W[idx]
    else:
        kw["left"], kw["right"] = model.left[idx], model.right[idx]
    return MultiHeadAttention(V=V, C=None if model.C is None else model.C[idx], beta=model.beta,
                              dtype=model.dtype, **kw)


def canonical_form(model: MultiHeadAttention, *, tol: float = 1e-9) -> MultiHeadAttention:
    """The layer with equal-score heads merged and silent heads dropped (Proposition 7.1).

    Heads ``g, h`` are merged when ``||W_g - W_h||_F <= tol * max(||W_g||_F, ||W_h||_F)`` and the same
    holds for ``c`` (their ``v`` are summed; the first head's ``W``, ``c`` are kept). Then heads whose
    summed ``||v_h||`` is at most ``tol`` times the largest are dropped. Heads are ordered by
    decreasing ``||W_h||_F`` (ties: decreasing ``||v_h||``), a convention only: errors are computed after
    matching (:func:`~headthief.extraction.multihead.result.match_heads`).

    Storage follows the input: factored ``W_h = L_h R_h^T`` stays factored, the dtype and ``beta`` are
    kept (``v`` sums are formed in float64, then cast). A layer whose every head is silent is the
    constant ``beta``; it is returned as one head with ``W = 0``, ``v = 0`` (``MultiHeadAttention``
    needs at least one head).

    Args:
        model: the layer.
        tol: relative tolerance of "equal" and "zero".

    Returns:
        A new :class:`MultiHeadAttention` computing the same function.
    """
    if not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    groups = _score_groups(model, tol)
    V = model.V.astype(np.float64)
    reps = [g[0] for g in groups]
    Vg = np.stack([V[g].sum(axis=0) for g in groups])
    norms = np.linalg.norm(Vg, axis=1)
    keep = [i for i in range(len(groups)) if norms[i] > tol * norms.max()] if norms.max() > 0 else []
    if not keep:
        d = model.d
        zero = {"W": np.zeros((1, d, d))} if model.W is not None else {
            "left": np.zeros((1, d, model.left.shape[2])), "right": np.zeros((1, d, model.left.shape[2]))}
        return MultiHeadAttention(V=np.zeros((1, d)), C=None if model.C is None else np.zeros((1, d)),
                                  beta=model.beta, dtype=model.dtype, **zero)
    Wn = np.linalg.norm(model.dense_W()[[reps[i] for i in keep]].reshape(len(keep), -1), axis=1)
    order = sorted(range(len(keep)), key=lambda k: (-Wn[k], -norms[keep[k]]))
    keep = [keep[k] for k in order]
    return _subset(model, [reps[i] for i in keep], Vg[keep])


def parameter_gap(a: MultiHeadAttention, b: MultiHeadAttention) -> float:
    """How far apart two parameter sets are, head by head.

    The smallest, over every head ``i`` of ``a`` and every head ``j`` of ``b`` with ``v_j != 0``, of
    ``max(||W_i - W_j|| / ||W_j||, ||v_i - v_j|| / ||v_j||)``: 0.5 means that no head of ``a`` is within
    50% of a head of ``b`` in both ``W`` and ``v``.
    """
    Wa, Wb = a.dense_W(), b.dense_W()
    Va, Vb = a.V.astype(np.float64), b.V.astype(np.float64)
    nW = np.maximum(np.linalg.norm(Wb.reshape(len(Wb), -1), axis=1), 1e-300)
    nV = np.linalg.norm(Vb, axis=1)
    gap = np.inf
    for j in range(b.heads):
        if nV[j] == 0:
            continue
        dW = np.linalg.norm((Wa - Wb[j]).reshape(a.heads, -1), axis=1) / nW[j]
        dV = np.linalg.norm(Va - Vb[j], axis=1) / nV[j]
        gap = min(gap, float(np.min(np.maximum(dW, dV))))
    return gap


def equivalent_parameters(model: MultiHeadAttention, *, rng: np.random.Generator | int = 0,
                          gap: float = 0.5, tol: float = 1e-9, max_tries: int = 1000) -> MultiHeadAttention:
    """A different parameter set that computes the same function (Proposition 7.1).

    Each group of equal-score heads (see :func:`canonical_form`) with summed value vector ``b`` is
    replaced by ``k`` copies of its score parameters with value vectors ``lambda_i b``, ``lambda`` a
    random point of the simplex (Dirichlet(1, ..., 1)); ``k`` starts at the group's size (so the
    paper's family of identical heads keeps its head count), at 3 for a lone head (two halves of a lone
    head could only be exactly ``b / 2``), and grows by one after every 100 rejected draws. A group's draw is kept when
    :func:`parameter_gap` ``(its new heads, model) >= gap``: no new head is within
    ``gap`` (relative) of an original head in both ``W`` and ``v``. Heads with ``v = 0`` are dropped.

    Args:
        model: the layer.
        rng: seed or generator for the weights.
        gap: the required parameter gap (0.5: every head differs by at least 50%).
        tol: tolerance of "equal score parameters".
        max_tries: bound on the draws for one group.

    Returns:
        A :class:`MultiHeadAttention` with the same function (up to rounding) and parameters at least
        ``gap`` away from ``model``'s.

    Raises:
        ConvergenceError: no draw met the gap within ``max_tries``.
    """
    rng = np.random.default_rng(rng)
    groups = _score_groups(model, tol)
    V = model.V.astype(np.float64)
    sums = [V[g].sum(axis=0) for g in groups]
    live = [i for i, b in enumerate(sums) if np.linalg.norm(b) > 0]
    if not live:
        raise ValueError("every head has v = 0: the layer is the constant beta, nothing to redistribute")
    heads: list[int] = []
    vs: list[np.ndarray] = []
    for i in live:
        k = len(groups[i]) if len(groups[i]) >= 2 else 3
        for attempt in range(max_tries):
            if attempt and attempt % 100 == 0:
                k += 1
            lam = rng.dirichlet(np.ones(k))
            part = [lam_k * sums[i] for lam_k in lam]
            if parameter_gap(_subset(model, [groups[i][0]] * k, np.stack(part)), model) >= gap:
                break
        else:
            raise ConvergenceError(f"no redistribution of head group {groups[i]}'s v met the parameter gap "
                                   f"{gap} in {max_tries} draws")
        heads += [groups[i][0]] * k
        vs += part
    return _subset(model, heads, np.stack(vs))
