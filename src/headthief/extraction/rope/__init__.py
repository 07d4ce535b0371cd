"""``--method rope`` (ours): a causal attention layer with rotary position embeddings (RoPE) and grouped-query
heads, as transformers' ``LlamaAttention`` runs it, from vector answers at every position.

The score of key i for the query at t is ``x_t^T Q_h^T R((i - t) theta) K_g x_i / sqrt(d_h)``: one bilinear form
per offset, all tied by the rotation (:mod:`headthief.models.rope`). Three stages:

H. saturated causal queries: every head's ``O_h = Wo_h V_g``, the key/value groups, ``M`` and ``b``
   (:mod:`.partitions`); the causal mask checked on every row;
S. the attention weights of every head read from the answers with a zero token as the reference; the query
   spaces, the key spaces (which fix the GQA grouping) and every head's form at offsets 1 .. N - 2
   (:mod:`.scores`);
R. theta from the eigenvalues of the pencil ``T(1)^{-1} T(D)``, then ``K_g`` and every ``Q_h``
   (:mod:`.rotation`).

With imprecise (float32) answers two more: O. after H, every ``O_h`` refined by alternating least squares over
random sequences (:mod:`.outputs`); Q. after R, every ``W_q^h`` and ``W_k^g`` refitted in all of R^d to stage S's
logit readings with theta fixed (:mod:`.refine`): each removes the error that the stage before it leaves to the
next (measured in docs/decoder.md).

Recovered up to the symmetries that commute with the rotation: per key/value group and frequency plane, a
rotation and a scale of the plane's two key coordinates (``K_g``'s rows f and f + d_h/2), undone on the same rows
of every ``Q_h`` of the group (its inverse transpose); ``V_g`` and ``Wo_h`` only as the products
``O_h = Wo_h V_g`` (a GL(d_h) per group); the order of the heads inside a group and of the groups. ``theta`` is
read from the answers, not assumed. Biases on the queries or keys are outside the model (their zero-token
reference is no longer 0: the model check fails); the output bias ``b = bo + Wo bv`` is recovered.

The model check compares the recovered layer with the target on fresh sequences up to ``verify_len`` tokens,
longer than any extraction query (length generalisation, which RoPE's relative form makes possible).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ...errors import NotIdentifiable, SpecError
from ...models.rope import RopeAttention
from ...oracles.answers import Output
from ...oracles.base import Oracle
from ..check import counters, cost, fresh_verdict
from ..precision import ModelCheck, answer_kind
from ..result import Fidelity, freeze_fields, rel_err
from .outputs import SEQUENCES, refine_outputs
from .partitions import CHECKS, find_heads, round_tokens
from .refine import refine_scores
from .rotation import rotation_parts
from .scores import EXTRA, PRECISE, WeightReader, find_spaces, form_layout, oversample, read_forms, space_layout

MODEL = "a causal RoPE attention layer with grouped-query heads (LlamaAttention)"
SAVE_FORMAT = "headthief-llama-attention-1"     # safetensors metadata: LlamaAttention's tensor names, float64
CHECK_FACTOR = 100      # fresh (longer) sequences may be this much worse than the error on the answers paid for
MIN_LEN = 4             # the shortest query length that reads two offsets
FIT_LIMIT = 1e-2        # a layer that fits the answers paid for worse than this is not the model


@dataclass(frozen=True, eq=False)
class RopeExtraction:
    """What ``--method rope`` recovered: ``layer`` (a :class:`~headthief.models.rope.RopeAttention`, float64),
    what it cost, the figures per stage and the model check."""

    layer: RopeAttention
    group: np.ndarray
    queries: int
    seconds: float
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    check: Any = None
    method: str = "rope"

    def __post_init__(self):
        freeze_fields(self, ("group",))

    @property
    def d(self) -> int:
        return self.layer.d

    @property
    def heads(self) -> int:
        return self.layer.heads

    @property
    def rank(self) -> int:
        return self.layer.head_dim

    def predict(self, batch):
        return self.layer.evaluate(batch)

    def verify(self, oracle: Oracle, n: int = 256, *, rng=0, max_len: int | None = None) -> Fidelity:
        """Largest error of any answered number on ``n`` fresh sequences of 1 to ``max_len`` tokens (default
        ``verify_len``, 64: longer than any extraction query) over the answers' rms."""
        from ..vector import vector_fidelity
        L = int(max_len or self.diagnostics.get("verify_len", 64))
        return vector_fidelity(self.layer, oracle, n, rng=rng, max_len=L, token_norm=float(np.sqrt(self.d)))

    def errors(self, truth: RopeAttention) -> dict[str, Any]:
        return rope_errors(self.layer, truth)

    def save(self, path) -> None:
        """``.safetensors``: ``q_proj`` .. ``o_proj`` under transformers' ``LlamaAttention`` names (float64;
        loadable into ``LlamaAttention``), with heads, kv_heads, head_dim and rope_theta in the metadata;
        anything else: the same tensors with ``numpy.savez``."""
        p = str(path)
        L = self.layer
        tensors = {k: np.asarray(v, dtype=np.float64) for k, v in L.state_dict().items()}
        if p.endswith(".safetensors"):
            from ...models.bert_export import writable_path, write_safetensors
            write_safetensors(tensors, writable_path(p), {
                "format": SAVE_FORMAT, "heads": str(L.heads), "kv_heads": str(L.kv_heads),
                "head_dim": str(L.head_dim), "rope_theta": repr(float(L.theta))}, None)
            return
        np.savez(p, theta=np.float64(L.theta), **{k.replace(".", "/"): v for k, v in tensors.items()})


