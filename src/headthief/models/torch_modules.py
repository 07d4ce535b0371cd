"""PyTorch and Hugging Face modules as black boxes: headthief sees only their forward pass.

Two targets, both scalar regressors in the sense of Section 3 (the last token is the query token):

* :func:`minilm_hf_forward` — Hugging Face transformers' own ``BertAttention`` of layer L of
  ``all-MiniLM-L6-v2``, loaded from the packaged weights with ``HF_HUB_OFFLINE=1`` and
  ``local_files_only=True``. For a batch of sequences X (n, N, 384) it runs the module's
  ``self`` (``BertSelfAttention``: all 12 heads, eager softmax attention, torch float32), keeps head
  H's 32-dimensional context of the last position and zeroes the other heads' contexts, passes
  that through the module's ``output.dense`` (``BertSelfOutput.dense``: the output projection with
  its bias; its dropout, residual and LayerNorm are not applied — with them the answer would no
  longer be a softmax-weighted sum of the tokens) and reads out one float along r. This is exactly
  the head that :mod:`headthief.models.minilm` maps to (W, c, v, beta); ``tests`` check that the two
  agree to float32 precision. The extraction never touches the module's weights.

  The readout ``r^T o`` of the module's float32 output o is ours, not the model's: it is computed in
  float64 and rounded once to float32 (the answer of a float32 model), so it adds no rounding of its
  own. (A float32 matmul readout sums 384 rounded products and, on layer 0 head 0, roughly triples the
  error of the answers: the low-rank extraction's W error was 3.0e-5 with it and 1.1e-5 without.)

* :func:`torch_mha` — ``torch.nn.MultiheadAttention(D, 1, batch_first=True)`` with PyTorch's default
  initialisation (Xavier-uniform ``in_proj_weight``, zero ``in_proj_bias`` and ``out_proj.bias``),
  drawn under ``torch.manual_seed(seed)`` inside :func:`torch.random.fork_rng` (the caller's global
  torch RNG is left untouched). The query is the last token, keys and values are all tokens; the
  output goes through ``out_proj`` and is read out along a seeded unit vector r (in float64, rounded
  once to float32, as above). Its true parameters, for measuring errors only, are
  (``in_proj_weight = [Wq; Wk; Wv]``, scaling 1/sqrt(D)):
  ``W = Wk^T Wq / sqrt(D)``, ``c = Wk^T bq / sqrt(D)``, ``v = Wv^T Wo^T r``,
  ``beta = r^T (Wo bv + bo)`` (the same derivation as in :mod:`headthief.models.minilm`).

Whole layers (multi-head, :class:`~headthief.models.multihead.MultiHeadAttention` truths):

* :func:`minilm_layer_hf_forward` — the same ``BertAttention`` with all 12 heads kept: the module's
  ``self`` then ``output.dense`` applied to the full concatenated context of the last position (no
  head zeroed; still no dropout, residual or LayerNorm), read out along r. Its truth is
  :func:`headthief.models.minilm.minilm_layer_truth` (beta = r^T (Wo bv + bo), bo once).

* ``torch_mha(d, seed, heads=H)`` — ``nn.MultiheadAttention(d, H, batch_first=True)`` (``heads=1``, the
  default, is the module above, drawn identically). Head h owns rows ``S_h = h d/H .. (h+1) d/H - 1``
  of Wq, Wk, Wv and columns S_h of Wo, and PyTorch scales by 1/sqrt(d/H), so
  :func:`torch_mha_multihead_truth` gives ``W_h = Wk_h^T Wq_h / sqrt(d/H)``,
  ``c_h = Wk_h^T bq_h / sqrt(d/H)``, ``v_h = Wv_h^T Wo_h^T r`` and ``beta = r^T (Wo bv + bo)``.

:class:`TorchOracle` is the oracle over such a forward function: it groups a batch by sequence
length, sends each group in chunks of at most ``max_tokens`` tokens as one float32 tensor, under
``torch.no_grad()``. torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import numpy as np

from ..oracles.base import Oracle
from .attention import AttentionHead
from .multihead import MultiHeadAttention
from .minilm import D_HEAD, D_MODEL, N_HEADS, _check_layer_head, minilm_dir, readout_vector

TORCH_HINT = "pip install -e '.[torch]' in the headthief clone, or bash scripts/setup.sh (torch==2.13.0, the CPU build, and transformers>=5)"


def import_torch():
    """Import torch, or raise :class:`ModuleNotFoundError` with the install command."""
    try:
        import torch
    except ImportError as e:
        raise ModuleNotFoundError(f"this target needs torch: {TORCH_HINT}", name="torch") from e
    return torch


class TorchOracle(Oracle):
    """Value queries answered by a torch forward function ``forward(X: (n, N, d) float32) -> (n,)``.

    The batch is grouped by sequence length; each group goes through ``forward`` in chunks of at
    most ``max_tokens`` tokens, under ``torch.no_grad()``.
    """

    def __init__(self, forward: Callable[[Any], Any], d: int, *, name: str = "torch",
                 max_tokens: int = 1 << 16, **kw):
        super().__init__(d, **kw)
        self.forward = forward
        self.name = name
        self.max_tokens = int(max_tokens)

    def __repr__(self) -> str:
        return f"TorchOracle({self.name}, {self._settings()})"

    def _query(self, X) -> np.ndarray:
        torch = import_torch()
        if self.output.vector:
            return self._query_vectors(torch, X)
        from .mha import _groups
        groups = _groups(X)
        out = np.empty(sum(len(idx) for idx, _ in groups), dtype=np.float64)
        with torch.no_grad():
            for idx, A in groups:
                N = A.shape[1]
                step = max(1, self.max_tokens // N)
                for s in range(0, len(idx), step):
                    t = torch.from_numpy(np.ascontiguousarray(A[s:s + step], dtype=np.float32))
                    out[idx[s:s + step]] = self.forward(t).double().numpy()
        return out

    def _query_vectors(self, torch, X):
        """Vector answers: ``forward`` returns (k, N, d_out) for k sequences of N tokens."""
        from .mha import _assemble, _groups
        groups = []
        with torch.no_grad():
            for idx, A in _groups(X):
                N = A.shape[1]
                step = max(1, self.max_tokens // N)
                parts = [self.forward(torch.from_numpy(np.ascontiguousarray(A[s:s + step], dtype=np.float32)))
                         .double().numpy() for s in range(0, len(idx), step)]
                groups.append((idx, np.concatenate(parts, axis=0)))
        return _assemble(self.output, X, groups, self.d_out)


def _readout_tensor(seed: int, d: int):
    """The readout vector r (float32 values, see :func:`readout_vector`) as a float64 tensor."""
    torch = import_torch()
    return torch.from_numpy(readout_vector(seed, d).astype(np.float64))


def _read_out(out, r):
    """``r^T out`` for each row of the module's float32 output, rounded once to float32.

    The readout is ours, not the module's: it is evaluated in float64 (error ~1e-16) and rounded once,
    so it adds nothing beyond the rounding of the float32 answer a float32 model returns.
    """
    return (out.double() @ r).float()


# --------------------------------------------------------------------------- Hugging Face BERT


@functools.lru_cache(maxsize=1)
def load_minilm_hf():
    """The packaged all-MiniLM-L6-v2 as a transformers ``BertModel`` (offline, float32, eval mode)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = minilm_dir()
    torch = import_torch()
    try:
        import transformers
        from transformers import BertModel
    except ImportError as e:
        raise ModuleNotFoundError(f"this target needs transformers: {TORCH_HINT}", name="transformers") from e
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = BertModel.from_pretrained(str(path), local_files_only=True, attn_implementation="eager",
                                      dtype=torch.float32)
    model.eval()
    return model


