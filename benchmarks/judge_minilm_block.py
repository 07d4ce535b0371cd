"""A recovered all-MiniLM-L6-v2 block judged by issue 19's measures: the file that

    headthief extract --target minilm-block:layer=L --method block --save block.safetensors

writes (transformers' ``BertLayer`` names, float64), loaded into transformers' ``BertLayer`` itself and
into headthief's numpy block, against the real block:

* the parts, modulo the block's symmetries (:func:`headthief.extraction.block.block_errors`: heads matched
  by the Hungarian method on ``P O_h``, neurons by their ``W_1`` rows; worst over heads and neurons);
* the fidelity on the 285 shipped sentences: the recovered ``BertLayer`` applied to every sentence's
  ``hidden_states[L]`` in the real model, against the real model's ``hidden_states[L + 1]`` (largest error
  of any number over their rms), and the same through the numpy block against ``minilm-block:layer=L``;
* the fidelity on 64 fresh sequences of 1 to 16 tokens on the previous LayerNorm's image
  (``gamma n + beta``, ``mean(n) = 0``, ``|n| = sqrt(d)``) against ``minilm-block:layer=L``.

The issue's goals: both fidelities <= 1e-4 and the attention parameters (``O_h``, ``W_h``, ``c_h``) within
1e-4; ``--json`` prints the figures and ``"met"`` for each. Two references without an extraction:
``--truth`` (the real block written and read back: the judge's own error) and ``--perturb REL ...`` (every
tensor times ``1 + REL g``, ``g ~ N(0, 1)``, seed 0: what weight error the goals tolerate).

    .venv/bin/python benchmarks/judge_minilm_block.py --block block.safetensors --layer 2
    .venv/bin/python benchmarks/judge_minilm_block.py --truth --perturb 1e-6 1e-5 1e-4 --layer 2

measured on this machine (one thread beside another job; 41 s for the four cases):

    case                        attention      other  sent. BertLayer  sent. numpy   LN image  met
    truth                        0.00e+00   8.83e-16         6.07e-06     4.71e-06   7.35e-06  sent. image att.
    perturb 1e-06                1.64e-06   2.31e-06         3.01e-05     3.01e-05   1.88e-05  sent. image att.
    perturb 1e-05                1.64e-05   2.31e-05         3.00e-04     3.00e-04   1.94e-04  att.
    perturb 0.0001               1.64e-04   2.31e-04         3.00e-03     3.00e-03   1.95e-03  none

The truth's figures are the real model's float32 rounding through one block (the answers' floor).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench_minilm_stage_r import PARTS, fidelity_on, layernorm_image, worst_over_rms
from headthief.extraction.block.extract import SAVE_FORMAT, block_errors, parts_from_block
from headthief.models.bert_block import BertBlock, from_minilm
from headthief.models.bert_export import read_safetensors, write_safetensors
from headthief.oracles.base import ModelOracle

GOAL = 1e-4                                   # the fidelity and attention-parameter goal
ATTENTION = ("O_rel_err", "W_rel_err", "c_rel_err")
SHORT = {"sentences": "sent.", "layernorm_image": "image", "attention": "att."}   # the goals, in the table


def read_block(path) -> tuple[BertBlock, dict]:
    """The numpy block (float64) of a ``--method block --save`` file and the file's tensors."""
    tensors, meta = read_safetensors(path, SAVE_FORMAT)
    return BertBlock.from_state_dict(tensors, int(meta["heads"]), dtype=np.float64), tensors


def bert_layer(tensors: dict, heads: int, ffn: int):
    """transformers' ``BertLayer`` (float64, eval) with ``tensors`` loaded strictly (every name, no extra)."""
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer
    d = tensors["attention.output.dense.weight"].shape[0]
    cfg = BertConfig(hidden_size=d, num_attention_heads=heads, intermediate_size=ffn, hidden_act="gelu",
                     layer_norm_eps=1e-12, attn_implementation="eager")
    layer = BertLayer(cfg).double().eval()
    layer.load_state_dict({k: torch.from_numpy(np.array(v, np.float64)) for k, v in tensors.items()}, strict=True)
    return layer


def layer_fidelity(layer, inputs: list, outputs: list) -> float:
    """Largest |BertLayer(x) - y| over every number of ``inputs`` / ``outputs`` (each (T, d)), over the rms."""
    import torch

    def run(X):
        out = layer(torch.from_numpy(np.asarray(X, np.float64))[None])
        return (out[0] if isinstance(out, tuple) else out)[0].numpy()
    with torch.no_grad():
        return worst_over_rms((run(X), Y) for X, Y in zip(inputs, outputs))


