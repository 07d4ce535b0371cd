"""The methods the command line offers: a registry of (run, expected query count, help), and the oracle
stack that the threat-model flags ask for. The CLI commands (extract, bench) read it; it reads the
extraction and oracle packages (imports run one way: cli -> methods -> extraction -> oracles)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import SpecError
from .extraction.result import Extraction
from .oracles.base import Oracle
from .targets import Target


def check_kw(args) -> dict:
    """The model check's settings from the command line: ``--no-check``, ``--verify N``, ``--seed``."""
    return {"check": not getattr(args, "no_check", False), "verify": int(getattr(args, "verify", 256)),
            "check_rng": 10_000 + int(getattr(args, "seed", 0))}


@dataclass(frozen=True)
class Method:
    """A CLI method: ``run(oracle, target, args, progress) -> Extraction``; ``expected`` gives the
    planned query count (for the progress bar), or None when it is not known in advance."""

    run: Callable[..., Extraction]
    expected: Callable[[Target, argparse.Namespace], int | None]
    help: str


def _run_exact(oracle, target, args, progress, clean=None):
    from .extraction.single.exact import extract_exact
    return extract_exact(oracle, **check_kw(args), probes=args.probes, bias=target.bias, scales=args.scales,
                         rng=np.random.default_rng(args.seed), progress=progress)


def _expected_exact(target, args):
    from .extraction.single.exact import exact_query_count
    return exact_query_count(target.d, bias=target.bias)


def _noisy_settings(target, args, *, need: bool):
    """W bound and margin for the noisy methods: --W-bound / --mu, else the target spec's W_norm / v_min."""
    W_bound = args.W_bound if args.W_bound is not None else target.info.get("W_norm")
    mu = args.mu if args.mu is not None else target.info.get("v_min")
    if need and W_bound is None:
        raise SpecError(f"--method {args.method} needs --W-bound W (the known bound on ||W||_F, W >= 2); "
                        "random: targets with W_norm= set it")
    if need and mu is None:
        raise SpecError(f"--method {args.method} needs --mu M (the margin: every non-zero |v_i| >= M); "
                        "random: targets with v_min= set it")
    return W_bound, mu


def _run_noisy_paper(oracle, target, args, progress, clean=None):
    from .extraction.robust.noisy_paper import extract_noisy_paper
    if target.bias:
        raise SpecError("noisy-paper is Theorem 6.1 for the paper's model (no biases); use --method noisy")
    W_bound, mu = _noisy_settings(target, args, need=True)
    return extract_noisy_paper(oracle, **check_kw(args), W_bound=W_bound, mu=mu, progress=progress)


def _expected_noisy_paper(target, args):
    from .extraction.robust.noisy_paper import noisy_paper_query_count
    return noisy_paper_query_count(target.d)


def _run_noisy(oracle, target, args, progress, clean=None):
    from .extraction.robust.noisy import extract_noisy
    W_bound, _ = _noisy_settings(target, args, need=False)
    return extract_noisy(oracle, **check_kw(args), tau=noise_tau(args, target), W_bound=W_bound, bias=target.bias,
                         extra=args.extra_probes, rng=np.random.default_rng(args.seed), progress=progress)


def _expected_noisy(target, args):
    from .extraction.robust.noisy import noisy_query_count
    return noisy_query_count(target.d, bias=target.bias, extra=args.extra_probes)


def _membership_paper_settings(target, args):
    """Theorem B.1's known constants: --W-bound / --mu, else the random: spec's W_norm and v_min / v_norm."""
    W_bound = args.W_bound if getattr(args, "W_bound", None) is not None else target.info.get("W_norm")
    mu = getattr(args, "mu", None)
    if mu is None and target.info.get("v_min") is not None:
        mu = target.info["v_min"] / target.info.get("v_norm", 1.0)   # the theorem normalises ||v|| = 1
    if W_bound is None or mu is None:
        raise SpecError("--method membership-paper needs Theorem B.1's known constants: --W-bound W (>= 2, "
                        "a bound on ||W||_F) and --mu M (min |v_i| / ||v||); random: targets with W_norm=, "
                        "v_min= (and v_norm=) set them")
    return max(2.0, float(W_bound)), float(mu)


