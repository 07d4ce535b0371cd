"""Benchmark of what an encoder API gives away without a block taken apart (issue 19: ``hidden=last``, and
``hidden=all`` past the dense stage V's d <= 88; ``block/encoder_parts.py``), run as the CLI runs it
(``headthief extract --target T --method encoder``; exit 2 with the parts in the row).

One row per target: the exit code, the offsets' and the output LayerNorms' relative errors against the
truth (modulo the ones-vector; gamma up to its sign; constant output coordinates against beta), the
offsets' residuals (one token / every token scaled), the model check's figure and threshold, the same
figure without the offsets, the activation's 4th-difference ratio, queries and seconds.

    .venv/bin/python benchmarks/bench_encoder_parts.py --seeds 900 920                       # d = 8, hidden=last
    .venv/bin/python benchmarks/bench_encoder_parts.py --dtype float32 --d 16 --heads 4 --ffn 32 --seeds 920 930
    .venv/bin/python benchmarks/bench_encoder_parts.py --hidden all --d 96 --layers 2 --seeds 940 945
    .venv/bin/python benchmarks/bench_encoder_parts.py --minilm last --seeds 0 3          # the real model

Measured figures: docs/block.md, section "What an encoder API gives away without a block taken apart".
"""

from __future__ import annotations

import argparse
import json
import time

from headthief.pipeline import extract


def _f(v) -> str:
    return "-" if v is None else f"{v:.2g}" if isinstance(v, float) else str(v)


def one(spec: str, seed: int, verify: int) -> dict:
    t0 = time.perf_counter()
    rep = extract(spec, "encoder", seed=seed, verify=verify, raise_errors=False)
    r = rep.row
    mc = r.get("model_check") or {}
    return {"target": spec, "seed": seed, "exit": rep.exit_code, "offsets": r.get("offsets_rel_err"),
            "ln_emb": r.get("ln_emb_gamma_rel_err"), "ln_out_gamma": r.get("ln_out_gamma_rel_err"),
            "ln_out_beta": r.get("ln_out_beta_rel_err"), "constant": r.get("ln_out_constant_coordinates"),
            "constant_err": r.get("ln_out_constant_err"), "res_one": r.get("offsets_residual"),
            "res_all": r.get("offsets_residual_all_tokens"), "check": mc.get("figure"),
            "threshold": mc.get("threshold"), "verdict": mc.get("verdict"),
            "without": r.get("equivariance_without_offsets"), "activation": r.get("activation_ratio"), "in_sample": r.get("equivariance_in_sample"),
            "median": r.get("equivariance_median"), "in_median": r.get("equivariance_in_sample_median"), "cond": r.get("offsets_condition"), "floor": r.get("offsets_floor"),
            "queries": r.get("queries_sent"), "s": round(time.perf_counter() - t0, 1),
            **({"error": r.get("error", "")[:160]} if rep.exit_code not in (0, 2) else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", choices=("all", "last"), default="last")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--minilm", choices=("all", "last"), default=None,
                    help="the real all-MiniLM-L6-v2 (transformers' BertModel) instead of random encoders")
    ap.add_argument("--seeds", type=int, nargs=2, default=(900, 905), metavar=("FROM", "TO"))
    ap.add_argument("--verify", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    a = ap.parse_args()
    cols = ("seed", "exit", "offsets", "ln_emb", "ln_out_gamma", "ln_out_beta", "constant", "constant_err", "res_one",
            "res_all", "in_sample", "cond", "floor", "check", "threshold", "without", "activation", "queries", "s")
    if not a.json:
        print(" | ".join(cols))
    for seed in range(*a.seeds):
        spec = (f"minilm-encoder:hidden={a.minilm}" if a.minilm else
                f"bert-encoder:d={a.d},heads={a.heads},ffn={a.ffn},layers={a.layers},seed={seed},hidden={a.hidden},"
                f"dtype={a.dtype}")
        row = one(spec, seed, a.verify)
        print(json.dumps(row) if a.json else " | ".join(_f(row[c]) for c in cols) + (
            f" | {row['error']}" if "error" in row else ""), flush=True)


if __name__ == "__main__":
    main()
