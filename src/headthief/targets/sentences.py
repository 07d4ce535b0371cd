"""Real sentences through the real all-MiniLM-L6-v2, for judging a recovered encoder or block.

* :func:`load_sentences`: the sentences shipped with headthief (``headthief/data/sentences.txt``: 285
  plain English sentences written for this project: daily life, science, questions, paraphrase pairs,
  negations, numbers);
* :func:`sentence_embeddings`: what sentence-transformers computes for all-MiniLM-L6-v2 (the packaged
  tokenizer, ``BertModel``, mean pooling over the attention mask, L2 normalisation), for any ``BertModel``
  with the packaged model's vocabulary (the real one, or one holding a recovered encoder:
  :func:`headthief.models.encoder_export.load_encoder_into_minilm`);
* :func:`hidden_states_of_sentences`: every sentence's ``hidden_states[0..6]`` in the real model, one
  (N_i, 384) array per sentence and layer (no padding): ``hidden_states[L]`` is what block L (as
  ``minilm-block:layer=L`` numbers it) sees for that sentence, the "real inputs" on which a recovered
  block's fidelity is measured.

torch and transformers are imported inside the functions (the ``torch`` extra).
"""

from __future__ import annotations

from importlib import resources

import numpy as np

SENTENCES = "sentences.txt"


def load_sentences() -> list[str]:
    """The shipped sentences, in file order (comment lines starting with ``#`` and blank lines skipped)."""
    text = resources.files("headthief.data").joinpath(SENTENCES).read_text(encoding="utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def minilm_tokenizer():
    """The packaged model's own tokenizer (``tokenizer.json``; offline)."""
    from ..models.minilm import minilm_dir
    from ..models.torch_modules import TORCH_HINT
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ModuleNotFoundError(f"tokenizing sentences needs transformers: {TORCH_HINT}", name="transformers") from e
    return AutoTokenizer.from_pretrained(str(minilm_dir()), local_files_only=True)


def _encode(model, sentences: list[str], batch: int):
    import torch
    tok = minilm_tokenizer()
    for i in range(0, len(sentences), batch):
        enc = tok(sentences[i:i + batch], padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                        token_type_ids=enc.get("token_type_ids"), output_hidden_states=True)
        yield enc["attention_mask"], out


def sentence_embeddings(sentences: list[str], model=None, *, batch: int = 64) -> np.ndarray:
    """(n, 384) float64 unit vectors: mean pooling of ``last_hidden_state`` over each sentence's tokens
    (the attention mask), then L2 normalisation, as sentence-transformers runs all-MiniLM-L6-v2.
    ``model``: a transformers ``BertModel`` (default: the packaged real one)."""
    if not sentences:
        raise ValueError("no sentences given")
    if model is None:
        from ..models.torch_modules import load_minilm_hf
        model = load_minilm_hf()
    rows = []
    for mask, out in _encode(model, list(sentences), batch):
        m = mask.unsqueeze(-1).to(out.last_hidden_state.dtype)
        pooled = (out.last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1e-9)
        rows.append(pooled.double().numpy())
    E = np.vstack(rows)
    return E / np.linalg.norm(E, axis=1, keepdims=True)


def hidden_states_of_sentences(sentences: list[str], model=None, *, batch: int = 64) -> list[list[np.ndarray]]:
    """For each layer L = 0..6, one (N_i, 384) float64 array per sentence: ``hidden_states[L]`` of the
    real model (or ``model``) at that sentence's tokens (padding dropped). ``result[L][i]``."""
    if not sentences:
        raise ValueError("no sentences given")
    if model is None:
        from ..models.torch_modules import load_minilm_hf
        model = load_minilm_hf()
    per_layer: list[list[np.ndarray]] | None = None
    for mask, out in _encode(model, list(sentences), batch):
        hs = out.hidden_states
        if per_layer is None:
            per_layer = [[] for _ in hs]
        lengths = mask.sum(1).tolist()
        for L, h in enumerate(hs):
            a = h.double().numpy()
            per_layer[L].extend(a[i, :n] for i, n in enumerate(lengths))
    return per_layer