def _run_membership_paper(oracle, target, args, progress, clean=None):
    from .extraction.robust.membership_paper import extract_membership_paper
    if target.bias:
        raise SpecError("membership-paper is Theorem B.1 for the paper's model (no biases); use --method membership")
    W_bound, mu = _membership_paper_settings(target, args)
    k = args.sphere_queries if args.sphere_queries is not None else 64 * target.d ** 2
    return extract_membership_paper(oracle, **check_kw(args), W_bound=W_bound, mu=mu, eps_W=args.eps_W, k=k,
                                    rng=np.random.default_rng(args.seed), progress=progress)


def _expected_membership_paper(target, args):
    from .extraction.robust.membership_paper import paper_query_count
    try:
        W_bound, mu = _membership_paper_settings(target, args)
    except SpecError:
        return None
    k = args.sphere_queries if args.sphere_queries is not None else 64 * target.d ** 2
    return paper_query_count(target.d, k, args.eps_W, mu, W_bound)


def _membership_bias(target, args) -> bool:
    # a rounding API read through its sign answers [f > 0.5 * 10**-K]: an output-bias shift, so the
    # biased variant (which recovers the threshold) is used
    return bool(target.bias or (args.noise_mode or "").startswith("round:")
                or published_output(target).startswith("rounded:"))


def _run_membership(oracle, target, args, progress, clean=None):
    from .extraction.robust.membership import extract_membership
    return extract_membership(oracle, **check_kw(args), bias=_membership_bias(target, args), rng=np.random.default_rng(args.seed),
                              progress=progress)


def _expected_membership(target, args):
    from .extraction.robust.membership import membership_query_bound
    return membership_query_bound(target.d, bias=_membership_bias(target, args))


def _rank_arg(args) -> int | None:
    """--rank for lowrank/rop: an integer, or None for 'auto'."""
    if args.rank is None or str(args.rank).strip().lower() == "auto":
        return None
    try:
        return int(args.rank)
    except ValueError:
        raise SpecError(f"--rank must be an integer or 'auto', got {args.rank!r}") from None


def _run_lowrank(oracle, target, args, progress, clean=None):
    from .extraction.single.lowrank import extract_lowrank
    return extract_lowrank(oracle, **check_kw(args), rank=_rank_arg(args), bias=target.bias, oversample=args.oversample,
                           scales=args.scales, rng=np.random.default_rng(args.seed), progress=progress)


def _expected_lowrank(target, args):
    from .extraction.single.lowrank import lowrank_query_count
    r = _rank_arg(args)
    if r is None or not 1 <= r <= target.d or (args.oversample is not None and args.oversample < 0):
        return None     # rank auto: not known in advance (bad settings: the method says why)
    return lowrank_query_count(target.d, r, bias=target.bias, oversample=args.oversample or 0)


def _run_rop(oracle, target, args, progress, clean=None):
    from .extraction.single.rop import extract_rop
    return extract_rop(oracle, **check_kw(args), rank=_rank_arg(args), measurements=args.measurements,
                       oversampling=args.oversampling, solver=args.solver, bias=target.bias,
                       scales=args.scales, rng=np.random.default_rng(args.seed), progress=progress)


def _expected_rop(target, args):
    from .extraction.single.rop import rop_query_count
    r = _rank_arg(args)
    if r is None or not 1 <= r <= target.d:
        return None
    try:
        return rop_query_count(target.d, r, measurements=args.measurements, oversampling=args.oversampling,
                               solver=args.solver, bias=target.bias,
                               float32=target.info.get("dtype") == "float32")
    except ValueError:
        return None


def _given_or_published(what: str, given: int | None, published, spec: str) -> int | None:
    """A size the user may give (``--heads``, ``--layers``) and the target may publish: the given one, checked
    against the published one (a contradiction is refused: the run would end in a failed model check), else
    the published one, else None."""
    if given is not None:
        if published is not None and int(published) != int(given):
            raise SpecError(f"--{what} {given} contradicts {spec}, which has {published} {what}")
        return int(given)
    return int(published) if published is not None else None


def _heads_arg(args) -> int | None:
    h = getattr(args, "heads", None)
    if h is None or str(h).strip().lower() == "auto":
        return None
    try:
        return int(h)
    except ValueError:
        raise SpecError(f"--heads must be an integer or 'auto', got {h!r}") from None


def _run_multihead(oracle, target, args, progress, clean=None):
    from .extraction.multihead import extract_multihead
    return extract_multihead(oracle, **check_kw(args), heads=_heads_arg(args), max_heads=args.max_heads,
                             rank=_rank_arg(args), bias=target.bias, rng=np.random.default_rng(args.seed),
                             progress=progress)


