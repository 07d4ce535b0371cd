"""``--method block``: a whole post-LN BERT encoder block from vector answers at every position.

The stages, in order (each module's docstring has the mathematics):

1. **L** (:mod:`.layernorm`): LN2's gamma and beta from answers to random sequences;
2. **activation** (:mod:`.smoothness`): GELU, not a piecewise-linear activation (a ReLU is a ModelMismatch);
3. **V** (:mod:`.value_sum`): ``B = I + sum_h O_h V_h`` and ``b`` modulo the ones-vector;
4. **F** (:mod:`.ffn`): LN1 and every GELU neuron, then the one-token model check;
5. **A** (:mod:`.heads`): every head's ``O_h``, ``W_h``, ``c_h`` from second-order reads at equal tokens.

With coarse (float32) answers the finite differences leave the parts at 1e-4..1e-3, so the algebra is a
start: after stage F the one-token map is refitted to answers of random tokens (:mod:`.one_token_refit`),
stage A pulls back through that refitted map, and the assembled block is refitted whole to answers of
random sequences (**R**, :mod:`.block_refit`); the parts are then read back from it (:func:`parts_of`).

The parts are assembled into a :class:`~headthief.models.bert_block.BertBlock` (a canonical representative:
``beta_1 = 0`` with ``beta_1 + b_2`` and ``W_1 beta_1 + b_1`` carried by b_2, b_1; the global scale of LN2's
input fixed by ``|gamma_1| = sqrt(d)``; ``K_h = sqrt(d_h) A_h^T``, ``Q_h = B_h^T`` for ``W_h = A_h B_h^T``;
``b_K = b_V = 0``), which answers like the target and is checked on fresh sequences of 1 to 16 tokens.

With a journal, the run keeps a checkpoint after each stage (and inside the refits every 50 evaluations, at
most once a minute):
given the same journal again it goes on after the last one (:mod:`.resume`).

Genuine symmetries (what no query can tell apart, and the comparison with a truth goes modulo): head
permutation; the Q/K split of ``W_h`` and the V/O split of ``O_h``; each ``O_h`` and ``B`` modulo a
ones-row (LN1 ignores a ones-vector added to its input); LN2's input scale s (``gamma_1, beta_1 + b_2,
W_2`` times s); ``beta_1`` vs ``b_1, b_2`` (only ``W_1 beta_1 + b_1`` and ``beta_1 + b_2`` act); ``W_1`` modulo
``v (1/gamma_1)^T`` on LN1's image; FFN neuron permutation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ...errors import BudgetExceeded, ConvergenceError, ModelMismatch, NotIdentifiable, SpecError
from ...oracles.answers import Output
from ...oracles.base import Oracle
from ..check import counters, cost, fresh_verdict
from ..precision import (NOISE_POINTS, NOISE_SEGMENTS, ModelCheck, answer_kind, noise_segments, refuse_half_precision,
                         refuse_if_random, token_scale, vector_answer_noise)
from ..result import Fidelity, freeze_fields, rel_err
from .ffn import (FFNPart, NearlyLinearFFN, check_one_token, check_span_fits, default_points, extract_ffn,
                  tight_note)
from .ffn_probes import check_fits, extract_ffn_probes, full_queries, probe_queries, use_probes
from .heads import Heads, extract_heads, stage_a_planned
from .layernorm import OutputLayerNorm, check_on_ellipsoid, ellipsoid_limit, fit_output_layernorm
from .block_refit import REFIT_LENGTHS, refit_block, refit_counts
from .resume import StageCheckpoints
from .torch_losses import check_device
from .one_token_refit import model_jacobian, refit_from_oracle, refit_one_token
from .smoothness import check_smooth_activation
from .arithmetic import MAX_TFLOP, REFIT_ITERATIONS, describe, over_limit, planned
from .value_sum import COARSE, ValueSum, centre, value_sum, with_map
from ...linalg import lstsq, svd

MODEL = "a post-LN BERT encoder block (attention, LN1, GELU FFN, LN2)"
SAVE_FORMAT = "headthief-bert-block-1"   # safetensors metadata: BertLayer's tensor names, float64
CHECK_FACTOR = 100     # fresh sequences may be this much worse than the parts' own measured precision
RETRY_A = 100         # coarse answers: stage A is drawn again when R ends this far above the answers' floor...
A_TRIES = 3           # ...at most this many stage A draws in all (their queries count in stage R's)
AT_FLOOR = 2.0        # R within this factor of the answers' floor (_floor) is at it (block_refit's floor): measured,
                      # R ends 1.04 - 1.08x above a fully fitted F+ on float32 blocks (d = 8, 16), 1.1 - 1.2x above
                      # the measured noise (d = 16, 32)
F_TARGET = 10.0       # coarse answers: the one-token refit F+ ends at this x the answers' measured noise (rms): it
                      # is a start, which R refines to the floor. Measured (float32 bert-block, --stage-f probes,
                      # F+ cut short by hand): d = 16 seed 59040, F+ at 30 iterations (one-token fidelity 1.7e-4) or
                      # its full fit: R 800 / 500 iterations to the same rms (1.2x the noise), every part within
                      # 1.2x; d = 32 seed 59041, F+ at 50 (rms 140x the noise) or 2,000: R 1,500 / 1,000, the same
                      # parts and fidelity (1.06e-6). On MiniLM block 2 the measured chain that met its line began
                      # R from F+ at 650 iterations (rms 6.2e-6, 9.5x its one-token noise of 6.5e-7)
POLISH_ABOVE = 1e-9   # exact answers: a block whose error on stage L's answers is above this (a tenth of the 1e-8
                      # the float64 route claims) is polished by the block refit on fresh sequences (_polish)
POLISH_ITER = 200     # ...this many L-BFGS iterations at most (measured at d = 16 from the algebra's start, seeds 25322
                      # and 25408: 100 leave every part within 2.1e-10, 200 within 2e-10 and the fidelity at
                      # 1.7e-12 - 7.4e-12, 2.6 s; 950 reach float64's floor, 11 s, past what the route claims)


def model_of(activation: str) -> str:
    """The model class the block method assumed: :data:`MODEL`, its FFN's activation named where not GELU."""
    return MODEL if activation == "gelu" else MODEL.replace("GELU FFN", f"{activation} FFN")


def activation_named(name: str, auto: bool = False) -> str:
    """``name`` if it is a smooth activation of :mod:`headthief.models.activations` (or ``auto``, where
    ``auto``), else a :class:`SpecError`."""
    from ...models.activations import activation
    if name == "auto":
        if auto:
            return name
        raise SpecError("--activation auto is read by --method block on free inputs only (stage F fits every "
                        "candidate's profiles there); name the activation here")
    try:
        activation(name)
    except ValueError as e:
        raise SpecError(f"--activation: {e}") from None
    return name


LN_EPS_EXACT = 1e-10   # --ln-eps above this (BERT's 1e-12 below) moves the answers by ~eps / var, past float64's
                       # precision: the algebra is then a start, and the refits fit with the eps (the float32 route)
LN_EPS_START = 2.0 ** -24   # ...the precision the algebra then assumes: float32's (its thresholds met a 1e-5 eps in
                            # float32 answers before: stage L's check aside, transformers' BertLayer went through)
LN_EPS_MAX = 1e-4      # --ln-eps accepted up to this (1e-5 measured; the algebra's start is not validated beyond)
LN_EPS_AUTO = 10.0     # --ln-eps auto: R's start is this times stage L's distance from LN2's ellipsoid (eps / var)
LN_EPS_COLLAPSED = 100.0   # --ln-eps auto: R's eps this far below its start is fitted again...
LN_EPS_RAISE = 10.0        # ...from this times the start
LN_EPS_MOVED = 3.0     # --ln-eps: R is run again from its result where the eps it fitted is this far from the told
LN_EPS_TOKENS = 2000   # --ln-eps: one-token queries of small norms added to the block refit's answers...
LN_EPS_NORMS = (1e-3, 0.5)   # ...log-uniform between these multiples of the token norm


AUTO_EPS = "auto"      # --ln-eps auto: the eps measured from the answers (ln_eps_measured; stage E's on an encoder)


