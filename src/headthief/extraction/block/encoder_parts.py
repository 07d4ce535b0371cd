"""What a BERT encoder API gives away without any block being taken apart (issue 19: ``hidden=last``, and
``hidden=all`` past the size :mod:`.encoder`'s dense stage V is built for).

An encoder queried with ``inputs_embeds`` adds one offset per position (``c_t = position_embeddings[t] +
token_type_embeddings[0]``), normalises (LN_emb), and runs position-free blocks, the last ending in a
LayerNorm. Three parts follow from that alone, at any d:

* **the offsets, modulo the ones-vector, from the last layer's states alone** (:func:`offsets_by_scale`).
  Every answer depends on token t only through ``normalize(x_t + c_t)``, so it does not move when ``x_t``
  is scaled about ``-c_t``. The Jacobian of all answers with respect to ``x_t`` (central differences)
  therefore annihilates ``x_t + c_t``: stacked over ``BASES`` base sequences, ``J_k c = -J_k x_k`` is a start.
  Then Newton on the exact invariance: with ``x'_t = a (x_t + c) - c`` the answers move by
  ``((a - 1) / a) J (c - c_t)`` to first order, measured at the answers' own precision (not a finite
  difference's), so a few steps bring c to that precision (measured on the real all-MiniLM-L6-v2 in
  float32: start 1.4e-3 - 3.7e-3, after Newton 3.6e-6 - 3.8e-6 relative with ``hidden=last``: the eight
  ``SCALES`` average the answers' rounding, two gave 5.3e-6 - 6.6e-6). With ``hidden=all`` stage E
  (:mod:`.embeddings`) reads them from ``h_0`` with LN_emb, and Newton starts from there;
* **every observed layer's output LayerNorm** (stage L, :func:`.layernorm.fit_output_layernorm`): with
  ``hidden=last`` the last block's ``gamma_2, beta_2`` (exact, up to the global sign), with ``hidden=all``
  every block's;
* **the activation's class, as a figure** (:func:`.smoothness.check_smooth_activation` along great circles of
  one-token ``inputs_embeds``: a smooth path stays smooth through GELU blocks, a ReLU's kinks stay kinks).
  Reported, not a gate: through all six float32 layers of all-MiniLM-L6-v2 some circles show sharp features
  (ratio 1.4 - 1.7 on 3 of 6 circles measured), which that check would call kinks.

The model check (:func:`equivariance`): with the offsets known, ``x_t = r_t u_t - c_t`` puts the unit vector
``u_t`` (centred) into LN_emb at position t whatever the scale ``r_t``; position-free blocks then answer a
permuted sequence of u's with the permuted answers. Fresh sequences, each asked twice (random scales, a
random permutation), must agree within 100x the same figure on as many twins of the method's own draw that
are rescaled but keep every token's position (or the offsets' residuals, or the identity's floor, where
larger), and the median sequence within 10x that reference's median (or the floor): a reference that keeps
positions does not grow with a position effect inside the blocks, which the permuted twins see. The same
figure without the offsets (``c = 0``) is reported beside it: how much the offsets matter at that input scale.

What is not done, and why: with ``hidden=last`` block k's inputs and outputs (k < L - 1) are never seen, and
every per-block stage in this package needs both (the blocks are a composition observed only at its end);
LN_emb's gamma and beta are not read either (only the normalised vector is controlled). The result is
returned inside a :class:`~headthief.errors.NotIdentifiable` (exit 2) with the parts and their check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ModelMismatch, NotIdentifiable
from ...models.bert_block import BERT_EPS
from ...oracles.base import Oracle
from .embeddings import Embeddings, embedding_stage
from .extract import CHECK_FACTOR
from .layernorm import OutputLayerNorm, check_on_ellipsoid, constant_coordinates, fit_output_layernorm
from .on_image import answer_precision
from .smoothness import THRESHOLD as SMOOTH
from .smoothness import check_smooth_activation
from .value_sum import NEWTON, SCALES, centre  # the scalings of token t about its offset, Newton's steps
from ...linalg import lstsq

BASES = 2                # base sequences per position: the Jacobians' stacked null-space equations (2 fix c; a
                         # third cost 2 d queries a position for nothing: all-MiniLM-L6-v2 seed 0, hidden=last,
                         # offsets 5.7e-6 at 2 and 3 bases, 27,721 against 40,119 queries)
MEDIAN_FACTOR = 10.0     # the model check's allowance on the median sequence (see extract_encoder_parts)
RADIUS = 1.0             # base tokens' norm (all-MiniLM-L6-v2's offsets have norm 0.66 - 2.4)
LAST = ("blocks 1..{L}: with the last layer's hidden states only, no block's input and output are both seen (block L's "
        "input is block L - 1's output), and every per-block stage here reads both; LN_emb's gamma and beta (only its "
        "normalised input is set). Whether the composition is identifiable from its end alone is not known; no method "
        "here takes it apart (docs/block.md)")
MODEL = ("a BERT encoder: inputs_embeds plus one offset per position, the embeddings' LayerNorm, then position-free "
         "blocks ending in a LayerNorm")


@dataclass(frozen=True)
class ScaleOffsets:
    """Offsets ``c_t`` (P, d), ones-component removed, read from the scale invariance of LN_emb."""

    offsets: np.ndarray
    residual: float          # largest in-sample residual of the invariance after Newton (relative to the answers' rms)
    start_residual: float    # the same at the Jacobians' start
    steps: int               # Newton steps taken (largest over positions)
    queries: int
    condition: float = 1.0   # largest rms gain ||J||_F / sqrt(d - 1) |x_t + c_t| / rms(answers) over the bases
    variance: float = 1.0    # smallest variance of x_t + c_t over the bases (LN_emb's eps acts against it)


def _centre(v: np.ndarray) -> np.ndarray:
    return v - v.mean(axis=-1, keepdims=True)


def _rel(A: np.ndarray, B: np.ndarray) -> float:
    return float(np.max(np.abs(A - B)) / max(np.sqrt(np.mean(B * B)), 1e-300))


def offsets_by_scale(oracle: Oracle, rng: np.random.Generator, *, positions: int, eps: float,
                     bases: int = BASES, radius: float = RADIUS, newton: int = NEWTON,
                     start: np.ndarray | None = None) -> ScaleOffsets:
    """The offsets of positions ``0 .. positions - 1`` from sequences of ``positions`` tokens (module docstring).
    ``eps``: the answers' relative precision (sets the Jacobians' step); ``start`` (P, d): Newton's start
    instead of the Jacobians' null-space equations (stage E's offsets). The caller judges the residual."""
    d, T = oracle.d, int(positions)
    if T < 1:
        raise ValueError(f"positions must be >= 1, got {positions}")
    if bases < 2:
        raise ValueError(f"need at least 2 base sequences, got {bases}")
    h = float(eps) ** (1.0 / 3.0) * radius                  # central differences: error ~ eps^(2/3)
    q0 = oracle.queries
    offsets = np.zeros((T, d))
    worst, worst_start, steps, cond, var = 0.0, 0.0, 0, 1.0, np.inf
    eye = np.eye(d)
    for t in range(T):
        Xs = [radius * rng.standard_normal((T, d)) / np.sqrt(d) for _ in range(bases)]
        base = np.asarray(oracle.query(np.stack(Xs)), np.float64).reshape(bases, -1)
        Js = []
        for X in Xs:
            Q = np.repeat(X[None], 2 * d, axis=0)
            Q[:d, t] += h * eye
            Q[d:, t] -= h * eye
            A = np.asarray(oracle.query(Q), np.float64).reshape(2 * d, -1)
            Js.append(_centre(((A[:d] - A[d:]) / (2.0 * h)).T))      # (T d_out, d), the ones-direction removed
        # normal equations (d x d): the stacked Jacobians are (T d_out, d) each, 0.13 GB at MiniLM with hidden=all
        Gs = [J.T @ J for J in Js]
        G = sum(Gs)
        # the rms gain: how much a random rounding of the input moves the answers, relative
        norms = [float(np.sqrt(max(np.trace(g), 0.0) / (d - 1))) / max(float(np.sqrt(np.mean(y * y))), 1e-300)
                 for g, y in zip(Gs, base)]
        if start is None:
            c = _centre(lstsq(G, -sum(g @ X[t] for g, X in zip(Gs, Xs)), rcond=None)[0])
        else:
            c = _centre(np.asarray(start[t], np.float64))
        GN = sum(((a - 1.0) / a) ** 2 for a in SCALES) * G
        best, best_c = np.inf, c
        a = np.asarray(SCALES)
        for step in range(newton + 1):
            # every base's scaled twins in one call: (bases, scalings) sequences, token t at a (x_t + c) - c
            twins = np.repeat(np.stack(Xs)[:, None], len(a), axis=1)
            twins[:, :, t] = a[None, :, None] * (twins[:, :, t] + c) - c
            Y2 = np.asarray(oracle.query(twins.reshape(-1, T, d)), np.float64).reshape(bases, len(a), -1)
            res = max(_rel(Y2[k, j], base[k]) for k in range(bases) for j in range(len(a)))
            R = ((a - 1.0) / a) @ (Y2 - base[:, None])                 # (bases, T d_out): sum_a (a-1)/a R_a
            rhs = sum(J.T @ r for J, r in zip(Js, R))
            if step == 0:
                worst_start = max(worst_start, res)
            halved = res < 0.5 * best
            if res < best:
                best, best_c = res, c
            if not halved or step == newton:                    # no longer halving: at the answers' precision
                break
            move = lstsq(GN, rhs, rcond=None)[0]
            if np.max(np.abs(move)) <= 4 * np.finfo(float).eps * max(float(np.max(np.abs(X[t] + c))) for X in Xs):
                break                       # below the tokens' rounding: the next step would ask the same sequences
            c = _centre(c - move)
            steps = max(steps, step + 1)
        offsets[t] = best_c
        worst = max(worst, best)
        cond = max(cond, max(n * float(np.linalg.norm(X[t] + best_c)) for n, X in zip(norms, Xs)))
        var = min(var, min(float(np.var(X[t] + best_c)) for X in Xs))
    return ScaleOffsets(offsets=offsets, residual=worst, start_residual=worst_start, steps=steps,
                        queries=int(oracle.queries - q0), condition=cond, variance=var)


@dataclass(frozen=True)
class OutputLayerNormRead:
    """One layer's output LayerNorm as far as its answers fix it: ``ln`` (stage L), or, where some output
    coordinates are constant (gamma = 0, or answers that do not resolve ``gamma n`` against beta there), those
    coordinates (``constant``) and their values (beta there), with ``ln`` None: the normalised vector's
    coordinates there are never seen, so the hyperplane and the sphere stage L fits are lost and the other
    gammas and betas are not fixed by the answers. (all-MiniLM-L6-v2's last LayerNorm, gamma -6.0e-33,
    -4.8e-33 and -1.5e-9 at coordinates 127, 223 and 319, is not such a case in float32: its answers resolve
    those coordinates, and stage L fits it in units of each coordinate's spread.)"""

    ln: OutputLayerNorm | None
    constant: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))
    constant_value: np.ndarray = field(default_factory=lambda: np.zeros(0))


