"""The ``http://HOST:PORT[?framing=auto|npy|sparse|json][&connect_wait=S]`` target: a model behind a ``headthief serve`` API.

The key comes from ``--api-key`` (the ``api_key`` setting of :func:`headthief.targets.resolve`) or the
``HEADTHIEF_API_KEY`` environment variable. The truth is unknown to the client (errors print as ``-``);
compare recovered parameters with ``--save``. ``framing=auto`` (the default) sends each request in
the sparse binary framing when at most a quarter of its entries are nonzero, else as ``.npy``.
``connect_wait=S`` (default 30, or ``HEADTHIEF_CONNECT_WAIT``): how long to wait for a server that is
still starting.

Resolving the target asks the server once, before any query: ``/v1/info`` and, with a key,
``/v1/usage``, so ``target.info["server_output"]`` is what this key's answers are (``value``,
``noisy:TAU``, ``rounded:K`` or ``sign``): a method that cannot use them can be refused up front.
A server that answers vectors (``/v1/info``: ``answer_kind`` ``last`` or ``all``, ``d_out``) gives a
target with ``output`` and ``d_out`` set, as the served target has them.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

from ..errors import OracleError, SpecError
from .base import Target


def build_http(spec: str, ctx: dict[str, Any]) -> Target:
    from ..oracles.http import HTTPOracle
    parts = urlsplit(spec)
    if not parts.hostname or parts.path not in ("", "/"):
        raise SpecError(f"an http target is http://HOST:PORT[?framing=auto|npy|sparse|json][&connect_wait=S], "
                        f"got {spec!r}")
    opts = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(opts) - {"framing", "connect_wait"}
    if unknown:
        raise SpecError(f"unknown option(s) for an http target: {', '.join(sorted(unknown))} "
                        "(allowed: framing, connect_wait)")
    wait = None
    if "connect_wait" in opts:
        try:
            wait = float(opts["connect_wait"])
        except ValueError:
            raise SpecError(f"connect_wait={opts['connect_wait']!r} is not a number of seconds") from None
    from ..oracles.http import FRAMINGS
    framing = opts.get("framing", "auto")
    if framing not in FRAMINGS:
        raise SpecError(f"framing={framing!r}: use {', '.join(FRAMINGS)}")
    url = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
    api_key = ctx.get("api_key")
    try:
        probe = HTTPOracle(url, api_key=api_key, framing=framing, retries=3, connect_wait=wait)
    except ImportError as e:
        raise SpecError(f"an http target needs httpx: pip install 'headthief[serve]' ({e})") from None
    except OracleError as e:
        raise SpecError(str(e)) from None
    info = dict(probe.info, output=probe.server_output)      # the key's own answers (its defences included)
    kind, d_out = probe.output, probe.d_out
    probe.close()
    d = int(info["d"])
    if ctx.get("d") is not None and int(ctx["d"]) != d:
        raise SpecError(f"--d {ctx['d']} but the server at {url} serves d = {d}")
    bias = bool(ctx.get("bias")) or bool(info.get("bias"))
    served = kind.value if kind.vector else "value"
    if ctx.get("output") is not None and str(ctx["output"]) != served:
        raise SpecError(f"--output {ctx['output']} but the server at {url} answers {kind.describe(d_out)} "
                        f"(output {served}); leave --output out for an http target")
    if ctx.get("d_out") is not None and kind.vector and int(ctx["d_out"]) != d_out:
        raise SpecError(f"--d-out {ctx['d_out']} but the server at {url} answers {d_out}-vectors")
    return Target(spec=spec, d=d, bias=bias, truth=None, output=served, d_out=d_out,
                  make_oracle=lambda **kw: HTTPOracle(url, api_key=api_key, framing=framing, connect_wait=wait, **kw),
                  info={"server_" + k: v for k, v in info.items()
                        if k in ("output", "max_batch", "max_len", "idempotency", "version", "answer_kind", "d_out")}
                  | {"framing": framing})
