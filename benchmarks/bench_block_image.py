"""Benchmark of the block method's stages on the previous LayerNorm's image (issue 19, toward --method
encoder): stage L, stage V from great-circle Jacobians (``block/value_sum_image.py``) and stage F reading
its Jacobians through dm/dn (``block/ffn_image.py``), every query behind ``ImageGuard`` (a token off the
image would be refused), against the truth of random float64 blocks.

The previous LayerNorm is ``image.random_image(d, seed)`` (as ``bert-block:...,seed=S,inputs=image`` draws
it: gamma ~ 1 + N(0, 0.1^2), beta ~ N(0, 0.05^2), from ``default_rng(1000 + seed)``). One row per block:
relative errors of K = P B G (over max |K|) and c = P (B beta_p + b), the Levenberg-Marquardt steps of stage V and its relative residual,
LN1's gamma (up to the block's global scale), the worst neuron (W_1 row, b_1, W_2 column, relative), the
one-token fidelity on fresh image tokens, queries and seconds. ``--whole``: the whole block
(``block/on_image.py``: the heads fitted), with every part's error on the image's directions
(``image_block_errors``), the fit's rms and steps, the fidelity on fresh image sequences.

    .venv/bin/python benchmarks/bench_block_image.py --d 16 --heads 4 --ffn 32 --seeds 9000 9020
    .venv/bin/python benchmarks/bench_block_image.py --d 32 --heads 4 --ffn 128 --seeds 9100 9101 --json
    .venv/bin/python benchmarks/bench_block_image.py --whole --d 16 --heads 4 --ffn 32 --seeds 9200 9220
    .venv/bin/python benchmarks/bench_block_image.py --whole --dtype float32 --d 8 --heads 2 --ffn 8 --seeds 9300 9320

Measured figures: docs/block.md, section "Stages V and F on the previous LayerNorm's image".
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from headthief.errors import HeadthiefError
from headthief.extraction.block import centre, extract_ffn, fit_output_layernorm
from headthief.extraction.block.ffn_image import check_on_image, image_reader
from headthief.extraction.block.image import ImageGuard, random_image
from headthief.extraction.block.value_sum_image import value_sum_on_image
from headthief.models.bert_block import random_block
from headthief.oracles.base import ModelOracle


def one(d: int, heads: int, ffn: int, seed: int) -> dict:
    t0 = time.perf_counter()
    block = random_block(d, heads, ffn, seed=seed)
    image = random_image(d, seed)
    inner = ModelOracle(block)
    oracle = ImageGuard(inner, image)
    rng = np.random.default_rng(seed)
    row: dict = {"seed": seed}
    try:
        k = -(-(2 * d + 8) // 16)
        X = image.tokens(image.points(rng, 16 * k)).reshape(k, 16, d)
        ln = fit_output_layernorm(np.asarray(oracle.query_packed(X)))
        ivs = value_sum_on_image(oracle, image, rng, precision=ln.sphere_residual)
        B, b = block.value_output_sum()
        P = np.eye(d) - 1.0 / d
        K, c = centre(B @ np.diag(image.gamma) @ P), centre(B @ image.beta + b)
        row.update(K=float(np.max(np.abs(ivs.K - K)) / np.max(np.abs(K))),
                   c=float(np.max(np.abs(ivs.c - c)) / np.max(np.abs(K))), lm_steps=ivs.iterations,
                   v_residual=ivs.residual, v_queries=ivs.queries)
        part = extract_ffn(oracle, ln, None, rng, ffn=ffn, reader=image_reader(oracle, ln, ivs, precision=1e-15))
        g1 = np.asarray(block.ln1_gamma, np.float64)
        s = float(part.gamma @ g1 / (g1 @ g1))
        W1 = block.W1 @ np.diag(g1) @ P
        b1 = block.W1 @ block.ln1_beta + block.b1
        worst = 0.0
        for k in range(ffn):
            j = int(np.argmin(np.linalg.norm(W1 - part.W1m[k], axis=1)))
            worst = max(worst, np.linalg.norm(part.W1m[k] - W1[j]) / np.linalg.norm(W1[j]),
                        abs(part.b1m[k] - b1[j]) / (1 + abs(b1[j])),
                        np.linalg.norm(P @ part.W2[:, k] - s * P @ block.W2[:, j]) / np.linalg.norm(s * block.W2[:, j]))
        chk = check_on_image(oracle, part, ln, ivs, rng)
        row.update(gamma1=float(np.max(np.abs(part.gamma - s * g1)) / np.max(np.abs(s * g1))), neurons=float(worst),
                   fidelity=chk["fidelity"], f_queries=part.info["queries"], result="ok")
    except HeadthiefError as e:
        row["result"] = f"{type(e).__name__}: {e}"
    row.update(queries=inner.queries, seconds=round(time.perf_counter() - t0, 1))
    return row


def whole(d: int, heads: int, ffn: int, seed: int, dtype: str = "float64") -> dict:
    """The whole block on the image (block/on_image.py): the stages, the heads fitted, the model check."""
    from headthief.extraction.block.on_image import extract_block_on_image, image_block_errors
    t0 = time.perf_counter()
    block = random_block(d, heads, ffn, seed=seed, dtype=getattr(np, dtype))
    image = random_image(d, seed)
    inner = ModelOracle(block)
    row: dict = {"seed": seed}
    try:
        res = extract_block_on_image(ImageGuard(inner, image), image, heads=heads, ffn=ffn, rng=seed)
        e = image_block_errors(res, block.astype(np.float64), image)
        parts = [k for k in e if k.endswith("_err")]
        row.update(worst_part=max(float(e[k]) for k in parts),
                   heads=max(e["O_rel_err"], e["W_rel_err"], e["c_rel_err"]),
                   ffn=max(e["W1_rel_err"], e["W2_rel_err"]), fit_rms=res.diagnostics["block_refit_rms_after"],
                   fit_steps=res.diagnostics["block_refit_iterations"], fidelity=res.check.figure, result="ok")
    except HeadthiefError as e:
        row["result"] = f"{type(e).__name__}: {e}"
    row.update(queries=inner.queries, seconds=round(time.perf_counter() - t0, 1))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=32)
    ap.add_argument("--seeds", type=int, nargs=2, default=(9000, 9020), metavar=("FIRST", "STOP"))
    ap.add_argument("--json", action="store_true", help="one JSON object per block instead of the table")
    ap.add_argument("--whole", action="store_true", help="the whole block (heads fitted), not stages V and F only")
    ap.add_argument("--dtype", default="float64", choices=("float64", "float32"), help="the block's answers (--whole)")
    a = ap.parse_args()
    cols = ("seed", "K", "c", "lm_steps", "gamma1", "neurons", "fidelity", "queries", "seconds", "result")
    if a.whole:
        cols = ("seed", "worst_part", "heads", "ffn", "fit_rms", "fit_steps", "fidelity", "queries", "seconds",
                "result")
    if not a.json:
        print(f"random_block({a.d}, {a.heads}, {a.ffn}), {a.dtype}, every query on the previous LayerNorm's image")
        print(" ".join(f"{k:>9}" for k in cols))
    for seed in range(*a.seeds):
        row = whole(a.d, a.heads, a.ffn, seed, a.dtype) if a.whole else one(a.d, a.heads, a.ffn, seed)
        if a.json:
            print(json.dumps(row), flush=True)
            continue
        cells = [f"{row[k]:9.2g}" if isinstance(row.get(k), float) else f"{row.get(k, '-')!s:>9}" for k in cols[:-1]]
        print(" ".join(cells), " ", row["result"][:100], flush=True)


if __name__ == "__main__":
    main()