def read_output_layernorm(Y: np.ndarray) -> OutputLayerNormRead:
    """Stage L on answers Y (k, d), or the constant coordinates when there are any (see the class)."""
    Y = np.asarray(Y, np.float64)
    const = constant_coordinates(Y)
    if const.size:
        return OutputLayerNormRead(ln=None, constant=const, constant_value=Y[:, const].mean(axis=0))
    return OutputLayerNormRead(ln=fit_output_layernorm(Y))


def scale_residual(oracle: Oracle, offsets: np.ndarray, rng: np.random.Generator, n: int = BASES) -> tuple[float, int]:
    """How far the answers move when every token of ``n`` random sequences of P tokens is scaled about its
    offset (by 2 or 0.5 at random), over the answers' rms: the offsets' precision as the whole encoder sees
    it; and the queries (2 n)."""
    P, d = offsets.shape
    q0, worst = oracle.queries, 0.0
    for _ in range(int(n)):
        X = RADIUS * rng.standard_normal((P, d)) / np.sqrt(d)
        a = rng.choice(SCALES[:2], size=(P, 1))
        Y = np.asarray(oracle.query(np.stack([X, a * (X + offsets) - offsets])), np.float64)
        worst = max(worst, _rel(Y[1], Y[0]))
    return worst, int(oracle.queries - q0)