def minilm_hf_forward(layer: int, head: int, *, readout: int = 0) -> Callable[[Any], Any]:
    """The forward function of head ``head`` of layer ``layer`` through transformers' BertAttention."""
    _check_layer_head(layer, head)
    torch = import_torch()
    attention = load_minilm_hf().encoder.layer[int(layer)].attention
    r = _readout_tensor(readout, D_MODEL)
    S = slice(D_HEAD * int(head), D_HEAD * (int(head) + 1))

    def forward(X):                                  # X: (n, N, 384) float32
        ctx = attention.self(X)[0]                   # (n, N, 384): the 12 heads' contexts, concatenated
        z = torch.zeros(X.shape[0], D_MODEL, dtype=ctx.dtype)
        z[:, S] = ctx[:, -1, S]                      # head H's context of the query (last) token
        return _read_out(attention.output.dense(z), r)   # O_h ctx_h + bo, read out along r

    return forward


def minilm_hf_oracle(layer: int, head: int, *, readout: int = 0, **kw) -> TorchOracle:
    """A :class:`TorchOracle` on :func:`minilm_hf_forward` (``kw``: budget, input_norm, transcript)."""
    return TorchOracle(minilm_hf_forward(layer, head, readout=readout), D_MODEL,
                       name=f"BertAttention(layer={layer}).head{head}", **kw)