def ln_eps_named(ln_eps) -> float | str | None:
    """``ln_eps`` (``--ln-eps``) as a float in ``(0, LN_EPS_MAX]``, :data:`AUTO_EPS` (measured from the answers),
    or None (BERT's 1e-12); else a :class:`SpecError` naming it."""
    if ln_eps is None:
        return None
    if isinstance(ln_eps, str) and ln_eps.strip().lower() == AUTO_EPS:
        return AUTO_EPS
    try:
        v = float(ln_eps)
    except (TypeError, ValueError):
        raise SpecError(f"--ln-eps must be a number (the LayerNorms' eps, e.g. 1e-5) or auto, got {ln_eps!r}") from None
    if not 0.0 < v <= LN_EPS_MAX:
        raise SpecError(f"--ln-eps must lie in (0, {LN_EPS_MAX:g}] (BERT's is 1e-12, RoBERTa's 1e-5), got {v:g}")
    return v


def ln_eps_told(ln_eps) -> tuple[float | str | None, bool]:
    """:func:`ln_eps_named`'s value and whether it is above :data:`LN_EPS_EXACT` (``loose``: the stages' algebra
    is then a start at float32's precision), as every route that takes ``--ln-eps`` reads it. :data:`AUTO_EPS`
    is not loose until measured (:func:`ln_eps_measured`)."""
    v = ln_eps_named(ln_eps)
    return v, v is not None and v != AUTO_EPS and v > LN_EPS_EXACT


def ln_eps_measured(ln: OutputLayerNorm, precision: float) -> float | None:
    """``--ln-eps auto`` on free inputs: None (BERT's negligible eps) where stage L's answers lie on LN2's
    ellipsoid within :func:`~.layernorm.check_on_ellipsoid`'s limit for BERT's eps, else the block refit's start
    for the eps: :data:`LN_EPS_AUTO` x the distance (rms of ``|n|^2 / d - 1``, about ``eps / var`` with var LN2's
    input variance, measured 6.7 - 10 where the eps was known), at most :data:`LN_EPS_MAX` (a distance 100x
    beyond is refused by that check). R fits the eps from there and runs again where it moved more than
    :data:`LN_EPS_MOVED`. A start above the eps is the safer side: from 10x above R found 1e-5 on every block
    tried, from 10x below one fell to eps 2e-16 (seed 22205, rms 8.6x the noise, inside the check)."""
    if ln.sphere_residual <= ellipsoid_limit(precision):
        return None
    return float(min(max(LN_EPS_AUTO * ln.sphere_residual, 10 * LN_EPS_EXACT), LN_EPS_MAX))


@dataclass(frozen=True, eq=False)
class BlockExtraction:
    """What ``--method block`` recovered: ``block`` (the canonical representative, float64) and the stages'
    parts, what it cost, the figures per stage and the model check."""

    block: Any
    ln: OutputLayerNorm
    value: ValueSum
    ffn: FFNPart
    attention: Heads
    queries: int
    seconds: float
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    check: Any = None
    method: str = "block"

    def __post_init__(self):
        freeze_fields(self, ())

    @property
    def d(self) -> int:
        return self.block.d

    @property
    def heads(self) -> int:
        return self.block.heads

    @property
    def rank(self) -> int:
        return self.block.head_dim

    def predict(self, batch):
        return self.block.evaluate(batch)

    def verify(self, oracle: Oracle, n: int = 256, *, rng=0, max_len: int = 16) -> Fidelity:
        """Largest error of any answered number on ``n`` fresh sequences of 1 to ``max_len`` tokens (norm
        about the extraction's token norm) over the answers' rms."""
        from ..vector import vector_fidelity
        return vector_fidelity(self.block, oracle, n, rng=rng, max_len=max_len,
                               token_norm=self.diagnostics.get("token_norm"))

    def errors(self, truth) -> dict[str, Any]:
        return block_errors(self, truth)

    def save(self, path) -> None:
        """``.safetensors``: the block under transformers' ``BertLayer`` names (loadable into ``BertLayer``);
        anything else: the same tensors with ``numpy.savez``."""
        p = str(path)
        tensors = {k: np.asarray(v, dtype=np.float64) for k, v in self.block.state_dict().items()}
        if p.endswith(".safetensors"):
            from ...models.bert_export import writable_path, write_safetensors
            from ...models.activations import activation
            write_safetensors(tensors, writable_path(p), {"format": SAVE_FORMAT, "heads": str(self.heads),
                                                          "ffn": str(self.block.ffn),
                                                          "activation": self.block.activation,
                                                          "hidden_act": activation(self.block.activation).hf,
                                                          "layer_norm_eps": repr(float(self.block.eps))}, None)
            return
        np.savez(p, **{k.replace(".", "/"): v for k, v in tensors.items()})


@dataclass(frozen=True, eq=False)
class BlockParts:
    """What a block run that stopped after stage V recovered (its later stages above ``--max-tflop``,
    :mod:`.arithmetic`): LN2 (``ln``), ``B`` and ``b`` (``value``), the activation check's ratio, the plan of
    what was not run (``plan``: floating-point operations by stage), and the stages' identities as the model
    check. Attached as ``.result`` to the :class:`~headthief.errors.ComputeLimit` that ends the run."""

    ln: OutputLayerNorm
    value: ValueSum
    activation_ratio: float
    plan: Mapping[str, float]
    queries: int
    seconds: float
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    check: Any = None
    method: str = "block (parts)"

    def __post_init__(self):
        freeze_fields(self, ())

    @property
    def d(self) -> int:
        return self.ln.d

    @property
    def rank(self) -> None:          # no head was recovered
        return None

    def errors(self, truth) -> dict[str, Any]:
        """LN2 (gamma up to the global sign) and ``P B``, ``P b`` against a :class:`BertBlock`, as
        :func:`block_errors` compares them."""
        return _ln_and_value_errors(self.ln, self.value, truth)


def assemble(ln: OutputLayerNorm, vs: ValueSum, ffn: FFNPart, att: Heads, ln_eps: float | None = None):
    """The canonical :class:`~headthief.models.bert_block.BertBlock` of the parts (module docstring), its
    LayerNorms' eps ``ln_eps`` (None: BERT's)."""
    from ...models.bert_block import BERT_EPS, BertBlock
    from ...models.mha import AttentionLayer
    H, d = att.heads, vs.B.shape[0]
    dh = d // H
    Q, K, V, bq, Wo = (np.zeros((H, dh, d)), np.zeros((H, dh, d)), np.zeros((H, dh, d)), np.zeros((H, dh)),
                       np.zeros((d, d)))
    for h in range(H):
        U, S, Vt = svd(att.W[h])
        A = U[:, :dh] * np.sqrt(S[:dh])
        Bm = Vt[:dh].T * np.sqrt(S[:dh])
        K[h] = np.sqrt(dh) * A.T
        Q[h] = Bm.T
        bq[h] = lstsq(A, att.c[h], rcond=None)[0]
        U, S, Vt = svd(att.O[h])
        Wo[:, h * dh:(h + 1) * dh] = U[:, :dh] * S[:dh]
        V[h] = Vt[:dh]
    layer = AttentionLayer(Q=Q, K=K, V=V, Wo=Wo, bq=bq, bk=np.zeros((H, dh)), bv=np.zeros((H, dh)), bo=vs.b,
                           output="all")
    return BertBlock(attention=layer, ln1_gamma=ffn.gamma, ln1_beta=np.zeros(d), W1=ffn.W1m / ffn.gamma[None, :],
                     b1=ffn.b1m, W2=ffn.W2, b2=ffn.c, ln2_gamma=ln.gamma, ln2_beta=ln.beta, output="all",
                     activation=ffn.activation, info={"recovered": True}, eps=BERT_EPS if ln_eps is None else ln_eps)


def parts_of(block, ln: OutputLayerNorm, vs: ValueSum, ffn: FFNPart, att: Heads):
    """The stages' parts (canonical forms, as :func:`assemble` reads them) of a block whose parameters were
    refitted: ``(ln, vs, ffn, att)``, each the given part with its numbers replaced (``info`` kept)."""
    d = block.d
    P = np.eye(d) - 1.0 / d
    new_ln = dataclasses.replace(ln, gamma=np.array(block.ln2_gamma, np.float64),
                                 beta=np.array(block.ln2_beta, np.float64))
    new_vs = with_map(vs, *block.value_output_sum())
    g1 = np.asarray(block.ln1_gamma, np.float64)
    s = float(np.linalg.norm(g1) / np.sqrt(d)) * (1.0 if g1.sum() > 0 else -1.0)
    W1 = np.asarray(block.W1, np.float64)
    new_ffn = dataclasses.replace(ffn, gamma=g1 / s, W1m=(W1 * g1[None, :]) @ P,
                                  b1m=np.asarray(block.b1, np.float64) + W1 @ np.asarray(block.ln1_beta, np.float64),
                                  W2=np.asarray(block.W2, np.float64) / s,
                                  c=P @ (np.asarray(block.b2, np.float64) + np.asarray(block.ln1_beta, np.float64)) / s)
    can = block.attention.canonical()
    H = block.heads
    new_att = dataclasses.replace(att, O=np.stack([centre(can.O(h)) for h in range(H)]),
                                  W=np.stack([can.W(h) for h in range(H)]), c=np.array(can.C, np.float64))
    return new_ln, new_vs, new_ffn, new_att