def check_shape(block: BertBlock, truth: BertBlock, path, layer: int) -> None:
    """Refuse (SystemExit, naming both) a block of another width, head count or FFN width than MiniLM's."""
    if (block.d, block.heads, block.ffn) != (truth.d, truth.heads, truth.ffn):
        raise SystemExit(f"{path}: d = {block.d}, {block.heads} heads, FFN {block.ffn}; MiniLM block {layer} has "
                         f"d = {truth.d}, {truth.heads} heads, FFN {truth.ffn}")


def judge(path, layer: int, sentences: tuple[list, list], image: list) -> dict:
    """The figures of the block in ``path`` (module docstring)."""
    block, tensors = read_block(path)
    truth = from_minilm(layer, dtype=np.float64)
    check_shape(block, truth, path, layer)
    ln, vs, part, att = parts_from_block(block)
    errs = block_errors(SimpleNamespace(ln=ln, value=vs, ffn=part, attention=att), truth)
    oracle = ModelOracle(from_minilm(layer, dtype=np.float32))      # what minilm-block:layer=L answers
    real_in, real_out = sentences
    row = {"parts": {k: float(errs[k]) for k in PARTS if k in errs},
           "attention_worst": max(float(errs[k]) for k in ATTENTION),
           "other_parts_worst": max(float(errs[k]) for k in PARTS if k in errs and k not in ATTENTION),
           "sentences_bert_layer": layer_fidelity(bert_layer(tensors, block.heads, block.ffn), real_in, real_out),
           "sentences_numpy": float(fidelity_on(block, oracle, real_in)),
           "layernorm_image": float(fidelity_on(block, oracle, image))}
    row["met"] = {"sentences": bool(max(row["sentences_bert_layer"], row["sentences_numpy"]) <= GOAL),
                  "layernorm_image": bool(row["layernorm_image"] <= GOAL),
                  "attention": bool(row["attention_worst"] <= GOAL)}
    return row


def write_reference(block: BertBlock, path: Path, rel: float = 0.0) -> None:
    """``block``'s tensors (times ``1 + rel g``, seed 0, where ``rel`` > 0) as a ``--save`` file."""
    rng = np.random.default_rng(0)
    tensors = {k: np.asarray(v, np.float64) * (1.0 + rel * rng.standard_normal(np.shape(v)))
               for k, v in block.state_dict().items()}
    write_safetensors(tensors, path, {"format": SAVE_FORMAT, "heads": str(block.heads), "ffn": str(block.ffn)}, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block", type=Path, help="a file written by headthief extract --method block --save")
    ap.add_argument("--layer", type=int, default=2, help="the MiniLM block it claims to be (default 2)")
    ap.add_argument("--truth", action="store_true", help="the real block written and read back")
    ap.add_argument("--perturb", type=float, nargs="*", default=[], help="relative weight noise levels")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N sentences")
    ap.add_argument("--json", action="store_true", help="print one JSON object (case -> figures)")
    args = ap.parse_args()
    if args.block is None and not args.truth and not args.perturb:
        ap.error("give --block FILE, --truth or --perturb REL ...")
    if args.block is not None:
        if not args.block.is_file():
            ap.error(f"--block {args.block}: no such file")
        check_shape(read_block(args.block)[0], from_minilm(args.layer, dtype=np.float64), args.block, args.layer)
    from headthief.targets.sentences import hidden_states_of_sentences, load_sentences
    t0 = time.perf_counter()
    sentences = load_sentences()[:args.limit]
    hs = hidden_states_of_sentences(sentences)
    real, image = hs[args.layer], layernorm_image(args.layer, np.random.default_rng(1))
    cases: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        refs = ([("truth", 0.0)] if args.truth else []) + [(f"perturb {r:g}", r) for r in args.perturb]
        for name, rel in refs:
            path = Path(tmp) / f"{len(cases)}.safetensors"
            write_reference(from_minilm(args.layer, dtype=np.float64), path, rel)
            cases[name] = judge(path, args.layer, (real, hs[args.layer + 1]), image)
        if args.block is not None:
            cases[str(args.block)] = judge(args.block, args.layer, (real, hs[args.layer + 1]), image)
    if args.json:
        print(json.dumps({"layer": args.layer, "sentences": len(sentences), "goal": GOAL, "cases": cases,
                          "seconds": time.perf_counter() - t0}))
        return
    print(f"MiniLM block {args.layer}: {len(sentences)} sentences, {len(image)} sequences on the LayerNorm image; "
          f"goal {GOAL:g} ({time.perf_counter() - t0:.0f} s)")
    print(f"{'case':<26} {'attention':>10} {'other':>10} {'sent. BertLayer':>16} {'sent. numpy':>12} "
          f"{'LN image':>10}  met")
    for name, r in cases.items():
        met = " ".join(SHORT[k] for k, v in r["met"].items() if v) or "none"
        print(f"{name:<26} {r['attention_worst']:>10.2e} {r['other_parts_worst']:>10.2e} "
              f"{r['sentences_bert_layer']:>16.2e} {r['sentences_numpy']:>12.2e} {r['layernorm_image']:>10.2e}  {met}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
