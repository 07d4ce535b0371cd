"""Export a recovered attention layer as BERT weights (safetensors, transformers' naming).

An extraction recovers a layer in its identifiable form (:class:`~headthief.models.mha.CanonicalLayer`):
per head ``W_h = K_h^T Q_h / sqrt(d_h)``, ``c_h = K_h^T bq_h / sqrt(d_h)``, ``O_h = Wo[:, h] V_h`` and
the output bias ``b = bo + Wo bv``. This module writes *one* choice of BERT parameters that reproduces
exactly those, under the tensor names of transformers' ``BertAttention`` (``self.query.weight`` ...
``output.dense.bias``), so ``BertAttention.load_state_dict(tensors, strict=False)`` takes them (only the
LayerNorm, which the canonical form does not describe, is left missing), and the module's
``output.dense(self(X)[0])`` (before the residual and LayerNorm) answers like the layer.

What the answers do not identify, and the canonical choice made for it
----------------------------------------------------------------------
* ``Q_h, K_h``: only ``K_h^T Q_h`` is fixed; any invertible d_h x d_h ``G`` gives the same answers with
  ``Q_h -> G Q_h, K_h -> G^{-T} K_h``. Choice: the SVD ``sqrt(d_h) W_h = L S R^T`` (d_h components,
  computed from the factors A_h, B_h by two QRs and a d_h x d_h SVD, so W_h is never formed) split
  symmetrically, ``K_h = sqrt(S) L^T``, ``Q_h = sqrt(S) R^T``; each singular pair's sign is fixed by making
  the largest-magnitude entry of ``L``'s column positive.
* ``bq_h``: only ``K_h^T bq_h`` is fixed (``bq_h`` is unique once K_h is chosen, when W_h has full rank
  d_h). Choice: the least-squares solution of ``K_h^T bq_h / sqrt(d_h) = c_h`` (the minimum-norm one when
  W_h is rank-deficient). A true layer's c_h lies in ``col(K_h^T) = col(W_h)``; a recovered c_h with a
  component outside it (noise) cannot be represented, and its relative size is reported as the residual.
* ``bk``: never changes an answer (it adds the same number to every score of a query). Choice: 0.
* ``V_h, Wo[:, h]``: only ``O_h = Wo[:, h] V_h`` is fixed (same G freedom). Choice: the SVD
  ``O_h = P S R^T`` (d_h components) split symmetrically, ``Wo[:, h] = P sqrt(S)``, ``V_h = sqrt(S) R^T``,
  signs fixed as above.
* ``bv`` and ``bo``: only ``b = bo + Wo bv`` is fixed. Choice: ``bv = 0``, ``bo = b``.
* The order of the heads is not identifiable either; the layer's order is kept.

Limits: transformers' ``BertConfig`` derives the head size as ``hidden_size / num_attention_heads`` and
its output dense maps d -> d, so a layer exports only when ``H * d_h == d`` (d_h = the rank of the
factors, ``A.shape[2]``) and ``d_out == d``; otherwise :class:`ValueError`. **Causal layers are refused**
(``ValueError``): BERT's attention is bidirectional, and a file loaded into a ``BertModel`` would silently
attend to the future.

torch, transformers and safetensors are imported inside the functions only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .mha import CanonicalLayer
from ..linalg import lstsq, svd

FORMAT = "headthief-bert-attention-1"
NAMES = ("self.query.weight", "self.query.bias", "self.key.weight", "self.key.bias",
         "self.value.weight", "self.value.bias", "output.dense.weight", "output.dense.bias")
LAYERNORM_KEYS = frozenset({"output.LayerNorm.weight", "output.LayerNorm.bias"})
# a factor pair whose discarded singular values exceed this (relative to the largest) is not a rank-d_h
# matrix, and cutting it would change the answers
_RANK_TOL = 1e-9


def _canonical(layer) -> CanonicalLayer:
    if isinstance(layer, CanonicalLayer):
        return layer
    if hasattr(layer, "canonical"):                    # an AttentionLayer
        return layer.canonical()
    raise TypeError(f"expected a CanonicalLayer (or an AttentionLayer), got {type(layer).__name__}")


def _check_exportable(layer: CanonicalLayer) -> tuple[int, int, int]:
    H, d, r = (int(s) for s in layer.A.shape)
    if layer.causal:
        raise ValueError("a causal layer cannot be exported as BERT attention: BertAttention is bidirectional "
                         "(a BertModel loading the file would attend to later tokens)")
    if H * r != d:
        raise ValueError(f"H * head_dim = {H} * {r} = {H * r} != hidden_size d = {d}: transformers' BertConfig "
                         f"derives the head size as hidden_size / num_attention_heads, so this layer has no "
                         "BERT form (the 1/sqrt(head_dim) scale and the tensor shapes would not match)")
    if layer.d_out != d:
        raise ValueError(f"d_out = {layer.d_out} != d = {d}: BERT's output dense maps hidden_size to hidden_size")
    return H, d, r


def _fix_signs(L: np.ndarray, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flip singular pairs so that each column of L has its largest-magnitude entry positive."""
    i = np.argmax(np.abs(L), axis=0)
    s = np.sign(L[i, np.arange(L.shape[1])])
    s[s == 0] = 1.0
    return L * s, R * s


