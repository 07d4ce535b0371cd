"""What a one-layer transformer extraction recovered, and the verification that looks at the FFN's kinks.

A recovered transformer is its attention (``W``, and ``c`` with score biases) and an FFN learned from
one-token queries (any result with ``.model``, a callable on (n, d) points with the neuron parameters
``A`` (d, m), ``w`` (m,), ``b1``, ``b2`` and ``linear``; :mod:`headthief.extraction.transformer.ffn`
returns one). With one head the recovered function is ``TF(X) = g(alpha(X, W)^T X)``: the FFN ``g``
applied to the attended token, whatever (equivalent) parametrisation of ``g`` the learner returned.

:func:`kink_sequences` builds sequences whose attended token lands just beside each recovered neuron's
hyperplane ``a_i^T z + b1_i = 0`` (where an extraction that got a neuron slightly wrong, or missed a
rarely active one, shows it most); :func:`verify_transformer` compares there and on random sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ...errors import ConvergenceError, NotIdentifiable
from ...models.attention import evaluate_by_length
from ...models.multihead import MultiHeadAttention
from ...models.transformer import Transformer
from ...oracles.base import Oracle
from ..result import Fidelity, fidelity, freeze_fields, rel_err


def ffn_parts(ffn) -> dict:
    """The neuron parameters of a learned FFN (``A`` (d, m), ``w``, ``b1``, ``b2``, ``linear``) as float64."""
    model = getattr(ffn, "model", ffn)
    A = np.asarray(model.A, dtype=np.float64)
    m = A.shape[1]
    b1 = getattr(model, "b1", None)
    lin = getattr(model, "linear", None)
    b2 = getattr(model, "b2", None)
    return {"A": A, "w": np.asarray(model.w, dtype=np.float64).reshape(m),
            "b1": np.zeros(m) if b1 is None else np.asarray(b1, dtype=np.float64).reshape(m),
            "b2": 0.0 if b2 is None else float(b2),
            "linear": None if lin is None else np.asarray(lin, dtype=np.float64).reshape(-1)}


def attended(W: np.ndarray, c: np.ndarray | None, X: np.ndarray) -> np.ndarray:
    """One head's attended tokens ``alpha(X)^T X`` for an (n, N, d) batch: (n, d) float64."""
    X = np.asarray(X, dtype=np.float64)
    s = np.einsum("nkd,nd->nk", X, X[:, -1, :] @ W.T)
    if c is not None:
        s = s + X @ c
    s -= s.max(axis=1, keepdims=True)
    a = np.exp(s)
    a /= a.sum(axis=1, keepdims=True)
    return np.einsum("nk,nkd->nd", a, X)


