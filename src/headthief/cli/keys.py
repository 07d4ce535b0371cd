"""``headthief keys``: make, list, change and revoke the API keys of a ``headthief serve`` database.

    headthief keys add NAME --db PATH [--budget N] [--rate R] [--defence SPEC]   # prints the key alone
    headthief keys list --db PATH [--json]
    headthief keys set NAME --db PATH [--budget N|none] [--rate R|none]        # change a key's limits
    headthief keys revoke NAME --db PATH                                        # every request with it: 401
    headthief keys audit --db PATH     # do budgets, ledger and answers agree? (exit 1 if not)

Only a hash of each key is stored: the key is printed once, by ``keys add``. Only ``keys add`` (and
``serve``) make a database; the other commands name a missing one (exit 2). A running server sees a
change or a revocation at the key's next request.
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
    ls.add_argument("--db", required=True, metavar="PATH", help="the server's database (must exist)")
    ls.add_argument("--json", action="store_true", help="one JSON list on stdout")
    st = sub.add_parser("set", help="change a key's budget and/or rate")
    st.add_argument("name", help="the key's name")
    st.add_argument("--db", required=True, metavar="PATH", help="the server's database (must exist)")
    st.add_argument("--budget", type=_limit(int), default=_UNCHANGED, metavar="N|none",
                    help="most queries the key may spend in all (none: no limit); below what it used, it is "
                         "refused from now on")
    st.add_argument("--rate", type=_limit(float), default=_UNCHANGED, metavar="R|none",
                    help="most requests per second (none: no limit)")
    rv = sub.add_parser("revoke", help="revoke a key: every request with it is answered 401 (its ledger stays)")
    rv.add_argument("name", help="the key's name")
    rv.add_argument("--db", required=True, metavar="PATH", help="the server's database (must exist)")
    au = sub.add_parser("audit", help="check that budgets, the ledger and the answers agree")
    au.add_argument("--db", required=True, metavar="PATH", help="the server's database (must exist)")


_UNCHANGED = object()


def _limit(kind):
    def parse(text: str):
        if text.strip().lower() in ("none", "off", "unlimited"):
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


def run(args) -> int:
    from ..errors import HeadthiefError
    from ..server.accounts import Accounts
    from ..server.defences import parse_defence
    try:
        acc = Accounts(args.db, create=args.keys_command == "add")
        try:
            if args.keys_command == "add":
                defence = parse_defence(args.defence).settings() if args.defence else None
                print(acc.add_key(args.name, budget=args.budget, rate=args.rate, defence=defence))
                return 0
            if args.keys_command == "list":
                return _list(acc, args.json)
            if args.keys_command == "set":
                changes = {k: v for k, v in (("budget", args.budget), ("rate", args.rate)) if v is not _UNCHANGED}
                if not changes:
                    print("headthief: keys set: give --budget N|none and/or --rate R|none", file=sys.stderr)
                    return 2
                rec = acc.update(args.name, **changes)
                print(f"{rec.name}: budget {_show(rec.budget)}, rate {_show(rec.rate)}, used {rec.used:,}"
                      + (" (over its budget: refused from now on)" if rec.budget is not None and rec.used > rec.budget
                         else ""))
                return 0
            if args.keys_command == "revoke":
                rec = acc.revoke(args.name)
                print(f"{rec.name}: revoked at {rec.revoked} (used {rec.used:,} queries)")
                return 0
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


def _show(x) -> str:
    return "none" if x is None else f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _list(acc, as_json: bool) -> int:
    rows = [k.as_dict() for k in acc.list_keys()]
    if as_json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no keys (make one with `headthief keys add NAME --db PATH`)")
        return 0
    cols = ("name", "prefix", "budget", "rate", "used", "flagged_at", "defence", "revoked")
    table = [[("-" if r[c] is None else (",".join(f"{k}={v}" for k, v in r[c].items()) if isinstance(r[c], dict)
                                          else f"{r[c]:,}" if isinstance(r[c], int) else f"{r[c]:g}"
                                          if isinstance(r[c], float) else str(r[c]))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    for t in table:
        print("  ".join(x.ljust(w) for x, w in zip(t, widths)).rstrip())
    return 0