def _expected_multihead(target, args):
    from .extraction.multihead import multihead_query_count
    H = _heads_arg(args)
    r = _rank_arg(args)
    if H is None:
        return None
    try:
        return multihead_query_count(target.d, H, r, target.bias)
    except (ValueError, TypeError):
        return None


def _bases(target, args):
    if getattr(args, "subspace_bases", None):
        try:
            return np.load(args.subspace_bases)
        except (OSError, ValueError) as e:
            raise SpecError(f"--subspace-bases {args.subspace_bases}: {e}") from None
    if target.bases is None:
        raise SpecError("--method multihead-subspaces needs the head subspaces: a multihead:...,subspaces=orthogonal "
                        "target, or --subspace-bases FILE.npy with an (H, d, d_h) array of orthonormal bases")
    return target.bases


def _run_multihead_subspaces(oracle, target, args, progress, clean=None):
    from .extraction.multihead import extract_multihead_subspaces
    return extract_multihead_subspaces(oracle, _bases(target, args), **check_kw(args), bias=target.bias,
                                       progress=progress, rng=np.random.default_rng(args.seed))


def _expected_multihead_subspaces(target, args):
    from .extraction.multihead import subspaces_query_count
    try:
        B = _bases(target, args)
        return subspaces_query_count([b.shape[1] for b in B], bias=target.bias)
    except (SpecError, ValueError, TypeError, AttributeError):
        return None


def _run_multihead_hessian(oracle, target, args, progress, clean=None):
    from .extraction.multihead import extract_multihead_hessian
    return extract_multihead_hessian(oracle, **check_kw(args), heads=_heads_arg(args), bias=target.bias,
                                     rng=np.random.default_rng(args.seed), progress=progress)


METHODS: dict[str, Method] = {
    "exact": Method(_run_exact, _expected_exact,
                    "Theorem 4.1: d^2 + d queries (d^2 + 2d + 1 with biases), exact recovery"),
    "lowrank": Method(_run_lowrank, _expected_lowrank,
                      "adaptive sketches W B, A^T W: d + r(2d - r) queries for rank r (--rank R|auto, "
                      "--oversample K)"),
    "rop": Method(_run_rop, _expected_rop,
                  "Theorem 5.1: d + m Gaussian rank-one measurements (--rank R, --solver als|convex, "
                  "--measurements M or --oversampling C)"),
    "noisy-paper": Method(_run_noisy_paper, _expected_noisy_paper,
                          "Theorem 6.1 as stated: d + d^2 queries, answers within +-tau (needs --W-bound, --mu)"),
    "noisy": Method(_run_noisy, _expected_noisy,
                    "answers within +-tau: probes chosen for the sigmoid inversion, d + d^2 queries"),
    "membership-paper": Method(_run_membership_paper, _expected_membership_paper,
                               "Theorem B.1 as stated: sign-only answers, k sphere queries for v + d^2 "
                               "bisections (needs --W-bound, --mu; its probes need --input-norm > 1)"),
    "multihead": Method(_run_multihead, _expected_multihead,
                        "multi-head attention, any heads (ours): saturation finds every v_h, head isolation reads "
                        "each W_h; canonical form up to permutation (--heads H|auto, --max-heads, --rank)"),
    "multihead-subspaces": Method(_run_multihead_subspaces, _expected_multihead_subspaces,
                                  "Proposition C.2: known orthogonal head subspaces, Theorem 4.1 in each "
                                  "(--subspace-bases FILE.npy, or a subspaces=orthogonal target)"),
    "multihead-hessian": Method(_run_multihead_hessian, lambda t, a: None,
                                "the paper's conjecture (Appendix C): probe Hessians, finest simultaneous block "
                                "diagonalisation, then Proposition C.2"),
    "membership": Method(_run_membership, _expected_membership,
                         "sign-only answers: bisection for v's direction and every W entry, about 42 (d^2 + d) queries"),
}


# --------------------------------------------------------------------------- one-layer transformers (issue 10)


def _transformer_heads(args, target) -> int:
    """--heads for the transformer methods: an integer; 'auto' means the head count the target publishes
    (``transformer:heads=H``, ``torch-transformer:heads=H``), else one head (the paper's model). A given H
    that contradicts a published one is refused (the run would end in a failed model check instead)."""
    H = _given_or_published("heads", _heads_arg(args), (target.info or {}).get("heads"), target.spec)
    return 1 if H is None else H