@dataclass(frozen=True, eq=False)
class TransformerExtraction:
    """A recovered one-layer transformer and what it cost, per part.

    Attributes:
        method: the algorithm's name.
        W: recovered score matrix (d, d); (H, d, d) with several heads.
        v: the antisymmetric readout ``A w_o`` (d,) or (H, d) where the method read it (the paper's
            reduction), else None.
        c: recovered score bias (d,) where the method allowed one, else None.
        ffn: the FFN learner's result (None when no FFN was learned: several heads, see ``predicts``).
        queries: value queries the extraction spent (checks and verification not included), the sum of
            ``attention_queries`` and ``ffn_queries``.
        attention_queries, ffn_queries: the two parts' value queries.
        seconds: wall time.
        predicts: ``"transformer"`` (``predict`` is the whole model) or ``"antisymmetric"`` (several
            heads: ``predict`` is ``TF(X) - TF(-X)``, the attention layer with ``v_h = A_h w_o``; the split
            of the FFN's first layer into per-head maps is not recovered).
        diagnostics: method-specific figures.
    """

    method: str
    W: np.ndarray
    v: np.ndarray | None
    c: np.ndarray | None
    ffn: Any
    queries: int
    attention_queries: int
    ffn_queries: int
    seconds: float
    predicts: str = "transformer"
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    v_scale_known: bool = True
    check: Any = None

    def __post_init__(self):
        freeze_fields(self, ("W", "v", "c"))

    @property
    def d(self) -> int:
        return int(self.W.shape[-1])

    @property
    def heads(self) -> int:
        return 1 if self.W.ndim == 2 else int(self.W.shape[0])

    @property
    def rank(self) -> int:
        Ws = [self.W] if self.W.ndim == 2 else list(self.W)
        return max(int(np.linalg.matrix_rank(w, tol=1e-9 * max(np.abs(w).max(), 1e-300))) for w in Ws)

    @property
    def kinks(self) -> int:
        """Neurons of the recovered FFN (its kink hyperplanes)."""
        return 0 if self.ffn is None else int(ffn_parts(self.ffn)["A"].shape[1])

    def model(self) -> Transformer | MultiHeadAttention:
        """The recovered model: a :class:`Transformer` (one head), or the antisymmetric attention layer."""
        if self.predicts == "antisymmetric":
            return MultiHeadAttention(V=np.atleast_2d(self.v), W=self.W.reshape(-1, self.d, self.d))
        p = ffn_parts(self.ffn)
        return Transformer(W=self.W, A=p["A"], w_o=p["w"], b1=p["b1"], b2=p["b2"], C=self.c, lin=p["linear"])

    def predict(self, batch) -> np.ndarray:
        """The recovered model's outputs (``TF(X) - TF(-X)`` when ``predicts == "antisymmetric"``)."""
        if self.predicts == "antisymmetric":
            return self.model().evaluate(batch)
        g = getattr(self.ffn, "model", self.ffn)
        return evaluate_by_length(lambda X: np.asarray(g(attended(self.W, self.c, X)), dtype=np.float64), batch)

    def verify(self, oracle: Oracle, n: int = 256, *, rng: np.random.Generator | int = 0,
               max_len: int = 32) -> Fidelity:
        """Compare with ``oracle`` on ``n`` fresh random sequences (as :meth:`Extraction.verify`)."""
        if self.predicts == "antisymmetric":
            from ...oracles.antisymmetric import AntiSymmetric
            oracle = AntiSymmetric(oracle)
        return fidelity(self, oracle, n, rng=rng, max_len=max_len)

    def errors(self, truth: Transformer) -> dict[str, Any]:
        """Errors against a known transformer: W (worst head after matching, with several heads), v and c."""
        out: dict[str, Any] = {"W_rel_err": None, "v_rel_err": None, "c_rel_err": None, "beta_abs_err": None}
        if not isinstance(truth, Transformer):
            return out
        Vt = truth.values()
        if truth.heads == 1 and self.heads == 1:
            out["W_rel_err"] = rel_err(self.W, truth.dense_W())
            if self.v is not None:
                out["v_rel_err"] = rel_err(self.v, Vt[0])
            if self.c is not None:
                tc = np.zeros(self.d) if truth.C is None else truth.C[0].astype(np.float64)
                out["c_rel_err" if truth.C is not None and np.any(tc) else "c_abs_err"] = (
                    rel_err(self.c, tc))
            return out
        from ..multihead.result import match_heads
        Wt = truth.W.astype(np.float64)
        Wf = self.W.reshape(-1, self.d, self.d)
        Vf = np.atleast_2d(self.v) if self.v is not None else np.zeros((len(Wf), self.d))
        rows, cols = match_heads(Wf, Vf, Wt, Vt)
        per = [{"true_head": int(j), "found_head": int(i), "W_rel_err": rel_err(Wf[i], Wt[j]),
                "v_rel_err": rel_err(Vf[i], Vt[j])} for i, j in zip(rows, cols)]
        complete = len(rows) == truth.heads == len(Wf)
        out["W_rel_err"] = max(e["W_rel_err"] for e in per) if complete else 1.0
        out["v_rel_err"] = max(e["v_rel_err"] for e in per) if complete else 1.0
        out["heads_true"], out["heads_found"], out["per_head"] = truth.heads, len(Wf), per
        return out

    def save(self, path) -> None:
        """Write W (and v, c) and the FFN's A, w, b1, b2, linear with ``numpy.savez``."""
        arrays: dict[str, Any] = {"W": self.W}
        for k in ("v", "c"):
            if getattr(self, k) is not None:
                arrays[k] = getattr(self, k)
        if self.ffn is not None:
            p = ffn_parts(self.ffn)
            arrays.update({"A": p["A"], "w_o": p["w"], "b1": p["b1"], "b2": np.float64(p["b2"])})
            if p["linear"] is not None:
                arrays["linear"] = p["linear"]
        np.savez(path, **arrays)


# ---------------------------------------------------------------------------------------------------
# verification next to the kinks


