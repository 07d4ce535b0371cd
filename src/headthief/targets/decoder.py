"""Target kinds on decoder attention: causal masks, rotary positions (RoPE), grouped-query heads.

* ``rope-mha:d=D,heads=H[,kv_heads=G][,head_dim=K][,rope_theta=T][,bias=1][,seed=S][,dtype=float32]
  [,output=last|all]`` — a seeded random :class:`~headthief.models.rope.RopeAttention` (the mathematics of
  transformers' ``LlamaAttention``), numpy, float64 unless ``dtype=float32``; answers at every position
  unless ``output=last``.
* ``llama-attn:d=D,heads=H[,kv_heads=G][,rope_theta=T][,seed=S][,dtype=float64]`` — transformers' own
  ``LlamaAttention`` (eager attention, built from a ``LlamaConfig``, no download) holding ``rope-mha``'s
  random weights for the same seed (no biases), its position embeddings from transformers'
  ``LlamaRotaryEmbedding`` for positions 0..N-1 and a causal 4-D additive mask; answers ``o_proj``'s output
  at every position. float32 unless ``dtype=float64``.
* ``gpt2-attn:d=D,heads=H[,seed=S][,dtype=float64]`` — transformers' ``GPT2Attention`` (eager, causal mask
  passed in, dropout 0, eval mode) with seeded random weights in its ``Conv1D`` layout; answers ``c_proj``'s
  output at every position. float32 unless ``dtype=float64``.

``truth`` is the numpy model in float64 holding the target's own (for float32: float32-rounded) weights:
a :class:`~headthief.models.rope.RopeAttention` for ``rope-mha`` and ``llama-attn``, the canonical form
(:class:`~headthief.models.mha.CanonicalLayer`) of a causal :class:`~headthief.models.mha.AttentionLayer`
for ``gpt2-attn``. For measuring errors only. torch and transformers are imported only when a
``llama-attn``/``gpt2-attn`` target is built.

transformers' eager ``LlamaAttention`` takes its softmax in float32, and ``LlamaRotaryEmbedding`` its
rotary tables in float32, whatever the module's dtype: a ``llama-attn`` target with ``dtype=float64``
answers to float32 precision only (see ``docs/decoder.md``); ``rope-mha`` is the float64 one.
"""

from __future__ import annotations

import functools
from typing import Any

from ..errors import SpecError
from .base import Target, TargetKind, _check_keys, _float, _int, check_size, output_option, register

_DECODER_MAX_TOKENS = 4096     # tokens per forward call (each holds heads x N scores)
_MAX_POSITIONS = 4096          # LlamaConfig.max_position_embeddings / GPT2Config.n_positions (not enforced:
                               # neither attention module reads it; the rotary tables are made for any position)


def _dtype(opts: dict[str, str], default: str):
    import numpy as np
    dtype = opts.get("dtype", default)
    if dtype not in ("float64", "float32"):
        raise SpecError(f"dtype={dtype!r}: use float64 or float32")
    return dtype, (np.float32 if dtype == "float32" else np.float64)


def _flag(opts: dict[str, str], key: str) -> bool:
    v = opts.get(key, "0")
    if v not in ("0", "1", "true", "false", "yes", "no"):
        raise SpecError(f"target option {key}={v!r}: use {key}=1 or {key}=0")
    return v in ("1", "true", "yes")


def _heads(kind: str, spec: str, opts: dict[str, str], *, head_dim_option: bool) -> tuple[int, int, int, int]:
    """d, heads, kv_heads and head_dim, checked (GQA divisibility, an even head dimension)."""
    d = _int(opts, "d", lo=1)
    H = _int(opts, "heads", lo=1)
    G = _int(opts, "kv_heads", H, lo=1)
    if H % G:
        raise SpecError(f"{spec}: heads={H} is not a multiple of kv_heads={G} (each key/value group serves "
                        "heads / kv_heads query heads)")
    if head_dim_option and "head_dim" in opts:
        dh = _int(opts, "head_dim", lo=1)
    else:
        if d % H:
            raise SpecError(f"{spec}: heads={H} does not divide d={d} (the head dimension is d / heads"
                            + ("; or give head_dim=K)" if head_dim_option else ")"))
        dh = d // H
    if dh % 2:
        raise SpecError(f"{spec}: head_dim={dh} is odd: RoPE turns pairs of coordinates (j, j + head_dim/2), "
                        "so the head dimension must be even")
    return d, H, G, dh