def minilm_layer_hf_forward(layer: int, readout: int = 0) -> Callable[[Any], Any]:
    """The forward function of the whole attention layer ``layer`` (all 12 heads) through transformers.

    ``BertAttention.self`` (eager softmax attention, float32) then ``output.dense`` on the last
    position's full context (no head zeroed; dropout, residual and LayerNorm not applied), read out
    along r. The black box of :func:`headthief.models.minilm.minilm_layer`.
    """
    from .minilm import _check_layer_readout
    layer, readout = _check_layer_readout(layer, readout)
    attention = load_minilm_hf().encoder.layer[layer].attention
    r = _readout_tensor(readout, D_MODEL)

    def forward(X):                                  # X: (n, N, 384) float32
        ctx = attention.self(X)[0]                   # (n, N, 384): the 12 heads' contexts, concatenated
        return _read_out(attention.output.dense(ctx[:, -1, :]), r)   # Wo ctx + bo, read out along r

    return forward


def minilm_layer_hf_oracle(layer: int, readout: int = 0, **kw) -> TorchOracle:
    """A :class:`TorchOracle` on :func:`minilm_layer_hf_forward` (``kw``: budget, input_norm, transcript)."""
    return TorchOracle(minilm_layer_hf_forward(layer, readout), D_MODEL,
                       name=f"BertAttention(layer={layer})", **kw)


def minilm_layer_vectors_forward(layer: int) -> Callable[[Any], Any]:
    """transformers' ``BertSelfAttention`` then ``BertSelfOutput.dense`` of layer ``layer`` at every
    position, read before the residual and LayerNorm: (k, N, 384) -> (k, N, 384) float32."""
    from .minilm import _check_layer_readout
    layer, _ = _check_layer_readout(layer, 0)
    attention = load_minilm_hf().encoder.layer[layer].attention

    def forward(X):
        return attention.output.dense(attention.self(X)[0])

    return forward


# --------------------------------------------------------------------------- torch.nn.MultiheadAttention


def torch_mha(d: int, seed: int, heads: int = 1):
    """``nn.MultiheadAttention(d, heads, batch_first=True)`` with default init under ``manual_seed(seed)``.

    ``heads`` must divide ``d``; ``heads=1`` (the default) is the one-head target.
    """
    d, heads = int(d), int(heads)
    if heads < 1 or d < 1 or d % heads:
        raise ValueError(f"heads must be >= 1 and divide d, got d={d}, heads={heads}")
    torch = import_torch()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        mha = torch.nn.MultiheadAttention(d, heads, batch_first=True)
    mha.eval()
    return mha


def torch_mha_forward(mha, *, readout: int = 0) -> Callable[[Any], Any]:
    """The scalar regressor: last token as the query, out_proj, readout along r."""
    import_torch()                                  # a clear error when torch is missing
    r = _readout_tensor(readout, mha.embed_dim)

    def forward(X):
        out = mha(X[:, -1:, :], X, X, need_weights=False)[0]   # (n, 1, d), out_proj applied
        return _read_out(out[:, 0, :], r)

    return forward


def torch_mha_vectors_forward(mha) -> Callable[[Any], Any]:
    """``nn.MultiheadAttention``'s own output at every position (self-attention, out_proj applied)."""
    import_torch()

    def forward(X):
        return mha(X, X, X, need_weights=False)[0]

    return forward


