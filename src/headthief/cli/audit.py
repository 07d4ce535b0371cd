"""``headthief audit --target SPEC``: every applicable method against every defence, one table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import HeadthiefError
from .reproduce import add_sweep_arguments
from .target_options import add_target_arguments


def add_arguments(p) -> None:
    add_target_arguments(p)
    p.add_argument("--defences", action="append", metavar="NAME",
                   help="only these defences (repeat; names as in the table, e.g. 'none', 'round:4')")
    p.add_argument("--methods", action="append", metavar="M", help="only these methods (repeat)")
    p.add_argument("--out", default="audit-out", help="output directory (default audit-out/)")
    add_sweep_arguments(p)
    p.add_argument("--json", action="store_true", help="print the table as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _fmt(x):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.1e}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def run(args) -> int:
    from ..reproduce.audit import audit_table, audit_tasks, draw_audit
    from ..reproduce.engine import run_sweep
    from .reproduce import progress_bar
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"headthief: --out {out}: is a file; give a directory (it is made when missing)", file=sys.stderr)
        return 2
    try:
        if args.api_key:            # the cells read the key from the environment (never stored in a task)
            import os
            os.environ["HEADTHIEF_API_KEY"] = args.api_key
        tasks = audit_tasks(args.target, methods=args.methods, names=args.defences, d=args.d, bias=args.bias)
        bar, cb = progress_bar(args.quiet, "audit cells")
        if bar is not None:
            bar.start()
        try:
            summary = run_sweep(tasks, store=out / "tasks", scheduler=args.scheduler, workers=args.workers, progress=cb)
        finally:
            if bar is not None:
                bar.stop()
    except HeadthiefError as exc:
        print(f"headthief: {exc}", file=sys.stderr)
        return 2
    rows = audit_table(summary.records)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps({"target": args.target, "rows": rows}, indent=1) + "\n")
    plotted = draw_audit(rows, out / "audit.png")
    cols = ("defence", "method", "outcome", "queries", "W_rel_err", "fidelity", "check")
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows]
    (out / "audit.md").write_text(f"# headthief audit --target {args.target}\n\n" + "\n".join(md) + "\n"
                                  + ("\n![audit](audit.png)\n" if plotted else ""))
    if args.json:
        print(json.dumps({"target": args.target, "rows": rows}))
        return 0
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"audit {args.target}: what each defence costs the attacker")
    for c in cols:
        t.add_column(c, justify="right" if c in ("queries", "W_rel_err", "fidelity") else "left")
    for r in rows:
        t.add_row(*(_fmt(r[c]) for c in cols))
    # piped to a file, rich would cut the table at 80 columns: give it the width it needs
    Console(width=None if sys.stdout.isatty() else 200).print(t)
    print(f"{summary.computed} cells computed, {summary.reused} reused; files: {out / 'audit.md'}, {out / 'audit.json'}"
          + (f", {out / 'audit.png'}" if plotted else ""))
    return 0
