"""What the server does to queries and answers besides computing them: a provider's defences.

A :class:`Defence` is a frozen set of settings, server-wide (``headthief serve`` options) or per key
(``headthief keys add --defence "noise=1e-4,mode=uniform"``, laid over the server's). It reuses the
threat-model wrappers of :mod:`headthief.oracles`:

- ``noise=TAU[,mode=adversarial|uniform]`` or ``mode=round:K``: answers within ``+-TAU`` of the truth
  (:class:`~headthief.oracles.Tolerance`, keyed with the server's secret, so a client cannot predict
  the noise, and deterministic per query, so asking again does not average it away);
  a vector target's answers get it per coordinate: every number of every answered vector is within
  ``+-TAU`` (or rounded to K decimals), its noise keyed by the query, so ``noisy:TAU`` and
  ``rounded:K`` mean the same for vectors as for values;
- ``sign=1``: only whether the answer is positive (:class:`~headthief.oracles.SignOnly`); one bit of
  one number per sequence, so a vector target refuses it (``serve`` exits 2 at start; a key with it
  is answered 403 ``defence_unsupported``);
- ``norm=R``: tokens with ``||x|| > R`` are refused (422);
- ``max_batch=N``, ``max_len=N``: the most sequences per request and tokens per sequence (422 beyond);
  the server lowers them where a full batch would not fit its byte limit
  (:func:`headthief.server.app.fit_limits`);
- ``prada=flag|refuse[,prada_delta=W][,prada_min=N]``: the query-distribution detector below.

PRADA (Juuti, Szyller, Marchal, Asokan, "PRADA: Protecting against DNN Model Stealing Attacks",
EuroS&P 2019): benign queries are drawn from a natural distribution, so the minimum distance of each new
query to the client's earlier ones is roughly normally distributed; an attacker's synthetic probes
(basis vectors, small perturbations of earlier queries) give a distribution far from normal. Per client
the detector keeps a growing set G of earlier queries (one per sequence length, a query joins G when its
minimum distance exceeds the running mean minus one standard deviation, as in the paper) and the list D
of minimum distances; once D has ``prada_min`` entries it computes the Shapiro-Wilk statistic W of D
(:func:`scipy.stats.shapiro`) and flags the client when ``W < prada_delta``. ``flag`` records the query
count at which that happened (``keys list`` shows it) and keeps answering; ``refuse`` answers 403 from
then on. Bounded: G keeps at most ``G_MAX`` queries per length and D the last ``D_MAX`` distances.
The server stores what each request adds to G and D in the transaction that charges it
(:meth:`Accounts.charge`), and a restarted server restores them (:meth:`Prada.restore`): a restart does
not reset the detector.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from ..errors import SpecError
from ..oracles.answers import Output

G_MAX = 2048     # queries kept per client and sequence length
D_MAX = 5000     # minimum distances kept per client (scipy's Shapiro-Wilk is accurate up to 5000)


@dataclass(frozen=True)
class Defence:
    """The defences applied to one key's queries (see the module docstring for each setting)."""

    noise: float | None = None
    mode: str | None = None
    sign: bool = False
    norm: float | None = None
    max_batch: int = 4096
    max_len: int = 4096
    prada: str = "off"
    prada_delta: float = 0.9
    prada_min: int = 100

    def __post_init__(self):
        from ..oracles.tolerance import parse_mode
        if self.mode is not None:
            try:
                kind, _ = parse_mode(self.mode)
            except ValueError as e:
                raise SpecError(str(e)) from None
            if kind != "round" and self.noise is None:
                raise SpecError(f"noise mode {self.mode} needs noise=TAU")
        if self.noise is not None and not (np.isfinite(self.noise) and self.noise >= 0):
            raise SpecError(f"noise={self.noise} must be a number >= 0")
        if self.norm is not None and not (np.isfinite(self.norm) and self.norm > 0):
            raise SpecError(f"norm={self.norm} must be a positive number")
        if self.max_batch < 1 or self.max_len < 1:
            raise SpecError("max_batch and max_len must be >= 1")
        if self.prada not in ("off", "flag", "refuse"):
            raise SpecError(f"prada={self.prada!r}: use off, flag or refuse")
        if not 0 < self.prada_delta < 1:
            raise SpecError(f"prada_delta={self.prada_delta} must be in (0, 1)")
        if self.prada_min < 3:
            raise SpecError(f"prada_min={self.prada_min} must be >= 3 (Shapiro-Wilk needs 3 points)")

    def output(self) -> str:
        """What the answers are, as ``/v1/info`` publishes it."""
        base = "value"
        if self.mode is not None and self.mode.startswith("round:"):
            base = f"rounded:{self.mode[6:]}"
        elif self.noise is not None:
            base = f"noisy:{self.noise:g}"
        return "sign" if self.sign else base

    def settings(self) -> dict[str, Any]:
        """The settings that differ from the defaults (what ``keys list`` shows)."""
        default = Defence()
        return {k: v for k, v in asdict(self).items() if v != getattr(default, k)}

    def wrap(self, oracle, secret: bytes):
        """The oracle that answers under these defences (innermost: ``oracle``)."""
        from ..oracles.sign_only import SignOnly
        from ..oracles.tolerance import Tolerance
        if self.mode is not None or self.noise is not None:
            cls = _unpacked(Tolerance) if oracle.output is Output.ALL else Tolerance
            oracle = cls(oracle, self.noise if self.mode is None or not self.mode.startswith("round:") else None,
                         self.mode or "adversarial", key=secret)
        if self.sign:
            oracle = SignOnly(oracle)
        return oracle