def _kink_check(res, target, args, clean=None):
    """Fidelity next to every recovered FFN kink (one head), on a clean oracle (``clean()``: the pipeline's,
    inside the query budget; else the target's own); added to the diagnostics.

    A figure above the model check's threshold raises :class:`ModelMismatch` like the check's own verdict."""
    import dataclasses

    from .errors import ModelMismatch
    from .extraction.transformer.recovered import verify_transformer
    if args.verify <= 0 or res.predicts != "transformer" or res.ffn is None:
        return res
    from .errors import BudgetExceeded
    oracle = clean() if clean is not None else target.make_oracle(input_norm=input_norm_for(args))
    try:
        f = verify_transformer(res, oracle, n=0, per_kink=2, rng=np.random.default_rng(20_000 + int(args.seed)))
    except BudgetExceeded as e:       # the budget is spent: the finished result is kept, the kinks unchecked
        return dataclasses.replace(res, diagnostics={**res.diagnostics, "fidelity_kinks_max_rel_err": None,
                                                     "warning": f"fidelity next to the kinks not measured: {e}"})
    diag = {**res.diagnostics, "fidelity_kinks_max_rel_err": f.kinks.max_rel_err, "kink_sequences": f.kinks.n,
            "kink_verify_queries": f.kinks.queries}
    res = dataclasses.replace(res, diagnostics=diag)
    mc = res.check
    if mc is not None and mc.threshold is not None and f.kinks.max_rel_err > mc.threshold:
        err = ModelMismatch(
            f"the recovered transformer reproduces random sequences (fidelity {mc.figure:.3g}) but not sequences "
            f"whose attended token lies next to a recovered FFN kink: fidelity there {f.kinks.max_rel_err:.3g} > "
            f"{mc.threshold:.3g} (a neuron recovered imprecisely, or a rarely active neuron missed)",
            check="fidelity next to kinks", figure=f.kinks.max_rel_err, threshold=mc.threshold)
        err.result = res
        raise err
    return res


def _run_transformer_paper(oracle, target, args, progress, clean=None):
    from .extraction.transformer.paper import extract_transformer_heads, extract_transformer_paper
    H = _transformer_heads(args, target)
    rng = np.random.default_rng(args.seed)
    if H > 1:
        return extract_transformer_heads(oracle, **check_kw(args), heads=H, max_heads=args.max_heads, rng=rng,
                                         progress=progress)
    return _kink_check(extract_transformer_paper(oracle, **check_kw(args), rng=rng, progress=progress), target, args, clean)


def _run_transformer(oracle, target, args, progress, clean=None):
    from .extraction.transformer.paper import extract_transformer_heads
    from .extraction.transformer.through_ffn import extract_transformer
    H = _transformer_heads(args, target)
    rng = np.random.default_rng(args.seed)
    if H > 1:
        if target.bias:
            raise SpecError("--method transformer with --heads > 1 needs an FFN without biases (several heads "
                            "are read through the antisymmetric oracle); with FFN biases only one head is supported")
        return extract_transformer_heads(oracle, **check_kw(args), heads=H, max_heads=args.max_heads, rng=rng,
                                         progress=progress)
    return _kink_check(extract_transformer(oracle, **check_kw(args), bias=target.bias, rng=rng, progress=progress),
                       target, args, clean)


METHODS["transformer-paper"] = Method(
    _run_transformer_paper, lambda t, a: None,
    "Section 4.1: antisymmetric queries + Theorem 4.1 for W (2(d^2 + d) queries), the FFN learner on one-token "
    "queries; FFN without biases (--heads H: several heads through the multi-head method)")
METHODS["transformer"] = Method(
    _run_transformer, lambda t, a: None,
    "one-layer transformer with FFN biases (ours): learn the FFN, invert it on monotone segments to read the "
    "scores, d^2 + d two-token queries for W and c")


def _run_ffn(oracle, target, args, progress, clean=None):
    from .extraction.transformer.ffn import extract_ffn
    return extract_ffn(oracle, **check_kw(args), bias=target.bias, rng=np.random.default_rng(args.seed),
                       progress=progress)


