"""``headthief journal show J``: what a journal holds, without running anything.

    headthief journal show J [--json]

The command that wrote it (target, method, seed and the settings that change which queries are asked), when,
the answered batches and rows, the file's size, and each stage checkpoint (``--method block`` and
``--method encoder``): the stage a resumed run goes on after, the evaluation a cut refit reached, the queries
spent until then, and whether this version of headthief can use it (a checkpoint written by other code is
ignored and its stage recomputed). A missing file or one that is not a journal: exit 2 with a message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="journal_command", required=True)
    sh = sub.add_parser("show", help="the command that wrote a journal, its answers and its stage checkpoints")
    sh.add_argument("path", help="the journal (--journal J of headthief extract)")
    sh.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} GB"  # pragma: no cover


def run(args) -> int:
    from ..extraction.block.resume import ENTRIES, current_code
    from ..oracles.journal import Journal, JournalError
    path = Path(args.path)
    if not path.is_file() or path.stat().st_size == 0:
        print(f"headthief: no journal at {path}", file=sys.stderr)
        return 2
    try:
        j = Journal(path, check_records=False)     # a MiniLM run's journal holds tens of GB: not read here
        try:
            info = j.summary()
        finally:
            j.close()
    except JournalError as e:
        print(f"headthief: {e}", file=sys.stderr)
        return 2
    for c in info["checkpoints"]:
        c["usable"] = c["name"] in ENTRIES and c["code"] == current_code(c["name"])
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return 0
    fp = dict(info["fingerprint"])
    head = [f"--target {fp.pop('target', '?')}", f"--method {fp.pop('method', '?')}", f"--seed {fp.pop('seed', '?')}"]
    rest = ", ".join(f"{k}={v}" for k, v in sorted(fp.items()) if v not in (None, False))
    print(f"journal     {info['path']} ({info['format']}, created {info['created']}, {_size(info['bytes'])})")
    print(f"command     {' '.join(head)}" + (f" ({rest})" if rest else ""))
    print(f"answers     {info['batches']:,} batches, {info['answered']:,} answered rows")
    if not info["checkpoints"]:
        print("checkpoint  none")
    for c in info["checkpoints"]:
        at = f" (evaluation {c['evaluation']})" if c.get("evaluation") else ""
        if c.get("neurons_found") is not None:        # inside stage F's neuron search
            at = f" ({c['neurons_found']:,} neurons found in {c['search_starts']:,} starts)"
        use = "usable by this version" if c["usable"] else "written by another version: its stages would be recomputed"
        print(f"checkpoint  {c['name']}: after {c.get('stage', '?')}{at}, {c.get('spent', 0):,} queries spent, "
              f"written {c.get('written', '?')}, {_size(c['bytes'])}; {use}")
    return 0
