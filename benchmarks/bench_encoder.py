"""Benchmark of ``--method encoder`` (issue 19) on random encoders (float64, or ``--dtype float32``) queried
with inputs_embeds, every layer's hidden states answered (``bert-encoder:...,hidden=all``): the embeddings'
LayerNorm and position offsets, then every block from forward paths (``block/encoder.py``).

One row per encoder: the largest relative error of any recovered part of any block (on the true previous
LayerNorm's image, ``image_block_errors``; plus LN_emb and the offsets), the heads' worst, each block's
fidelity on fresh forward sequences, the reassembled encoder's fidelity on fresh inputs_embeds (every
layer), queries and seconds.

    .venv/bin/python benchmarks/bench_encoder.py --d 8 --heads 2 --ffn 8 --layers 2 --seeds 300 320
    .venv/bin/python benchmarks/bench_encoder.py --d 16 --heads 4 --ffn 32 --layers 3 --seeds 400 401
    .venv/bin/python benchmarks/bench_encoder.py --dtype float32 --seeds 500 520
    .venv/bin/python benchmarks/bench_encoder.py --dtype float32 --ln-eps 1e-5 --seeds 21300 21310   # --ln-eps
    .venv/bin/python benchmarks/bench_encoder.py --dtype float32 --ln-eps 1e-5 --tell auto --seeds 22300 22320

With ``--ln-eps E`` every LayerNorm of the encoders has eps E (``bert-encoder:...,ln_eps=E``) and the method is
told it; ``worst`` is then taken modulo LN2's input scale as before, and the column ``g1 scale`` is LN1's gamma
without that rescaling (a parameter once eps is not negligible, seen only through eps / var). ``--tell auto``:
the method measures the eps at stage E (``--ln-eps auto``), shown in the column ``eps``.

Measured figures: docs/block.md, section "--method encoder".
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from headthief.errors import HeadthiefError
from headthief.extraction.block.encoder import extract_encoder
from headthief.targets import resolve


def one(d: int, heads: int, ffn: int, layers: int, seed: int, dtype: str = "float64",
        ln_eps: float | None = None, tell=None) -> dict:
    t0 = time.perf_counter()
    target = resolve(f"bert-encoder:d={d},heads={heads},ffn={ffn},layers={layers},seed={seed},dtype={dtype}"
                     + (f",ln_eps={ln_eps:g}" if ln_eps is not None else ""))
    oracle = target.make_oracle()
    row: dict = {"seed": seed}
    try:
        res = extract_encoder(oracle, layers=layers, heads=heads, ffn=ffn, rng=seed, verify=256,
                              ln_eps=ln_eps if tell is None else tell)
        e = res.errors(target.truth)
        scale = e.pop("ln1_gamma_unscaled_rel_err", None)
        row.update(worst=max(v for k, v in e.items() if k.endswith("_rel_err") and k != "worst_rel_err"),
                   heads=max(e["O_rel_err"], e["W_rel_err"], e["c_rel_err"]), g1_scale=scale,
                   blocks=" ".join(f"{b['fidelity']:.1e}" for b in res.diagnostics["blocks"]),
                   fidelity=res.check.figure, result="ok", eps=res.diagnostics.get("ln_eps_measured"))
    except HeadthiefError as ex:
        row["result"] = f"{type(ex).__name__}: {ex}"
    row.update(queries=oracle.queries, seconds=round(time.perf_counter() - t0, 1))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs=2, default=(300, 320), metavar=("FIRST", "STOP"))
    ap.add_argument("--dtype", default="float64", choices=("float64", "float32"), help="the encoder's answers")
    ap.add_argument("--ln-eps", dest="ln_eps", type=float, default=None,
                    help="every LayerNorm's eps (bert-encoder:ln_eps=...), told to the method (--ln-eps)")
    ap.add_argument("--tell", type=lambda t: "auto" if t == "auto" else float(t), default=None,
                    help="the eps told to the method instead of --ln-eps, or auto (measured at stage E: column eps)")
    ap.add_argument("--json", action="store_true", help="one JSON object per encoder instead of the table")
    a = ap.parse_args()
    cols = (("seed", "worst", "heads", "fidelity", "queries", "seconds") + (("g1_scale",) if a.ln_eps else ())
            + (("eps",) if a.tell == "auto" else ()))
    if not a.json:
        print(f"bert-encoder:d={a.d},heads={a.heads},ffn={a.ffn},layers={a.layers} ({a.dtype}, hidden=all)")
        print(" ".join(f"{k:>9}" for k in cols), "  per-block fidelity   result")
    for seed in range(*a.seeds):
        row = one(a.d, a.heads, a.ffn, a.layers, seed, a.dtype, a.ln_eps, a.tell)
        if a.json:
            print(json.dumps(row), flush=True)
            continue
        cells = [f"{row[k]:9.2g}" if isinstance(row.get(k), float) else f"{row.get(k, '-')!s:>9}" for k in cols]
        print(" ".join(cells), f"  {row.get('blocks', '-'):>18}  ", row["result"][:100], flush=True)


if __name__ == "__main__":
    main()