METHODS["ffn"] = Method(
    _run_ffn, lambda t, a: None,
    "two-layer ReLU FFN from one-token queries (Section 4.1's A_FFN, ours): kinks on paths that cross every "
    "hyperplane, gradient jumps, flips by least squares / LP or an m + 2 form; about 3 D m queries (bias: D = d + 1)")


def _run_vector(oracle, target, args, progress, clean=None):
    from .extraction.vector import extract_vector
    h = str(getattr(args, "heads", "auto"))
    heads = None if h == "auto" else int(h)
    # declared (--causal for a py: box, or the spec's own mask: mha:...,causal=1, gpt2-attn:), else detected
    spec_causal = target is not None and (target.info or {}).get("causal") is True
    causal = True if getattr(args, "causal", False) or spec_causal else None
    return extract_vector(oracle, **check_kw(args), heads=heads, causal=causal, rng=np.random.default_rng(args.seed),
                          progress=progress)


METHODS["vector"] = Method(
    _run_vector, lambda t, a: None,
    "ours: a multi-head attention layer with output projection from vector (hidden-state) answers: d + 1 "
    "one-token queries for sum_h O_h and b, saturated two-token maps that split the heads' output spaces "
    "(--heads auto finds H), soft anchor queries for every W_h and c_h (--causal: a py: box declared causal)")


def _block_sizes(target, args) -> tuple[int | None, int | None]:
    heads = _heads_arg(args)
    info = (target.info or {}) if target is not None else {}
    ffn = getattr(args, "ffn", None) or info.get("ffn")
    return heads, (int(ffn) if ffn is not None else None)


def _run_block(oracle, target, args, progress, clean=None):
    from .extraction.block.arithmetic import MAX_TFLOP
    from .extraction.block.extract import extract_block
    heads, ffn = _block_sizes(target, args)
    if ffn is None:
        raise SpecError(f"--method block needs the FFN's width: give --ffn M ({target.spec} does not publish it)")
    image = ((target.info or {}) if target is not None else {}).get("input_image")
    if image is not None:                      # a block inside an encoder: every query on the previous LN's image
        from .extraction.block.image import LayerNormImage
        from .extraction.block.on_image import extract_block_on_image
        heads = heads or (target.info or {}).get("heads")
        if heads is None:
            raise SpecError("--method block on a previous LayerNorm's image needs the head count: give --heads H")
        if getattr(args, "stage_f", "auto") != "auto":
            raise SpecError("--stage-f applies to free inputs only: on the image stage F reads full Jacobians")
        kw = check_kw(args)
        return extract_block_on_image(oracle, LayerNormImage(np.array(image["gamma"]), np.array(image["beta"])),
                                      heads=int(heads), ffn=ffn, rng=np.random.default_rng(args.seed),
                                      verify=kw["verify"], check=kw["check"], progress=progress,
                                      activation=getattr(args, "activation", "gelu"),
                                      ln_eps=getattr(args, "ln_eps", None),
                                      max_tflop=float(getattr(args, "max_tflop", MAX_TFLOP)))
    return extract_block(oracle, **check_kw(args), heads=heads, ffn=ffn, rng=np.random.default_rng(args.seed),
                         progress=progress, stage_f=getattr(args, "stage_f", "auto"),
                         max_tflop=float(getattr(args, "max_tflop", MAX_TFLOP)),
                         refit_device=getattr(args, "refit_device", None),
                         activation=getattr(args, "activation", "gelu"), ln_eps=getattr(args, "ln_eps", None))


def _expected_block(target, args):
    from .extraction.block.extract import expected_queries, ln_eps_told
    _, ffn = _block_sizes(target, args)
    f32 = str(((target.info or {}) if target is not None else {}).get("dtype", "float64")) == "float32"
    loose = ln_eps_told(getattr(args, "ln_eps", None))[1]
    return expected_queries(target.d, ffn, f32, stage_f=getattr(args, "stage_f", "auto"), ln_eps=loose) if ffn else None


METHODS["block"] = Method(
    _run_block, _expected_block,
    "ours: a whole post-LN BERT block (attention, LN1, GELU FFN, LN2) from vector answers at every position: "
    "LN2 from the answers' ellipsoid, B = I + sum_h O_h V_h from Jacobians, LN1 and every neuron from Jacobians "
    "on LN1's sphere, every head from second-order reads at equal tokens; with float32 answers that algebra is the "
    "start of least-squares refits to answers of random tokens and sequences (--heads H|auto, --ffn M)")