def _unpacked(cls):
    """``cls`` (a :class:`~headthief.oracles.base.WrappedOracle`) whose ``_query`` hands its answers back
    unpacked for an ``all`` oracle. A wrapper's ``_transform`` gives the packed (sum N_i, d_out) rows, but
    :meth:`Oracle._query` must answer unpacked ((n, N, d_out) or a list of (N_i, d_out) arrays), which
    ``Oracle._check_vectors`` packs again. A 2-D array is never an unpacked ``all`` answer, so this
    only unpacks what is packed."""

    class Unpacked(cls):
        def _query(self, X):
            from ..oracles.answers import unpack
            y = super()._query(X)
            return unpack(self.output, y, X) if isinstance(y, np.ndarray) and y.ndim == 2 else y

    Unpacked.__name__, Unpacked.__qualname__ = cls.__name__, cls.__qualname__
    return Unpacked


_FIELDS = {"noise": float, "mode": str, "sign": bool, "norm": float, "max_batch": int, "max_len": int,
           "prada": str, "prada_delta": float, "prada_min": int}


def parse_defence(text: str | dict | None, base: Defence | None = None) -> Defence:
    """``"noise=1e-4,mode=uniform"`` (or a dict of the same) laid over ``base``. Raises SpecError."""
    base = base or Defence()
    if not text:
        return base
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in str(text).split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise SpecError(f"defence setting {part!r} is not key=value (known: {', '.join(_FIELDS)})")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    kw: dict[str, Any] = {}
    for k, v in items:
        if k not in _FIELDS:
            raise SpecError(f"unknown defence setting {k!r} (known: {', '.join(_FIELDS)})")
        typ = _FIELDS[k]
        try:
            if typ is bool:
                kw[k] = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
            else:
                kw[k] = typ(v)
        except (TypeError, ValueError):
            raise SpecError(f"defence setting {k}={v!r} is not a {typ.__name__}") from None
    return replace(base, **kw)


class Prada:
    """The PRADA detector's state for one client (see the module docstring). Thread-safe."""

    def __init__(self, delta: float = 0.9, min_queries: int = 100):
        self.delta = float(delta)
        self.min_queries = int(min_queries)
        self._G: dict[tuple[int, ...], np.ndarray] = {}
        self._D: list[float] = []
        self._lock = threading.Lock()
        self.seen = 0
        self.base = 0          # queries the client had paid before this detector saw any
        self.flagged_at: int | None = None
        self.last_W: float | None = None

    def __repr__(self) -> str:
        return f"Prada(delta={self.delta}, min_queries={self.min_queries}, seen={self.seen}, flagged_at={self.flagged_at})"

    def restore(self, points, distances) -> None:
        """Take back a stored state: ``points`` (sequence length N, float64 bytes of an N*d query) in the
        order they joined G, and the last distances of D, oldest first."""
        rows: dict[tuple[int, ...], list[np.ndarray]] = {}
        for _, blob in points:
            x = np.frombuffer(blob, dtype="<f8")
            rows.setdefault((x.shape[0],), []).append(x)
        with self._lock:
            for key, xs in rows.items():        # one stack per length (not one per point)
                G = self._G.get(key)
                new = np.stack(xs[:G_MAX]).astype(np.float64)
                self._G[key] = (new if G is None else np.vstack([G, new]))[:G_MAX]
            self._D = [float(v) for v in distances][-D_MAX:]

    def observe(self, X, added: dict | None = None) -> int | None:
        """Take in a batch of queries; return the (1-based) query count at which the client was first
        flagged, or None if it has not been. ``added`` (a dict) receives what this batch added to the
        state, to be stored: ``points`` [(N, bytes)] and ``distances`` [float]."""
        if added is not None:
            added.setdefault("points", [])
            added.setdefault("distances", [])
        from scipy.stats import shapiro
        seqs = list(X) if isinstance(X, np.ndarray) else X
        with self._lock:
            for x in seqs:
                x = np.asarray(x, dtype=np.float64).ravel()
                key = (x.shape[0],)
                G = self._G.get(key)
                self.seen += 1
                if G is None or G.shape[0] == 0:
                    self._G[key] = x[None, :]
                    if added is not None:
                        added["points"].append((len(x), x.astype("<f8").tobytes()))
                    continue
                dmin = float(np.sqrt(max(0.0, float(np.min(np.sum((G - x) ** 2, axis=1))))))
                self._D.append(dmin)
                if added is not None:
                    added["distances"].append(dmin)
                if len(self._D) > D_MAX:
                    del self._D[: len(self._D) - D_MAX]
                D = np.asarray(self._D)
                threshold = float(D.mean() - D.std()) if D.size > 1 else 0.0
                if dmin > threshold and G.shape[0] < G_MAX:
                    self._G[key] = np.vstack([G, x[None, :]])
                    if added is not None:
                        added["points"].append((len(x), x.astype("<f8").tobytes()))
                if self.flagged_at is None and D.size >= self.min_queries and D.size % 10 == 0:
                    if np.ptp(D) == 0:
                        W = 0.0          # every distance equal: as far from normal as it gets
                    else:
                        W = float(shapiro(D).statistic)
                    self.last_W = W
                    if W < self.delta:
                        self.flagged_at = self.seen
            return self.flagged_at
