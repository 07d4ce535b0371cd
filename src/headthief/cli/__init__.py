"""Command line: ``headthief extract``, ``headthief targets``.

Exit codes: 0 done; 2 not identifiable or bad input (one line on stderr); 3 query budget exceeded
(stderr says how many queries were spent); 4 the oracle failed or a bounded procedure did not
converge; 130 interrupted (the transcript, if one was asked for, is saved first).
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..targets import describe
from .extract import add_arguments, cmd_extract


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headthief", description="Recover attention-head parameters from black-box queries.")
    p.add_argument("--version", action="version", version=f"headthief {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("extract", help="extract a head from a target and report errors and cost")
    add_arguments(e)

    sub.add_parser("targets", help="list the available target kinds")

    from . import keys, serve
    serve.add_arguments(sub.add_parser("serve", help="serve a target as a model API (keys, budgets, defences)"))
    keys.add_arguments(sub.add_parser("keys", help="make, list and audit the API keys of a serve database"))
    from . import journal as _journal
    _journal.add_arguments(sub.add_parser("journal", help="what a journal holds: its command, answers, checkpoints"))

    b = sub.add_parser("bench", help="run a benchmark job and print its table")
    jobs = b.add_subparsers(dest="job", required=True)
    from . import bench_real
    bench_real.add_arguments(jobs.add_parser(
        "real", help="extract all 72 heads of all-MiniLM-L6-v2 (and one head per black-box module)"))
    from . import reproduce as _reproduce
    _reproduce.add_arguments(sub.add_parser("reproduce", help="measure every claim of the paper; write a report"))
    from . import audit as _audit
    _audit.add_arguments(sub.add_parser("audit", help="every method against every defence on one target"))
    return p


def cmd_targets(args) -> int:
    rows = describe()
    width = max(len(s) for s, _ in rows)
    for syntax, desc in rows:
        print(f"{syntax:<{width}}  {desc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _dispatch(argv)
    except BrokenPipeError:
        # the reader of stdout went away (``headthief targets | head -1``): not an error of ours; stdout is
        # pointed at /dev/null so that Python's own flush at exit does not complain a second time
        import os
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0


def _dispatch(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "extract":
        return cmd_extract(args)
    if args.command == "targets":
        return cmd_targets(args)
    if args.command == "audit":
        from . import audit as _audit
        return _audit.run(args)
    if args.command == "reproduce":
        from . import reproduce as _reproduce
        return _reproduce.run(args)
    if args.command == "serve":
        from . import serve
        return serve.run(args)
    if args.command == "keys":
        from . import keys
        return keys.run(args)
    if args.command == "journal":
        from . import journal as _journal
        return _journal.run(args)
    if args.command == "bench" and args.job == "real":
        from . import bench_real
        return bench_real.run(args)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
