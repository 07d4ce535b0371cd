"""Write recovered BERT blocks as a ``BertModel`` encoder (safetensors, transformers' naming), and load
such a file into the packaged all-MiniLM-L6-v2 in place of its own encoder.

A file holds ``encoder.layer.{i}.<BertLayer name>`` for i = 0..L-1 (the names of
:meth:`~headthief.models.bert_block.BertBlock.state_dict`: ``attention.self.query.weight`` ...
``output.LayerNorm.bias``), float32, with metadata ``format = headthief-bert-encoder-1``, ``layers``,
``heads``, ``hidden_size``, ``intermediate_size`` and the caller's entries (e.g. per block what was
recovered exactly and what was fitted). A recovered block is one representative of its symmetry class
(head and neuron order, the ``Q/K`` and ``W_O V`` splits, the global scale of LN1/FFN): any representative
gives the same hidden states, which is all a ``BertModel`` computes with it.

:func:`load_encoder_into_minilm` builds the packaged ``BertModel`` (its real word, position and
token-type embeddings, its embedding LayerNorm and pooler) and replaces every ``encoder.layer.*`` tensor
by the file's; a missing or unexpected tensor, or a shape that differs, is an error. The result encodes
real sentences with :func:`headthief.targets.sentences.sentence_embeddings`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .activations import SMOOTH
from .bert_export import read_safetensors, writable_path, write_safetensors

FORMAT = "headthief-bert-encoder-1"


def encoder_tensors(blocks) -> dict[str, np.ndarray]:
    """``encoder.layer.{i}.*`` -> float32 array for every block (``BertBlock``s of one width and head count)."""
    blocks = list(blocks)
    if not blocks:
        raise ValueError("an encoder needs at least one block")
    d, H = blocks[0].d, blocks[0].heads
    out: dict[str, np.ndarray] = {}
    for i, b in enumerate(blocks):
        if (b.d, b.heads) != (d, H):
            raise ValueError(f"block {i} has d={b.d}, heads={b.heads}; block 0 has d={d}, heads={H}")
        if b.activation != blocks[0].activation:
            raise ValueError(f"block {i} uses {b.activation}, block 0 {blocks[0].activation}: a BertModel's blocks "
                             "share one hidden_act")
        if b.activation not in SMOOTH:
            raise ValueError(f"block {i} uses {b.activation}: a BertModel's hidden_act here is one of "
                             f"{', '.join(SMOOTH)}")
        for k, v in b.state_dict().items():
            out[f"encoder.layer.{i}.{k}"] = np.ascontiguousarray(v, dtype=np.float32)
    return out


def save_bert_encoder(blocks, path, *, metadata: dict | None = None) -> dict[str, Any]:
    """Write :func:`encoder_tensors` of ``blocks`` to ``path`` (safetensors). Raises
    :class:`FileNotFoundError` when the directory does not exist (checked before anything is computed)."""
    path = writable_path(path)
    blocks = list(blocks)
    tensors = encoder_tensors(blocks)
    reserved = {"format": FORMAT, "layers": str(len(blocks)), "heads": str(blocks[0].heads),
                "hidden_size": str(blocks[0].d), "intermediate_size": str(blocks[0].ffn),
                "hidden_act": SMOOTH[blocks[0].activation].hf}
    write_safetensors(tensors, path, reserved, metadata)
    return {"path": str(path), "layers": len(blocks), "tensors": len(tensors)}


def read_bert_encoder(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and metadata of a :func:`save_bert_encoder` file (format checked)."""
    return read_safetensors(path, FORMAT)


def load_encoder_into_minilm(path):
    """The packaged all-MiniLM-L6-v2 ``BertModel`` (float32, eval, eager) with every ``encoder.layer.*``
    tensor replaced by the file's (a :func:`save_bert_encoder` file with the model's 6 layers, d = 384)."""
    import copy

    import torch

    from .torch_modules import load_minilm_hf
    tensors, meta = read_bert_encoder(path)
    model = copy.deepcopy(load_minilm_hf())     # never the shared real model: it stays the reference
    own = {k: v for k, v in model.state_dict().items() if k.startswith("encoder.layer.")}
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise ValueError(f"{path}: does not fit all-MiniLM-L6-v2's encoder (missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                         f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''})")
    for k, v in tensors.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, the model's is {tuple(own[k].shape)}")
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in tensors.items()}
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{path}: unexpected tensors {result.unexpected_keys[:4]}")
    model.eval()
    return model
