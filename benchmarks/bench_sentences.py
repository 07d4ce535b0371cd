"""Sentence embeddings of a (recovered) encoder against the real all-MiniLM-L6-v2, on the sentences
shipped with headthief (``headthief/data/sentences.txt``, 285 sentences written for this project).

The encoder file (``--encoder FILE``, written by ``headthief.models.encoder_export.save_bert_encoder``;
the future ``--method encoder --save``) is loaded into transformers' ``BertModel`` with the packaged
model's real embeddings and tokenizer; every sentence is encoded and mean-pooled as sentence-transformers
does; the table gives the cosine to the real model's embedding (min, median, how many >= 0.9999: the
issue's moonshot criterion) and, per layer L, the largest relative error of ``hidden_states[L]`` over the
sentences (max |h - h_real| / rms h_real).

Without an extraction to judge yet, two references:

* ``--truth``: the packaged blocks themselves written and loaded back (the pipeline's own error: 0);
* ``--perturb REL [REL ...]``: every weight of every block multiplied by (1 + REL g), g ~ N(0, 1) (seed 0):
  how precise a recovered encoder must be for cosine >= 0.9999.

    .venv/bin/python benchmarks/bench_sentences.py --truth --perturb 1e-4 1e-3 1e-2
    .venv/bin/python benchmarks/bench_sentences.py --encoder encoder.safetensors

measured on this machine (285 sentences; 2 cores; 18 s for the five cases):

    case           min cos    median cos  >= 0.9999  max rel. error of hidden_states[1..6]
    truth          1.0000000  1.0000000   285/285   0.0e+00  0.0e+00  0.0e+00  0.0e+00  0.0e+00  0.0e+00
    perturb 1e-05  1.0000000  1.0000000   285/285   2.8e-04  2.3e-04  3.0e-04  3.6e-04  5.1e-04  4.7e-04
    perturb 0.0001 0.9999999  0.9999999   285/285   2.8e-03  2.3e-03  3.1e-03  3.6e-03  5.1e-03  4.7e-03
    perturb 0.001  0.9999879  0.9999931   285/285   2.8e-02  2.3e-02  3.1e-02  3.6e-02  5.1e-02  4.7e-02
    perturb 0.01   0.9987830  0.9993031     0/285   2.7e-01  2.3e-01  3.1e-01  3.6e-01  5.0e-01  4.7e-01

So the moonshot's cosine >= 0.9999 tolerates relative weight errors of ~1e-3 in every block, while a
block fidelity of 1e-4 on hidden states (the issue's per-block goal) needs weights to ~3e-6: the
per-block goal is the stricter one.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from headthief.models.bert_block import from_minilm
from headthief.models.encoder_export import load_encoder_into_minilm, save_bert_encoder
from headthief.targets.sentences import hidden_states_of_sentences, load_sentences, sentence_embeddings


def perturbed_blocks(rel: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for L in range(6):
        b = from_minilm(L)
        sd = {k: np.asarray(v, dtype=np.float64) * (1.0 + rel * rng.standard_normal(np.shape(v)))
              for k, v in b.state_dict().items()}
        out.append(type(b).from_state_dict(sd, b.heads, dtype=np.float32))
    return out


def compare(model, sentences, E_real, H_real) -> dict:
    E = sentence_embeddings(sentences, model)
    cos = np.sum(E * E_real, axis=1)
    H = hidden_states_of_sentences(sentences, model)
    layer_err = []
    for L in range(1, len(H)):
        errs = [np.max(np.abs(a - b)) / np.sqrt(np.mean(b ** 2)) for a, b in zip(H[L], H_real[L])]
        layer_err.append(float(max(errs)))
    return {"min_cos": float(cos.min()), "median_cos": float(np.median(cos)),
            "n_ok": int(np.sum(cos >= 0.9999)), "n": len(cos), "layer_err": layer_err}


def show(name: str, r: dict) -> None:
    errs = " ".join(f"{e:8.1e}" for e in r["layer_err"])
    print(f"{name:14s} {r['min_cos']:.7f}  {r['median_cos']:.7f}  {r['n_ok']:4d}/{r['n']}  {errs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder", type=Path, help="a save_bert_encoder file to judge")
    ap.add_argument("--truth", action="store_true", help="the packaged blocks written and loaded back")
    ap.add_argument("--perturb", type=float, nargs="*", default=[], help="relative weight noise levels")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N sentences")
    args = ap.parse_args()
    sentences = load_sentences()[: args.limit]
    E_real = sentence_embeddings(sentences)
    H_real = hidden_states_of_sentences(sentences)
    print("case           min cos    median cos  >= 0.9999  max rel. error of hidden_states[1..6]")
    with tempfile.TemporaryDirectory() as tmp:
        cases = []
        if args.truth:
            cases.append(("truth", [from_minilm(L) for L in range(6)]))
        cases += [(f"perturb {rel:g}", perturbed_blocks(rel)) for rel in args.perturb]
        for name, blocks in cases:
            path = Path(tmp) / "encoder.safetensors"
            save_bert_encoder(blocks, path, metadata={"case": name})
            show(name, compare(load_encoder_into_minilm(path), sentences, E_real, H_real))
    if args.encoder is not None:
        show(args.encoder.name, compare(load_encoder_into_minilm(args.encoder), sentences, E_real, H_real))


if __name__ == "__main__":
    main()