def encoder_layers(info: dict, given: int | None, oracle, target) -> int:
    """The encoder's block count: ``--layers``, else what the target publishes, else read from the answers'
    size when they are every layer's hidden states (``d_out = (L + 1) d``, L >= 1). A ``--layers`` that
    contradicts the target's own count is refused."""
    spec = target.spec if target is not None else "the oracle"
    L = _given_or_published("layers", given, info.get("layers") or info.get("n_layers"), spec)
    if L is not None:
        return L
    d, d_out = oracle.d, oracle.d_out
    if d_out > d and d_out % d == 0:
        return d_out // d - 1
    raise SpecError(f"--method encoder needs the number of layers: give --layers L ({spec} does not publish it, "
                    f"and its {d_out} numbers per position do not say it)")


def _run_encoder(oracle, target, args, progress, clean=None):
    from .extraction.block.arithmetic import MAX_TFLOP
    from .extraction.block.encoder import blocks_too_large, extract_encoder
    info = (target.info or {}) if target is not None else {}
    heads, ffn = _block_sizes(target, args)
    heads = heads or info.get("heads")
    layers = encoder_layers(info, getattr(args, "layers", None), oracle, target)
    L, d = int(layers), oracle.d
    if oracle.d_out not in (d, (L + 1) * d):
        raise SpecError(f"--method encoder reads every layer's hidden states ((layers + 1) x d = {(L + 1) * d}) or "
                        f"the last layer's (d = {d}); {target.spec} answers {oracle.d_out} numbers per position")
    kw = check_kw(args)
    length = min(16, int(info.get("positions", 16)))
    rng = np.random.default_rng(args.seed)
    max_tflop = float(getattr(args, "max_tflop", MAX_TFLOP))
    too_large = (blocks_too_large(d, int(ffn), L, max_tflop, heads=int(heads) if heads else None, length=length)
                 if ffn is not None and oracle.d_out != d else "")
    if oracle.d_out == d or too_large:
        # what is possible without taking a block apart; the run ends in exit 2 with those parts in the row
        if getattr(args, "ln_eps", None) is not None:
            raise SpecError("--ln-eps applies to --method encoder with every layer's hidden states and the blocks "
                            "taken apart: the parts read without a block (hidden=last, or blocks planned past "
                            "--max-tflop) assume BERT's 1e-12")
        from .extraction.block.encoder_parts import extract_encoder_parts, not_recovered
        hidden = "last" if oracle.d_out == d else "all"
        reason = None if hidden == "last" else f"the blocks: {too_large} (docs/block.md)"
        parts = extract_encoder_parts(oracle, layers=L, hidden=hidden, rng=rng, length=length, verify=kw["verify"],
                                      check=kw["check"], check_rng=kw["check_rng"], reason=reason, progress=progress)
        raise not_recovered(parts)
    if heads is None or ffn is None:
        raise SpecError("--method encoder needs the head count and the FFN's width "
                        f"(--heads H, --ffn M; {target.spec} does not publish them)")
    return extract_encoder(oracle, layers=L, heads=int(heads), ffn=int(ffn), rng=rng, length=length,
                           verify=kw["verify"], check=kw["check"], check_rng=kw["check_rng"], progress=progress,
                           activation=getattr(args, "activation", "gelu"), ln_eps=getattr(args, "ln_eps", None),
                           max_tflop=max_tflop)


METHODS["encoder"] = Method(
    _run_encoder, lambda t, a: None,
    "ours: a whole BERT encoder queried with inputs_embeds, every layer's hidden states answered (float64 or "
    "float32): the embeddings' LayerNorm and position offsets, then each block from forward paths (its "
    "inputs observed, never inverted): stage V, stage F and the heads fitted, as --method block on a LayerNorm's "
    "image (--heads, --ffn). With hidden=last, or blocks that plan more than --max-tflop (MiniLM's: about 180,000 "
    "TFLOP): what the API gives away without a block taken apart (the position offsets from LN_emb's scale "
    "invariance, the output LayerNorms, a permutation check; with every layer's states also block 0's stage V), "
    "exit 2")


def _run_rope(oracle, target, args, progress, clean=None):
    from .extraction.rope import extract_rope
    return extract_rope(oracle, **check_kw(args), heads=_heads_arg(args), rng=np.random.default_rng(args.seed),
                        max_len=int(getattr(args, "max_len", 16)), verify_len=int(getattr(args, "verify_len", 64)),
                        progress=progress)


