"""Frozen results of an extraction, fidelity checks, and the shared recovery checker."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ..models.attention import AttentionHead
from ..oracles.base import Oracle


@dataclass(frozen=True)
class Fidelity:
    """How closely a recovered head reproduces the oracle on fresh random sequences.

    ``max_rel_err`` is the largest absolute output error divided by the root-mean-square of the true
    outputs. ``queries`` are the verification queries (counted apart from extraction queries).
    """

    n: int
    queries: int
    max_abs_err: float
    rms_true: float
    max_rel_err: float


def freeze_fields(obj, names) -> None:
    """In a frozen result's ``__post_init__``: ``diagnostics`` becomes a read-only mapping and each named
    array (those not None) a read-only float64 copy."""
    object.__setattr__(obj, "diagnostics", MappingProxyType(dict(obj.diagnostics)))
    for name in names:
        a = getattr(obj, name)
        if a is not None:
            a = np.array(a, dtype=np.float64)
            a.setflags(write=False)
            object.__setattr__(obj, name, a)


@dataclass(frozen=True, eq=False)
class Extraction:
    """What an extraction recovered and what it cost.

    Attributes:
        method: the algorithm's name.
        W, v: recovered parameters (W dense (d, d) float64).
        c, beta: recovered biases, or None when the method assumed the paper's unbiased model.
        rank: rank of the recovered W (detected or given).
        queries: oracle queries the extraction spent (verification not included).
        seconds: wall time of the extraction.
        diagnostics: method-specific figures (re-asked probes, oracle calls, conditioning, ...).
        v_scale_known: False when only v's direction is identifiable (sign-only oracles).
        check: the model check's :class:`~headthief.extraction.check.ModelCheck` (None when the method
            was called without it).
    """

    method: str
    W: np.ndarray
    v: np.ndarray
    c: np.ndarray | None
    beta: float | None
    rank: int
    queries: int
    seconds: float
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    v_scale_known: bool = True
    check: Any = None

    def __post_init__(self):
        freeze_fields(self, ("W", "v", "c"))

    @property
    def d(self) -> int:
        return int(self.v.shape[0])

    def head(self) -> AttentionHead:
        """The recovered head as a model that can be evaluated."""
        return AttentionHead(v=self.v, W=self.W, c=self.c, beta=self.beta)

    def predict(self, batch) -> np.ndarray:
        """The recovered head's outputs on a batch of sequences."""
        return self.head().evaluate(batch)

    def verify(self, oracle: Oracle, n: int = 256, *, rng: np.random.Generator | int = 0,
               max_len: int = 32) -> Fidelity:
        """Compare the recovered head with ``oracle`` on ``n`` fresh random sequences.

        Sequences have Gaussian entries and lengths 1..``max_len`` (tokens are rescaled to the oracle's
        input-norm bound, if it has one). Only the queries made here are counted in the result.
        """
        return fidelity(self, oracle, n, rng=rng, max_len=max_len)

    def errors(self, truth: AttentionHead) -> dict[str, float | None]:
        """Parameter errors against a known head: ``X_rel_err = ||X_hat - X|| / ||X||``.

        When only v's direction is identifiable (``v_scale_known`` False) ``v_rel_err`` is None,
        ``v_dir_err`` is reported instead, and beta is compared with ``beta / ||v||``.
        """
        W = truth.dense_W()
        out: dict[str, float | None] = {"W_rel_err": rel_err(self.W, W)}
        v = truth.v.astype(np.float64)
        if self.v_scale_known:
            out["v_rel_err"] = rel_err(self.v, v)
        else:
            out["v_rel_err"] = None
            out["v_dir_err"] = direction_err(self.v, v)
        tc = truth.c.astype(np.float64) if truth.c is not None else None
        out["c_rel_err"] = rel_err(self.c, tc) if (self.c is not None and tc is not None) else None
        if self.beta is not None and truth.beta is not None:
            # sign-only answers identify beta in units of ||v|| only (as they identify v's direction)
            tb = float(truth.beta) if self.v_scale_known else float(truth.beta) / float(np.linalg.norm(v))
            out["beta_abs_err"] = abs(self.beta - tb)
        else:
            out["beta_abs_err"] = None
        return out

    def save(self, path) -> None:
        """Write the recovered W, v (and c, beta when present) with ``numpy.savez``."""
        arrays = {"W": self.W, "v": self.v}
        if self.c is not None:
            arrays["c"] = self.c
        if self.beta is not None:
            arrays["beta"] = np.float64(self.beta)
        np.savez(path, **arrays)


def fidelity(res, oracle: Oracle, n: int, *, rng: np.random.Generator | int = 0, max_len: int = 32) -> Fidelity:
    """Compare ``res.predict`` with ``oracle`` on ``n`` fresh :func:`random_sequences` (the ``verify`` of
    every result type). When only v's direction is identified (``res.v_scale_known`` False) the
    predictions are compared after the best positive rescaling."""
    batch = random_sequences(res.d, n, rng=rng, max_len=max_len, input_norm=oracle.input_norm)
    before = oracle.queries
    y_true = oracle.query(batch)
    spent = oracle.queries - before
    y_hat = res.predict(batch)
    if not res.v_scale_known:
        a = float(y_hat @ y_true) / max(float(y_hat @ y_hat), 1e-300)
        y_hat = y_hat * max(a, 0.0)
    err = np.abs(y_hat - y_true)
    rms = float(np.sqrt(np.mean(y_true ** 2)))
    return Fidelity(n=n, queries=spent, max_abs_err=float(err.max()), rms_true=rms,
                    max_rel_err=float(err.max() / max(rms, 1e-300)))


def random_sequences(d: int, n: int, *, rng: np.random.Generator | int = 0, max_len: int = 32,
                     input_norm: float | None = None) -> list[np.ndarray]:
    """``n`` random sequences: Gaussian entries, lengths 1..``max_len``; with ``input_norm`` every
    sequence is rescaled so that its largest token has norm ``0.999 * input_norm``."""
    rng = np.random.default_rng(rng)
    lengths = rng.integers(1, max_len + 1, size=n)
    batch = [rng.standard_normal((int(L), d)) for L in lengths]
    if input_norm is not None:
        batch = [x * (0.999 * input_norm / max(np.linalg.norm(x, axis=1).max(), 1e-300)) for x in batch]
    return batch


def rel_err(est: np.ndarray, true: np.ndarray) -> float:
    """``||est - true|| / ||true||`` (Frobenius / 2-norm); the absolute error when ``true`` is 0."""
    den = float(np.linalg.norm(true))
    num = float(np.linalg.norm(np.asarray(est, dtype=np.float64) - true))
    return num / den if den > 0 else num


def direction_err(est: np.ndarray, true: np.ndarray) -> float:
    """``|| est/||est|| - true/||true|| ||``: the error of a vector known only up to positive scale."""
    a = np.asarray(est, dtype=np.float64)
    b = np.asarray(true, dtype=np.float64)
    return float(np.linalg.norm(a / np.linalg.norm(a) - b / np.linalg.norm(b)))