def _planes(K: np.ndarray) -> np.ndarray:
    """(..., dh, d) -> complex (..., dh/2, d): plane f's two rows f and f + dh/2 as k_f + i k_{f + dh/2}."""
    half = K.shape[-2] // 2
    return K[..., :half, :] + 1j * K[..., half:, :]


def rope_errors(est: RopeAttention, truth: RopeAttention) -> dict[str, Any]:
    """Relative errors up to the symmetries (see the module): heads matched by their ``O_h``; per group and
    plane the complex factor z that best maps the true key plane onto the recovered one, the queries
    compared after ``conj(z)``; ``theta`` relative; the output bias absolute."""
    if not isinstance(truth, RopeAttention):
        raise TypeError(f"rope_errors compares with a RopeAttention, got {type(truth).__name__}")
    if (est.heads, est.kv_heads, est.head_dim, est.d) != (truth.heads, truth.kv_heads, truth.head_dim, truth.d):
        return {"shape_mismatch": f"recovered H={est.heads}, G={est.kv_heads}, d_h={est.head_dim}; "
                                  f"true H={truth.heads}, G={truth.kv_heads}, d_h={truth.head_dim}"}
    dh, r = est.head_dim, est.group_size

    def O(L, h):
        return L.Wo[:, h * dh:(h + 1) * dh] @ L.V[h // L.group_size]

    Ot = [O(truth, h) for h in range(truth.heads)]
    match = [int(np.argmin([np.linalg.norm(O(est, h) - o) for o in Ot])) for h in range(est.heads)]
    gmap = {h // r: match[h] // truth.group_size for h in range(est.heads)}
    Ke, Kt = _planes(est.K), _planes(truth.K)
    Qe, Qt = _planes(est.Q), _planes(truth.Q)
    z = np.zeros((est.kv_heads, dh // 2), complex)
    k_num = k_den = 0.0
    for g in range(est.kv_heads):
        tg = gmap[g]
        for f in range(dh // 2):
            kt, ke = Kt[tg, f], Ke[g, f]
            z[g, f] = np.vdot(kt, ke) / np.vdot(kt, kt)
            k_num += float(np.linalg.norm(ke / z[g, f] - kt) ** 2)
            k_den += float(np.linalg.norm(kt) ** 2)
    per_head, q_worst, o_worst = [], 0.0, 0.0
    for h in range(est.heads):
        th, g = match[h], h // r
        qa = Qe[h] * np.conj(z[g])[:, None]
        q_err = float(np.linalg.norm(qa - Qt[th]) / np.linalg.norm(Qt[th]))
        o_err = rel_err(O(est, h), Ot[th])
        q_worst, o_worst = max(q_worst, q_err), max(o_worst, o_err)
        per_head.append({"head": h, "true_head": th, "group": g, "true_group": gmap[g], "Q_rel_err": q_err,
                         "O_rel_err": o_err})
    groups_ok = all(gmap[h // r] == match[h] // truth.group_size for h in range(est.heads)) and \
        len(set(match)) == est.heads
    def b(L):                                   # the identifiable output bias: bo + Wo bv
        return L.bo + L.Wo @ np.repeat(L.bv, L.group_size, axis=0).reshape(-1)

    b_est, b_true = b(est), b(truth)
    return {"Q_rel_err": q_worst, "K_rel_err": float(np.sqrt(k_num / k_den)), "O_rel_err": o_worst,
            "theta_rel_err": abs(est.theta - truth.theta) / truth.theta,
            "b_abs_err": float(np.max(np.abs(b_est - b_true))), "heads_matched": bool(groups_ok),
            "per_head": per_head}


def _insample(layer: RopeAttention, reads) -> float:
    X, Y = reads
    Yh = layer.forward(X)
    return float(np.max(np.abs(Yh - Y)) / max(float(np.sqrt(np.mean(Y ** 2))), 1e-300))


def extract_rope(oracle: Oracle, *, heads: int | None = None, rng: np.random.Generator | int = 0, check: bool = True,
                 verify: int = 256, check_rng: int = 10_000, max_len: int = 16, verify_len: int = 64,
                 progress=None) -> RopeExtraction:
    """Recover a causal RoPE attention layer (see the module).

    Args:
        oracle: answers a d-vector at every position (``output=all``); refused before the first query otherwise.
        heads: the number of query heads, or None to find it.
        max_len: the longest query the extraction sends (>= 4); the score forms are read at offsets up to
            ``min(max_len, d_h) - 2``.
        verify_len: the model check's fresh sequences have 1 to ``verify_len`` tokens.
        check / verify / check_rng: the model check: a fidelity on fresh sequences worse than
            ``CHECK_FACTOR`` x the error on the answers paid for (floored at 30 x the answers' precision) raises
            :class:`ModelMismatch` (exit 5).
    """
    if oracle.output is not Output.ALL:
        raise SpecError(f"--method rope needs the answer at every position (output=all): the causal mask and the "
                        f"offsets are read there; this target answers {oracle.output.describe(oracle.d_out)}")
    if oracle.d_out != oracle.d:
        raise SpecError(f"--method rope needs answers of the tokens' dimension (o_proj: d -> d); got d_out = "
                        f"{oracle.d_out}, d = {oracle.d}")
    if int(max_len) < MIN_LEN:
        raise SpecError(f"--max-len {max_len}: --method rope needs queries of {MIN_LEN} tokens at least")
    rng = np.random.default_rng(rng)
    t0 = time.perf_counter()
    before = counters(oracle)
    probe = np.asarray(oracle.query(rng.standard_normal((2, 2, oracle.d))), dtype=np.float64)
    kind = answer_kind(oracle, probe)
    eps = max(kind.eps, kind.tau / max(float(np.sqrt(np.mean(probe ** 2))), 1e-300))
    if progress is not None:
        progress(2)
    start_h = oracle.queries
    discarded = 0                   # queries of a first stage H (and O) whose split did not explain the answers
    part = find_heads(oracle, rng, precision=eps, heads=heads, max_len=max_len, progress=progress)
    if eps > PRECISE:               # float32 answers: stage H's O_h (~1e-5) would limit every later stage
        try:
            part = refine_outputs(oracle, part, rng, max_len=max_len, progress=progress)
        except NotIdentifiable as first:
            # stage H's split does not explain the answers: once more, every round with the smaller moves (which
            # change the token a head picks on fewer rows); a second refusal is the answer
            discarded = oracle.queries - start_h
            part = find_heads(oracle, rng, precision=eps, heads=heads, max_len=max_len, retry=True, progress=progress)
            try:
                part = refine_outputs(oracle, part, rng, max_len=max_len, progress=progress)
            except NotIdentifiable as second:
                raise NotIdentifiable(f"{second} (a second stage H with smaller moves; the first: {first})") from first
    reader = WeightReader(part)
    sp = find_spaces(oracle, part, reader, rng, max_len=max_len, precision=eps, progress=progress)
    fm = read_forms(oracle, part, sp, reader, rng, max_len=max_len, precision=eps, progress=progress)
    rot = rotation_parts(fm.T, fm.offsets, part.group, sp.Ua, sp.Ub, tol=part.info["linearity_tol"])
    Q, K, refit = rot.Q, rot.K, {}
    if eps > PRECISE:               # float32 answers: the spaces (~5e-5) limit the forms; refit in all of R^d
        Q, K, refit = refine_scores(rot.Q, rot.K, rot.theta, part.group, fm.logits)
    fm = dataclasses.replace(fm, logits=())
    bias = bool(np.any(np.abs(part.b) > 0))
    layer = RopeAttention(Q=Q, K=K, V=part.V, Wo=part.Wo, bo=part.b if bias else None, bias=bias,
                          theta=rot.theta)
    insample = _insample(layer, fm.reads)
    if insample > FIT_LIMIT and eps > PRECISE:
        raise NotIdentifiable(
            f"the recovered layer fits the answers paid for only to {insample:.3g} (> {FIT_LIMIT}) at this answer "
            f"precision ({eps:.2g}), which cannot tell a wrong model from the method's own imprecision: the heads' "
            f"attention weights are read through stage H's O_h (sum error {part.info['sum_rel_err']:.2g}), the "
            f"forms fit to {fm.residual:.2g}, and {rot.info['planes_still']} of {layer.head_dim // 2} rotation "
            f"planes turn too slowly over offsets 1..{int(fm.offsets[-1])} to be read (theta read as {rot.theta:.6g}; "
            f"{layer.heads} heads in {layer.kv_heads} key/value groups found)")
    spent = oracle.queries - before["queries"]
    longest = max(int(part.info["tokens_per_query"]), int(fm.info["form_tokens"]), 2,
                  int(sp.info["keys_per_space_query"] + sp.info["queries_per_space_query"] + 1))
    diag = {"heads_found": layer.heads, "kv_heads_found": layer.kv_heads, "head_dim": layer.head_dim,
            "theta": rot.theta, "freqs_read": rot.info["freqs_read"], "answer_precision": eps,
            "queries_stage_H": part.queries, "queries_stage_O": int(part.info.get("output_queries", 0)),
            "queries_stage_H_discarded": discarded,
            "queries_stage_S": sp.queries + fm.queries,
            "longest_extraction_query": longest, "verify_len": int(verify_len), "insample_rel_err": insample,
            "form_residual": fm.residual, **{k: v for k, v in part.info.items() if k != "head_dim"},
            **sp.info, **fm.info, **refit, **{k: v for k, v in rot.info.items() if k not in ("theta", "freqs_read")},
            "numbers_received": int(oracle.numbers), **cost(oracle, before)}
    res = RopeExtraction(layer=layer, group=part.group, queries=spent, seconds=time.perf_counter() - t0,
                         diagnostics=diag)
    if not check:
        return dataclasses.replace(res, check=ModelCheck("unchecked", MODEL, detail="the model check was skipped (--no-check)"))
    return dataclasses.replace(res, check=_verdict(res, oracle, insample, eps, verify, check_rng, verify_len))


def _verdict(res: RopeExtraction, oracle: Oracle, insample: float, eps: float, n: int, seed, verify_len) -> ModelCheck:
    def judge(f):
        threshold = CHECK_FACTOR * max(insample, 30.0 * eps, 1e-13)
        detail = (f"fidelity {f.max_rel_err:.3g} on {n} fresh sequences of 1 to {verify_len} tokens (every "
                  f"position; the extraction's longest query had {res.diagnostics['longest_extraction_query']}); "
                  f"threshold {threshold:.3g}: {CHECK_FACTOR}x the error on the answers paid for ({insample:.3g}), "
                  f"floored at 30x the answers' precision {eps:.2g}" + (
                      "" if insample <= FIT_LIMIT else
                      f"; the layer does not fit the answers paid for ({insample:.3g} > {FIT_LIMIT})"))
        message = (f"the target does not behave like {MODEL}: {detail} (a sliding window, a position bias, or a "
                   "layer this method cannot resolve)")
        return f.max_rel_err <= threshold and insample <= FIT_LIMIT, threshold, detail, message

    return fresh_verdict(res, oracle, model=MODEL, n=n, seed=seed, judge=judge, max_len=verify_len)


def expected_queries(d: int, head_dim: int | None, max_len: int = 16, float32: bool = False) -> int | None:
    """The planned query count without retries (stage H: one round), from the stages' own layouts, or None
    when the head dimension is not known in advance."""
    if not head_dim:
        return None
    over = oversample(2.0 ** -24 if float32 else 2.0 ** -53)
    _, _, _, batches = space_layout(head_dim, max_len)
    _, k = form_layout(head_dim, max_len)
    probe, zero_token = 2, 1
    stage_h = zero_token + round_tokens(max_len) * d + 1 + CHECKS
    stage_o = d + EXTRA + SEQUENCES if float32 else 0
    return probe + stage_h + stage_o + batches * 2 * (over * d + EXTRA) + (2 if k else 1) * (
        2 * over * head_dim ** 2 + EXTRA)


__all__ = ["RopeExtraction", "expected_queries", "extract_rope", "rope_errors"]