def _svd_of_product(A: np.ndarray, B: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The top-k SVD ``L diag(S) R^T`` of ``A B^T`` (A: (m, r), B: (n, r)) without forming it, and the
    largest discarded singular value relative to the largest kept (0 when nothing is discarded)."""
    Qa, Ra = np.linalg.qr(A)
    Qb, Rb = np.linalg.qr(B)
    P, S, Rt = svd(Ra @ Rb.T)
    L, R = Qa @ P, Qb @ Rt.T
    tail = float(S[k] / S[0]) if len(S) > k and S[0] > 0 else 0.0
    L, R = _fix_signs(L[:, :k], R[:, :k])
    S = S[:k]
    if len(S) < k:                                     # fewer factor columns than k: pad with zero pairs
        pad = k - len(S)
        L = np.hstack([L, np.zeros((L.shape[0], pad))])
        R = np.hstack([R, np.zeros((R.shape[0], pad))])
        S = np.concatenate([S, np.zeros(pad)])
    return L, S, R, tail


def _bert_tensors_f64(layer: CanonicalLayer) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    H, d, dh = _check_exportable(layer)
    root = np.sqrt(dh)
    Q = np.zeros((H, dh, d))
    K = np.zeros((H, dh, d))
    V = np.zeros((H, dh, d))
    Wo = np.zeros((d, H * dh))
    bq = np.zeros((H, dh))
    c_res = []
    for h in range(H):
        # sqrt(dh) W_h = sqrt(dh) A_h B_h^T = L diag(S) R^T; K_h = sqrt(S) L^T, Q_h = sqrt(S) R^T
        L, S, R, tail = _svd_of_product(layer.A[h] * root, layer.B[h], dh)
        if tail > _RANK_TOL:
            raise ValueError(f"head {h}: W_h has rank > head_dim = {dh} (discarded singular value "
                             f"{tail:.3g} of the largest)")
        s = np.sqrt(S)
        K[h], Q[h] = (L * s).T, (R * s).T
        # K_h^T bq_h / sqrt(dh) = c_h, least squares (minimum norm on zero singular values)
        c = layer.C[h]
        bq[h] = lstsq(K[h].T, c * root, rcond=None)[0]
        nc = float(np.linalg.norm(c))
        c_res.append(float(np.linalg.norm(K[h].T @ bq[h] / root - c)) / (nc if nc > 0 else 1.0))
        # O_h = U_h Vt_h^T = P diag(S) R^T; Wo[:, h] = P sqrt(S), V_h = sqrt(S) R^T
        P, So, Ro, tail_o = _svd_of_product(layer.U[h], layer.Vt[h], dh)
        if tail_o > _RANK_TOL:
            raise ValueError(f"head {h}: O_h has rank > head_dim = {dh} (discarded singular value "
                             f"{tail_o:.3g} of the largest)")
        so = np.sqrt(So)
        Wo[:, h * dh:(h + 1) * dh], V[h] = P * so, (Ro * so).T
    tensors = {
        "self.query.weight": Q.reshape(H * dh, d), "self.query.bias": bq.reshape(-1),
        "self.key.weight": K.reshape(H * dh, d), "self.key.bias": np.zeros(H * dh),
        "self.value.weight": V.reshape(H * dh, d), "self.value.bias": np.zeros(H * dh),
        "output.dense.weight": Wo, "output.dense.bias": np.asarray(layer.b, np.float64).copy(),
    }
    report = {"heads": H, "head_dim": dh, "hidden_size": d, "c_residual": c_res,
              "c_residual_max": max(c_res) if c_res else 0.0}
    return tensors, report


def bert_attention_tensors(layer: CanonicalLayer, *, dtype=np.float64, return_report: bool = False):
    """BERT attention weights reproducing ``layer``'s W_h, c_h, O_h and b (see the module docstring for the
    canonical choice), keyed by transformers' ``BertAttention`` names: ``self.query.weight`` (H d_h, d),
    ``self.query.bias`` (H d_h,), ``self.key.*``, ``self.value.*``, ``output.dense.weight`` (d, H d_h),
    ``output.dense.bias`` (d,). ``bk = bv = 0``, ``bo = b``.

    ``layer``: a :class:`CanonicalLayer` (an ``AttentionLayer`` is converted with ``.canonical()``).
    ``dtype``: of the returned arrays (computed in float64). With ``return_report=True`` returns
    ``(tensors, report)``; ``report["c_residual"]`` holds per head ``||K_h^T bq_h / sqrt(d_h) - c_h|| /
    ||c_h||`` (round-off for a true layer; the part of a noisy c_h outside col(W_h) otherwise).
    Raises :class:`ValueError` for a causal layer, ``H * d_h != d``, ``d_out != d``, or a W_h / O_h of rank
    above d_h."""
    tensors, report = _bert_tensors_f64(_canonical(layer))
    tensors = {k: np.ascontiguousarray(v, dtype=dtype) for k, v in tensors.items()}
    return (tensors, report) if return_report else tensors


def save_bert_attention(layer: CanonicalLayer, path, *, metadata: dict | None = None) -> dict[str, Any]:
    """Write :func:`bert_attention_tensors` of ``layer`` as a float32 safetensors file at ``path``.

    The file's metadata (strings, as safetensors requires): ``format`` = ``headthief-bert-attention-1``,
    ``heads``, ``head_dim``, ``hidden_size``, ``causal`` (always ``"false"``: causal layers are refused),
    ``c_residual_max``, plus ``metadata``'s entries (values given as non-strings are JSON-encoded; the
    reserved keys cannot be overridden). Returns the report of :func:`bert_attention_tensors` with ``path``.
    Raises :class:`FileNotFoundError` when ``path``'s directory does not exist, :class:`ValueError` as
    :func:`bert_attention_tensors` does."""
    path = writable_path(path)
    layer = _canonical(layer)
    tensors, report = bert_attention_tensors(layer, dtype=np.float32, return_report=True)
    reserved = {"format": FORMAT, "heads": str(report["heads"]), "head_dim": str(report["head_dim"]),
                "hidden_size": str(report["hidden_size"]), "causal": json.dumps(bool(layer.causal)),
                "c_residual_max": repr(float(report["c_residual_max"]))}
    write_safetensors(tensors, path, reserved, metadata)
    return {**report, "path": str(path)}


def writable_path(path) -> Path:
    """``path`` as a Path, after checking its directory exists (before anything is computed or written)."""
    path = Path(os.fspath(path))
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {parent} does not exist")
    return path


def write_safetensors(tensors: dict[str, np.ndarray], path: Path, reserved: dict[str, str],
                      metadata: dict | None) -> None:
    """Save ``tensors`` with ``reserved`` metadata (``reserved["format"]`` names the format) plus the
    caller's ``metadata`` (non-strings JSON-encoded; a reserved key is a :class:`ValueError`)."""
    from safetensors.numpy import save_file

    meta = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in (metadata or {}).items()}
    clash = sorted(set(meta) & set(reserved))
    if clash:
        raise ValueError(f"metadata keys {clash} are reserved by {reserved['format']}")
    save_file(tensors, str(path), metadata={**meta, **reserved})


