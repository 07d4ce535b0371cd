"""``headthief serve``: serve a target as a model API (FastAPI + uvicorn; the ``serve`` extra).

    headthief serve --target random:d=64,seed=1 --db server.sqlite [--host 127.0.0.1 --port 8000]
                    [--target py:model.py:f --d 64 [--bias]]
                    [--noise TAU --noise-mode MODE] [--sign-only] [--input-norm R] [--max-batch N]
                    [--max-len N] [--max-body-bytes B] [--max-json-bytes B] [--prada flag|refuse]
                    [--defence "k=v,..."] [--require-idempotency] [--sync full|normal] [--blas-threads N]

It binds the port first (a port in use or out of range is exit 2 and touches no database), then takes
the database's lock (``PATH.lock``: one server per database; a second ``serve`` on it is exit 2), then
opens or makes the database. On stderr it prints ``headthief: serving TARGET on http://HOST:PORT ...``
and, once uvicorn accepts requests, ``headthief serve: ready on http://HOST:PORT`` (``--port 0`` picks
a free port). Keys are made with ``headthief keys add``.

A target that answers vectors (``mha:d=32,heads=4,output=all``, ``minilm-layer:layer=2,output=last``,
``torch-mha:d=64,output=all``) is served as such: ``/v1/info`` publishes ``answer_kind`` and ``d_out``,
the answers carry the vectors, ``--noise`` / ``--noise-mode round:K`` apply per coordinate, and
``--sign-only`` (one bit per sequence) is refused with exit 2.
"""

from __future__ import annotations

import argparse
import sys

from .target_options import add_target_arguments, target_from_args, whole_number

INSTALL = ("headthief is not on a package index: from a clone, `bash scripts/setup.sh` (a .venv with every "
           "extra) or `pip install -e '.[serve]'`")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be a whole number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be in 0..65535 (0 picks a free port), got {port}")
    return port


_positive_int = whole_number("the value")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.allow_abbrev = False      # --d is --d, never an abbreviation of --db or --defence (read at parse time)
    add_target_arguments(p, api_key=False)
    p.add_argument("--db", required=True, metavar="PATH",
                   help="the accounts database (SQLite; made when missing; one server per database)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port, 0..65535 (default 8000; 0 picks a free one)")
    g = p.add_argument_group("defences (server-wide; `keys add --defence` sets them per key)")
    g.add_argument("--noise", type=float, default=None, metavar="TAU", help="answers within +-TAU of the truth")
    g.add_argument("--noise-mode", default=None, help="adversarial (default) | uniform | round:K (implies TAU)")
    g.add_argument("--sign-only", action="store_true", help="answer only 1 if f(X) > 0 else 0")
    g.add_argument("--input-norm", type=float, default=None, metavar="R", help="refuse tokens with ||x|| > R")
    g.add_argument("--max-batch", type=_positive_int, default=4096, metavar="N", help="most sequences per request (default 4096, lowered so that a full batch fits --max-body-bytes)")
    g.add_argument("--max-len", type=_positive_int, default=4096, metavar="N", help="most tokens per sequence (default 4096, lowered first, not below 32, so that a full batch fits "
                        "--max-body-bytes)")
    g.add_argument("--max-body-bytes", type=_positive_int, default=64 * 2**20, metavar="B",
                   help="largest .npy or sparse body (64 MiB; held about once in memory)")
    g.add_argument("--max-json-bytes", type=_positive_int, default=8 * 2**20, metavar="B",
                   help="largest JSON body (8 MiB; parsing JSON costs about 10x its size in memory)")
    g.add_argument("--prada", choices=["off", "flag", "refuse"], default="off",
                   help="the PRADA query-distribution detector: flag a key, or refuse it once flagged")
    g.add_argument("--prada-delta", type=float, default=0.9, metavar="W", help="flag when Shapiro-Wilk W < this (0.9)")
    g.add_argument("--prada-min", type=int, default=100, metavar="N", help="distances before the first test (100)")
    g.add_argument("--defence", default=None, metavar="SPEC", help='the same settings as "k=v,..." (overrides)')
    p.add_argument("--require-idempotency", action="store_true",
                   help="refuse (400) a query without an Idempotency-Key header; by default such a query is "
                        "answered and charged every time it is sent (`headthief extract` always sends one)")
    p.add_argument("--sync", choices=["full", "normal"], default="full",
                   help="ledger durability: full (default) fsyncs every charge before answering; normal (opt-in, "
                        "faster) survives a server crash but may lose the last charges to a power loss or OS crash")
    p.add_argument("--blas-threads", type=int, default=1, metavar="N",
                   help="BLAS threads per request (default 1: requests run in parallel on their own threads, and "
                        "an idle BLAS team would spin on cores the clients need; 0 leaves the library's default)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level on stderr (default warning: errors and tracebacks only; info adds "
                        "startup and shutdown messages)")
    p.add_argument("--access-log", action="store_true", help="log every request on stderr (uvicorn's access log)")


