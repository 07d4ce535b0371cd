"""A PyTorch one-layer transformer as a black box: ``nn.MultiheadAttention`` then ``nn.Linear``-ReLU-``nn.Linear``.

``torch_transformer(d, m, seed, heads=H)`` builds, under ``torch.manual_seed(seed)`` inside
:func:`torch.random.fork_rng` (the caller's global RNG untouched), with PyTorch's default
initialisation:

    attn = nn.MultiheadAttention(d, H, batch_first=True)      # Xavier in_proj, zero in_proj/out_proj biases
    ffn  = nn.Sequential(nn.Linear(d, m), nn.ReLU(), nn.Linear(m, 1))   # default init: non-zero biases

and the forward pass reads the attention at the last position (query = last token, keys = values = all
tokens), ``TF(X) = ffn(attn(x_N, X, X))``, in float32. No residual, LayerNorm or dropout (with them the
answer is no longer a function of the attended tokens).

Its truth, in float64 and for measuring errors only, is a :class:`~headthief.models.transformer.Transformer`
(head h owns rows ``S_h`` of the in-projections and columns ``S_h`` of out_proj, scores scaled by
``1/sqrt(d/H)``)::

    W_h = Wk_h^T Wq_h / sqrt(d/H),  c_h = Wk_h^T bq_h / sqrt(d/H),  A_h = (W_1 Wo_h Wv_h)^T,
    b_1 = W_1 (Wo bv + bo) + b_lin1,  w_o = lin2.weight,  b_2 = lin2.bias.

torch is imported inside the functions.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .transformer import Transformer


def torch_transformer(d: int, m: int, seed: int, heads: int = 1):
    """The module: ``(attn, ffn)`` in eval mode. ``heads`` must divide ``d``."""
    from .torch_modules import import_torch
    d, m, heads = int(d), int(m), int(heads)
    if d < 1 or m < 1 or heads < 1 or d % heads:
        raise ValueError(f"need d, m >= 1 and heads dividing d, got d={d}, m={m}, heads={heads}")
    torch = import_torch()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        ffn = torch.nn.Sequential(torch.nn.Linear(d, m), torch.nn.ReLU(), torch.nn.Linear(m, 1))
    attn.eval()
    ffn.eval()
    return attn, ffn


def torch_transformer_forward(module) -> Callable[[Any], Any]:
    """``forward(X: (n, N, d) float32) -> (n,)``: attention at the last position, then the FFN."""
    attn, ffn = module

    def forward(X):
        z = attn(X[:, -1:, :], X, X, need_weights=False)[0][:, 0, :]
        return ffn(z)[:, 0]

    return forward


def torch_transformer_truth(module) -> Transformer:
    """The module's merged parameters as a float64 :class:`Transformer` (for measuring errors only)."""
    attn, ffn = module
    d, H = attn.embed_dim, attn.num_heads
    dh = d // H
    f64 = np.float64

    def arr(t):
        return t.detach().numpy().astype(f64)

    Win, bin_ = arr(attn.in_proj_weight), arr(attn.in_proj_bias)
    Wq, Wk, Wv = Win[:d], Win[d:2 * d], Win[2 * d:]
    bq, bv = bin_[:d], bin_[2 * d:]
    Wo, bo = arr(attn.out_proj.weight), arr(attn.out_proj.bias)
    W1, b1 = arr(ffn[0].weight), arr(ffn[0].bias)
    w2, b2 = arr(ffn[2].weight)[0], float(arr(ffn[2].bias)[0])
    S = [slice(h * dh, (h + 1) * dh) for h in range(H)]
    scale = 1.0 / np.sqrt(dh)
    W = np.stack([Wk[s].T @ Wq[s] * scale for s in S])
    C = np.stack([Wk[s].T @ bq[s] * scale for s in S])
    A = np.stack([(W1 @ Wo[:, s] @ Wv[s]).T for s in S])
    return Transformer(W=W, A=A, w_o=w2, b1=W1 @ (Wo @ bv + bo) + b1, b2=b2, C=C, dtype=f64)


__all__ = ["torch_transformer", "torch_transformer_forward", "torch_transformer_truth"]