def parts_from_block(block) -> tuple[OutputLayerNorm, ValueSum, FFNPart, Heads]:
    """A known block's parts in the stages' canonical forms (:func:`parts_of` on blank parts): a start for
    the refits in tests and benchmarks (a truth perturbed), not anything the method reads."""
    d, f, H = block.d, block.ffn, block.heads
    ln = OutputLayerNorm(gamma=np.ones(d), beta=np.zeros(d), plane_residual=0.0, sphere_residual=0.0, answers=0)
    vs = ValueSum(B=np.eye(d), b=np.zeros(d), Binv=np.eye(d), c0=np.zeros(d), c1=np.ones(d) / np.sqrt(d),
                  residual=0.0, conditioning=1.0, expected=0.0, step=0.0, queries=0)
    part = FFNPart(gamma=np.ones(d), c=np.zeros(d), W1m=np.zeros((f, d)), b1m=np.zeros(f), W2=np.zeros((d, f)),
                   activation=block.activation)
    att = Heads(O=np.zeros((H, d, d)), W=np.zeros((H, d, d)), c=np.zeros((H, d)))
    return parts_of(block, ln, vs, part, att)


def _ln_and_value_errors(ln: OutputLayerNorm, vs: ValueSum, truth) -> dict[str, Any]:
    """Stages L and V against a :class:`BertBlock`: LN2 (gamma up to the global sign), ``P B``, ``P b``."""
    sign = 1.0 if float(ln.gamma @ truth.ln2_gamma) >= 0 else -1.0
    B, b = truth.value_output_sum()
    return {"ln2_gamma_rel_err": rel_err(sign * ln.gamma, truth.ln2_gamma),
            "ln2_beta_rel_err": rel_err(ln.beta, truth.ln2_beta),
            "B_rel_err": rel_err(vs.B, centre(B)), "b_rel_err": rel_err(vs.b, centre(b))}


def block_errors(res: BlockExtraction, truth) -> dict[str, Any]:
    """Relative errors of every recovered part against a :class:`BertBlock` truth, modulo the symmetries of
    the module docstring (heads matched by the Hungarian method on ``P O_h``, neurons by their W_1 rows)."""
    from scipy.optimize import linear_sum_assignment
    from scipy.spatial.distance import cdist
    d = truth.d
    P = np.eye(d) - 1.0 / d
    out: dict[str, Any] = _ln_and_value_errors(res.ln, res.value, truth)
    can = truth.attention.canonical()
    H = truth.heads
    att = res.attention
    cost_m = np.array([[rel_err(att.O[i], centre(can.O(j))) for j in range(H)] for i in range(att.heads)])
    rows, cols = linear_sum_assignment(cost_m)
    per = []
    for i, j in zip(rows, cols):
        per.append({"head": int(j), "recovered_as": int(i), "O_rel_err": rel_err(att.O[i], centre(can.O(j))),
                    "W_rel_err": rel_err(att.W[i], can.W(j)), "c_rel_err": rel_err(att.c[i], can.C[j])})
    per.sort(key=lambda r: r["head"])
    for k in ("O_rel_err", "W_rel_err", "c_rel_err"):
        out[k] = max(r[k] for r in per)
    g1 = np.asarray(truth.ln1_gamma, dtype=np.float64)
    s = float(res.ffn.gamma @ g1 / (g1 @ g1))                          # LN2's input scale (a symmetry)
    out["ln1_gamma_rel_err"] = rel_err(res.ffn.gamma, s * g1)
    W1t = np.asarray(truth.W1, np.float64) @ np.diag(g1) @ P
    b1t = np.asarray(truth.W1, np.float64) @ np.asarray(truth.ln1_beta, np.float64) + np.asarray(truth.b1, np.float64)
    W2t = s * P @ np.asarray(truth.W2, np.float64)
    # every pair's |w - wt| / |wt| in one C loop (cdist): the pairs one by one were 2.4 million rel_err calls at
    # MiniLM's FFN 1536, 18 s a call of this function
    norms = np.linalg.norm(W1t, axis=1)
    cost_n = cdist(np.asarray(res.ffn.W1m, np.float64), W1t) / np.where(norms > 0, norms, 1.0)     # as rel_err
    r_, c_ = linear_sum_assignment(cost_n)
    out["W1_rel_err"] = max(rel_err(res.ffn.W1m[i], W1t[j]) for i, j in zip(r_, c_))
    out["b1_abs_err"] = max(abs(float(res.ffn.b1m[i] - b1t[j])) for i, j in zip(r_, c_))
    out["W2_rel_err"] = max(rel_err(P @ res.ffn.W2[:, i], W2t[:, j]) for i, j in zip(r_, c_))
    out["ffn_bias_rel_err"] = rel_err(res.ffn.c, s * P @ (np.asarray(truth.ln1_beta, np.float64)
                                                       + np.asarray(truth.b2, np.float64)))
    out["heads_found"], out["heads_true"] = att.heads, H
    out["per_head"] = per
    from ...models.bert_block import BERT_EPS
    block = getattr(res, "block", None)              # parts alone (benchmarks/judge_minilm_block.py): no eps
    eps = BERT_EPS if block is None else float(block.eps)
    if eps != BERT_EPS or float(truth.eps) != BERT_EPS:     # an eps told, fitted, or the truth's
        out["ln_eps"], out["ln_eps_true"] = eps, float(truth.eps)
    if block is not None and max(eps, float(truth.eps)) > LN_EPS_EXACT:
        # an eps makes LN2's input scale a parameter, not a symmetry: LN1's gamma without the rescaling above
        out["ln1_gamma_unscaled_rel_err"] = rel_err(np.asarray(block.ln1_gamma, np.float64), g1)
    return out


