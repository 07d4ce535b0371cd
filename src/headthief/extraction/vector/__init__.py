"""Vector answers (ours): a multi-head attention layer with output projection from hidden-state answers.

``extract_vector(oracle)`` recovers every head's ``W_h`` (as ``K_h^T Q_h / sqrt(d_h)``), score bias ``c_h``,
``O_h = Wo[:, h] V_h`` and the output bias ``b = bo + Wo bv`` (:mod:`headthief.models.mha` explains why
these and nothing finer are identifiable), up to a permutation of the heads, in three stages:

A. d + 1 one-token queries: ``y = M x + b`` with ``M = sum_h O_h`` (:mod:`.affine`);
B. saturated two-token queries: projectors ``O_S M^+`` separate the heads' output spaces, so the split
   into heads is found, and with it the head count (:mod:`.spaces`);
C. soft queries with shared anchor tokens: every head's attention weights read from its part of the
   answer, then its key and query spaces and the core of ``W_h`` and ``c_h`` by least squares (:mod:`.scores`).

Proposition 7.1 (heads are not identifiable from one scalar readout) is a property of the scalar answer:
with vectors the split is identifiable exactly when the heads' output spaces ``col(O_h)`` are linearly
independent (``sum_h rank O_h = rank M``) and no two heads attend alike on every two-token query (equal
``(W_h, c_h)``, when their ``O_h`` can only be learnt as a sum).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ...errors import NotIdentifiable, SpecError
from ...models.mha import CanonicalLayer
from ...oracles.answers import Output
from ...oracles.base import Oracle
from ..check import counters, cost, fresh_verdict
from ..precision import ModelCheck
from ..result import Fidelity, freeze_fields
from .affine import affine_part
from .scores import fit_scores, read_scores
from .refine import directed_maps, solve_directed
from .spaces import head_spaces, output_maps
from ...linalg import svd

MODEL = "a multi-head attention layer with output projection"
OVERSAMPLE_EXACT = 2.0     # stage C's reads per direction they tell, exact (float64) answers
OVERSAMPLE_NOISY = 4.0     # ... rounded answers (measured relative noise above NOISY: float32); docs/vector.md
NOISY = 1e-9
FIT_LIMIT = 1e-2      # a layer whose error on its own fitted answers is above this is not the assumed model
POLISH_ROUNDS = 3     # refits of the O_h (maps cleared of unsaturated heads) and the scores, from answers paid for


@dataclass(frozen=True, eq=False)
class VectorExtraction:
    """What ``--method vector`` recovered (a :class:`~headthief.models.mha.CanonicalLayer`) and what it cost."""

    layer: CanonicalLayer
    queries: int
    seconds: float
    diagnostics: Mapping[str, Any] = field(default_factory=dict)
    check: Any = None
    method: str = "vector"

    def __post_init__(self):
        freeze_fields(self, ())

    @property
    def d(self) -> int:
        return self.layer.d

    @property
    def heads(self) -> int:
        return self.layer.heads

    @property
    def rank(self) -> int:
        return int(self.layer.A.shape[2])

    def predict(self, batch):
        return self.layer.evaluate(batch)

    def verify(self, oracle: Oracle, n: int = 256, *, rng=0, max_len: int = 16) -> Fidelity:
        return vector_fidelity(self.layer, oracle, n, rng=rng, max_len=max_len,
                               token_norm=self.diagnostics.get("token_norm"))

    def errors(self, truth: CanonicalLayer) -> dict[str, Any]:
        return self.layer.errors(truth)

    def save(self, path) -> None:
        """``.safetensors``: the layer in transformers' BertSelfAttention + BertSelfOutput.dense naming
        (:mod:`headthief.models.bert_export`); anything else: the canonical arrays with ``numpy.savez``."""
        p = str(path)
        if p.endswith(".safetensors"):
            from ...models.bert_export import save_bert_attention
            save_bert_attention(self.layer, p)
            return
        L = self.layer
        np.savez(p, A=L.A, B=L.B, C=L.C, U=L.U, Vt=L.Vt, b=L.b, causal=L.causal,
                 W=np.stack([L.W(h) for h in range(L.heads)]), O=np.stack([L.O(h) for h in range(L.heads)]))


def _fresh(d: int, n: int, rng: np.random.Generator, max_len: int, norm: float):
    lens = rng.integers(1, max_len + 1, size=n)
    return [rng.standard_normal((int(N), d)) * (norm / np.sqrt(d)) for N in lens]


def vector_fidelity(layer: CanonicalLayer, oracle: Oracle, n: int, *, rng=0, max_len: int = 16,
                    token_norm: float | None = None) -> Fidelity:
    """Largest error of any answered number on ``n`` fresh sequences over the rms of the answers."""
    rng = np.random.default_rng(rng)
    R = oracle.input_norm
    norm = token_norm or (0.5 * R if R is not None else float(np.sqrt(oracle.d)))
    if R is not None:
        norm = min(norm, R)
    batch = _fresh(oracle.d, n, rng, max_len, norm)
    before = oracle.queries
    y = oracle.query_packed(batch)
    from ...oracles.answers import pack
    yh = pack(oracle.output, layer.evaluate(batch), batch, layer.d_out)
    rms = float(np.sqrt(np.mean(y ** 2)))
    err = float(np.max(np.abs(yh - y)))
    return Fidelity(n=n, queries=oracle.queries - before, max_abs_err=err, rms_true=rms,
                    max_rel_err=err / max(rms, 1e-300))


def extract_vector(oracle: Oracle, *, heads: int | None = None, causal: bool | None = None,
                   rng: np.random.Generator | int = 0, check: bool = True, verify: int = 256, check_rng: int = 10_000,
                   oversample: float | None = None, max_maps: int = 40, refine: bool = True,
                   progress=None) -> VectorExtraction:
    """Recover a multi-head attention layer with output projection from vector answers (see the module).

    Args:
        oversample: stage C's reads per direction they must tell (:func:`.scores.read_scores`); None
            (default): :data:`OVERSAMPLE_NOISY` for rounded answers at every position (measured relative noise
            above :data:`NOISY`: float32), else :data:`OVERSAMPLE_EXACT`. Twice the reads halve the score fit's
            variance; with the last position's answers only, a read is one query (8,304 of MiniLM layer 2's
            18,815 queries), so there the reads stay as for exact answers (measured in docs/vector.md).
        refine: after stage C, take aimed maps (:mod:`.refine`: every head set 60 logits to a chosen side
            by the recovered score gradients, perturbations half the token long off those gradients;
            (H + 2)(d - H) more queries), solve the O_h from them and refit the scores; kept only where
            the layer then fits the answers already paid for better. Without it, a polish that clears
            stage B's maps of nearly-saturated heads' leak (no queries) is run instead.
        oracle: answers with vectors (``oracle.output`` ``last`` or ``all``); refused before the first
            query otherwise.
        heads: the head count, or None to find it (the parts the output space splits into).
        causal: the layer's mask as the user knows it (``headthief extract --causal``): True, each position
            attends to itself and earlier ones (False: bidirectional, checked alike); None (default), detected
            by stage A's two-token query with answers at every position and taken as bidirectional with the
            last position's only. At the last position a causal and a bidirectional layer with the same weights answer alike, so there the
            declaration is not checked: it sets the recovered layer's mask (its other positions, what
            ``save`` writes). With every position's answer a declaration the two-token query contradicts
            raises :class:`ModelMismatch` before stage B.
        check / verify / check_rng: the model check: fresh sequences compared number by number; a figure
            above 10 x the method's own error on the answers it was fitted to (floored at 30 x the answers'
            measured relative noise), or a fit error above 1e-2, raises :class:`ModelMismatch` (exit 5).
    """
    if not oracle.output.vector:
        raise SpecError(f"--method vector needs vector answers (a hidden-state API: output=last or all); this "
                        f"target answers {oracle.output.describe(oracle.d_out)}: use a scalar method "
                        "(multihead, lowrank, exact)")
    rng = np.random.default_rng(rng)
    t0 = time.perf_counter()
    before = counters(oracle)
    aff = affine_part(oracle, rng, causal=causal)
    if progress is not None:
        progress(aff.queries)
    sp = head_spaces(oracle, aff, rng, heads=heads, max_maps=max_maps, progress=progress)
    O, design_rank = output_maps(sp, aff.M)
    # the reads see the mask only where they read earlier positions: at the last one it attends to every token
    # either way, so a declared mask changes no query and no fitted number there, only the layer assembled below
    masked_reads = bool(aff.causal) and aff.detected is not None
    if oversample is None:
        noisy = aff.rel_noise > NOISY and oracle.output is not Output.LAST
        oversample = OVERSAMPLE_NOISY if noisy else OVERSAMPLE_EXACT
    sc, reads = read_scores(oracle, aff.b, O, rng, causal=masked_reads, oversample=oversample, progress=progress)
    r = sp.bases[0].shape[1]
    layer = _assemble(sc, O, r, aff.b, bool(aff.causal), oracle.output)
    insample = _insample(layer, reads)
    polish = []
    for _ in range(0 if refine else POLISH_ROUNDS):   # (the aimed maps of refine supersede the polish)       # no query: the maps and the reads already paid for, fitted again
        model = (np.stack([a @ b.T for a, b in zip(sc.A, sc.B)]), sc.C, O)
        O_new = output_maps(sp, aff.M, model=model)[0]
        sc_new = fit_scores(reads, aff.b, O_new, rng)
        layer_new = _assemble(sc_new, O_new, r, aff.b, bool(aff.causal), oracle.output)
        err_new = _insample(layer_new, reads)
        polish.append({"insample_rel_err": err_new, "score_fit_rms": sc_new.fit_rms})
        if not err_new < 0.8 * insample:            # keep a round only where it fits the paid answers better
            break
        O, sc, layer, insample = O_new, sc_new, layer_new, err_new
    refined = {}
    if refine:
        # aimed maps: the recovered score gradients choose every head's side and the safe directions (:mod:`.refine`)
        Wm = np.stack([a @ b.T for a, b in zip(sc.A, sc.B)])
        meas, q_ref, info = directed_maps(oracle, Wm, sc.C, aff.rel_noise, rng, progress=progress)
        refined = {"refine_queries": q_ref, **info}
        O_new = solve_directed(meas, aff.M, sp.noise_M, len(O), r) if meas else None
        if O_new is not None:
            try:
                sc_new = fit_scores(reads, aff.b, O_new, rng)
            except NotIdentifiable as e:               # the refit failed: keep stage C's layer, say why
                refined["failed"] = str(e)
                O_new = None
        if O_new is not None:
            layer_new = _assemble(sc_new, O_new, r, aff.b, bool(aff.causal), oracle.output)
            err_new = _insample(layer_new, reads)
            refined["insample_rel_err"] = err_new
            refined["kept"] = bool(err_new < insample)
            if err_new < insample:
                O, sc, layer, insample = O_new, sc_new, layer_new, err_new
    spent = oracle.queries - before["queries"]
    diag = {"heads_found": len(sp.bases), "head_dim": int(sp.bases[0].shape[1]), "rank_M": sp.rank,
            "causal": aff.causal, **({"causal_declared": aff.declared} if aff.declared is not None else {}),
            "answer_rel_noise": aff.rel_noise, "stage_C_oversample": float(oversample), "stage_A_queries": aff.queries,
            "stage_B_queries": sp.queries, "stage_C_queries": sc.queries,
            "stage_R_queries": int(refined.get("refine_queries", 0)), "refine_kept": bool(refined.get("kept", False)), "saturated_maps": sp.maps,
            "maps_rejected": sp.rejected, "selection_rank": design_rank, "map_idempotency": sp.idempotency, "score_fit_rms": sc.fit_rms,
            "score_reads": sc.reads, "polish": polish, "insample_rel_err": insample, "refine": refined, "token_norm": sc.token_norm, "numbers_received": int(oracle.numbers),
            **cost(oracle, before)}
    res = VectorExtraction(layer=layer, queries=spent, seconds=time.perf_counter() - t0, diagnostics=diag)
    if not check:
        return dataclasses.replace(res, check=ModelCheck("unchecked", MODEL, detail="the model check was skipped (--no-check)"))
    return dataclasses.replace(res, check=_verdict(res, oracle, aff.rel_noise, insample, verify, check_rng))


def _assemble(sc, O, r: int, b, causal: bool, output) -> CanonicalLayer:
    """The canonical layer from stage C's scores and the output maps (each O_h cut to rank r)."""
    Us, Vts = [], []
    for h in range(len(O)):
        U, s, Vt = svd(O[h], full_matrices=False)
        Us.append(U[:, :r])
        Vts.append((s[:r, None] * Vt[:r]).T)
    return CanonicalLayer(A=np.stack(sc.A), B=np.stack(sc.B), C=sc.C, U=np.stack(Us), Vt=np.stack(Vts),
                          b=b, causal=causal, output=output)