def read_safetensors(path, fmt: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors (numpy) and metadata of a safetensors file whose metadata says ``format = fmt``."""
    from safetensors import safe_open

    path = Path(os.fspath(path))
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    with safe_open(str(path), framework="numpy") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != fmt:
        raise ValueError(f"{path}: not a {fmt} file (format = {meta.get('format')!r})")
    return tensors, meta


def read_bert_attention(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors (numpy float32) and metadata of a file written by :func:`save_bert_attention`; checks
    the format, the names and the shapes. Needs safetensors only."""
    tensors, meta = read_safetensors(path, FORMAT)
    H, dh, d = int(meta["heads"]), int(meta["head_dim"]), int(meta["hidden_size"])
    shapes = {n: ((H * dh, d) if n.endswith("weight") and n.startswith("self.") else
                  (d, H * dh) if n == "output.dense.weight" else
                  (d,) if n == "output.dense.bias" else (H * dh,)) for n in NAMES}
    if set(tensors) != set(NAMES):
        raise ValueError(f"{path}: tensors {sorted(tensors)} are not {sorted(NAMES)}")
    for n, shape in shapes.items():
        if tensors[n].shape != shape:
            raise ValueError(f"{path}: {n} has shape {tensors[n].shape}, expected {shape}")
    return tensors, meta


def load_bert_attention(path) -> tuple[Callable[[Any], Any], Any]:
    """A transformers ``BertAttention`` holding the weights of ``path`` (a :func:`save_bert_attention`
    file), and its forward function.

    The module is built from ``BertConfig(hidden_size=d, num_attention_heads=H, intermediate_size=4 d,
    attn_implementation="eager")`` with dropout 0, in eval mode, float32 (nothing is downloaded); the
    tensors go in with ``load_state_dict(strict=False)``, and anything missing besides the LayerNorm (left
    at its init: the canonical form does not describe it) or unexpected is an error. Returns
    ``(forward, attention)``: ``forward(X)`` takes a (k, N, d) float32 tensor (a numpy array is converted)
    and returns ``attention.output.dense(attention.self(X)[0])`` (k, N, d), before the residual and
    LayerNorm, under ``torch.no_grad()``."""
    tensors, meta = read_bert_attention(path)
    if meta.get("causal", "false") != "false":
        raise ValueError(f"{path}: causal layers are not supported by BertAttention")
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertAttention

    H, d = int(meta["heads"]), int(meta["hidden_size"])
    config = BertConfig(hidden_size=d, num_attention_heads=H, intermediate_size=4 * d,
                        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
                        attn_implementation="eager")
    if getattr(config, "_attn_implementation", "eager") != "eager":
        config._attn_implementation = "eager"
    attention = BertAttention(config).to(torch.float32)
    if attention.self.attention_head_size != int(meta["head_dim"]):
        raise ValueError(f"{path}: head_dim {meta['head_dim']} != BertConfig's head size "
                         f"{attention.self.attention_head_size}")
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in tensors.items()}
    result = attention.load_state_dict(state, strict=False)
    missing, unexpected = set(result.missing_keys), set(result.unexpected_keys)
    if missing - LAYERNORM_KEYS or unexpected:
        raise ValueError(f"{path}: BertAttention did not take the tensors (missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)})")
    attention.eval()

    def forward(X):
        if not isinstance(X, torch.Tensor):
            X = torch.as_tensor(np.asarray(X, dtype=np.float32))
        with torch.no_grad():
            return attention.output.dense(attention.self(X)[0])

    return forward, attention


__all__ = ["bert_attention_tensors", "save_bert_attention", "load_bert_attention", "read_bert_attention"]