def defence_from_args(args):
    from ..server.defences import Defence, parse_defence
    base = Defence(noise=args.noise, mode=args.noise_mode, sign=args.sign_only, norm=args.input_norm,
                   max_batch=args.max_batch, max_len=args.max_len, prada=args.prada, prada_delta=args.prada_delta,
                   prada_min=args.prada_min)
    return parse_defence(args.defence, base)


def check_target(target) -> None:
    """Ask the target one question before serving it, so a ``py:`` function that fails on the given
    ``--d`` (or answers something that is not a number) stops ``serve`` at once instead of answering
    every request 422."""
    import numpy as np

    from ..errors import HeadthiefError, SpecError
    X = np.random.default_rng(0).normal(size=(1, 2, target.d))
    X *= 0.5 / np.linalg.norm(X, axis=2, keepdims=True)      # tokens of norm 0.5: within any input-norm bound
    try:
        target.make_oracle().query(X)
    except HeadthiefError as e:
        raise SpecError(f"the target {target.spec} cannot answer a query of 2 tokens of dimension d = {target.d}: "
                        f"{e}") from None


def run(args) -> int:
    import socket

    from ..errors import HeadthiefError
    try:
        import uvicorn

        from ..server.accounts import DatabaseLock
        from ..server.app import Service, check_defence, create_app
    except ImportError as e:
        print(f"headthief: serve needs fastapi and uvicorn (the serve extra; {INSTALL}): {e}", file=sys.stderr)
        return 2
    if args.target.startswith(("http://", "https://")):
        print("headthief: serving an http:// target would proxy another server; serve a local target", file=sys.stderr)
        return 2
    # the port first: a port in use must not leave a database behind
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only for sockets that say so;
    # without it every keep-alive response waits ~40 ms for a delayed ACK (Nagle)
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
    except OSError as e:
        print(f"headthief: cannot make a socket for {args.host} ({e})", file=sys.stderr)
        return 2
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except (OSError, OverflowError) as e:
        sock.close()
        print(f"headthief: cannot listen on {args.host}:{args.port} ({e})", file=sys.stderr)
        return 2
    lock = None
    try:
        target = target_from_args(args)
        check_target(target)
        defence = defence_from_args(args)
        check_defence(target, defence)          # sign-only on a vector target: before the database is touched
        lock = DatabaseLock(args.db)
        service = Service(target, args.db, defence=defence, max_body_bytes=args.max_body_bytes,
                          max_json_bytes=args.max_json_bytes, sync=args.sync,
                          require_idempotency=args.require_idempotency)
    except HeadthiefError as e:
        sock.close()
        if lock is not None:
            lock.release()
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
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print("headthief: warning: listening beyond loopback without TLS; put a TLS proxy in front", file=sys.stderr)
    answers = "" if not service.kind.vector else f"answers {service.kind.describe(service.d_out)}; "
    print(f"headthief: serving {args.target} on {url} ({answers}database {args.db}; defences "
          f"{service.defence.settings() or 'none'}; limits {service.defence.max_batch} sequences x "
          f"{service.defence.max_len} tokens; Idempotency-Key {'required' if args.require_idempotency else 'optional'}"
          f"{'; ledger sync=normal: not durable against power loss' if args.sync == 'normal' else ''})",
          file=sys.stderr, flush=True)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(f"headthief serve: ready on {url}", file=sys.stderr, flush=True)

    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log, timeout_keep_alive=30)
    try:
        Server(config).run(sockets=[sock])
    finally:
        service.accounts.close()
        lock.release()
    return 0
