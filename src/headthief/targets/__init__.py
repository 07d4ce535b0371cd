"""Target specs: ``KIND:key=value,...`` strings that name a black box for the command line.

Each kind is a :class:`TargetKind` in :data:`TARGET_KINDS`: a parser from the spec's options to a
:class:`Target` (the oracle to extract from, and the true parameters where they are known, for
measuring errors). ``headthief targets`` lists them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SpecError
from ..models.attention import random_head
from ..oracles.base import CallableOracle, ModelOracle
from .base import TARGET_KINDS, Target, TargetKind, _check_keys, _float, _int, check_size, parse_options, register


def _build_random(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    _check_keys("random", opts, {"d", "seed", "rank", "sparse_v", "v", "bias", "dtype", "W_norm", "v_norm", "v_min"})
    d = _int(opts, "d", lo=1)
    seed = _int(opts, "seed", 0, lo=0)
    rank = _int(opts, "rank", d, lo=1)
    if rank > d:
        raise SpecError(f"rank={rank} is larger than d={d}")
    sparse_v = _float(opts, "sparse_v", 0.0)
    if not 0.0 <= sparse_v < 1.0:
        raise SpecError(f"sparse_v={sparse_v} must be in [0, 1)")
    vmode = opts.get("v", "gaussian")
    if vmode not in ("gaussian", "zero"):
        raise SpecError(f"v={vmode!r}: use v=zero (or leave it out)")
    bias = opts.get("bias", "0") in ("1", "true", "yes")
    dtype = opts.get("dtype", "float64")
    if dtype not in ("float64", "float32"):
        raise SpecError(f"dtype={dtype!r}: use float64 or float32")
    check_size(spec, d * d if rank == d else 2 * d * rank + d)
    norms = {k: _float(opts, k, None) for k in ("W_norm", "v_norm", "v_min") if k in opts}
    for k, x in norms.items():
        if not (np.isfinite(x) and x >= 0):
            raise SpecError(f"{k}={x} must be a finite number >= 0")
    try:
        head = random_head(d, rng=seed, rank=rank, sparse_v=sparse_v, v_zero=vmode == "zero", bias=bias,
                           dtype=np.float32 if dtype == "float32" else np.float64, **norms)
    except ValueError as e:
        raise SpecError(f"{spec}: {e}") from None
    return Target(spec=spec, d=d, bias=bias, truth=head,
                  make_oracle=lambda **kw: ModelOracle(head, **kw),
                  info={"dtype": dtype, "true_rank": rank, **norms})


def _build_py(spec: str, rest: str, ctx: dict[str, Any]) -> Target:
    path, sep, func = rest.rpartition(":")
    if not sep or not path or not func:
        raise SpecError(f"py target must be py:PATH.py:FUNC, got {spec!r}")
    d = ctx.get("d")
    if not d:
        raise SpecError("a py: target needs --d D (the token dimension of your model)")
    output = ctx.get("output") or "value"
    if output not in ("value", "last", "all"):
        raise SpecError(f"--output {output!r}: use value (one number per sequence), last (a vector at the last "
                        "position) or all (a vector at every position)")
    d_out = ctx.get("d_out") or (int(d) if output != "value" else None)
    causal = bool(ctx.get("causal"))
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"py target: no such file {path!r}")
    mod_spec = importlib.util.spec_from_file_location(f"headthief_user_{p.stem}", p)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        raise SpecError(f"py target: importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, func, None)
    if not callable(fn):
        raise SpecError(f"py target: {path} has no callable named {func!r}")
    return Target(spec=spec, d=int(d), bias=bool(ctx.get("bias")), truth=None, output=output, d_out=d_out,
                  make_oracle=lambda **kw: CallableOracle(fn, int(d), **{"output": output, "d_out": d_out, **kw}),
                  info={"callable": func, **({"output": output} if output != "value" else {}),
                        **({"causal": True} if causal else {})})


register(TargetKind("random", "random:d=D[,seed=S][,rank=R][,sparse_v=F][,v=zero][,bias=1][,dtype=float32][,W_norm=X][,v_norm=Y][,v_min=M]",
                    "a seeded random head (Section 3 model; biases with bias=1; factored W when rank < d)",
                    _build_random))


def _build_multihead(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.multihead import random_multihead
    _check_keys("multihead", opts, {"d", "heads", "seed", "rank", "bias", "dtype", "subspaces", "identical"})
    d = _int(opts, "d", lo=1)
    H = _int(opts, "heads", lo=1)
    seed = _int(opts, "seed", 0, lo=0)
    rank = _int(opts, "rank", 0, lo=0) or None
    bias = opts.get("bias", "0") in ("1", "true", "yes")
    dtype = opts.get("dtype", "float64")
    if dtype not in ("float64", "float32"):
        raise SpecError(f"dtype={dtype!r}: use float64 or float32")
    sub = opts.get("subspaces")
    if sub not in (None, "orthogonal"):
        raise SpecError(f"subspaces={sub!r}: use subspaces=orthogonal (or leave it out)")
    identical = opts.get("identical", "0") in ("1", "true", "yes")
    check_size(spec, H * d * d)
    try:
        model = random_multihead(d, H, rng=seed, rank=rank, bias=bias, subspaces=sub, identical=identical,
                                 dtype=np.float32 if dtype == "float32" else np.float64)
    except ValueError as e:
        raise SpecError(f"{spec}: {e}") from None
    return Target(spec=spec, d=d, bias=bias, truth=model, make_oracle=lambda **kw: ModelOracle(model, **kw),
                  info={"dtype": dtype, "heads": H, "true_rank": rank or (d // H if sub else d),
                        **({"subspaces": sub} if sub else {}), **({"identical": True} if identical else {})},
                  bases=model._cache.get("bases"))


register(TargetKind("multihead", "multihead:d=D,heads=H[,rank=R][,seed=S][,bias=1][,dtype=float32][,subspaces=orthogonal][,identical=1]",
                    "seeded random multi-head attention (Section 7; orthogonal subspaces = Assumption C.1; "
                    "identical=1 = Proposition 7.1's family)", _build_multihead))


def _build_mha(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.mha import random_layer
    from .base import output_option
    _check_keys("mha", opts, {"d", "heads", "head_dim", "seed", "bias", "causal", "output", "dtype"})
    d = _int(opts, "d", lo=1)
    H = _int(opts, "heads", lo=1)
    head_dim = _int(opts, "head_dim", 0, lo=0) or None
    seed = _int(opts, "seed", 0, lo=0)
    bias = opts.get("bias", "0") in ("1", "true", "yes")
    causal = opts.get("causal", "0") in ("1", "true", "yes")
    output = output_option("mha", opts, "last")
    dtype = opts.get("dtype", "float64")
    if dtype not in ("float64", "float32"):
        raise SpecError(f"dtype={dtype!r}: use float64 or float32")
    check_size(spec, 4 * d * d + H * d * d)
    try:
        layer = random_layer(d, H, head_dim=head_dim, seed=seed, bias=bias, causal=causal, output=output,
                             dtype=np.float32 if dtype == "float32" else np.float64)
    except ValueError as e:
        raise SpecError(f"{spec}: {e}") from None
    return Target(spec=spec, d=d, bias=bias, truth=layer.canonical(), output=output, d_out=d,
                  make_oracle=lambda **kw: ModelOracle(layer, **kw),
                  info={"dtype": dtype, "heads": H, "head_dim": layer.head_dim, "causal": causal, "output": output})


register(TargetKind("mha", "mha:d=D,heads=H[,head_dim=K][,bias=1][,causal=1][,output=last|all][,dtype=float32][,seed=S]",
                    "a seeded random multi-head attention layer with output projection answering d-vectors (BERT's "
                    "self-attention + output dense; biases with bias=1; causal mask with causal=1)", _build_mha))


def _build_ffn(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.ffn import random_ffn
    _check_keys("ffn", opts, {"d", "m", "seed", "bias", "sparse", "dtype"})
    d = _int(opts, "d", lo=1)
    m = _int(opts, "m", lo=1)
    seed = _int(opts, "seed", 0, lo=0)
    bias = opts.get("bias", "0") in ("1", "true", "yes")
    sparse = _float(opts, "sparse", 0.0)
    if not 0.0 <= sparse <= 1.0:
        raise SpecError(f"sparse={sparse} must be in [0, 1]")
    dtype = opts.get("dtype", "float64")
    if dtype not in ("float64", "float32"):
        raise SpecError(f"dtype={dtype!r}: use float64 or float32")
    check_size(spec, 2 * d * m)
    model = random_ffn(d, m, seed, bias=bias, sparse=sparse, dtype=np.float32 if dtype == "float32" else np.float64)
    return Target(spec=spec, d=d, bias=bias, truth=model, make_oracle=lambda **kw: ModelOracle(model, **kw),
                  info={"dtype": dtype, "m": m, **({"sparse": sparse} if sparse else {})})


register(TargetKind("ffn", "ffn:d=D,m=M[,seed=S][,bias=1][,sparse=F][,dtype=float32]",
                    "a seeded random two-layer ReLU FFN on one-token queries (Section 4.1's FFN; biases with bias=1; "
                    "sparse=F makes that share of neurons rarely active, or tiny without biases)", _build_ffn))


def resolve(spec: str, **ctx: Any) -> Target:
    """Turn a spec string into a :class:`Target`. ``ctx`` carries CLI settings (``d``, ``bias``, ``output``,
    ``d_out``, ``causal``: what a ``py:`` black box cannot say about itself)."""
    kind, sep, rest = spec.partition(":")
    if ctx.get("causal") and kind != "py":
        raise SpecError(f"--causal declares a py: black box causal; {spec} is not one: other kinds fix their "
                        "mask in the spec (mha:...,causal=1; rope-mha:, llama-attn: and gpt2-attn: are causal) or, "
                        "behind an API, have it detected from answers at every position (--method vector)")
    if kind in ("http", "https"):
        from .http import build_http
        return build_http(spec, ctx)
    if kind == "py":
        return _build_py(spec, rest, ctx)
    if kind not in TARGET_KINDS:
        known = ", ".join(["py"] + sorted(TARGET_KINDS))
        raise SpecError(f"unknown target kind {kind!r} in {spec!r} (known: {known})")
    return TARGET_KINDS[kind].build(spec, parse_options(rest), ctx)


def describe() -> list[tuple[str, str]]:
    rows = [(k.syntax, k.description) for k in TARGET_KINDS.values()]
    rows.append(("http://HOST:PORT[?framing=auto|sparse|npy|json][&connect_wait=S] --api-key K",
                 "a model behind a `headthief serve` API (key also from HEADTHIEF_API_KEY)"))
    rows.append(("py:PATH.py:FUNC --d D [--bias] [--output last|all [--d-out K] [--causal]]",
                 "your own black box: FUNC maps a list of (N_i, d) arrays to one float per array (--output last: "
                 "one K-vector per array; --output all: one (N_i, K) array per array; --causal: each position "
                 "attends to itself and earlier ones, for --method vector)"))
    return rows


# Target kinds on real models (minilm:, minilm-hf:, torch-mha:); they register themselves on import.
from . import real  # noqa: E402,F401
# One-layer transformer targets (transformer:, torch-transformer:); they register themselves on import.
from . import transformer as _transformer  # noqa: E402,F401
# Whole BERT blocks and the MiniLM encoder (bert-block:, minilm-block:, minilm-block-hf:, minilm-encoder:).
from . import encoder as _encoder  # noqa: E402,F401
# Decoder attention: RoPE, grouped-query heads, causal masks (rope-mha:, llama-attn:, gpt2-attn:).
from . import decoder as _decoder  # noqa: E402,F401