def _unit_tokens(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    u = _centre(rng.standard_normal((n, d)))
    return u / np.linalg.norm(u, axis=-1, keepdims=True)


def equivariance(oracle: Oracle, offsets: np.ndarray, rng: np.random.Generator, n: int, *,
                 radius: float = RADIUS, baseline: bool = True, permute: bool = True) -> tuple[float, float, int, float]:
    """The model check's figures on ``n`` fresh sequences of 2 to P tokens (module docstring): the largest
    disagreement between a sequence's answers and its permuted, rescaled twin's, over the answers' rms; the
    same with zero offsets (``baseline``; else 0.0); the queries (4 n, or 2 n); and the median disagreement
    with the offsets (a typical sequence's, where the largest follows the heavy tail). ``permute=False``: the
    twin is only rescaled (every token keeps its position), the same figures without the identity under test:
    what the answers' rounding and the offsets' error alone leave on such sequences."""
    P, d = offsets.shape
    q0 = oracle.queries
    worst0 = 0.0
    each = []
    for _ in range(int(n)):
        T = int(rng.integers(2, P + 1)) if P >= 2 else 1
        U = _unit_tokens(rng, T, d)
        perm = rng.permutation(T) if permute else np.arange(T)
        r1, r2 = radius * rng.uniform(0.5, 2.0, (2, T, 1))
        cs = (offsets[:T], np.zeros((T, d)))[:2 if baseline else 1]
        # the sequence and its twin, with the offsets and (baseline) without: one call
        Y = np.asarray(oracle.query(np.stack([q for c in cs for q in (r1 * U - c, r2 * U[perm] - c)])), np.float64)
        each.append(_rel(Y[1], Y[0][perm]))
        if baseline:
            worst0 = max(worst0, _rel(Y[3], Y[2][perm]))
    worst = max(each, default=0.0)
    return worst, worst0, int(oracle.queries - q0), float(np.median(each)) if each else 0.0


@dataclass(frozen=True, eq=False)
class EncoderParts:
    """The parts an encoder API gives away without a block taken apart (module docstring): the offsets
    (P, d; modulo the ones-vector), LN_emb (``hidden=all`` only), the output LayerNorms of the observed layers
    (``layers_seen``: 1-based layer numbers, ``output_lns``: :class:`OutputLayerNormRead` in that order), the
    activation check's ratio,
    and what was not recovered (``not_recovered``, a sentence)."""

    hidden: str
    offsets: np.ndarray
    ln_emb: OutputLayerNorm | None
    output_lns: tuple
    layers_seen: tuple
    activation_ratio: float
    not_recovered: str
    queries: int
    seconds: float
    diagnostics: dict = field(default_factory=dict)
    check: Any = None
    method: str = "encoder (parts)"
    block0: Any = None       # block 0's stage V on LN_emb's image (hidden=all; :class:`.value_sum_image.ImageValueSum`)
    block0_refused: str = ""  # why block 0's stage V was not read, where it was tried and refused ("" otherwise)

    @property
    def d(self) -> int:
        return int(self.offsets.shape[1])

    @property
    def rank(self) -> None:          # no head was recovered
        return None

    def errors(self, truth) -> dict[str, Any]:
        """Against an :class:`~headthief.models.bert_block.Encoder`: the offsets (centred) and every recovered
        LayerNorm (gamma compared up to the global sign, a symmetry of the block), relative."""
        from ..result import rel_err
        P = self.offsets.shape[0]
        c = _centre(np.asarray(truth.position[:P], np.float64) + np.asarray(truth.token_type, np.float64))
        out: dict[str, Any] = {"offsets_rel_err": rel_err(self.offsets, c)}
        if self.ln_emb is not None:
            out["ln_emb_gamma_rel_err"] = rel_err(self.ln_emb.gamma, np.asarray(truth.ln_gamma, np.float64))
            out["ln_emb_beta_rel_err"] = rel_err(self.ln_emb.beta, np.asarray(truth.ln_beta, np.float64))
        g_err = b_err = c_err = None
        for layer, r in zip(self.layers_seen, self.output_lns):
            tb = truth.blocks[layer - 1]
            g, b = np.asarray(tb.ln2_gamma, np.float64), np.asarray(tb.ln2_beta, np.float64)
            if r.ln is not None:
                g_err = max(g_err or 0.0, rel_err(r.ln.gamma, np.sign(g.sum()) * g))
                b_err = max(b_err or 0.0, rel_err(r.ln.beta, b))
            else:       # a constant coordinate is gamma n + beta with gamma ~ 0: its value against beta there,
                # over the largest |beta| (MiniLM's are 1e-32 and -8.7e-8: a relative error would be noise)
                c_err = max(c_err or 0.0, float(np.max(np.abs(r.constant_value - b[r.constant])) / np.max(np.abs(b))))
        out["ln_out_gamma_rel_err"], out["ln_out_beta_rel_err"] = g_err, b_err
        if self.block0 is not None:         # K = P B G on mean-zero n, c = P (B beta + b), over max |K| (value_sum_image)
            tb = truth.blocks[0].astype(np.float64)
            B, b = tb.value_output_sum()
            d = B.shape[0]
            G, beta = np.asarray(truth.ln_gamma, np.float64), np.asarray(truth.ln_beta, np.float64)
            K, c = centre(B @ np.diag(G) @ (np.eye(d) - 1.0 / d)), centre(B @ beta + b)
            scale = float(np.max(np.abs(K)))
            out["block0_K_rel_err"] = float(np.max(np.abs(self.block0.K - K))) / scale
            out["block0_c_rel_err"] = float(np.max(np.abs(self.block0.c - c))) / scale
        if c_err is not None:
            out["ln_out_constant_err"] = c_err
        out["worst_rel_err"] = max(v for v in out.values() if v is not None)
        return out


def extract_encoder_parts(oracle: Oracle, *, layers: int, hidden: str, rng: np.random.Generator | int = 0,
                          length: int = 16, verify: int = 64, check: bool = True, check_rng=None,
                          reason: str | None = None, progress=None) -> EncoderParts:
    """The parts (module docstring) of an encoder API answering every layer's hidden states (``hidden="all"``,
    ``(layers + 1) d`` numbers per position) or the last layer's (``"last"``, d), over positions
    ``0 .. length - 1``. Returns the parts with their model check and what is not recovered (``reason``;
    default for ``hidden="last"``: the blocks, and why); :func:`not_recovered` makes the exception that ends
    such a run. :class:`ModelMismatch` when the answers are not of this class."""
    from ..precision import ModelCheck
    rng = np.random.default_rng(rng)
    d, L = oracle.d, int(layers)
    if reason is None:
        reason = LAST.format(L=L) if hidden == "last" else "the blocks"
    if hidden not in ("all", "last"):
        raise ValueError(f"hidden must be 'all' or 'last', got {hidden!r}")
    want = (L + 1) * d if hidden == "all" else d
    if oracle.d_out != want:
        raise ValueError(f"hidden={hidden} with {L} layers answers {want} numbers per position, the oracle {oracle.d_out}")
    t0, q0 = time.perf_counter(), oracle.queries
    k = -(-4 * (d + 2) // length)       # stage L needs d + 2 answers per layer; 4x that (MiniLM: beta to 1.5e-3 with 1x)
    Y = np.asarray(oracle.query(rng.standard_normal((max(k, 2), length, d))), np.float64).reshape(-1, oracle.d_out)
    eps, kind = answer_precision(oracle, Y)
    seen = tuple(range(1, L + 1)) if hidden == "all" else (L,)
    slices = [Y[:, j * d:(j + 1) * d] for j in seen] if hidden == "all" else [Y]
    lns = tuple(read_output_layernorm(S) for S in slices)
    for j, r in zip(seen, lns):                 # as every block route checks its LayerNorms (a larger eps is another
        if r.ln is not None:                    # model: exit 5, naming it, not an exit 2 about what is unread)
            check_on_ellipsoid(r.ln, eps, where=f"layer {j}'s output: ")
    if progress is not None:
        progress(0)
    emb: Embeddings | None = None
    diag: dict[str, Any] = {}
    start = None
    if hidden == "all":
        # stage E's offsets are exact on h_0, but float32 h_0 leaves them coarse for the layers behind (all-
        # MiniLM-L6-v2: every token scaled about them moves the answers by 1.7e-3 of their rms, about the true
        # offsets 1e-5): Newton goes on from them
        emb = embedding_stage(oracle, rng, length=length, d_hidden=d)
        start = emb.offsets
        diag["embedding_residual"] = emb.residual
    so = offsets_by_scale(oracle, rng, positions=length, eps=eps, start=start)
    offsets, residual = so.offsets, so.residual
    # the identity's own precision, amplified by the map's rms gain at the bases: the answers' rounding (all-
    # MiniLM-L6-v2: Newton's residual 1.3e-5 and 9.9e-5 on two seeds, where 30 eps is 1.8e-6), and LN_emb's eps,
    # which scaling by a moves by up to 1.5 eps_LN / var(x + c) (float64 d = 8: residuals 5e-12 .. 8e-11)
    floor = max(30.0 * eps, 1.5 * BERT_EPS / so.variance, 1e-13) * so.condition
    if residual > CHECK_FACTOR * floor:
        raise ModelMismatch(f"the answers are not invariant to scaling a token about one point per position "
                            f"(residual {residual:.3g} > {CHECK_FACTOR}x {floor:.3g}: 30x the answers' precision "
                            f"{eps:.2g} or LN_emb's eps over the tokens' variance, times the map's rms gain "
                            f"{so.condition:.3g}): no LayerNorm of inputs_embeds plus a position offset before "
                            "position-free blocks", check="offsets (scale invariance)",
                            figure=residual, threshold=CHECK_FACTOR * floor)
    # Newton's residual scales one token at a time; the check moves every token at once, on ``verify``
    # sequences: its precision is measured that way, on as many (all-MiniLM-L6-v2: 1.3e-5 one token at a time;
    # every token, 3 sequences: 2.1e-5; the check's figure 3.3e-4 on 32 sequences, 1.5e-3 on 256: a heavy tail)
    scaled, _ = scale_residual(oracle, offsets, rng, n=max(BASES, int(verify)))
    # and the check's own figures on as many sequences of the method's draw, each twin rescaled but not permuted:
    # the same inputs without the identity under test (a position effect inside the blocks would raise a
    # permuted reference with the figure it is compared with). Its tail is heavier than the all-token scaling's
    # (all-MiniLM-L6-v2: 256 fresh sequences gave 9.0e-3 where every token scaled gave 3.5e-4)
    in_sample, _, _, in_median = equivariance(oracle, offsets, rng, max(BASES, int(verify)), baseline=False,
                                              permute=False)
    together = max(scaled, in_sample)
    diag.update({"offsets_residual": so.residual, "offsets_start_residual": so.start_residual,
                 "offsets_newton_steps": so.steps, "offsets_queries": so.queries,
                 "offsets_residual_all_tokens": scaled, "equivariance_in_sample": in_sample,
                 "equivariance_in_sample_median": in_median,
                 "offsets_condition": so.condition, "offsets_floor": floor})
    block0, block0_refused = None, ""
    if hidden == "all" and emb is not None:
        block0, block0_refused = _block0_value_sum(oracle, emb, L, rng, eps, diag)
    if progress is not None:
        progress(1)
    # the activation's class is reported, not a gate: no block is recovered, and the real all-MiniLM-L6-v2 has
    # sharp features along some great circles of one-token inputs (measured: largest 4th difference 14 against
    # a median 2e-4 on 3 of 6 circles, ratio 1.4 - 1.7 there at 128 to 512 points), a false "kinked" otherwise
    try:
        ratio = float(check_smooth_activation(oracle, rng, precision=eps).ratio)
    except ModelMismatch as e:
        ratio = float(e.figure)
    diag.update({"activation_ratio": ratio, "activation": "smooth" if ratio >= SMOOTH else "not shown smooth",
                 "layers_seen": len(seen),
                 "ln_out_plane_residual": max((r.ln.plane_residual for r in lns if r.ln), default=None),
                 "ln_out_sphere_residual": max((r.ln.sphere_residual for r in lns if r.ln), default=None),
                 "ln_out_constant_coordinates": ",".join(f"{j}:{i}" for j, r in zip(seen, lns) for i in r.constant)
                 or None})
    res = EncoderParts(hidden=hidden, offsets=offsets, ln_emb=None if emb is None else emb.ln, output_lns=lns,
                       layers_seen=seen, activation_ratio=ratio, not_recovered=reason,
                       queries=int(oracle.queries - q0), seconds=time.perf_counter() - t0, diagnostics=diag,
                       block0=block0, block0_refused=block0_refused)
    if not check:
        return _with(res, ModelCheck("unchecked", MODEL, detail="the model check was skipped"), t0)
    crng = rng if check_rng is None else np.random.default_rng(check_rng)
    fid, fid0, vq, fid_median = equivariance(oracle, offsets, crng, verify)
    # each of a check sequence's P tokens can move its answers by about Newton's residual through its offset's
    # error, in either of the two queries: at least 2 P x the residual is allowed (float64, d = 96: residual
    # 2.4e-11, figure 7.8e-10)
    spread = 2 * offsets.shape[0] * residual
    limit = max(CHECK_FACTOR * max(together, floor), spread)
    # a typical sequence too: the median of as many sequences is stable where the largest follows the tail
    # (measured, fresh permuted over the reference's medians: 1.2 - 2.6 on 33 random encoders, d = 8 - 96,
    # float64 and float32; 2.3 and 1.3 on all-MiniLM-L6-v2), so 10x it
    med_limit = max(MEDIAN_FACTOR * max(in_median, floor), spread)
    detail = (f"{verify} fresh sequences of 2 to {length} tokens and their permuted, rescaled twins agree to "
              f"{fid:.3g} (median {fid_median:.3g}) with the recovered offsets ({fid0:.3g} without them); "
              f"threshold {limit:.3g} (median {med_limit:.3g}): {CHECK_FACTOR}x ({MEDIAN_FACTOR:g}x for the "
              f"median) the largest of the same figures on as many rescaled twins of the method's draw that "
              f"keep every token's position ({in_sample:.3g}, median {in_median:.3g}), the offsets' residual with "
              f"every token scaled, and the identity's floor {floor:.3g} (30x the answers' ({kind.describe()}) "
              f"precision or LN_emb's eps over the tokens' variance, times the map's rms gain "
              f"{so.condition:.3g}), at least 2 P x their one-token residual")
    diag["equivariance_without_offsets"] = fid0
    diag["equivariance_median"] = fid_median
    if fid > limit or fid_median > med_limit:
        figure, thr = (fid, limit) if fid > limit else (fid_median, med_limit)
        raise ModelMismatch(f"the encoder's answers are not those of position-free blocks behind the recovered "
                            f"offsets: {detail}", check="permutation equivariance", figure=figure, threshold=thr)
    mc = ModelCheck("pass", MODEL, answers=kind.describe(), figure=fid, threshold=limit, verify_queries=vq,
                    detail=detail)
    return _with(res, mc, t0)


def _block0_value_sum(oracle: Oracle, emb: Embeddings, layers: int, rng: np.random.Generator, eps: float,
                      diag: dict):
    """Block 0's stage V on LN_emb's image from forward paths (:func:`.encoder._value_sum`; past d = 24 by
    alternating least squares first): ``(ImageValueSum, "")``, or ``(None, why)`` (the reason in ``diag`` too). A read refused
    (a pair Jacobian too poorly conditioned for the answers' precision, or a fit that did not settle) is said,
    not raised: the run ends in exit 2 either way, with the other parts. A fit that settles far from any one B
    on every try is the wrong model class (exit 5), as on the encoder route."""
    from ...errors import ConvergenceError
    from .encoder import _Paths, _value_sum
    from .value_sum_image import retrying
    paths = _Paths(oracle, emb, layers)
    q = oracle.queries
    try:
        ivs = retrying(lambda: _value_sum(paths, 0, paths.image, rng, eps), settled_mismatch=True)
    except (ConvergenceError, NotIdentifiable) as e:
        diag.update({"block0_value_sum": f"not read: {e}", "block0_value_sum_queries": int(oracle.queries - q)})
        return None, f"not read: {e}"
    diag.update({"block0_value_sum": "read", "block0_value_sum_queries": int(oracle.queries - q),
                 "block0_value_sum_residual": ivs.residual, "block0_value_sum_expected": ivs.expected,
                 "block0_value_sum_conditioning": ivs.conditioning, "block0_value_sum_iterations": ivs.iterations})
    return ivs, ""


def _with(res: EncoderParts, mc, t0: float) -> EncoderParts:
    import dataclasses
    return dataclasses.replace(res, check=mc, seconds=time.perf_counter() - t0)


def not_recovered(parts: EncoderParts) -> NotIdentifiable:
    """The exception that ends a parts-only run (exit 2), the parts attached as ``result`` (the report's row)."""
    got = ("LN_emb, the offsets" if parts.ln_emb is not None else "the offsets (modulo the ones-vector)")
    full = [j for j, r in zip(parts.layers_seen, parts.output_lns) if r.ln is not None]
    lns = ("no output LayerNorm" if not full else f"layer {full[0]}'s output LayerNorm" if len(full) == 1
           else f"the output LayerNorms of layers {', '.join(map(str, full))}")
    for j, r in zip(parts.layers_seen, parts.output_lns):
        if r.ln is None:
            lns += (f"; layer {j}'s output coordinates {', '.join(map(str, r.constant))} are constant (gamma ~ 0; "
                    "their beta read), so its LayerNorm's other gammas and betas are not fixed by its answers")
    r = parts.activation_ratio
    act = (f"activation smooth (4th-difference ratio {r:.1f})" if r >= SMOOTH else
           f"activation not shown smooth (4th-difference ratio {r:.1f} < {SMOOTH:.2f}: kinks, or sharp features at "
           "the answers' precision)")
    if parts.block0 is not None:
        lns += (f", block 0's stage V on LN_emb's image (P B G_emb and P (B beta_emb + b), relative residual "
                f"{parts.block0.residual:.2g})")
    elif parts.block0_refused:
        lns += f" (block 0's stage V {parts.block0_refused})"
    mc = parts.check
    checked = f"; model check {mc.verdict}" + (f" ({mc.figure:.3g} <= {mc.threshold:.3g})" if mc.verdict == "pass" else "")
    exc = NotIdentifiable(f"hidden={parts.hidden}: recovered {got} of positions 0..{parts.offsets.shape[0] - 1} and "
                          f"{lns}, {act}{checked}, "
                          f"{parts.queries} queries. Not recovered: {parts.not_recovered}")
    exc.result = parts
    return exc


__all__ = ["EncoderParts", "OutputLayerNormRead", "ScaleOffsets", "read_output_layernorm", "equivariance", "extract_encoder_parts", "not_recovered", "offsets_by_scale"]