def _theta(spec: str, opts: dict[str, str]) -> float:
    import math
    theta = _float(opts, "rope_theta", 10000.0)
    if not (math.isfinite(theta) and theta > 0):
        raise SpecError(f"{spec}: rope_theta={opts.get('rope_theta')} must be a finite number > 0")
    return theta


def _rope_info(layer, **extra) -> dict[str, Any]:
    return {"heads": layer.heads, "kv_heads": layer.kv_heads, "head_dim": layer.head_dim, "rope_theta": layer.theta,
            "causal": True, "positions": "0..N-1 (token indices)", "output": layer.output.value, **extra}


# --------------------------------------------------------------------------------------------- rope-mha


def _build_rope_mha(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    import numpy as np

    from ..models.rope import random_rope_layer
    from ..oracles.base import ModelOracle
    _check_keys("rope-mha", opts, {"d", "heads", "kv_heads", "head_dim", "rope_theta", "bias", "seed", "dtype",
                                   "output"})
    d, H, G, dh = _heads("rope-mha", spec, opts, head_dim_option=True)
    theta = _theta(spec, opts)
    bias = _flag(opts, "bias")
    seed = _int(opts, "seed", 0, lo=0)
    dtype, dt = _dtype(opts, "float64")
    output = output_option("rope-mha", opts, "all")
    check_size(spec, 2 * (H + G) * dh * d)
    try:
        layer = random_rope_layer(d, H, G, head_dim=dh, theta=theta, seed=seed, bias=bias, dtype=dt, output=output)
    except ValueError as e:
        raise SpecError(f"{spec}: {e}") from None
    return Target(spec=spec, d=d, bias=bias, truth=layer.astype(np.float64), output=output, d_out=d,
                  make_oracle=lambda **kw: ModelOracle(layer, **kw),
                  info=_rope_info(layer, seed=seed, dtype=dtype, bias=bias, black_box="numpy"))


# --------------------------------------------------------------------------------------------- torch plumbing


def causal_mask(N: int, dtype):
    """The 4-D additive mask transformers' eager attention expects: (1, 1, N, N), 0 where key i <= query t,
    the dtype's most negative number above the diagonal."""
    from ..models.torch_modules import import_torch
    torch = import_torch()
    return torch.full((N, N), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


def _torch_dtype(dt):
    import numpy as np

    from ..models.torch_modules import import_torch
    torch = import_torch()
    return torch.float32 if dt is np.float32 else torch.float64


def _import_transformers():
    from ..models.torch_modules import TORCH_HINT, import_torch
    import_torch()
    try:
        import transformers
    except ImportError as e:
        raise ModuleNotFoundError(f"this target needs transformers: {TORCH_HINT}", name="transformers") from e
    transformers.utils.logging.set_verbosity_error()
    return transformers


def _oracle(forward, d: int, name: str, dt, kw):
    """A TorchOracle answering at every position; a float64 module is sent float64 queries (TorchOracle
    itself sends float32 tensors, which would round the queries of a float64 target)."""
    import numpy as np

    from ..models.torch_modules import TorchOracle
    cls = TorchOracle if dt is np.float32 else _float64_torch_oracle()
    return cls(forward, d, name=name, output="all", d_out=d, max_tokens=_DECODER_MAX_TOKENS, **kw)


@functools.lru_cache(maxsize=1)
def _float64_torch_oracle():
    """:class:`~headthief.models.torch_modules.TorchOracle` whose vector queries travel as float64 tensors
    (made on first use, so that importing this module imports no torch adapter)."""
    import numpy as np

    from ..models.mha import _assemble, _groups
    from ..models.torch_modules import TorchOracle

    class Float64TorchOracle(TorchOracle):
        def _query_vectors(self, torch, X):
            groups = []
            with torch.no_grad():
                for idx, A in _groups(X):
                    step = max(1, self.max_tokens // A.shape[1])
                    parts = [self.forward(torch.from_numpy(np.ascontiguousarray(A[s:s + step], dtype=np.float64)))
                             .double().numpy() for s in range(0, len(idx), step)]
                    groups.append((idx, np.concatenate(parts, axis=0)))
            return _assemble(self.output, X, groups, self.d_out)

    return Float64TorchOracle


# --------------------------------------------------------------------------------------------- llama-attn


def llama_attention(layer, *, dtype=None, attn_implementation: str = "eager"):
    """transformers' ``LlamaAttention`` (eval mode) and ``LlamaRotaryEmbedding`` for ``layer``'s shape and
    theta, holding ``layer``'s weights, in ``dtype`` (a torch dtype; default the layer's own)."""
    import numpy as np
    _import_transformers()
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    if dtype is None:
        dtype = _torch_dtype(layer.dtype)
    cfg = LlamaConfig(hidden_size=layer.d, num_attention_heads=layer.heads, num_key_value_heads=layer.kv_heads,
                      head_dim=layer.head_dim, attention_bias=bool(layer.bias), attention_dropout=0.0,
                      rope_parameters={"rope_type": "default", "rope_theta": float(layer.theta)},
                      max_position_embeddings=_MAX_POSITIONS)
    cfg._attn_implementation = attn_implementation
    module = LlamaAttention(cfg, layer_idx=0).eval().to(dtype)
    module.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in layer.state_dict().items()},
                           strict=True)
    return module, LlamaRotaryEmbedding(cfg).eval()


def llama_attn_forward(module, rotary):
    """``(k, N, d) -> (k, N, d)``: ``module`` (a ``LlamaAttention``) with ``rotary``'s position embeddings
    for positions 0..N-1 and the causal mask; the input cast to the module's dtype."""
    from ..models.torch_modules import import_torch
    torch = import_torch()
    dtype = module.o_proj.weight.dtype

    def forward(X):
        X = X.to(dtype)
        N = X.shape[1]
        cos, sin = rotary(X, torch.arange(N)[None])
        return module(X, position_embeddings=(cos, sin), attention_mask=causal_mask(N, dtype))[0]

    return forward


def _build_llama_attn(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    import numpy as np

    from ..models.rope import random_rope_layer
    _check_keys("llama-attn", opts, {"d", "heads", "kv_heads", "rope_theta", "seed", "dtype"})
    d, H, G, dh = _heads("llama-attn", spec, opts, head_dim_option=False)
    theta = _theta(spec, opts)
    seed = _int(opts, "seed", 0, lo=0)
    dtype, dt = _dtype(opts, "float32")
    check_size(spec, 2 * (H + G) * dh * d)
    layer = random_rope_layer(d, H, G, head_dim=dh, theta=theta, seed=seed, dtype=dt, output="all")
    try:
        forward = llama_attn_forward(*llama_attention(layer))
    except ImportError as e:
        raise SpecError(str(e)) from e
    name = f"transformers LlamaAttention (eager, d={d}, heads={H}, kv_heads={G})"
    return Target(spec=spec, d=d, bias=False, truth=layer.astype(np.float64), output="all", d_out=d,
                  make_oracle=lambda **kw: _oracle(forward, d, name, dt, kw),
                  info=_rope_info(layer, seed=seed, dtype=dtype, black_box="transformers LlamaAttention (eager)",
                                  rotary="transformers LlamaRotaryEmbedding (tables in float32)"))


# --------------------------------------------------------------------------------------------- gpt2-attn


def gpt2_state_dict(layer) -> dict[str, Any]:
    """An :class:`~headthief.models.mha.AttentionLayer`'s weights in ``GPT2Attention``'s ``Conv1D`` layout
    (``y = x @ W + b``): ``c_attn.weight`` (d, 3d) = ``[Q; K; V]^T`` (heads in order inside each third),
    ``c_attn.bias`` (3d,), ``c_proj.weight`` (d, d) = ``Wo^T``, ``c_proj.bias`` (d,)."""
    import numpy as np
    d = layer.d
    if layer.heads * layer.head_dim != d:
        raise ValueError(f"GPT2Attention has heads * head_dim = d; this layer has {layer.heads} x {layer.head_dim} "
                         f"!= {d}")
    Wqkv = np.concatenate([layer.Q.reshape(d, d), layer.K.reshape(d, d), layer.V.reshape(d, d)], axis=0)
    return {"c_attn.weight": Wqkv.T, "c_attn.bias": np.concatenate([layer.bq.reshape(d), layer.bk.reshape(d),
                                                                     layer.bv.reshape(d)]),
            "c_proj.weight": np.asarray(layer.Wo).T, "c_proj.bias": layer.bo}


def gpt2_layer(module, output="all"):
    """A ``GPT2Attention``'s weights as a causal float64 :class:`~headthief.models.mha.AttentionLayer`
    (head h: columns h d_h .. (h+1) d_h - 1 of each third of ``c_attn``, rows of ``c_proj``)."""
    import numpy as np

    from ..models.mha import AttentionLayer
    d, H = int(module.embed_dim), int(module.num_heads)
    dh = d // H
    f = lambda t: t.detach().double().numpy()                                # noqa: E731
    W, b = f(module.c_attn.weight), f(module.c_attn.bias)
    Wp, bp = f(module.c_proj.weight), f(module.c_proj.bias)
    part = lambda i: W[:, i * d:(i + 1) * d].T.reshape(H, dh, d)             # noqa: E731
    bpart = lambda i: b[i * d:(i + 1) * d].reshape(H, dh)                    # noqa: E731
    return AttentionLayer(Q=part(0), K=part(1), V=part(2), Wo=Wp.T, bq=bpart(0), bk=bpart(1), bv=bpart(2), bo=bp,
                          causal=True, output=output, dtype=np.float64)


def gpt2_attention(layer, *, dtype=None):
    """transformers' ``GPT2Attention`` (eager, eval mode, dropout 0) holding ``layer``'s weights (an
    :class:`~headthief.models.mha.AttentionLayer` with heads * head_dim = d), in ``dtype`` (a torch dtype;
    default the layer's own)."""
    import numpy as np
    _import_transformers()
    import torch
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    if dtype is None:
        dtype = _torch_dtype(layer.dtype)
    cfg = GPT2Config(n_embd=layer.d, n_head=layer.heads, n_positions=_MAX_POSITIONS, attn_pdrop=0.0, resid_pdrop=0.0,
                     embd_pdrop=0.0)
    cfg._attn_implementation = "eager"
    module = GPT2Attention(cfg, layer_idx=0).eval().to(dtype)
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in gpt2_state_dict(layer).items()}
    module.load_state_dict(tensors, strict=True)       # copied into the module's own dtype
    return module


def gpt2_attn_forward(module):
    """``(k, N, d) -> (k, N, d)``: ``module`` (a ``GPT2Attention``) with the causal mask (transformers 5 no
    longer masks inside the module: without a mask it attends both ways)."""
    dtype = module.c_proj.weight.dtype

    def forward(X):
        X = X.to(dtype)
        return module(X, attention_mask=causal_mask(X.shape[1], dtype))[0]

    return forward


def _build_gpt2_attn(spec: str, opts: dict[str, str], ctx: dict[str, Any]) -> Target:
    from ..models.mha import random_layer
    _check_keys("gpt2-attn", opts, {"d", "heads", "seed", "dtype"})
    d = _int(opts, "d", lo=1)
    H = _int(opts, "heads", lo=1)
    if d % H:
        raise SpecError(f"{spec}: heads={H} does not divide d={d} (GPT-2's head dimension is d / heads)")
    seed = _int(opts, "seed", 0, lo=0)
    dtype, dt = _dtype(opts, "float32")
    check_size(spec, 4 * d * d)
    layer = random_layer(d, H, seed=seed, bias=True, causal=True, output="all", dtype=dt)
    try:
        module = gpt2_attention(layer)
    except ImportError as e:
        raise SpecError(str(e)) from e
    forward = gpt2_attn_forward(module)
    truth = gpt2_layer(module).canonical()
    name = f"transformers GPT2Attention (eager, d={d}, heads={H})"
    return Target(spec=spec, d=d, bias=True, truth=truth, output="all", d_out=d,
                  make_oracle=lambda **kw: _oracle(forward, d, name, dt, kw),
                  info={"heads": H, "head_dim": d // H, "causal": True, "output": "all", "seed": seed, "dtype": dtype,
                        "weights": "mha: random_layer scales (Q, K, V ~ N(0, 1/d), c_proj ~ N(0, 1/d), biases "
                                   "~ N(0, 0.5^2))",
                        "black_box": "transformers GPT2Attention (eager)"})


register(TargetKind("rope-mha", "rope-mha:d=D,heads=H[,kv_heads=G][,head_dim=K][,rope_theta=T][,bias=1][,seed=S]"
                                "[,dtype=float32][,output=last|all]",
                    "a seeded random causal attention layer with rotary positions (RoPE) and grouped-query heads, "
                    "LlamaAttention's mathematics in numpy (float64; d-vectors at every position)", _build_rope_mha))
register(TargetKind("llama-attn", "llama-attn:d=D,heads=H[,kv_heads=G][,rope_theta=T][,seed=S][,dtype=float64]",
                    "transformers' LlamaAttention (eager, its rotary embedding, causal mask) holding rope-mha's "
                    "weights for the same seed, o_proj's output at every position (float32; needs torch, "
                    "transformers)", _build_llama_attn))
register(TargetKind("gpt2-attn", "gpt2-attn:d=D,heads=H[,seed=S][,dtype=float64]",
                    "transformers' GPT2Attention (eager, causal, no rotation) with seeded random weights (mha:'s "
                    "scales, biases), c_proj's output at every position (float32; needs torch, transformers)",
                    _build_gpt2_attn))