def _expected_rope(target, args):
    from .extraction.rope import expected_queries
    info = (target.info or {}) if target is not None else {}
    f32 = str(info.get("dtype", "float64")) == "float32"
    return expected_queries(target.d, info.get("head_dim"), int(getattr(args, "max_len", 16)), f32)


METHODS["rope"] = Method(
    _run_rope, _expected_rope,
    "ours: a causal decoder attention layer with rotary positions (RoPE) and grouped-query heads "
    "(transformers' LlamaAttention) from vector answers at every position: saturated causal queries for every "
    "head's O_h and the key/value groups, attention weights read against zero tokens for the query/key spaces "
    "and the score form at each offset, theta from the rotation's eigenvalues (--max-len: longest query, "
    "default 16; --verify-len: the check's fresh sequences, default 64)")
VECTOR_METHODS = {"vector", "block", "rope", "encoder"}


# Methods whose oracle has an input-norm bound by default (R = 1): under noise, a bound on ||x_i|| is
# what keeps additive noise from being made negligible just by scaling the inputs up (Section 6).
NORM_BOUND_METHODS = {"noisy-paper", "noisy", "membership-paper", "membership"}
# Methods that read only the sign of each answer: --sign-only is implied for them.
SIGN_ONLY_METHODS = {"membership-paper", "membership"}


def input_norm_for(args) -> float | None:
    """The input-norm bound R: ``--input-norm``, else 1 for the noisy/membership methods, else none."""
    if args.input_norm is not None:
        if not (math.isfinite(args.input_norm) and args.input_norm > 0):
            raise SpecError(f"--input-norm must be a positive number, got {args.input_norm}")
        return float(args.input_norm)
    return 1.0 if args.method in NORM_BOUND_METHODS else None


def published_output(target: Target) -> str:
    """What a model API says its answers are (``/v1/info``, or ``/v1/usage`` for the key's own defences):
    ``value``, ``noisy:TAU``, ``rounded:K`` or ``sign``; ``value`` for a local target."""
    return str(target.info.get("server_output") or "value")


def noise_tau(args, target: Target | None = None) -> float:
    """The tolerance the oracle's answers have: ``--noise``, or ``0.5 * 10**-K`` for round:K; else what
    a model API publishes of its own answers (``noisy:TAU``, ``rounded:K``: the server adds the noise,
    the client only needs to know TAU); else 0."""
    from .oracles.tolerance import parse_mode, round_tolerance
    if args.noise_mode is not None:
        kind, K = parse_mode(args.noise_mode)
        if kind == "round":
            return round_tolerance(K)
    if args.noise is not None:
        return float(args.noise)
    from .oracles.http import output_tolerance
    return output_tolerance(published_output(target)) if target is not None else 0.0


def build_oracle(target: Target, args, **oracle_kw) -> Oracle:
    """The oracle stack the flags ask for, innermost first.

    1. the target's oracle, with the budget, transcript and the input-norm bound R (``--input-norm``);
    2. ``Tolerance`` (``--noise TAU --noise-mode MODE``; ``--noise-mode round:K`` alone implies TAU);
    3. ``SignOnly`` (``--sign-only``), outermost.
    """
    from .oracles.tolerance import Tolerance, parse_mode
    oracle = target.make_oracle(input_norm=input_norm_for(args), **oracle_kw)
    if args.noise is not None and not (math.isfinite(args.noise) and args.noise >= 0):
        raise SpecError(f"--noise must be a number >= 0, got {args.noise}")
    if args.noise_mode is not None:
        kind, _ = parse_mode(args.noise_mode)
        if kind != "round" and args.noise is None:
            raise SpecError(f"--noise-mode {args.noise_mode} needs --noise TAU")
        oracle = Tolerance(oracle, args.noise, args.noise_mode)
    elif args.noise is not None:
        oracle = Tolerance(oracle, args.noise, "adversarial")
    if args.sign_only or args.method in SIGN_ONLY_METHODS:  # Appendix B's membership oracle, outermost
        if args.method not in SIGN_ONLY_METHODS:
            raise SpecError(f"--sign-only: the oracle answers only 0/1, which --method {args.method} cannot use; "
                            f"use --method {' or '.join(sorted(SIGN_ONLY_METHODS))}")
        from .oracles.sign_only import SignOnly
        oracle = SignOnly(oracle)
    return oracle