def _insample(layer: CanonicalLayer, reads) -> float:
    """The recovered layer's largest error on stage C's own answers (already paid for), over their rms: the
    method's precision on this target, against which the fresh sequences are judged."""
    X = np.stack([x for g in reads.groups for x, _, _ in g])          # every read has n tokens
    Y = np.concatenate([y.reshape(-1) for g in reads.groups for _, _, y in g])
    Yh = np.asarray(layer.evaluate(X)).reshape(-1)
    return float(np.max(np.abs(Yh - Y)) / max(float(np.sqrt(np.mean(Y ** 2))), 1e-300))


def _verdict(res: VectorExtraction, oracle: Oracle, rel_noise: float, insample: float, n: int, seed) -> ModelCheck:
    def judge(f):
        # the method's own precision: its error on the answers it was fitted to, floored at 30x the answers'
        # measured noise; a fresh sequence an order of magnitude worse than that is not the assumed model
        threshold = 10.0 * max(insample, 30.0 * rel_noise, 1e-13)
        detail = (f"fidelity {f.max_rel_err:.3g} on {n} fresh sequences (every answered number); threshold "
                  f"{threshold:.3g}: 10x the method's error on the answers it was fitted to ({insample:.3g}), "
                  f"floored at 30x the answers' measured relative noise {rel_noise:.3g}")
        message = (f"the target does not behave like {MODEL}: {detail}" + (
            f"; the layer does not even fit the answers it was fitted to (error {insample:.3g} > {FIT_LIMIT})"
            if insample > FIT_LIMIT else "")
            + " (a deeper model, a nonlinearity after the attention, or a layer this method cannot resolve)")
        return f.max_rel_err <= threshold and insample <= FIT_LIMIT, threshold, detail, message

    return fresh_verdict(res, oracle, model=MODEL, n=n, seed=seed, judge=judge)


__all__ = ["extract_vector", "VectorExtraction", "vector_fidelity"]
