"""The approximate value oracle of Section 6: every answer within +-tau of the truth, deterministic.

    AVQ(X; tau) in [f(X) - tau, f(X) + tau],   the same X always gets the same answer,

so asking a query again does not average the noise away. :class:`Tolerance` wraps any oracle (a model,
a user's callable, a real head) and perturbs its answers in one of three ways:

- ``"adversarial"``: ``f(X) +- tau`` exactly; the sign is a keyed hash of the query's bytes.
- ``"uniform"``: ``f(X) + tau * u`` with ``u`` in [-1, 1] a keyed hash of the query's bytes.
- ``"round:K"``: ``f(X)`` rounded to K decimals (a real API's rounding), so ``tau = 0.5 * 10**-K``. The
  error is not symmetric noise: it is a deterministic function of the true value (answers to queries
  with nearly equal values share their error, and a value that moves by less than the rounding step may
  not move the answer at all).

The hash covers the sequence's shape and its float64 bytes (with ``-0.0`` read as ``0.0``) and the key,
one sequence at a time, so an answer does not depend on how the queries were batched.

Composition: ``Tolerance(ModelOracle(head, input_norm=1.0), tau=1e-4)``; the wrapper inherits the inner
oracle's input-norm bound (the bound that keeps additive noise from being made negligible by scaling
the inputs up) and refuses, with :class:`~headthief.errors.InvalidQuery`, a token that breaks it.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .base import Oracle, WrappedOracle

MODES = ("adversarial", "uniform", "round:K")


def parse_mode(mode: str) -> tuple[str, int | None]:
    """Split ``"round:K"`` into ("round", K); other modes give (mode, None). Raises ValueError."""
    if not isinstance(mode, str):
        raise ValueError(f"noise mode must be a string, got {type(mode).__name__}")
    if mode in ("adversarial", "uniform"):
        return mode, None
    if mode.startswith("round:"):
        try:
            K = int(mode[len("round:"):])
        except ValueError:
            raise ValueError(f"noise mode {mode!r}: K in round:K must be an integer") from None
        if not 0 <= K <= 15:
            raise ValueError(f"noise mode {mode!r}: K must be in 0..15 (float64 keeps about 16 digits)")
        return "round", K
    raise ValueError(f"unknown noise mode {mode!r} (use adversarial, uniform or round:K)")


def round_tolerance(K: int) -> float:
    """The tolerance of rounding to K decimals: ``0.5 * 10**-K``."""
    return 0.5 * 10.0 ** (-K)


def _key_bytes(key) -> bytes:
    if isinstance(key, bytes):
        kb = key
    elif isinstance(key, str):
        kb = key.encode()
    elif isinstance(key, (int, np.integer)):
        kb = int(key).to_bytes(16, "little", signed=True)
    else:
        raise TypeError(f"key must be an int, str or bytes, got {type(key).__name__}")
    if len(kb) > 64:
        kb = hashlib.blake2b(kb, digest_size=64).digest()
    return kb


class Tolerance(WrappedOracle):
    """Answers within ``+-tau`` of ``inner``'s, deterministic per query (Section 6's AVQ oracle).

    Args:
        inner: the oracle whose answers are perturbed (any :class:`Oracle`).
        tau: the tolerance; required for ``"adversarial"`` and ``"uniform"``; for ``"round:K"`` it is
            implied (``0.5 * 10**-K``) and, if given, must agree.
        mode: ``"adversarial"``, ``"uniform"`` or ``"round:K"``.
        key: the secret of the keyed hash (int, str or bytes): two keys give two different noise
            patterns, the same key always the same.
        **kw: budget / transcript / input_norm of the wrapper itself (input_norm defaults to inner's).
    """

    def __init__(self, inner: Oracle, tau: float | None = None, mode: str = "adversarial", *,
                 key: int | str | bytes = 0, **kw):
        kind, K = parse_mode(mode)
        if kind == "round":
            implied = round_tolerance(K)
            if tau is not None and not np.isclose(tau, implied, rtol=1e-9, atol=0.0):
                raise ValueError(f"noise mode {mode!r} rounds to {K} decimals, so tau = {implied:g}; "
                                 f"got tau = {tau:g} (leave tau out)")
            tau = implied
        else:
            if tau is None:
                raise ValueError(f"noise mode {mode!r} needs a tolerance tau")
            if not (np.isfinite(tau) and tau >= 0):
                raise ValueError(f"tau must be a finite number >= 0, got {tau}")
        super().__init__(inner, **kw)
        self.tau = float(tau)
        self.mode = mode
        self.kind = kind
        self.K = K
        self._key = _key_bytes(key)

    def _settings(self) -> str:
        return f"tau={self.tau:g}, mode={self.mode!r}, " + super()._settings()

    def noise_units(self, X) -> np.ndarray:
        """The keyed hash of each sequence as a number in [-1, 1) (53 random bits each)."""
        seqs = X if not isinstance(X, np.ndarray) else (X[i] for i in range(X.shape[0]))
        out = []
        for x in seqs:
            x = np.ascontiguousarray(x, dtype=np.float64) + 0.0      # -0.0 -> 0.0
            h = hashlib.blake2b(key=self._key, digest_size=8)
            h.update(np.asarray(x.shape, dtype=np.int64).tobytes())
            h.update(x.tobytes())
            out.append(int.from_bytes(h.digest(), "little") >> 11)
        return np.asarray(out, dtype=np.float64) * 2.0 ** -52 - 1.0

    def noise_units_per_coordinate(self, X, shape) -> np.ndarray:
        """Vector answers: one keyed unit in [-1, 1) per answered number (packed ``shape``), drawn from a
        generator seeded by the sequence's keyed hash, so the same query always gets the same noise."""
        seeds = (self.noise_units(X) + 1.0) * 2.0 ** 52
        lens = np.ones(len(seeds), dtype=np.int64) if self.output.value == "last" else \
            np.array([x.shape[0] for x in (X if not isinstance(X, np.ndarray) else X)], dtype=np.int64)
        parts = [np.random.default_rng(int(s)).uniform(-1.0, 1.0, size=(int(L), shape[1]))
                 for s, L in zip(seeds, lens)]
        return np.concatenate(parts, axis=0) if parts else np.zeros(shape)

    def _transform(self, X, y: np.ndarray) -> np.ndarray:
        if self.kind == "round":
            return np.round(y, self.K)
        u = self.noise_units(X) if y.ndim == 1 else self.noise_units_per_coordinate(X, y.shape)
        if self.kind == "adversarial":
            return y + self.tau * np.where(u >= 0, 1.0, -1.0)
        return y + self.tau * u
