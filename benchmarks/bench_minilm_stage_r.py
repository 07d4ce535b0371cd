"""The block refit (R) on a real all-MiniLM-L6-v2 block (d = 384, 12 heads, FFN 1536), from the parts the
stages before it recovered: how far the last step of ``--method block`` (float32 answers) takes the whole
block at MiniLM's size, per iteration.

    .venv/bin/python benchmarks/bench_minilm_stage_f.py --layer 2 --dtype float32 --save f.pkl
    .venv/bin/python benchmarks/bench_minilm_stage_f.py --load f.pkl --refit-iterations 300 --save fplus.pkl
    .venv/bin/python benchmarks/bench_minilm_stage_a.py --jacobian fplus.pkl --save a.pkl
    .venv/bin/python benchmarks/bench_minilm_stage_r.py --load a.pkl --iterations 150

``--load`` takes the parts ``bench_minilm_stage_a.py --jacobian FILE --save`` wrote (LN2, ``B``, LN1 and the
FFN after the one-token refit F+, the heads of stage A read through F+'s one-token map), assembles the block
(:func:`headthief.extraction.block.extract.assemble`) and refits every parameter
(:func:`headthief.extraction.block.block_refit.refit_block`, scaled L-BFGS) to the answers the method asks
for at this size: random sequences of 2, 4, 8 and 16 tokens (``refit_counts``: 37,000 positions) and
:func:`~headthief.extraction.block.one_token_refit.random_answers`: random one-token queries (30,792), for at
most ``--iterations`` iterations. ``--save`` pickles the refitted block (and, every 50 evaluations, the
block so far: a run cut short keeps its progress); given to ``--load``, R goes on from it (its L-BFGS
memory and scaling drawn afresh). ``--device cuda``: R's loss on a GPU (``--refit-device``). Prints the rms
by evaluation, then before and after: the fidelity (max |y - y_real| over the answers' rms, every
position) on fresh sequences of 1 to 16 tokens of norm sqrt(d), on the 285 shipped sentences'
``hidden_states[L]`` in the real model and on fresh sequences on the previous LayerNorm's image (the
issue's two measures; on the sentences also each half of the block recovered with the other true:
:func:`halves`), and every part against the checkpoint modulo the symmetries
(:func:`headthief.extraction.block.block_errors`, worst over heads and neurons), queries and minutes.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from types import SimpleNamespace

import numpy as np

from headthief.extraction.block.extract import _refit_sequences, assemble, block_errors, parts_of
from headthief.extraction.block.block_refit import refit_block, refit_counts
from headthief.extraction.block.one_token_refit import random_answers
from headthief.models.bert_block import from_minilm
from headthief.oracles.base import ModelOracle

PARTS = ("B_rel_err", "b_rel_err", "ln1_gamma_rel_err", "W1_rel_err", "W2_rel_err", "ffn_bias_rel_err",
         "O_rel_err", "W_rel_err", "c_rel_err", "ln2_gamma_rel_err", "ln2_beta_rel_err")


def fidelity(block, oracle, rng, d: int, n: int = 64) -> float:
    """:func:`fidelity_on` ``n`` fresh sequences of 1 to 16 tokens of norm sqrt(d)."""
    sequences = []
    for T in rng.integers(1, 17, n):
        X = rng.standard_normal((int(T), d))
        sequences.append(X * (np.sqrt(d) / np.linalg.norm(X, axis=1, keepdims=True)))
    return fidelity_on(block, oracle, sequences)


def fidelity_on(block, oracle, sequences) -> float:
    """The largest error over every position of ``sequences`` (each (T, d)), relative to the answers' rms."""
    return worst_over_rms((block.forward(X[None]), oracle.query(X[None])) for X in sequences)


def worst_over_rms(pairs) -> float:
    """The largest |prediction - answer| over every number of the (prediction, answer) pairs, over the answers'
    rms."""
    worst, sq, count = 0.0, 0.0, 0
    for y, Y in pairs:
        y, Y = np.asarray(y), np.asarray(Y)
        worst = max(worst, float(np.max(np.abs(y - Y))))
        sq, count = sq + float(np.sum(Y * Y)), count + Y.size
    return worst / np.sqrt(sq / count)


