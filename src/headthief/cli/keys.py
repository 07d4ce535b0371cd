"""``headthief keys``: make and list the API keys of a ``headthief serve`` database.

    headthief keys add NAME --db PATH [--budget N] [--rate R] [--defence SPEC]   # prints the key alone
    headthief keys list --db PATH [--json]
    headthief keys audit --db PATH     # do budgets, ledger and answers agree? (exit 1 if not)

Only a hash of each key is stored: the key is printed once, by ``keys add``.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="keys_command", required=True)
    a = sub.add_parser("add", help="make a key and print it (alone, on stdout)")
    a.add_argument("name", help="a name for the key (unique in the database)")
    a.add_argument("--db", required=True, metavar="PATH", help="the server's database")
    a.add_argument("--budget", type=int, default=None, metavar="N", help="most queries the key may spend")
    a.add_argument("--rate", type=float, default=None, metavar="R", help="most requests per second")
    a.add_argument("--defence", default=None, metavar="SPEC",
                   help='defences for this key, laid over the server\'s: "noise=1e-4,mode=uniform", "sign=1", '
                        '"prada=refuse", ...')
    ls = sub.add_parser("list", help="every key's name, budget, rate and queries used")
    ls.add_argument("--db", required=True, metavar="PATH")
    ls.add_argument("--json", action="store_true", help="one JSON list on stdout")
    au = sub.add_parser("audit", help="check that budgets, the ledger and the answers agree")
    au.add_argument("--db", required=True, metavar="PATH")


def run(args) -> int:
    from ..errors import HeadthiefError
    from ..server.accounts import Accounts
    from ..server.defences import parse_defence
    try:
        acc = Accounts(args.db)
        try:
            if args.keys_command == "add":
                defence = parse_defence(args.defence).settings() if args.defence else None
                print(acc.add_key(args.name, budget=args.budget, rate=args.rate, defence=defence))
                return 0
            if args.keys_command == "list":
                return _list(acc, args.json)
            if args.keys_command == "audit":
                problems = acc.audit()
                totals = acc.ledger_totals()
                for name, (reqs, queries) in totals.items():
                    print(f"{name}: {reqs} requests charged, {queries} queries")
                for p in problems:
                    print(f"headthief: audit: {p}", file=sys.stderr)
                return 1 if problems else 0
        finally:
            acc.close()
    except HeadthiefError as e:
        print(f"headthief: {e}", file=sys.stderr)
        return 2
    return 2  # pragma: no cover


def _list(acc, as_json: bool) -> int:
    rows = [k.as_dict() for k in acc.list_keys()]
    if as_json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no keys (make one with `headthief keys add NAME --db PATH`)")
        return 0
    cols = ("name", "prefix", "budget", "rate", "used", "flagged_at", "defence")
    table = [[("-" if r[c] is None else (",".join(f"{k}={v}" for k, v in r[c].items()) if isinstance(r[c], dict)
                                          else f"{r[c]:,}" if isinstance(r[c], int) else f"{r[c]:g}"
                                          if isinstance(r[c], float) else str(r[c]))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    for t in table:
        print("  ".join(x.ljust(w) for x, w in zip(t, widths)).rstrip())
    return 0
