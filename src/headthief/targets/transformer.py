"""Target kinds for one-layer transformers (Section 4.1): ``transformer:`` and ``torch-transformer:``.

* ``transformer:d=D,m=M[,seed=S][,bias=1][,heads=H][,dtype=float32]`` — a seeded random
  :class:`~headthief.models.transformer.Transformer` (:func:`~headthief.models.transformer.random_transformer`):
  attention read at the last token, a width-M ReLU FFN; ``bias=1`` gives the FFN biases b_1, b_2,
  ``heads=H`` puts H heads before the FFN.
* ``torch-transformer:d=D,m=M[,heads=H][,seed=S]`` — ``nn.MultiheadAttention`` then
  ``nn.Linear``-ReLU-``nn.Linear`` with PyTorch's default initialisation (FFN biases included), float32
  (:mod:`headthief.models.torch_transformer`); its truth is read from the module's weights.

Registered into :data:`headthief.targets.base.TARGET_KINDS` when :mod:`headthief.targets` is imported;
torch is imported only when a torch target is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import SpecError
from .base import Target, TargetKind, _check_keys, _int, check_size, register


def _flag(opts: dict[str, str], key: str) -> bool:
    val = opts.get(key, "0")
    if val not in ("0", "1", "true", "false", "yes", "no"):
        raise SpecError(f"target option {key}={val!r}: use 1 or 0")
    return val in ("1", "true", "yes")


def _build_transformer(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.transformer import random_transformer
    from ..oracles.base import ModelOracle
    _check_keys("transformer", opts, {"d", "m", "seed", "bias", "heads", "dtype"})
    d = _int(opts, "d", lo=1)
    m = _int(opts, "m", lo=1)
    seed = _int(opts, "seed", 0, lo=0)
    H = _int(opts, "heads", 1, lo=1)
    bias = _flag(opts, "bias")
    dtype = opts.get("dtype", "float64")
    if dtype not in ("float64", "float32"):
        raise SpecError(f"dtype={dtype!r}: use float64 or float32")
    check_size(spec, H * d * d + 2 * d * m)
    model = random_transformer(d, m, seed, bias=bias, heads=H, dtype=np.float32 if dtype == "float32" else np.float64)
    return Target(spec=spec, d=d, bias=bias, truth=model, make_oracle=lambda **kw: ModelOracle(model, **kw),
                  info={"dtype": dtype, "m": m, "heads": H, "ffn_bias": bias, "true_rank": d})


def _build_torch_transformer(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.torch_modules import TorchOracle
    from ..models.torch_transformer import torch_transformer, torch_transformer_forward, torch_transformer_truth
    _check_keys("torch-transformer", opts, {"d", "m", "seed", "heads"})
    d = _int(opts, "d", lo=1)
    m = _int(opts, "m", lo=1)
    seed = _int(opts, "seed", 0, lo=0)
    H = _int(opts, "heads", 1, lo=1)
    try:
        module = torch_transformer(d, m, seed, heads=H)
    except ImportError as e:
        raise SpecError(str(e)) from e
    except ValueError as e:
        raise SpecError(f"{spec}: {e}") from None
    forward = torch_transformer_forward(module)
    truth = torch_transformer_truth(module)
    name = f"MultiheadAttention({d}, {H}) + Linear({d}, {m}) + ReLU + Linear({m}, 1)"
    return Target(spec=spec, d=d, bias=True, truth=truth,
                  make_oracle=lambda **kw: TorchOracle(forward, d, name=name, **kw),
                  info={"seed": seed, "m": m, "heads": H, "dtype": "float32", "ffn_bias": True, "true_rank": d // H,
                        "black_box": "torch.nn.MultiheadAttention + nn.Linear/ReLU/nn.Linear"})


register(TargetKind("transformer", "transformer:d=D,m=M[,seed=S][,bias=1][,heads=H][,dtype=float32]",
                    "a seeded random one-layer transformer (Section 4.1): attention at the last token, a width-M "
                    "ReLU FFN (FFN biases with bias=1, H heads before the FFN)", _build_transformer))
register(TargetKind("torch-transformer", "torch-transformer:d=D,m=M[,heads=H][,seed=S]",
                    "torch.nn.MultiheadAttention + Linear/ReLU/Linear (default init, FFN biases), read at the last "
                    "position, float32 (needs torch)", _build_torch_transformer))