def _ln_sequences(d: int) -> int:
    """Stage L's queries: sequences of 16 tokens, at least 2 d + 8 answers in all."""
    return -(-(2 * d + 8) // 16)


RESCUE = 100      # exact answers: a stage-F map within this factor of its check is refitted (F+) and checked again


def _sequences(rng: np.random.Generator, n: int, length: int, d: int, scale: float) -> np.ndarray:
    """``n`` random sequences of ``length`` tokens (n, length, d), every token of norm ``scale``."""
    X = rng.standard_normal((n, length, d))
    return X * (scale / np.linalg.norm(X, axis=2, keepdims=True))


def _answers_for_ln(oracle: Oracle, rng: np.random.Generator, scale: float) -> np.ndarray:
    X = _sequences(rng, _ln_sequences(oracle.d), 16, oracle.d, scale)
    return np.asarray(oracle.query_packed(X)), X


def _refit_sequences(oracle: Oracle, rng: np.random.Generator, scale: float, block) -> list:
    """Random sequences for the block refit (:mod:`.block_refit`): for each length in REFIT_LENGTHS, enough
    sequences for a quarter of ``max(4000, 8 x parameters / d)`` answered positions; tokens of norm
    ``scale``. Returns ``[(X (N, T, d), Y (N, T, d)), ...]``."""
    d = oracle.d
    out = []
    for T, n in zip(REFIT_LENGTHS, refit_counts(d, block.ffn)):
        X = _sequences(rng, n, T, d, scale)
        out.append((X, np.asarray(oracle.query(X), dtype=np.float64)))
    return out


def _small_tokens(oracle: Oracle, rng: np.random.Generator, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """:data:`LN_EPS_TOKENS` one-token queries of norms log-uniform in ``LN_EPS_NORMS`` x ``scale`` and their
    answers, ``(X (k, 1, d), Y (k, 1, d))``: the block refit's data where it fits the LayerNorms' eps. At the
    method's own norms LN1's input variance barely varies, so the eps is nearly a rescaling the other parts
    absorb (measured: transformers' RobertaLayer, eps 1e-5, fitted 6e-8 from them alone); small tokens leave
    LN1's input to its bias, where eps / var is large."""
    d = oracle.d
    X = rng.standard_normal((LN_EPS_TOKENS, 1, d))
    lo, hi = np.log(LN_EPS_NORMS[0] * scale), np.log(LN_EPS_NORMS[1] * scale)
    X *= np.exp(rng.uniform(lo, hi, (LN_EPS_TOKENS, 1, 1))) / np.linalg.norm(X, axis=2, keepdims=True)
    return X, np.asarray(oracle.query(X), dtype=np.float64)


def _probes(d: int, ffn: int, stage_f: str) -> bool:
    if stage_f not in ("auto", "full", "probes"):
        raise SpecError(f"stage_f must be auto, full or probes, got {stage_f!r}")
    return stage_f == "probes" or (stage_f == "auto" and use_probes(d, ffn))


def expected_queries(d: int, ffn: int, float32: bool = False, stage_f: str = "auto", ln_eps: bool = False) -> int:
    """The planned query count (answers at every position) for the progress bar: stage L, the activation
    check, stage V (3 base tokens; for float32 6, the step's ladder and c0's Newton, each at its most), stage
    F with its one-token check, stage A, the model check; for float32 answers the one-token refit's random
    tokens, the block refit's sequences and the model check's noise segments, and no Jacobian stencils in
    stage A (it pulls back through the refitted model). ``ln_eps``: a LayerNorm eps fitted (``--ln-eps``): the
    float32 route and its small tokens, whatever the answers."""
    from .one_token_refit import random_queries
    from .smoothness import CIRCLES, MAX_POINTS
    from .value_sum import BASES, COARSE_BASES, LADDER, NEWTON, PILOT_DIRECTIONS, SCALES
    f = probe_queries(d, ffn) if _probes(d, ffn, stage_f) else full_queries(d, ffn)
    v = (COARSE_BASES * (8 * d + 1 + len(SCALES) * (NEWTON + 1)) + 4 * PILOT_DIRECTIONS * len(LADDER) if float32
         else BASES * 8 * d)
    base = _ln_sequences(d) + CIRCLES * MAX_POINTS + v + f + 64 + 256
    if ln_eps:
        return expected_queries(d, ffn, True, stage_f) + LN_EPS_TOKENS
    if not float32:
        return base + stage_a_planned(d, False)
    return (base + stage_a_planned(d, True) + random_queries(d, ffn)
            + sum(refit_counts(d, ffn)) + 2 * NOISE_SEGMENTS * NOISE_POINTS)  # noise segments: F+'s, the check's


def extract_block(oracle: Oracle, *, heads: int | None = None, ffn: int, rng: np.random.Generator | int = 0,
                  check: bool = True, verify: int = 256, check_rng=0, progress=None,
                  stage_f: str = "auto", max_tflop: float = MAX_TFLOP,
                  refit_device: str | None = None, activation: str = "gelu",
                  ln_eps: float | str | None = None) -> BlockExtraction:
    """Stages L, activation, V, F, A (module docstring) and the model check on ``verify`` fresh sequences
    (:func:`_extract_block`). ``activation``: the FFN's assumed activation (:mod:`headthief.models.activations`:
    BERT's exact ``gelu`` by default, or ``gelu_tanh``, ``silu``, ``quick_gelu``); a block whose answers
    another explains is refused by the stages' checks, as a ReLU block is. A refusal of the model class
    (:class:`ModelMismatch`) first asks one random sequence three times
    (:func:`~headthief.extraction.precision.refuse_if_random`): a target whose answers are not a function of
    its input (dropout left on) is refused as that, not as the stage's wrong class. ``ln_eps``: both
    LayerNorms' eps (None: BERT's 1e-12, which the stages' algebra leaves out exactly; RoBERTa and many others
    use 1e-5). An eps above :data:`LN_EPS_EXACT` moves the answers by ~eps / var, so the algebra's figures are
    then a start at float32's precision and the refits fit the answers with the eps in their loss (the route
    float32 answers take), float64 answers too. ``ln_eps="auto"``: measured from stage L's answers
    (:func:`ln_eps_measured`: BERT's where they lie on LN2's ellipsoid, else the block refit's start)."""
    try:
        return _extract_block(oracle, heads=heads, ffn=ffn, rng=rng, check=check, verify=verify,
                              check_rng=check_rng, progress=progress, stage_f=stage_f, max_tflop=max_tflop,
                              refit_device=refit_device, activation=activation, ln_eps=ln_eps)
    except ModelMismatch as e:
        refuse_if_random(oracle, e, what="The block method")
        raise


def _extract_block(oracle: Oracle, *, heads: int | None, ffn: int, rng: np.random.Generator | int,
                   check: bool, verify: int, check_rng, progress, stage_f: str, max_tflop: float,
                   refit_device: str | None, activation: str = "gelu",
                   ln_eps: float | str | None = None) -> BlockExtraction:
    """:func:`extract_block`'s stages L, activation, V, F, A and the model check on ``verify`` fresh sequences.
    ``heads``: H, or None to read it from the second-order reads' rank; ``ffn``: the FFN's width;
    ``stage_f``: ``full`` (tangent Jacobians), ``probes`` (:mod:`.ffn_probes`) or ``auto`` (probes where
    they need a quarter of the queries or fewer). Where the stages after V plan more than ``max_tflop``
    TFLOP (:mod:`.arithmetic`; MiniLM's size: thousands), the run stops after stage V with
    :class:`~headthief.errors.ComputeLimit`, the parts read so far attached as ``.result``. ``refit_device``:
    a torch device for the two refits' losses (:mod:`.torch_losses`; None or ``numpy``: numpy)."""
    if not oracle.output.vector:
        raise SpecError(f"the block method needs vector answers, got output={oracle.output.value}")
    if oracle.output is not Output.ALL:     # before the first query (it was stage L's "needs 18 answers, got 3")
        raise SpecError("the block method needs the answers at every position (--output all), got the last "
                        "position's only: its stages V and A can read last-position answers, but stage L's "
                        "LayerNorm fit, the refits and the model check are built for every position")
    rng = np.random.default_rng(rng)
    d = oracle.d
    if ffn is None or int(ffn) < 1:
        raise SpecError(f"--method block needs the FFN's width (--ffn M, M >= 1), got {ffn}")
    probes = _probes(d, int(ffn), stage_f)
    device = check_device(refit_device)           # before the first query
    act = activation_named(activation, auto=True)
    ln_eps, loose = ln_eps_told(ln_eps)          # loose: an eps the algebra leaves out, a start refitted
    auto = ln_eps == AUTO_EPS                     # measured at stage L (ln_eps_measured)
    if probes:
        check_fits(d, int(ffn))                   # before the first query
    else:
        check_span_fits(d, int(ffn))
    t0 = time.perf_counter()
    before = counters(oracle)
    scale = token_scale(oracle)
    stages: dict[str, Any] = {}
    seconds: dict[str, float] = {}

    clock = [time.perf_counter()]

    def mark(name, q0):
        stages[name] = int(oracle.queries - q0)
        now = time.perf_counter()
        seconds[name] = round(now - clock[0], 2)
        clock[0] = now
        if progress is not None:
            progress(stages[name])

    describe = getattr(progress, "describe", None) or (lambda text: None)   # the CLI's bar shows the stage

    def fit_progress(name):
        return lambda calls, rms: describe(f"{name}, evaluation {calls}, rms {rms:.2e}")

    ck = StageCheckpoints(oracle, rng, before["queries"])
    done, st = ck.load()                          # a journal's checkpoint: go on after its last stage
    if done is not None:
        stages.update(st["stages"])
        seconds.update(st["seconds"])
        if progress is not None:
            progress(ck.offset)
    if ck.to_run("V", done):
        q0 = oracle.queries
        Y, X_ln = _answers_for_ln(oracle, rng, scale)
        refuse_half_precision(Y, "the block method")
        ln = fit_output_layernorm(Y)
        kind = answer_kind(oracle, Y)             # float64, float32 (read from the answers), or a tolerance
        eps = max(kind.eps, kind.tau / float(np.sqrt(np.mean(Y ** 2))), LN_EPS_START if loose else 0.0)
        said = None
        if auto:
            ln_eps = ln_eps_measured(ln, eps)
            said = _auto_said(ln, eps, ln_eps)      # at the answers' own precision, before the route's floor
            loose = ln_eps is not None
            eps = max(eps, LN_EPS_START) if loose else eps
        check_on_ellipsoid(ln, eps, ln_eps=ln_eps)
        mark("L", q0)
        q0 = oracle.queries
        ratio = check_smooth_activation(oracle, rng, precision=eps, scale=scale).ratio
        mark("activation", q0)
        q0 = oracle.queries
        vs = value_sum(oracle, rng, precision=eps, scale=scale)
        mark("V", q0)
        st = {"Y": Y, "X_ln": X_ln, "ln": ln, "kind": kind, "eps": eps, "ratio": ratio, "vs": vs, "ln_eps": ln_eps,
              "ln_eps_auto": said}
        ck.save("V", {**st, "stages": stages, "seconds": seconds})
    Y, X_ln, ln, kind, eps, ratio, vs = (st[k] for k in ("Y", "X_ln", "ln", "kind", "eps", "ratio", "vs"))
    if auto:                                      # as measured when stage L ran (a resume reads it back)
        ln_eps = st["ln_eps"]
        loose = ln_eps is not None
    plan = planned(d, int(ffn), probes=probes, coarse=eps > COARSE)
    if over_limit(plan, max_tflop):
        raise _stopped_after_v(ln, vs, ratio, plan, max_tflop, oracle, before, t0,
                               {**_stage_figures(stages, seconds, ratio, ln, vs), "activation": act}, kind,
                               ck.spent(), device)
    # stage F's steps and its one-token threshold (100 x eps^0.8 sqrt(d)) were validated at a floor of 1e-15
    # (20/20 seeds, docs/block.md); at float64's own 1.1e-16 the threshold sits at the figures it passes
    # (fidelity 7.3e-11 against 6.9e-11 on seed 1008, a correct block)
    eps_f = max(eps, 1e-15)
    coarse = eps > COARSE          # float32 (or noisier) answers: the algebra is a start, refitted to answers
    if ck.to_run("F", done):
        if ck.to_run("F-span", done):
            q0 = oracle.queries
            f_start = ck.spent()
            # stage F from full Jacobians, or from probe Jacobians where those need a quarter of the queries or
            # fewer
            route = extract_ffn_probes if probes else extract_ffn
            name = "stage F (LN1, the FFN's span and neurons)"
            describe(name)

            def span_progress(step, res):         # the span's steps (hours at MiniLM's size), then the neurons
                describe(f"{name}, span step {step}, fixed-point residual {res:.2e}")

            f_rng = rng.bit_generator.state                  # a kept neuron search resumes stage F from here

            class NeuronProgress:
                """The neuron search's progress on the bar, and its checkpoint (the probe route's search is
                hours at MiniLM's size): kept at most once a minute as ``F-search``, with the generator and
                the queries as at stage F's start, so a resumed run reads stage F again (its answers replayed
                from the journal) and the search goes on where it was kept, if the span is the same."""

                def __call__(self, found, count, starts):
                    describe(f"{name}, neuron search, {found} of {count} found in {starts} starts")

                def keep(self, key, state):
                    if ck.store is not None and ck.due():     # (no journal: nothing kept, nothing built)
                        ck.save("F-search", {**st, "search": (key, state()), "stages": stages, "seconds": seconds},
                                rng_state=f_rng, spent=f_start)

                restored_at = None                           # the kept search's starts, once restored

                def restore(self, key):
                    kept = st.get("search") if done == "F-search" else None
                    if kept is None or kept[0] != key:
                        return None
                    self.restored_at = int(kept[1]["starts"])
                    return kept[1]
            neuron_progress = NeuronProgress()

            def read_f(**points):
                return route(oracle, ln, vs, rng, ffn=int(ffn), precision=eps_f, progress=span_progress,
                             activation=act, found_progress=neuron_progress, **points)
            missed, base = [], default_points(d, int(ffn))
            for more in (1, 2, 4):
                # on the full route a span that does not settle, or whose neurons are not all found, is read again
                # from 2x, then 4x as many fresh points (measured: transformers' float32 SiLU BertLayer, d = 16, FFN
                # 32, PyTorch's init: "found 7 of 32 neurons" at 165 points, a weakly curved FFN in float32; float64
                # bert-block:d=8,heads=2,ffn=16,seed=23403, 19 constraints a point on the span: not settled at 85
                # points, settled at 170)
                try:
                    span_part = read_f(**({} if more == 1 else {"points": more * base}))
                    break
                except (ConvergenceError, NotIdentifiable) as e:
                    if probes or isinstance(e, NearlyLinearFFN):     # (a FFN too wide: refused up front)
                        raise
                    if more == 4:
                        raise type(e)(f"{e} (stage F read three times, from {base}, 2x and 4x as many fresh points; "
                                      f"the first two: {'; '.join(missed)})") from e
                    missed.append(str(e).removesuffix(tight_note(d, int(ffn))))   # said once, with the last read
                    describe(f"{name}, again at {2 * more * base} fresh points ({e})")
            span_part = dataclasses.replace(span_part, info={**span_part.info, "retried": missed})
            st = {**{k: v for k, v in st.items() if k != "search"}, "span": span_part, "f_start": f_start,
                  "search_resumed": neuron_progress.restored_at}
            if coarse:
                ck.save("F-span", {**st, "stages": stages, "seconds": seconds})
        else:                                     # stage F's queries so far, counted as if asked in this run
            q0 = oracle.queries - (ck.spent() - st["f_start"])
        part = st["span"]
        refit: dict[str, Any] = {}
        ones = None
        if coarse:
            after_span = {"rng_state": rng.bit_generator.state, "spent": ck.spent()}   # F+'s answers follow

            def keep_f(calls, parts, history):    # F+'s progress, at most once a minute
                if ck.due():
                    ck.save("F+partial", {**st, "fplus": parts, "fplus_calls": calls + st.get("fplus_calls", 0),
                                          "fplus_history": history, "stages": stages, "seconds": seconds},
                            **after_span)

            alts = st["span"].info.get("activation_alternatives") or {}
            # the answers' own noise first (NOISE_SEGMENTS short segments, as the model check measures it): F+
            # is the start stage A pulls back through and R refines, and ends at F_TARGET x that noise; R's floor
            # is then AT_FLOOR x the noise (_floor). Not with --activation auto's candidates, compared by their rms
            noise_f, _, nq_f = _fit_noise(oracle, np.random.default_rng(int(rng.integers(2 ** 62))), scale)
            noise_f = max(noise_f, 0.5 * 2.0 ** -24)
            describe("F+ one-token refit")
            ln0, vs0 = ln, vs
            part, ln, vs, refit, ones = refit_from_oracle(oracle, part, ln, vs, rng, scale=scale,
                                                          start=st.get("fplus"), checkpoint=keep_f, device=device,
                                                          progress=fit_progress("F+ one-token refit"),
                                                          history=st.get("fplus_history"),
                                                          target=None if alts else F_TARGET * noise_f)
            refit.update({"refit_noise": noise_f, "refit_noise_queries": nq_f})
            if "fplus" in st:
                refit["resumed_from_evaluation"] = st["fplus_calls"]
            # --activation auto: float32 profiles do not separate GELU from its tanh form (measured); every
            # candidate that fitted them nearly as well is refitted to the same one-token answers, the lowest rms
            # kept (a wrong class ends 100x or more above a right one's: the block refit's noise check, measured)
            rms = {part.activation: refit["refit_rms_after"]}
            for other, alt in alts.items():
                describe(f"F+ one-token refit ({other}, --activation auto)")
                got = refit_one_token(alt, ln0, vs0, *ones, rng=rng, device=device,
                                      progress=fit_progress(f"F+ one-token refit ({other})"))
                rms[other] = got[3]["refit_rms_after"]
                if rms[other] < min(v for k, v in rms.items() if k != other):
                    part, ln, vs = got[:3]
                    refit = {**got[3], **{k: refit[k] for k in ("refit_queries", "refit_noise", "refit_noise_queries")}}
            if alts:
                refit["activation_refits"] = ", ".join(f"{k} {v:.2g}" for k, v in rms.items())
        try:
            one = check_one_token(oracle, part, ln, vs, rng, precision=eps_f, scale=scale)
        except ModelMismatch as e:
            if coarse or e.figure > RESCUE * e.threshold:
                raise
            # exact answers, the algebra's map just outside its check: neurons whose pre-activations span a
            # narrow range leave their GELU' profiles' 1-D fits poorly conditioned (measured: transformers'
            # BertLayer with PyTorch's init, d = 32, FFN 128: 7.3e-10 against 5.7e-10; d = 16, FFN 64: 1.1e-9).
            # The one-token refit float32 answers always get, then the same check: a wrong model class fits no
            # better and is refused by it
            describe("F+ one-token refit (stage F's map missed its check)")
            part, ln, vs, refit, ones = refit_from_oracle(oracle, part, ln, vs, rng, scale=scale, device=device,
                                                          progress=fit_progress("F+ one-token refit"))
            refit["after_check"] = float(e.figure)
            one = check_one_token(oracle, part, ln, vs, rng, precision=eps_f, scale=scale)
        part = dataclasses.replace(part, info={k: v for k, v in part.info.items() if k != "activation_alternatives"})
        mark("F", q0)
        st = {k: v for k, v in st.items() if k not in ("span", "fplus", "fplus_calls", "fplus_history", "f_start")}
        st = {**st, "ln": ln, "vs": vs, "part": part, "refit": refit, "ones": ones, "one": one}
        ck.save("F", {**st, "stages": stages, "seconds": seconds})
    ln, vs, part, refit, ones, one = (st[k] for k in ("ln", "vs", "part", "refit", "ones", "one"))
    refit = dict(refit)
    def draw_heads():                         # stage A; coarse answers: pulled back through F+'s map
        return extract_heads(oracle, vs, rng, heads=heads, precision=eps, scale=scale,
                             jacobian=model_jacobian(part, ln, vs) if coarse else None)

    if ck.to_run("A", done):
        q0 = oracle.queries
        describe("stage A (the heads)")
        att = draw_heads()
        mark("A", q0)
        shrink = getattr(progress, "shrink", None)     # the CLI's bar: stage A's pilot chose fewer levels than
        if shrink is not None:                        # the plan counts (coarse answers), so its total comes down
            shrink(stage_a_planned(oracle.d, coarse) - stages["A"])
        st = {**st, "att": att}
        ck.save("A", {**st, "stages": stages, "seconds": seconds})
    att = st["att"]
    block = assemble(ln, vs, part, att, ln_eps)
    eps_mode = "fit" if loose else "off"          # the block refit's LayerNorm eps (block_refit.refit_block)
    if coarse and done != "R":
        q0 = oracle.queries
        after_a = {"rng_state": rng.bit_generator.state, "spent": ck.spent()}   # R's answers follow from here
        groups = [(ones[0][:, None, :], ones[1][:, None, :])] + _refit_sequences(oracle, rng, scale, block)
        if loose:                             # where the LayerNorms' eps shows (_small_tokens)
            groups.append(_small_tokens(oracle, rng, scale))
        start = st.get("partial", block)      # a refit cut short goes on from the block it had reached
        if "partial" in st:
            refit["block_refit_resumed_from_evaluation"] = st["partial_calls"]

        def keep(calls, partial, history):    # R's progress, at most once a minute: a cut run loses little
            if ck.due():
                ck.save("R-partial", {**st, "partial": partial, "partial_calls": calls + st.get("partial_calls", 0),
                                      "partial_history": history, "stages": stages, "seconds": seconds}, **after_a)

        floor = _floor(refit)
        at_floor = AT_FLOOR * floor if np.isfinite(floor) else None
        describe("R block refit")
        block, brefit = refit_block(start, groups, rng=rng, checkpoint=keep, progress=fit_progress("R block refit"),
                                    device=device, history=st.get("partial_history"), ln_eps=eps_mode,
                                    floor=at_floor)
        tries, q_retry = 1, oracle.queries
        while (brefit["block_refit_rms_after"] > RETRY_A * floor and tries < A_TRIES
               and not over_limit({k: (tries + 1) * v for k, v in plan.items()}, max_tflop)):
            # stage A's heads left the block refit far above the one-token refit's floor: a poor draw of its
            # base tokens (measured: float32 bert-block d = 12 seed 14607, heads' residual 0.14 against
            # 2.6e-4 - 9.8e-4 with other draws, R stuck at rms 0.22; F+ at 1.2e-7). A wrong model class
            # leaves F+ as far above the answers' noise as R, so it is not retried for that (the check refuses it).
            # Only while the plan times the draws stays within max_tflop (at MiniLM's size: none)
            tries += 1
            describe(f"stage A again (try {tries}: the block refit stopped at rms "
                     f"{brefit['block_refit_rms_after']:.2e}, {RETRY_A}x above the answers' floor {floor:.2e})")
            att2 = draw_heads()
            block2, brefit2 = refit_block(assemble(ln, vs, part, att2, ln_eps), groups, rng=rng,
                                          progress=fit_progress("R block refit"), device=device, ln_eps=eps_mode,
                                          floor=at_floor)
            if brefit2["block_refit_rms_after"] < brefit["block_refit_rms_after"]:
                block, brefit, att = block2, brefit2, att2
        if loose and abs(np.log(block.eps / ln_eps)) > np.log(LN_EPS_MOVED):
            # the eps fitted far from the told one: R ends slowed on the path (measured: told 1e-7, eps 1e-5 found,
            # the FFN's parts 5e-4 - 8.8e-4, R's rms 3.9x the noise); L-BFGS again from there, the better kept
            describe(f"R block refit again (the LayerNorms' eps moved from {ln_eps:.2g} to {block.eps:.2g})")
            block, brefit = _refit_again(block, brefit, block, groups, rng=rng, device=device,
                                         progress=fit_progress("R block refit"), floor=at_floor)
            brefit["block_refit_eps_restarted"] = True
        if auto and loose and block.eps < ln_eps / LN_EPS_COLLAPSED:
            # stage L saw the answers off LN2's ellipsoid, yet R's eps fell far below its start: a basin where the
            # other parts absorb the eps (measured from a start 10x below the truth, above). R once more from the
            # assembled block at LN_EPS_RAISE x the start, the lower rms kept
            high = min(LN_EPS_RAISE * ln_eps, LN_EPS_MAX)
            describe(f"R block refit from a higher eps ({high:.2g}: the fitted one fell to {block.eps:.2g})")
            block, brefit = _refit_again(block, brefit, dataclasses.replace(start, eps=high), groups, rng=rng,
                                         device=device, progress=fit_progress("R block refit"), floor=at_floor)
            brefit["block_refit_eps_from_higher"] = high
        refit.update(brefit)
        if tries > 1:
            refit.update({"block_stage_a_tries": tries, "block_stage_a_retry_queries": int(oracle.queries - q_retry)})
        mark("R", q0)
        kept = {k: v for k, v in st.items() if k not in ("partial", "partial_calls", "partial_history")}
        st = {**kept, "block": block, "refit": refit, "att": att}
        ck.save("R", {**st, "stages": stages, "seconds": seconds})
    if coarse:
        block, refit = st["block"], dict(st["refit"])
        ln, vs, part, att = parts_of(block, ln, vs, part, att)
    # the parts' own precision on answers already paid for: stage L's sequences (every position)
    def on_stage_l(b):
        return float(np.max(np.abs(np.asarray(b.forward(X_ln)).reshape(-1, d) - Y)) / np.sqrt(np.mean(Y ** 2)))

    insample = on_stage_l(block)
    # coarse answers: the one-token map R left, judged on stage F's check tokens (fitted by neither refit) at no
    # query; the model check's parts' precision is then this map's, not F+'s (which may end at F_TARGET x the noise)
    final_one = one_token_fidelity(block, one) if coarse else None
    polish = dict(st.get("polish", {}))       # a run resumed after its polish: its figures, and its block below
    if not coarse and ck.to_run("R", done) and insample > POLISH_ABOVE:
        # only a block the model check would take as of this class (its error on stage L's answers within
        # CHECK_FACTOR x the parts' own precision, _verdict's rule) is polished: a refit would absorb a wrong class
        if insample > CHECK_FACTOR * parts_precision(one["fidelity"], att.info["heads_residual"], eps):
            polish = {"block_polish": f"not run: the error on stage L's answers, {insample:.3g}, is above "
                                      f"{CHECK_FACTOR}x the parts' own precision (the model check's rule: a refit "
                                      "would absorb a wrong class)"}
        else:
            q0 = oracle.queries
            describe(f"R block refit (float64 polish: {insample:.2g} on stage L's answers, above {POLISH_ABOVE:g})")
            got, polish = _polish(oracle, rng, scale, block, plan, max_tflop, device, fit_progress("R block refit"))
            after = on_stage_l(got) if got is not None else np.inf
            polish.update(block_polish_kept=after < insample, block_polish_insample_before=insample)
            if after < insample:
                block = got
                polish["block_polish_insample_after"] = after
            mark("R", q0)
            st = {**st, "block": block, "polish": polish}
            ck.save("R", {**st, "stages": stages, "seconds": seconds})
    if not coarse and polish.get("block_polish_kept"):   # just polished, or resumed after the polish
        block = st["block"]
        ln, vs, part, att = parts_of(block, ln, vs, part, att)
        insample = polish["block_polish_insample_after"]
    spent = ck.spent()
    diag = {**_stage_figures(stages, seconds, ratio, ln, vs), "answer_precision": eps,
            "activation": block.activation, "activation_assumed": act, "ln_eps": float(block.eps),
            **({"ln_eps_auto_start": ln_eps, "ln_eps_auto": st.get("ln_eps_auto")} if auto else {}),
            "activation_fits": part.info.get("activation_fits"),
            "one_token_fidelity": one["fidelity"], "ffn_span_iterations": part.info.get("span_iterations"),
            **({} if final_one is None else {"one_token_fidelity_final": final_one}),
            "stage_f_route": "probes" if "probes" in part.info else "full", "stage_f_probes": part.info.get("probes"),
            "stage_f_reads": 1 + len(part.info.get("retried", [])),
            "stage_f_missed": "; ".join(part.info.get("retried", [])) or None,
            "ffn_profile_fit_worst": part.info.get("profile_fit_worst"), "insample_rel_err": insample,
            "heads_residual": att.info["heads_residual"], "heads_polish_sweeps": att.info["polish_sweeps"],
            "heads_read_fit_residual": att.info["read_fit_residual"], "token_norm": scale,
            "heads_read_levels": att.info["levels"],
            **({"heads_read_levels_pilot": att.info["levels_pilot_fits"]} if "levels_pilot_fits" in att.info else {}),
            "resumed_from": done, "neuron_search_resumed_from": st.get("search_resumed"),
            "queries_restored": ck.offset, "refit_device": device, **polish,
            **{(k if k.startswith("block_") else f"one_token_{k}"): v for k, v in refit.items()},
            "fitted": ("FFN span (iterated), neuron profiles (1-D fits), heads (alternating least squares); "
                       + ("LN1, the FFN and LN2 then refitted to one-token answers (stage F's map missed its check)"
                          if refit else "the rest exact algebra")
                       + ("; then every part refitted to answers of fresh sequences (the float64 polish)"
                          if polish.get("block_polish_kept") else "") if not coarse else
                       "every part: the stages' algebra (span, profiles and heads iterated or fitted) is the start "
                       "of two least-squares refits to the answers (one-token map, then the whole block)"),
            **cost(oracle, before)}
    res = BlockExtraction(block=block, ln=ln, value=vs, ffn=part, attention=att, queries=spent,
                          seconds=time.perf_counter() - t0, diagnostics=diag)
    if not check:
        return dataclasses.replace(res, check=ModelCheck("unchecked", model_of(act),
                                                         detail="the model check was skipped"))
    return dataclasses.replace(res, check=_verdict(res, oracle, insample, eps, verify, check_rng))


def _polish(oracle: Oracle, rng: np.random.Generator, scale: float, block, plan: dict, max_tflop: float,
            device: str | None, progress) -> tuple[Any, dict]:
    """Exact (float64) answers, a block above :data:`POLISH_ABOVE` on stage L's answers: ``(block or None,
    figures)``, the block refit (:func:`.block_refit.refit_block`, every part free, at most :data:`POLISH_ITER`
    iterations) on fresh sequences (:func:`_refit_sequences`) from the assembled block. The stages' algebra
    leaves the heads, a fitted part, at the second-order reads' precision (measured at d = 16: 1.5e-8 - 3.6e-8 on
    1 - 3 of every 20 unseen seeds, fidelity up to 1.8e-7), every other part at ~1e-10; from there 200 iterations bring
    every part to ~1e-10 (seed 25322, SiLU: within 3.2e-11, fidelity 7.1e-8 -> 1.7e-12, 938 queries, 2.6 s).
    None (the algebra's block kept) where the plan with the refit would pass ``max_tflop`` or the refit does not
    improve."""
    cost = planned(block.d, block.ffn, probes=False, coarse=True)["R block refit"] * POLISH_ITER / REFIT_ITERATIONS
    if over_limit({**plan, "R polish": cost}, max_tflop):
        return None, {"block_polish": f"not run: with it the plan passes --max-tflop {max_tflop:g}"}
    q0 = oracle.queries
    groups = _refit_sequences(oracle, rng, scale, block)
    try:
        got, info = refit_block(block, groups, rng=rng, max_iter=POLISH_ITER, progress=progress, device=device)
    except ConvergenceError as e:
        return None, {"block_polish": f"did not improve ({e})", "block_polish_queries": int(oracle.queries - q0)}
    return got, {"block_polish": "run", "block_polish_queries": int(oracle.queries - q0),
                 "block_polish_rms_before": info["block_refit_rms_before"],
                 "block_polish_rms_after": info["block_refit_rms_after"],
                 "block_polish_iterations": info["block_refit_iterations"]}


def _refit_again(block, brefit: dict, start, groups, **kw) -> tuple[Any, dict]:
    """R once more from ``start`` with the eps fitted (``--ln-eps``'s second runs), the lower rms of it and of
    ``block`` (R's result, ``brefit`` its figures) kept; the row keeps the first run's starting rms and counts
    both runs' iterations. A run with nothing to gain (the first had ended at the answers' floor: "did not
    improve", measured with --ln-eps auto, seed 22031) keeps ``block``."""
    try:
        new, info = refit_block(start, groups, ln_eps="fit", **kw)
    except ConvergenceError:
        return block, brefit
    if not info["block_refit_rms_after"] < brefit["block_refit_rms_after"]:
        return block, brefit
    return new, {**brefit, **info, "block_refit_rms_before": brefit["block_refit_rms_before"],
                 "block_refit_iterations": brefit["block_refit_iterations"] + info["block_refit_iterations"]}


def _auto_said(ln: OutputLayerNorm, precision: float, start: float | None) -> str:
    """What ``--ln-eps auto`` read from stage L's answers (:func:`ln_eps_measured`), for the row."""
    from ...models.bert_block import BERT_EPS
    limit = ellipsoid_limit(precision)
    if start is None:
        return (f"BERT's {BERT_EPS:g} kept: stage L's answers lie on LN2's ellipsoid (distance "
                f"{ln.sphere_residual:.2g} within {limit:.2g}), so an eps below about {limit:.2g} x LN2's input "
                "variance does not show in them")
    return (f"stage L's answers lie {ln.sphere_residual:.2g} off LN2's ellipsoid (beyond {limit:.2g}): the block "
            f"refit fitted the eps from {start:.2g}")


def _stage_figures(stages: dict, seconds: dict, ratio: float, ln: OutputLayerNorm, vs: ValueSum) -> dict[str, Any]:
    """The figures of stages L, activation and V (and every stage's queries and seconds) that a finished run's
    row and a run stopped after stage V both carry."""
    return {**{f"queries_stage_{k}": v for k, v in stages.items()},
            **{f"seconds_stage_{k}": v for k, v in seconds.items()}, "activation_ratio": ratio,
            "ln2_sphere_residual": ln.sphere_residual, "value_sum_residual": vs.residual,
            "value_sum_conditioning": vs.conditioning}


REFITS = ("F+ one-token refit", "R block refit")    # the stages --refit-device moves to a torch device


def _how_to_go_on(plan: dict[str, float], device: str | None) -> str:
    """The end of the stop-after-V message: the --max-tflop that runs the plan, the journal that makes a long run
    resumable, and which part of it --refit-device and --blas-threads move."""
    total = sum(plan.values()) / 1e12
    refits = sum(v for k, v in plan.items() if k in REFITS) / 1e12
    step = 10.0 ** (math.floor(math.log10(total)) - 1)      # the total rounded up to two digits
    need = math.ceil(total / step) * step
    text = (f"To run them: the same command with --max-tflop {need:.4g}, and with --journal J.sqlite if it has none: "
            "the journal keeps every answer and a checkpoint after each stage" +
            (" and through the refits" if refits > 0 else "") +
            " (and once a minute in stage F's neuron search on the probe route), and the same command goes on from "
            "there")
    if refits > 0 and device in (None, "cpu"):
        text += (f". The two refits are {refits:.3g} of the {total:.3g} TFLOP: --refit-device cuda runs them on a "
                 "GPU (minutes at MiniLM's size; docs/block.md, \"The refits on a GPU\")")
    return text + (". The other stages run in numpy on this machine's CPU, one BLAS thread unless --blas-threads N "
                   "(docs/block.md, \"Not reached\": a block of MiniLM's size, d = 384 and FFN 1536, is about 20 hours of a "
                   "2-core CPU without a GPU)")


def _stopped_after_v(ln, vs, ratio, plan, max_tflop, oracle, before, t0, figures, kind, spent: int,
                     device: str | None = None) -> Exception:
    """The :class:`ComputeLimit` that ends a run after stage V, with the parts read (:class:`BlockParts`);
    ``figures``: :func:`_stage_figures`; the message ends with how to run the rest (:func:`_how_to_go_on`)."""
    from ...errors import ComputeLimit
    from .value_sum import CONSISTENCY
    total = sum(plan.values()) / 1e12
    detail = (f"the identities of the stages run hold: answers on one LayerNorm's hyperplane and ellipsoid (stage L), "
              f"a smooth activation (4th-difference ratio {ratio:.1f}), the one-token Jacobians explained by one "
              f"value-output map (residual {vs.residual:.3g} <= {CONSISTENCY * vs.expected:.3g}); the block as a whole "
              "is not checked (stages F and A not run)")
    mc = ModelCheck("pass", MODEL, answers=kind.describe(), figure=vs.residual, threshold=CONSISTENCY * vs.expected,
                    detail=detail)
    diag = {**figures, "value_sum_expected": vs.expected, "value_sum_step": vs.step,
            "planned_tflop": total, **{f"planned_tflop_{k.replace(' ', '_').replace('+', 'plus').replace('-', '_')}":
                                       v / 1e12 for k, v in plan.items()},
            "max_tflop": float(max_tflop), **cost(oracle, before)}
    parts = BlockParts(ln=ln, value=vs, activation_ratio=ratio, plan=dict(plan),
                       queries=int(spent), seconds=time.perf_counter() - t0,
                       diagnostics=diag, check=mc)
    exc = ComputeLimit(
        f"stopped after stage V: the stages after it plan {total:.3g} TFLOP ({describe(plan)}), above --max-tflop "
        f"{max_tflop:g}. Recovered: LN2's gamma and beta, B = I + sum_h O_h V_h and b (modulo the ones-vector; "
        f"the stencil's measured error {vs.expected:.2g}, conditioning {vs.conditioning:.3g}), {parts.queries} queries. "
        "Not run: stage F (LN1, the FFN), stage A (the heads)" + (", the refits" if "R block refit" in plan else "") +
        ". " + _how_to_go_on(plan, device))
    exc.result = parts
    return exc


def one_token_fidelity(block, one: dict) -> float | None:
    """The block's largest error on the one-token check's fresh tokens (:func:`.ffn.check_one_token`'s
    ``tokens`` and ``answers``, fitted by no refit) over those answers' rms; None where the check kept no
    tokens (a checkpoint written before it did)."""
    if "tokens" not in one:
        return None
    X, Y = np.asarray(one["tokens"]), np.asarray(one["answers"])
    got = np.asarray(block.forward(X[:, None, :])).reshape(Y.shape)
    return float(np.max(np.abs(got - Y)) / np.sqrt(np.mean(Y ** 2)))


def _floor(refit: dict) -> float:
    """The answers' floor the block refit is judged against (rms relative to the answers'): the noise measured
    before F+ where F+ ended at its target (F_TARGET x that noise: its own rms then says how far it was let go,
    not the floor), else F+'s in-sample rms on the same oracle's answers (inf where F+ did not run)."""
    rms, target = float(refit.get("refit_rms_after", np.inf)), refit.get("refit_target")
    if target is not None and rms <= float(target) * (1 + 1e-9) and "refit_noise" in refit:
        return float(refit["refit_noise"])
    return rms


def _fit_noise(oracle: Oracle, seed, scale: float) -> tuple[float, float, int]:
    """The answers' own noise (:func:`~..precision.vector_answer_noise`) relative to their rms and absolute,
    on ``NOISE_SEGMENTS`` short segments of the last token of 4-token sequences (tokens of norm ``scale``),
    and the queries it took: what the block refit's rms is judged against."""
    g = seed if isinstance(seed, np.random.Generator) else np.random.default_rng([int(seed), 0x401E])
    seqs = noise_segments(list(_sequences(g, NOISE_SEGMENTS, 4, oracle.d, scale)), g, input_norm=oracle.input_norm)
    Y = np.asarray(oracle.query(np.stack(seqs)), dtype=np.float64)
    sigma = vector_answer_noise(list(Y))
    return sigma / max(float(np.sqrt(np.mean(Y ** 2))), 1e-300), sigma, len(seqs)


def parts_precision(one_token: float, heads: float, eps: float) -> float:
    """The assembled block's parts' own precision, as the model check reads it: the one-token fidelity, the
    heads' figure, 30x the answers' precision (at least 1e-13)."""
    return max(float(one_token), float(heads), 30.0 * eps, 1e-13)


FIT_NOISE = 10         # coarse answers: the block refit's rms may be this much above the answers' measured noise


def _verdict(res: BlockExtraction, oracle: Oracle, insample: float, eps: float, n: int, seed) -> ModelCheck:
    model = model_of(res.block.activation)
    # coarse answers: stage A's residual is that of a start the block refit replaced; the parts' precision is
    # then the refitted one-token map's fidelity on fresh queries and the answers' own (never the refit's own
    # residual, which a block of the wrong head count would inflate along with the threshold)
    coarse = "block_refit_insample" in res.diagnostics
    # polished (exact answers, _polish): the heads are then the refit's, as good as its error on stage L's answers
    # (only a block already within that rule before it is polished: _extract_block)
    heads = 0.0 if coarse else float(res.diagnostics["block_polish_insample_after"] if res.diagnostics.get(
        "block_polish_kept") else res.diagnostics["heads_residual"])
    # coarse answers: the final block's own one-token map (R's), on the check's fresh tokens, where it was read
    final = res.diagnostics.get("one_token_fidelity_final")
    parts = parts_precision(float(res.diagnostics["one_token_fidelity"] if final is None else final), heads, eps)
    noise = fit = sigma = None
    nq = 0
    if coarse and n > 0:
        # a refit of the right class ends at the answers' own noise (measured: 0.94 - 1.2x on random float32
        # blocks, transformers' float32 BertLayer and DistilBERT block, noise and rounding defences; 2.3x on
        # MiniLM's block 2 after 1,000 iterations); the parts' figures above are those of the fit, which a wrong
        # class inflates along with the threshold (transformers' tanh-GELU BertLayer, d = 16: refit rms 1.1e-5 =
        # 131x the noise, fidelity 9.8e-5 within a threshold of 7e-3)
        try:
            noise, sigma, nq = _fit_noise(oracle, seed, float(res.diagnostics["token_norm"]))
        except BudgetExceeded as e:
            return ModelCheck("unchecked", model, oracle.output.describe(oracle.d_out),
                              detail=f"the query budget ran out before the check ({e})")
        noise = max(noise, 0.5 * 2.0 ** -24)
        fit = float(res.diagnostics["block_refit_rms_after"])

    which = "the refitted block's " if final is not None else ""

    def judge(f):
        threshold = CHECK_FACTOR * max(insample, parts)
        detail = (f"fidelity {f.max_rel_err:.3g} on {n} fresh sequences of 1 to 16 tokens (every position); "
                  f"threshold {threshold:.3g}: {CHECK_FACTOR}x the larger of the error on stage L's answers "
                  f"({insample:.3g}) and the parts' own precision ({parts:.3g}: {which}one-token fidelity, the heads' "
                  f"residual, 30x the answers' precision {eps:.2g})" + (
                      "" if insample <= CHECK_FACTOR * parts else
                      f"; the error on stage L's answers is itself above {CHECK_FACTOR}x the parts'"))
        ok = f.max_rel_err <= threshold and insample <= CHECK_FACTOR * parts
        message = f"the target does not behave like {model}: {detail}"
        if fit is not None:
            fits = fit <= FIT_NOISE * noise
            detail += (f"; the block refit's rms {fit:.3g} is {fit / noise:.2g}x the answers' own noise {noise:.3g} "
                       f"(measured on {NOISE_SEGMENTS} short segments, {nq} queries; at most {FIT_NOISE}x)")
            if not fits:
                from ...models.activations import SMOOTH
                other = "another activation (--activation: " + ", ".join(
                    a for a in SMOOTH if a != res.block.activation) + ")"
                message = (f"the target does not behave like {model} of this shape: the block refit fits the "
                           f"answers only to rms {fit:.3g}, {fit / noise:.3g}x their own noise {noise:.3g} (at most "
                           f"{FIT_NOISE}x); {other} or another width fits no better, and neither does a refit "
                           "stopped short of the answers' floor (it stopped: "
                           f"{res.diagnostics.get('block_refit_message')}). Fidelity {f.max_rel_err:.3g} "
                           "on fresh sequences")
            ok = ok and fits
        return ok, threshold, detail, message

    return fresh_verdict(res, oracle, model=model, n=n, seed=seed, judge=judge, noise=sigma,
                         noise_queries=nq)


__all__ = ["BlockExtraction", "BlockParts", "assemble", "block_errors", "expected_queries", "extract_block",
           "parts_from_block", "parts_of"]