def acceptance_inputs(layer: int, rng, n: int = 64) -> tuple[list, list]:
    """The issue's two input sets for block ``layer``: every shipped sentence's ``hidden_states[layer]`` in
    the real model (the inputs the real block sees), and :func:`layernorm_image`'s ``n`` sequences."""
    from headthief.targets.sentences import hidden_states_of_sentences, load_sentences
    return hidden_states_of_sentences(load_sentences())[layer], layernorm_image(layer, rng, n)


def layernorm_image(layer: int, rng, n: int = 64) -> list:
    """``n`` fresh sequences of 1 to 16 random tokens on the LayerNorm before block ``layer`` (``gamma n +
    beta``, ``mean(n) = 0``, ``|n| = sqrt(d)``; the embeddings' LayerNorm for block 0)."""
    from headthief.models.bert_block import _minilm_tensors
    if layer == 0:
        t = _minilm_tensors()
        gamma, beta = t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"]
    else:
        prev = from_minilm(layer - 1, dtype=np.float64)
        gamma, beta = prev.ln2_gamma, prev.ln2_beta
    image = []
    for T in rng.integers(1, 17, n):
        u = rng.standard_normal((int(T), len(beta)))
        u -= u.mean(axis=1, keepdims=True)
        u *= np.sqrt(len(beta)) / np.linalg.norm(u, axis=1, keepdims=True)
        image.append(np.asarray(gamma, np.float64) * u + np.asarray(beta, np.float64))
    return image


def report(label: str, block, parts, truth, oracle, rng, d: int, inputs=None) -> None:
    ln, vs, part, att = parts
    errs = block_errors(SimpleNamespace(ln=ln, value=vs, ffn=part, attention=att), truth)
    print(label)
    print("  " + ", ".join(f"{k.replace('_rel_err', '')} {errs[k]:.2e}" for k in PARTS if k in errs))
    print(f"  fidelity on fresh sequences {fidelity(block, oracle, rng, d):.3e}", flush=True)
    if inputs is not None:
        real, image = inputs
        print(f"  fidelity on the {len(real)} sentences' hidden states {fidelity_on(block, oracle, real):.3e}, "
              f"on {len(image)} fresh sequences on the previous LayerNorm's image "
              f"{fidelity_on(block, oracle, image):.3e}", flush=True)
        split = {name: fidelity_on(hybrid, oracle, real) for name, hybrid in halves(block, truth).items()}
        print("  on the sentences, one half of the block recovered and the other half true: "
              + ", ".join(f"{k} {v:.3e}" for k, v in split.items()), flush=True)


