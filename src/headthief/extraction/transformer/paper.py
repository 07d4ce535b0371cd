"""The paper's reduction for one-layer transformers (Section 4.1): antisymmetric queries + Theorem 4.1,
and an FFN learner on one-token queries.

For ``TF(X) = w_o^T ReLU(alpha(X, W)^T X A)`` (no FFN biases):

1. *Attention.* ``VQ(X) - VQ(-X) = alpha(X, W)^T X v`` with ``v = A w_o`` (negating the tokens leaves the
   scores, and ``ReLU(u) - ReLU(-u) = u``): a single-head oracle
   (:class:`~headthief.oracles.antisymmetric.AntiSymmetric`). Theorem 4.1
   (:func:`~headthief.extraction.single.exact.extract_exact`) on it recovers W and v exactly with
   ``d^2 + d`` antisymmetric answers: ``2 (d^2 + d)`` value queries (544 at d = 16).
2. *FFN.* One-token queries see ``VQ([x]) = w_o^T ReLU(A^T x)``, the FFN alone; the FFN learner
   (:func:`~headthief.extraction.transformer.ffn.extract_ffn`, the paper's assumed ``A_FFN``) returns an
   equivalent network g.
3. The recovered transformer is ``g(alpha(X, W_hat)^T X)``: equal to the black box on every input.

Several heads before the FFN (``heads = H > 1``): the antisymmetric oracle is multi-head attention with
``v_h = A_h w_o``, and :func:`~headthief.extraction.multihead.extract_multihead` recovers every W_h (up to
permutation). One-token queries see only ``sum_h A_h``, so the per-head maps are not recovered: the
result models (and is checked against) the antisymmetric answers.

FFN biases break step 1 (``ReLU(z + b) - ReLU(-z + b) != z``). The method checks the two facts the
reduction needs before it spends anything on Theorem 4.1: ``VQ([0]) = 0`` and the one-token
antisymmetric answers are linear (``VQ~([a + b]) = VQ~([a]) + VQ~([b])``), 7 value queries reported as
``diagnostics["reduction_check_queries"]``, and refuses with :class:`ModelMismatch` (``--method
transformer`` handles biases).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np

from ...errors import ModelMismatch
from ...oracles.antisymmetric import AntiSymmetric
from ...oracles.base import Oracle
from ..check import TRANSFORMER, checked
from ..probes import Progress, looks_float32
from .recovered import TransformerExtraction

REFUSAL = ("the antisymmetric reduction of Section 4.1 does not hold for this target: {why}. The reduction "
           "needs an FFN without biases, where ReLU(z) - ReLU(-z) = z turns VQ(X) - VQ(-X) into attention; "
           "with FFN biases ReLU(z + b_1) - ReLU(-z + b_1) != z, so the antisymmetric answers are not an "
           "attention head and Theorem 4.1 would recover a wrong W. Use --method transformer (it learns the FFN "
           "with its biases from one-token queries and reads the attention through it)")


def paper_attention_query_count(d: int, heads: int = 1) -> int | None:
    """Value queries of the attention part: ``2 (d^2 + d)`` for one head (None for several: adaptive)."""
    return 2 * (d * d + d) if heads == 1 else None


def run_ffn_learner(oracle: Oracle, *, bias: bool, rng, progress: Progress, learner: Callable | None = None,
                    max_queries: int | None = None):
    """Run the FFN learner on one-token queries; returns (result, value queries spent).

    ``learner`` defaults to :func:`headthief.extraction.transformer.ffn.extract_ffn`; any callable
    ``learner(oracle, *, bias, rng, progress) -> result with .model`` works (the paper's ``A_FFN``).
    A learner that wears the model check is called with ``check=False``: its check would compare with
    multi-token answers, which are not the FFN's.
    """
    if learner is None:
        from .ffn import extract_ffn as learner
    kw: dict[str, Any] = {"bias": bias, "rng": rng, "progress": progress}
    if max_queries is not None:
        kw["max_queries"] = max_queries
    if getattr(learner, "model_class", None) is not None:
        kw["check"] = False
    q0 = oracle.queries
    res = learner(oracle, **kw)
    return res, oracle.queries - q0


def reduction_check(oracle: Oracle, *, rng: np.random.Generator) -> tuple[int, float, float]:
    """Test ``VQ([0]) = 0`` and the linearity of one-token antisymmetric answers (7 value queries).

    Returns (queries, worst violation, allowance); raises :class:`ModelMismatch` with the reason when
    the reduction does not hold.
    """
    d = oracle.d
    a, b = rng.standard_normal(d), rng.standard_normal(d)
    R = oracle.input_norm
    if R is not None:
        s = 0.45 * R / max(np.linalg.norm(a), np.linalg.norm(b), 1e-300)
        a, b = a * s, b * s
    toks = [np.zeros(d), a, b, a + b, -a, -b, -(a + b)]
    y = oracle.query([t[None, :] for t in toks])
    spent = len(toks)
    eps = 2.0 ** -24 if looks_float32(y) else 2.0 ** -53
    M = float(np.max(np.abs(y)))
    allowed = 64 * math.sqrt(d) * eps * max(M, 1e-300)
    f0 = float(y[0])
    if abs(f0) > 2 * allowed:
        raise ModelMismatch(REFUSAL.format(why=f"VQ([0]) = {f0:.6g}, not 0 (an FFN bias)"),
                            check="zero token", figure=abs(f0), threshold=2 * allowed,
                            hint="use --method transformer")
    anti = y[1:4] - y[4:7]
    viol = abs(anti[2] - anti[0] - anti[1])
    if viol > 8 * allowed:
        raise ModelMismatch(REFUSAL.format(
            why=f"the one-token antisymmetric answers are not linear (VQ~([a + b]) - VQ~([a]) - VQ~([b]) = "
                f"{viol:.3g})"), check="antisymmetric linearity", figure=viol, threshold=8 * allowed,
            hint="use --method transformer")
    return spent, max(abs(f0), viol), 8 * allowed


@checked(TRANSFORMER)
def extract_transformer_paper(
    oracle: Oracle,
    *,
    bias: bool = False,
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
    ffn_learner: Callable | None = None,
    ffn_max_queries: int | None = None,
) -> TransformerExtraction:
    """Recover a one-head transformer without FFN biases by the paper's reduction (Section 4.1).

    Args:
        oracle: the black box (exact value answers).
        bias: must be False: the reduction needs an FFN without biases (True raises ValueError naming
            ``extract_transformer``).
        rng: generator or seed (the reduction check's tokens, the FFN learner).
        progress: called with the number of value queries answered after each oracle call.
        ffn_learner: the FFN learner (default :func:`extract_ffn`), see :func:`run_ffn_learner`.
        ffn_max_queries: a cap handed to the FFN learner.

    Returns:
        A :class:`TransformerExtraction`; ``attention_queries`` is exactly ``2 (d^2 + d)`` on exact
        float64 answers (plus ``diagnostics["requeried"]`` otherwise).

    Raises:
        ModelMismatch: the target's FFN has biases (``VQ([0]) != 0`` or non-linear antisymmetric
            one-token answers): the reduction does not hold.
        NotIdentifiable: ``v = A w_o = 0`` (the antisymmetric answers vanish).
    """
    from ..single.exact import extract_exact
    _refuse_bias(bias)
    rng = np.random.default_rng(rng)
    t0 = time.perf_counter()
    q0 = oracle.queries
    check_q, viol, allowed = reduction_check(oracle, rng=rng)
    if progress:
        progress(check_q)
    qa = oracle.queries
    att = extract_exact(AntiSymmetric(oracle), check=False, rng=rng, progress=progress)
    attention_queries = oracle.queries - qa
    ffn, ffn_queries = run_ffn_learner(oracle, bias=False, rng=rng, progress=progress, learner=ffn_learner,
                                       max_queries=ffn_max_queries)
    diagnostics = {"attention_queries": attention_queries, "ffn_queries": ffn_queries,
                   "reduction_check_queries": check_q, "reduction_violation": viol, "reduction_allowed": allowed,
                   "ffn_neurons": int(np.asarray(getattr(ffn, "model", ffn).A).shape[1]),
                   "requeried": att.diagnostics.get("requeried", 0)}
    diagnostics.update(_ffn_diagnostics(ffn))
    return TransformerExtraction(
        method="transformer-paper", W=att.W, v=att.v, c=None, ffn=ffn, queries=oracle.queries - q0,
        attention_queries=attention_queries, ffn_queries=ffn_queries, seconds=time.perf_counter() - t0,
        diagnostics=diagnostics)


def extract_transformer_heads(
    oracle: Oracle,
    *,
    heads: int | None,
    max_heads: int = 16,
    bias: bool = False,
    rng: np.random.Generator | int = 0,
    progress: Progress = None,
    check: bool = True,
    verify: int = 256,
    check_rng: np.random.Generator | int = 10_000,
) -> TransformerExtraction:
    """Several heads before a bias-free FFN: :func:`extract_multihead` through the antisymmetric oracle.

    ``VQ(X) - VQ(-X) = sum_h alpha_h(X)^T X v_h`` with ``v_h = A_h w_o``: the multi-head method recovers
    every W_h (up to permutation) and v_h; its model check (multi-head identities, fidelity) runs on the
    antisymmetric answers. One-token queries see only ``sum_h A_h``, so the per-head FFN maps are not
    recovered: the result's ``predicts`` is ``"antisymmetric"``.

    Raises:
        ModelMismatch: FFN biases (the reduction does not hold), or the antisymmetric answers are not
            multi-head attention.
    """
    from ..multihead import extract_multihead
    _refuse_bias(bias)
    rng = np.random.default_rng(rng)
    t0 = time.perf_counter()
    check_q, viol, allowed = reduction_check(oracle, rng=rng)
    if progress:
        progress(check_q)
    att = extract_multihead(AntiSymmetric(oracle), heads=heads, max_heads=max_heads, rng=rng, progress=progress,
                            check=check, verify=verify, check_rng=check_rng)
    attention_queries = att.queries
    diagnostics = {k: v for k, v in att.diagnostics.items()}
    if "queries_fresh" in diagnostics:        # the reduction check's queries are the method's too
        diagnostics["queries_fresh"] += check_q
        diagnostics["oracle_calls"] = diagnostics.get("oracle_calls", 0) + 1
    diagnostics.update({"attention_queries": attention_queries, "ffn_queries": 0, "reduction_check_queries": check_q,
                        "reduction_violation": viol, "reduction_allowed": allowed, "predicts": "antisymmetric",
                        "note": "several heads: the attention layer of VQ(X) - VQ(-X) is recovered (W_h, v_h = A_h "
                                "w_o) and checked against those answers; one-token queries see only sum_h A_h, so "
                                "the per-head FFN maps are not recovered"})
    return TransformerExtraction(
        method="transformer-heads", W=att.W, v=att.V, c=None, ffn=None,
        queries=att.queries + check_q, attention_queries=attention_queries, ffn_queries=0,
        seconds=time.perf_counter() - t0, predicts="antisymmetric", diagnostics=diagnostics,
        check=att.check)


def _refuse_bias(bias: bool) -> None:
    if bias:
        raise ValueError("the paper's reduction needs an FFN without biases (ReLU(z + b) - ReLU(-z + b) != z); "
                         "use extract_transformer (--method transformer) for a target with biases")


def _ffn_diagnostics(ffn) -> dict:
    out = {}
    diag = getattr(ffn, "diagnostics", {}) or {}
    if "resolution" in diag:
        out["resolution"] = diag["resolution"]
    if diag.get("warning"):
        out["warning"] = f"FFN learner: {diag['warning']}"
    return out
