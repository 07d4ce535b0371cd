"""``headthief reproduce``: every claim of the paper measured, one report."""

from __future__ import annotations

import json
import shlex
import sys

from ..errors import HeadthiefError


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes: about 25 s on 2 cores")
    p.add_argument("--only", action="append", metavar="NAME",
                   help="only these experiments (repeat or comma-separate); see --list")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.add_argument("--out", default="reproduce-out", help="output directory (default reproduce-out/)")
    add_sweep_arguments(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_sweep_arguments(p) -> None:
    """``--scheduler`` and ``--workers``: where a sweep's tasks run (reproduce, audit, bench real)."""
    p.add_argument("--scheduler", default="processes",
                   help="serial | processes (a dask LocalCluster here, the default) | tcp://HOST:PORT")
    p.add_argument("--workers", type=int, default=None, help="LocalCluster workers (default min(2, cores))")


def progress_bar(quiet: bool, label: str):
    """A rich progress bar on stderr counting tasks (None when quiet or stderr is not a terminal)."""
    if quiet or not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    bar = Progress("[bold]" + label, BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=False)
    task = bar.add_task(label, total=None)

    def cb(done, total, rec):
        bar.update(task, completed=done, total=total)
    return bar, cb


def run(args) -> int:
    from ..reproduce.claims import EXPERIMENTS
    from ..reproduce.run import reproduce
    if args.list:
        for e in EXPERIMENTS:
            print(f"{e.name:<18} {e.ref}")
        return 0
    bar, cb = progress_bar(args.quiet, "tasks")
    command = "headthief " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "headthief reproduce"
    try:
        if bar is not None:
            bar.start()
        res = reproduce(args.out, quick=args.quick, only=args.only, scheduler=args.scheduler, workers=args.workers,
                        progress=cb, command=command)
    except HeadthiefError as exc:
        print(f"headthief: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.stop()
    if args.json:
        print(json.dumps({"out": str(res.out), "verdicts": res.verdicts, "reused": res.reused,
                          "computed": res.computed, "failed": res.failed, "seconds": round(res.seconds, 2),
                          "files": {k: str(v) for k, v in res.files.items()}}))
    else:
        print(f"{res.computed} tasks computed, {res.reused} reused, {res.failed} failed in {res.seconds:.0f} s")
        for name, v in res.verdicts.items():
            print(f"  {name:<18} {v}")
        if "robustness" in res.verdicts:
            print_robustness(res.files["results.json"])
        print(f"report: {res.files['report.md']}  {res.files['report.html']}")
    return 0


def print_robustness(results_json) -> None:
    """The robustness experiment's success-rate table on stdout, plain text at full width (not cut to the
    terminal), then its failure messages grouped per row and its caveat."""
    from ..reproduce.claims import ROBUST_COLUMNS
    from ..reproduce.report import text_table
    data = json.loads(open(results_json).read())
    exp = next((e for e in data["experiments"] if e["name"] == "robustness"), None)
    if exp is None or not exp["table"]:
        return
    rows = exp["table"]
    print()
    print(f"robustness: {exp['verdict']}")
    print(text_table(rows, [c for c in ROBUST_COLUMNS if c != "failures"]))
    failing = [r for r in rows if r.get("failures", "-") != "-"]
    if failing:
        print("failures:")
        for r in failing:
            print(f"  {r['method']} {r['target']} {r['dtype']}: {r['failures']}")
    if exp.get("caveat"):
        print(f"caveat: {exp['caveat']}")
    print()
