"""``headthief serve``: serve a target as a model API (FastAPI + uvicorn; the ``serve`` extra).

    headthief serve --target random:d=64,seed=1 --db server.sqlite [--host 127.0.0.1 --port 8000]
                    [--noise TAU --noise-mode MODE] [--sign-only] [--input-norm R] [--max-batch N]
                    [--max-len N] [--prada flag|refuse] [--defence "k=v,..."] [--sync full|normal]
                    [--blas-threads N]

Prints ``headthief: serving TARGET on http://HOST:PORT`` on stderr once the socket is listening
(``--port 0`` picks a free port). Keys are made with ``headthief keys add``. One process per database.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="the target to serve (see `headthief targets`)")
    p.add_argument("--db", required=True, metavar="PATH", help="the accounts database (SQLite; made when missing)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    g = p.add_argument_group("defences (server-wide; `keys add --defence` sets them per key)")
    g.add_argument("--noise", type=float, default=None, metavar="TAU", help="answers within +-TAU of the truth")
    g.add_argument("--noise-mode", default=None, help="adversarial (default) | uniform | round:K (implies TAU)")
    g.add_argument("--sign-only", action="store_true", help="answer only 1 if f(X) > 0 else 0")
    g.add_argument("--input-norm", type=float, default=None, metavar="R", help="refuse tokens with ||x|| > R")
    g.add_argument("--max-batch", type=int, default=4096, metavar="N", help="most sequences per request (4096)")
    g.add_argument("--max-len", type=int, default=4096, metavar="N", help="most tokens per sequence (4096)")
    g.add_argument("--max-body-bytes", type=int, default=64 * 2**20, metavar="B", help="largest body (64 MiB)")
    g.add_argument("--prada", choices=["off", "flag", "refuse"], default="off",
                   help="the PRADA query-distribution detector: flag a key, or refuse it once flagged")
    g.add_argument("--prada-delta", type=float, default=0.9, metavar="W", help="flag when Shapiro-Wilk W < this (0.9)")
    g.add_argument("--prada-min", type=int, default=100, metavar="N", help="distances before the first test (100)")
    g.add_argument("--defence", default=None, metavar="SPEC", help='the same settings as "k=v,..." (overrides)')
    p.add_argument("--sync", choices=["full", "normal"], default="full",
                   help="ledger durability: full (default) fsyncs every charge before answering; normal (opt-in, "
                        "faster) survives a server crash but may lose the last charges to a power loss or OS crash")
    p.add_argument("--blas-threads", type=int, default=1, metavar="N",
                   help="BLAS threads per request (default 1: requests run in parallel on their own threads, and "
                        "an idle BLAS team would spin on cores the clients need; 0 leaves the library's default)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every request on stderr (uvicorn's access log)")


def defence_from_args(args):
    from ..server.defences import Defence, parse_defence
    base = Defence(noise=args.noise, mode=args.noise_mode, sign=args.sign_only, norm=args.input_norm,
                   max_batch=args.max_batch, max_len=args.max_len, prada=args.prada, prada_delta=args.prada_delta,
                   prada_min=args.prada_min)
    return parse_defence(args.defence, base)


def run(args) -> int:
    import socket

    from ..errors import HeadthiefError
    try:
        import uvicorn

        from ..server.app import Service, create_app
    except ImportError as e:
        print(f"headthief: serve needs fastapi and uvicorn: pip install 'headthief[serve]' ({e})", file=sys.stderr)
        return 2
    try:
        defence = defence_from_args(args)
        service = Service(args.target, args.db, defence=defence, max_body_bytes=args.max_body_bytes,
                          sync=args.sync)
    except HeadthiefError as e:
        print(f"headthief: {e}", file=sys.stderr)
        return 2
    app = create_app(service)
    if args.blas_threads > 0:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:         # threadpoolctl is in the sweep extra; without it the default stays
            pass
        else:
            threadpool_limits(args.blas_threads)
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only for sockets that say so;
    # without it every keep-alive response waits ~40 ms for a delayed ACK (Nagle)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"headthief: cannot listen on {args.host}:{args.port} ({e})", file=sys.stderr)
        return 2
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print("headthief: warning: listening beyond loopback without TLS; put a TLS proxy in front", file=sys.stderr)
    print(f"headthief: serving {args.target} on http://{host}:{port} (database {args.db}; defences "
          f"{defence.settings() or 'none'}"
          f"{'; ledger sync=normal: not durable against power loss' if args.sync == 'normal' else ''})",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log, timeout_keep_alive=30)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        service.accounts.close()
    return 0