def kink_sequences(res: TransformerExtraction, *, per_kink: int = 2, offset: float = 1e-6, max_len: int = 8,
                   rng: np.random.Generator | int = 0) -> list[np.ndarray]:
    """Sequences whose attended token (under the recovered attention) lies just beside each recovered kink.

    For every neuron i of the recovered FFN and each of ``per_kink`` random base sequences X, the whole
    sequence is shifted along ``a_i`` (``X + t 1 a_i^T``) and ``t`` bisected (on the recovered model, no
    queries) until the attended token ``z`` meets ``a_i^T z + b1_i = 0``; the two sequences at
    ``a_i^T z + b1_i = +-offset * ||a_i|| * scale`` are returned (2 per base, ``2 m per_kink`` in all).
    """
    if res.predicts != "transformer" or res.ffn is None:
        raise NotIdentifiable("kink sequences need a recovered FFN (one head)")
    rng = np.random.default_rng(rng)
    p = ffn_parts(res.ffn)
    A, b1 = p["A"], p["b1"]
    d = res.d
    out: list[np.ndarray] = []
    for i in range(A.shape[1]):
        a = A[:, i]
        na = float(np.linalg.norm(a))
        if na == 0:
            continue
        u = a / na
        for _ in range(per_kink):
            N = int(rng.integers(2, max_len + 1))
            X = rng.standard_normal((N, d))

            def h(t):
                Z = attended(res.W, res.c, (X + t * u)[None])[0]
                return float(Z @ u + b1[i] / na)

            lo, hi = -1.0, 1.0
            for _ in range(200):                       # bracket: h grows like t for large |t|
                if h(lo) < 0 < h(hi):
                    break
                lo, hi = 2 * lo, 2 * hi
            else:
                raise ConvergenceError(f"no bracket of neuron {i}'s kink along its normal")
            for _ in range(200):                       # bisection to float64 resolution
                mid = 0.5 * (lo + hi)
                if mid in (lo, hi):
                    break
                if h(mid) < 0:
                    lo = mid
                else:
                    hi = mid
            scale = max(1.0, float(np.abs(X).max()))
            for sgn in (-1.0, 1.0):
                t = lo + sgn * offset * scale
                out.append(X + t * u)
    return out


@dataclass(frozen=True)
class TransformerFidelity:
    """Fidelity (max abs error / RMS of the true outputs) on random sequences and next to every kink."""

    random: Fidelity
    kinks: Fidelity | None

    @property
    def max_rel_err(self) -> float:
        return max(self.random.max_rel_err, self.kinks.max_rel_err if self.kinks else 0.0)

    @property
    def queries(self) -> int:
        return self.random.queries + (self.kinks.queries if self.kinks else 0)

    def as_dict(self) -> dict[str, Any]:
        out = {"fidelity_random_max_rel_err": self.random.max_rel_err, "fidelity_random_n": self.random.n}
        if self.kinks is not None:
            out.update({"fidelity_kinks_max_rel_err": self.kinks.max_rel_err, "fidelity_kinks_n": self.kinks.n})
        return out


def verify_transformer(res: TransformerExtraction, oracle: Oracle, *, n: int = 10_000, per_kink: int = 2,
                       rng: np.random.Generator | int = 0, max_len: int = 32) -> TransformerFidelity:
    """Fidelity on ``n`` random sequences and on :func:`kink_sequences` (one head with an FFN)."""
    rng = np.random.default_rng(rng)
    rand = res.verify(oracle, n, rng=rng, max_len=max_len) if n > 0 else None
    kinks = None
    if res.predicts == "transformer" and res.ffn is not None and per_kink > 0:
        seqs = kink_sequences(res, per_kink=per_kink, rng=rng)
        before = oracle.queries
        y = oracle.query(seqs)
        spent = oracle.queries - before
        y_hat = res.predict(seqs)
        err = np.abs(y_hat - y)
        rms = float(np.sqrt(np.mean(y ** 2)))
        kinks = Fidelity(n=len(seqs), queries=spent, max_abs_err=float(err.max()), rms_true=rms,
                         max_rel_err=float(err.max() / max(rms, 1e-300)))
    if rand is None:
        rand = Fidelity(n=0, queries=0, max_abs_err=0.0, rms_true=0.0, max_rel_err=0.0)
    return TransformerFidelity(rand, kinks)
