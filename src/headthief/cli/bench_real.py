"""``headthief bench real``: extract every pretrained head of all-MiniLM-L6-v2 and tabulate the result.

For each selected head (all 6 x 12 = 72 by default) it resolves ``minilm:layer=L,head=H``, runs the
chosen method exactly as ``headthief extract`` does (same method table, same options, rank auto),
checks the fidelity on fresh Gaussian sequences of lengths 1..32, and writes one row: layer, head,
detected rank, queries, W / c / v relative errors, beta absolute error, fidelity, seconds. Then one
head through each black-box module (``minilm-hf:`` and ``torch-mha:``; skipped with a note when
torch is not installed). Progress goes to stderr, the table and a summary to stdout;
``--out FILE.csv`` also writes the table as CSV (any other suffix: Markdown), ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import HeadthiefError
from .reproduce import add_sweep_arguments

COLUMNS = ["target", "method", "layer", "head", "rank", "queries", "W_rel_err", "c_rel_err", "v_rel_err",
           "beta_abs_err", "fidelity_max_rel_err", "check", "seconds"]
BLACK_BOXES = [("minilm-hf:layer=0,head=0", None), ("torch-mha:d=64,seed=1", "exact")]


def _index_list(text: str, n: int, what: str) -> list[int]:
    """Parse ``"all"``, ``"3"``, ``"0,2,5"`` or ``"0-3"`` into indices in 0..n-1."""
    if text == "all":
        return list(range(n))
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{what} {text!r}: use all, 3, 0,2,5 or 0-3") from None
        if not (0 <= a <= b < n):
            raise argparse.ArgumentTypeError(f"--{what} {text!r}: indices must lie in 0..{n - 1}")
        out.extend(range(a, b + 1))
    return sorted(set(out))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="lowrank", help="extraction method for the MiniLM heads (default lowrank)")
    p.add_argument("--layers", default="all", help="layers to run: all (default), 3, 0,2 or 0-2")
    p.add_argument("--heads", default="all", help="heads to run in each layer: all (default), 5, 0,5 or 0-3")
    p.add_argument("--rank", default="auto", help="rank for lowrank: an integer or auto (default)")
    p.add_argument("--oversample", type=int, default=None, metavar="K", help="lowrank oversampling (default: auto)")
    p.add_argument("--readout", type=int, default=0, metavar="SEED", help="readout vector seed (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the extraction's randomness (default 0)")
    p.add_argument("--verify", type=int, default=256, metavar="N",
                   help="fidelity check on N fresh Gaussian sequences of lengths 1..32 (default 256)")
    p.add_argument("--no-blackbox", action="store_true", help="skip the minilm-hf / torch-mha rows")
    p.add_argument("--out", metavar="FILE", help="also write the table to FILE.csv or FILE.md")
    p.add_argument("--json", action="store_true", help="print one JSON object (rows, black boxes, summary)")
    add_sweep_arguments(p)
    p.add_argument("--store", metavar="DIR", help="keep each finished head in DIR; a re-run reuses them")


def extract_row(spec: str, method: str, args: argparse.Namespace) -> dict:
    """Run ``method`` on ``spec`` through the extraction pipeline (what ``headthief extract`` runs, the
    model check included); return one table row. A run whose model check failed (the recovered head is
    further from the target than the float32 answers' measured noise explains) is a row with ``check``
    ``fail`` and its figures; a run that did not finish raises its typed error."""
    from ..pipeline import SETTING_METHODS, extract
    opts = {"seed": args.seed, "verify": args.verify}
    if method in SETTING_METHODS["rank"]:
        opts["rank"] = str(args.rank)
    if args.oversample is not None and method in SETTING_METHODS["oversample"]:
        opts["oversample"] = args.oversample
    rep = extract(spec, method, raise_errors=False, **opts)
    if rep.result is None:
        raise rep.exception
    row = rep.row           # its figures are already finite or None (the pipeline's row)
    mc = row.get("model_check") or {}
    return {
        "target": spec, "method": method, "layer": row.get("target_layer"), "head": row.get("target_head"),
        "rank": row.get("rank"), "queries": row.get("queries"),
        **{k: row.get(k) for k in ("W_rel_err", "c_rel_err", "v_rel_err", "beta_abs_err", "fidelity_max_rel_err")},
        "check": mc.get("verdict"),
        "seconds": round(rep.result.seconds, 3),
        **({"check_threshold": mc.get("threshold")} if rep.exit_code == 5 else {}),
    }


def bench_cell(p: dict, rng) -> dict:
    """One head as a task of the sweep engine (:mod:`headthief.reproduce.engine`). The extraction's seed
    is ``--seed`` (not the task's generator), so the figures are those of a plain loop."""
    args = argparse.Namespace(**p["args"])
    return extract_row(p["spec"], p["method"], args)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2e}" if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5) else f"{v:.3g}"
    return str(v)


def format_text(rows: list[dict]) -> str:
    cells = [[_fmt(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def summarize(rows: list[dict], expected_rank: int = 32) -> dict:
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return {"heads": len(rows), "failed": len(rows)}

    def worst(key):
        vals = [r[key] for r in ok if r.get(key) is not None]
        return max(vals) if vals else None

    q = [r["queries"] for r in ok]
    return {
        "heads": len(rows), "failed": len(rows) - len(ok),
        "check_failed": sum(r.get("check") == "fail" for r in ok),
        f"rank_{expected_rank}": sum(r["rank"] == expected_rank for r in ok),
        "queries_min": min(q), "queries_max": max(q),
        "W_rel_err_max": worst("W_rel_err"), "c_rel_err_max": worst("c_rel_err"),
        "v_rel_err_max": worst("v_rel_err"), "beta_abs_err_max": worst("beta_abs_err"),
        "fidelity_max": worst("fidelity_max_rel_err"),
        "seconds_median": float(np.median([r["seconds"] for r in ok])),
        "seconds_total": round(sum(r["seconds"] for r in ok), 2),
    }


def _torch_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


def run(args: argparse.Namespace) -> int:
    from ..models.minilm import N_HEADS, N_LAYERS
    try:
        layers = _index_list(args.layers, N_LAYERS, "layers")
        heads = _index_list(args.heads, N_HEADS, "heads")
    except argparse.ArgumentTypeError as e:
        print(f"headthief: {e}", file=sys.stderr)
        return 2
    from ..methods import METHODS
    if args.method not in METHODS:
        print(f"headthief: unknown method {args.method!r} (known: {', '.join(METHODS)})", file=sys.stderr)
        return 2
    if args.out:
        from ..pipeline import check_output_path
        try:
            check_output_path(args.out, "--out")
        except HeadthiefError as e:
            print(f"headthief: {e}", file=sys.stderr)
            return 2
    jobs = [(f"minilm:layer={L},head={H}" + (f",readout={args.readout}" if args.readout else ""), args.method)
            for L in layers for H in heads]
    boxes = [] if args.no_blackbox else [(s, m or args.method) for s, m in BLACK_BOXES]
    if boxes and not _torch_available():
        print("headthief: torch/transformers are not installed; skipping the black-box rows "
              "(pip install -e '.[torch]' in the headthief clone, or bash scripts/setup.sh)", file=sys.stderr)
        boxes = []
    from ..reproduce.engine import Task, run_sweep
    keep = {k: getattr(args, k) for k in ("seed", "rank", "oversample", "verify")}
    all_jobs = jobs + boxes
    tasks = [Task("bench-real", f"{spec}|{method}", "headthief.cli.bench_real:bench_cell",
                  {"spec": spec, "method": method, "args": keep}) for spec, method in all_jobs]

    def progress(done, total, rec):
        label = f"[{done}/{total}] {rec['params']['spec']} ({rec['params']['method']})"
        if rec.get("error"):
            print(f"{label}: failed: {rec['error']}", file=sys.stderr)
        else:
            row = rec["value"]
            print(f"{label}: rank {row['rank']}, {row['queries']} queries, W err {_fmt(row['W_rel_err'])}, "
                  f"fidelity {_fmt(row['fidelity_max_rel_err'])}, {row['seconds']:.1f} s", file=sys.stderr)

    t0 = time.perf_counter()
    try:
        sweep = run_sweep(tasks, store=args.store, scheduler=args.scheduler, workers=args.workers,
                          progress=progress)
    except HeadthiefError as e:
        print(f"headthief: {e}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    box_rows: list[dict] = []
    for i, rec in enumerate(sweep.records):
        spec, method = rec["params"]["spec"], rec["params"]["method"]
        row = rec["value"] if rec["value"] is not None else {"target": spec, "method": method, "error": rec["error"]}
        (rows if i < len(jobs) else box_rows).append(row)
    if sweep.reused:
        print(f"headthief: {sweep.reused} head(s) reused from {args.store}", file=sys.stderr)
    summary = summarize(rows)
    summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
    summary["method"] = args.method
    if args.out:
        path = Path(args.out)
        if path.suffix == ".csv":
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=COLUMNS + ["error"], extrasaction="ignore")
                w.writeheader()
                w.writerows(rows + box_rows)
        else:
            path.write_text(format_markdown(rows + box_rows) + "\n")
    if args.json:
        print(json.dumps({"rows": rows, "black_boxes": box_rows, "summary": summary}))
    else:
        print(format_text(rows))
        if box_rows:
            print("\nblack-box modules:")
            print(format_text(box_rows))
        print("\nsummary: " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))
    if summary.get("failed") or any("error" in r for r in box_rows):
        return 4
    return 5 if summary.get("check_failed") or any(r.get("check") == "fail" for r in box_rows) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="headthief bench real", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))