def halves(block, truth) -> dict:
    """Where a recovered block's error lies: the recovered attention with the true LN1, FFN and LN2, and the
    true attention with the recovered LN1, FFN and LN2 (each half keeps its own gauge: LN1 ignores the
    attention's ones-vector component, and the position-wise half's global scale is its own)."""
    import dataclasses
    pos = {k: getattr(block, k) for k in ("ln1_gamma", "ln1_beta", "W1", "b1", "W2", "b2", "ln2_gamma", "ln2_beta")}
    return {"attention": dataclasses.replace(truth, attention=block.attention),
            "LN1 + FFN + LN2": dataclasses.replace(truth, **pos)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", required=True,
                    help="the parts bench_minilm_stage_a.py --jacobian FILE --save wrote, or this script's --save")
    ap.add_argument("--iterations", type=int, default=150,
                    help="at most this many L-BFGS iterations (0: only the figures of the loaded block)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save", default=None, help="pickle the refitted block (and what it cost) here")
    ap.add_argument("--device", default=None, help="a torch device for R's loss (cpu, cuda): --refit-device's path")
    args = ap.parse_args()
    if args.device is not None:
        from headthief.extraction.block.torch_losses import check_device
        check_device(args.device)
    if args.save is not None:
        open(args.save, "ab").close()                   # the output path checked before the first query
    with open(args.load, "rb") as fh:
        saved = pickle.load(fh)
    if "part" not in saved:
        raise SystemExit(f"{args.load} holds no one-token parts: write it with bench_minilm_stage_a.py "
                         "--jacobian FILE (a refitted one-token map), not --jacobian truth or measured")
    layer = int(saved["layer"])
    block = from_minilm(layer, dtype=np.float32)
    truth = from_minilm(layer, dtype=np.float64)
    d, ffn = block.d, block.ffn
    oracle = ModelOracle(block)
    rng = np.random.default_rng(args.seed)
    ln, vs, part, att = saved["ln"], saved["vs"], saved["part"], saved["heads"]
    print(f"loaded {args.load}: {saved['queries']} queries and {saved['minutes']:.1f} min before", flush=True)
    inputs = acceptance_inputs(layer, np.random.default_rng(args.seed + 1))
    if "block" in saved:                                # this script's own --save: R goes on from its block
        start = saved["block"]
        ln, vs, part, att = parts_of(start, ln, vs, part, att)
        report(f"the block after {saved['info']['block_refit_iterations']} R iterations:", start,
               (ln, vs, part, att), truth, oracle, rng, d, inputs)
    else:
        start = assemble(ln, vs, part, att)
        report("the assembled block (the stages' parts):", start, (ln, vs, part, att), truth, oracle, rng, d,
               inputs)
    if args.iterations == 0:
        print(f"(--iterations 0: no refit; {oracle.queries} queries for the figures above)")
        return
    t0 = time.perf_counter()
    q0 = oracle.queries
    X1, Y1 = random_answers(oracle, rng, scale=float(np.sqrt(d)), ffn=ffn)
    n1 = len(X1)
    groups = [(X1[:, None, :], Y1[:, None, :])] + _refit_sequences(oracle, rng, float(np.sqrt(d)), start)
    print(f"answers: {oracle.queries - q0} queries ({n1} one-token, {sum(refit_counts(d, ffn))} sequences)", flush=True)

    def progress(calls, rms):
        print(f"  R evaluation {calls}: rms {rms:.3e}, {(time.perf_counter() - t0) / 60:.1f} min", flush=True)

    done = saved.get("info", {}).get("block_refit_iterations", 0)

    def save(block, info, queries, minutes):
        """Write the block atomically (a temporary file renamed): a checkpoint never spoils the last."""
        tmp = f"{args.save}.tmp"
        with open(tmp, "wb") as fh:
            pickle.dump({"layer": layer, "block": block, "info": info, "ln": ln, "vs": vs, "part": part,
                         "heads": att, "queries": queries, "minutes": minutes}, fh)
        os.replace(tmp, args.save)

    def checkpoint(calls, block, history):              # an unfinished R is kept too, to go on with --load
        save(block, {"block_refit_iterations": done + calls, "checkpoint": True}, saved["queries"] + oracle.queries,
             saved["minutes"] + (time.perf_counter() - t0) / 60)

    fitted, info = refit_block(start, groups, max_iter=args.iterations, progress=progress, rng=rng,
                               checkpoint=None if args.save is None else checkpoint, device=args.device)
    print(f"R: {info['block_refit_iterations']} iterations, rms {info['block_refit_rms_before']:.3e} -> "
          f"{info['block_refit_rms_after']:.3e}, {(time.perf_counter() - t0) / 60:.1f} min "
          f"({info['block_refit_message']})", flush=True)
    info = {**info, "block_refit_iterations": done + info["block_refit_iterations"]}
    if args.save is not None:                           # before the report: a finished refit is never lost
        save(fitted, info, saved["queries"] + oracle.queries, saved["minutes"] + (time.perf_counter() - t0) / 60)
    report("after R (the block refit):", fitted, parts_of(fitted, ln, vs, part, att), truth, oracle, rng, d,
           inputs)
    print(f"in all {saved['queries'] + oracle.queries} queries, "
          f"{saved['minutes'] + (time.perf_counter() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
