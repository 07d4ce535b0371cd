"""Frozen results of a multi-head extraction, and how recovered heads are matched to the true ones.

Multi-head attention is identifiable at best up to a permutation of the heads and, by Proposition 7.1,
only in *canonical form*: heads with equal (W_h, c_h) merged (their v_h summed) and heads with v_h = 0
dropped (see :mod:`headthief.extraction.multihead.canonical`). Errors are therefore computed after
putting the truth in canonical form and matching each recovered head to a true one with
:func:`scipy.optimize.linear_sum_assignment` on a distance between heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ...models.multihead import MultiHeadAttention
from ...oracles.base import Oracle
from ..result import Fidelity, fidelity, freeze_fields, rel_err


@dataclass(frozen=True, eq=False)
class MultiHeadExtraction:
    """What a multi-head extraction recovered (in canonical form) and what it cost.

    Attributes:
        method: the algorithm's name.
        W: recovered score matrices, (H, d, d) float64.
        V: recovered value-readout vectors, (H, d).
        C: recovered score biases (H, d), or None when the method assumed no biases.
        beta: recovered output bias, or None.
        queries: oracle queries the extraction spent (checks and verification not included).
        seconds: wall time of the extraction.
        diagnostics: method-specific figures.
        canonical: True when the result is in canonical form (always, for headthief's methods).
    """

    method: str
    W: np.ndarray
    V: np.ndarray
    C: np.ndarray | None
    beta: float | None
    queries: int
    seconds: float
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    canonical: bool = True
    v_scale_known: bool = True
    check: Any = None

    def __post_init__(self):
        freeze_fields(self, ("W", "V", "C"))
        if self.W.ndim != 3 or self.V.ndim != 2 or self.W.shape[:2] != self.V.shape:
            raise ValueError(f"W must be (H, d, d) and V (H, d); got {self.W.shape}, {self.V.shape}")

    @property
    def d(self) -> int:
        return int(self.V.shape[1])

    @property
    def heads(self) -> int:
        return int(self.V.shape[0])

    @property
    def ranks(self) -> list[int]:
        return [int(np.linalg.matrix_rank(self.W[h], tol=1e-9 * max(np.abs(self.W[h]).max(), 1e-300)))
                for h in range(self.heads)]

    @property
    def rank(self) -> int:
        """The largest head rank (reported where a single number is expected)."""
        return max(self.ranks) if self.heads else 0

    def model(self) -> MultiHeadAttention:
        """The recovered layer as a model that can be evaluated."""
        return MultiHeadAttention(V=self.V, W=self.W, C=self.C, beta=self.beta)

    def predict(self, batch) -> np.ndarray:
        """The recovered layer's outputs on a batch of sequences."""
        return self.model().evaluate(batch)

    def verify(self, oracle: Oracle, n: int = 256, *, rng: np.random.Generator | int = 0,
               max_len: int = 32) -> Fidelity:
        """Compare with ``oracle`` on ``n`` fresh random sequences (as :meth:`Extraction.verify`)."""
        return fidelity(self, oracle, n, rng=rng, max_len=max_len)

    def errors(self, truth: MultiHeadAttention) -> dict[str, Any]:
        """Errors against a known layer, after canonical form and matching (worst head and per head).

        ``W_rel_err``, ``v_rel_err``, ``c_rel_err`` are the worst matched head's relative errors;
        ``per_head`` lists each true head's errors and the recovered head matched to it;
        ``heads_true`` / ``heads_found`` count heads in canonical form (a missing or spurious head
        makes every worst-head error 1.0 or more).
        """
        from .canonical import canonical_form
        t = canonical_form(truth)
        Wt, Vt = t.dense_W(), t.V.astype(np.float64)
        Ct = t.C.astype(np.float64) if t.C is not None else None
        rows, cols = match_heads(self.W, self.V, Wt, Vt)
        per_head = []
        for i, j in zip(rows, cols):
            e = {"true_head": int(j), "found_head": int(i), "W_rel_err": rel_err(self.W[i], Wt[j]),
                 "v_rel_err": rel_err(self.V[i], Vt[j])}
            if Ct is not None and self.C is not None:
                e["c_rel_err"] = rel_err(self.C[i], Ct[j])
            per_head.append(e)
        complete = len(rows) == t.heads == self.heads

        def worst(key):
            vals = [e[key] for e in per_head if key in e]
            if not vals:
                return None
            return max(vals) if complete else max(max(vals), 1.0)

        out: dict[str, Any] = {"W_rel_err": worst("W_rel_err"), "v_rel_err": worst("v_rel_err"),
                               "c_rel_err": worst("c_rel_err") if Ct is not None and self.C is not None else None}
        if self.beta is not None and t.beta is not None:
            out["beta_abs_err"] = abs(self.beta - float(t.beta))
        else:
            out["beta_abs_err"] = None
        out["heads_true"] = t.heads
        out["heads_found"] = self.heads
        out["per_head"] = per_head
        return out

    def save(self, path) -> None:
        """Write the stacked W (H, d, d), V (H, d) (and C, beta when present) with ``numpy.savez``."""
        arrays = {"W": self.W, "V": self.V}
        if self.C is not None:
            arrays["C"] = self.C
        if self.beta is not None:
            arrays["beta"] = np.float64(self.beta)
        np.savez(path, **arrays)


def head_distance(W1: np.ndarray, v1: np.ndarray, W2: np.ndarray, v2: np.ndarray) -> np.ndarray:
    """Pairwise distances between two sets of heads: ``rel(W) + rel(v)`` for every (i, j), (H1, H2)."""
    W1, W2 = np.asarray(W1, np.float64), np.asarray(W2, np.float64)
    v1, v2 = np.asarray(v1, np.float64), np.asarray(v2, np.float64)
    dW = np.linalg.norm((W1[:, None] - W2[None]).reshape(len(W1), len(W2), -1), axis=2)
    dv = np.linalg.norm(v1[:, None] - v2[None], axis=2)
    nW = np.maximum(np.linalg.norm(W2.reshape(len(W2), -1), axis=1), 1e-300)
    nv = np.maximum(np.linalg.norm(v2, axis=1), 1e-300)
    return dW / nW[None] + dv / nv[None]


def match_heads(W_found, V_found, W_true, V_true) -> tuple[np.ndarray, np.ndarray]:
    """Match found heads to true heads (min total :func:`head_distance`); returns (found, true) indices."""
    from scipy.optimize import linear_sum_assignment
    if len(V_found) == 0 or len(V_true) == 0:
        return np.zeros(0, int), np.zeros(0, int)
    return linear_sum_assignment(head_distance(W_found, V_found, W_true, V_true))