def torch_mha_layer(mha, output="all"):
    """The module's weights as a float64 :class:`~headthief.models.mha.AttentionLayer` (for errors only)."""
    from .mha import AttentionLayer
    d, H = mha.embed_dim, mha.num_heads
    dh = d // H
    f64 = np.float64
    Win = mha.in_proj_weight.detach().numpy().astype(f64)
    bin_ = mha.in_proj_bias.detach().numpy().astype(f64)
    sh = lambda a: a.reshape(H, dh, d)                                     # noqa: E731
    return AttentionLayer(Q=sh(Win[:d]), K=sh(Win[d:2 * d]), V=sh(Win[2 * d:]),
                          Wo=mha.out_proj.weight.detach().numpy().astype(f64),
                          bq=bin_[:d].reshape(H, dh), bk=bin_[d:2 * d].reshape(H, dh), bv=bin_[2 * d:].reshape(H, dh),
                          bo=mha.out_proj.bias.detach().numpy().astype(f64), output=output)


def torch_mha_truth(mha, *, readout: int = 0) -> AttentionHead:
    """(W, c, v, beta) of a one-head MultiheadAttention, in float64, for measuring errors only
    (:func:`torch_mha_multihead_truth`'s one head, with the layer's output bias).

    For ``num_heads > 1`` use :func:`torch_mha_multihead_truth`.
    """
    if mha.num_heads != 1:
        raise ValueError(f"torch_mha_truth is for one head; this module has {mha.num_heads}: "
                         "use torch_mha_multihead_truth")
    layer = torch_mha_multihead_truth(mha, readout=readout)
    return AttentionHead(W=layer.W[0], c=layer.C[0], v=layer.V[0], beta=layer.beta, dtype=np.float64)


def torch_mha_multihead_truth(mha, *, readout: int = 0) -> MultiHeadAttention:
    """(W_h, c_h, v_h, beta) of an H-head MultiheadAttention as a float64 :class:`MultiHeadAttention`.

    Head h owns rows S_h (d/H of them) of the in-projections and columns S_h of out_proj; PyTorch scales
    scores by 1/sqrt(d/H). beta = r^T (Wo bv + bo) is the whole layer's (bo once). For measuring
    errors only. With ``num_heads == 1`` this is :func:`torch_mha_truth` as a one-head layer.
    """
    d, H = mha.embed_dim, mha.num_heads
    if getattr(mha, "in_proj_weight", None) is None or mha.in_proj_bias is None or mha.out_proj.bias is None \
            or mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError("only the packed in-projection with biases (the default MultiheadAttention) is supported")
    dh = d // H
    f64 = np.float64
    Win = mha.in_proj_weight.detach().numpy().astype(f64)
    bin_ = mha.in_proj_bias.detach().numpy().astype(f64)
    Wq, Wk, Wv = Win[:d], Win[d:2 * d], Win[2 * d:]
    bq, bv = bin_[:d], bin_[2 * d:]
    Wo = mha.out_proj.weight.detach().numpy().astype(f64)
    bo = mha.out_proj.bias.detach().numpy().astype(f64)
    r = readout_vector(readout, d).astype(f64)
    scale = 1.0 / np.sqrt(dh)
    S = [slice(h * dh, (h + 1) * dh) for h in range(H)]
    W = np.stack([Wk[s].T @ Wq[s] * scale for s in S])
    C = np.stack([Wk[s].T @ bq[s] * scale for s in S])
    V = np.stack([Wv[s].T @ (Wo[:, s].T @ r) for s in S])
    return MultiHeadAttention(V=V, W=W, C=C, beta=float(r @ (Wo @ bv + bo)), dtype=f64)


__all__ = ["TorchOracle", "load_minilm_hf", "minilm_hf_forward", "minilm_hf_oracle", "minilm_layer_hf_forward",
           "minilm_layer_hf_oracle", "torch_mha", "torch_mha_forward", "torch_mha_truth",
           "torch_mha_multihead_truth", "N_HEADS"]
