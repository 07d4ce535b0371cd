"""The target options every command that takes a target shares: ``--target``, ``--d``, ``--bias``, ``--api-key``.

``extract``, ``serve``, ``audit`` and ``bench`` add them with :func:`add_target_arguments` and turn them
into a :class:`~headthief.targets.Target` with :func:`target_from_args`, so ``--d`` means the same
everywhere (and ``serve --d 64`` is not an abbreviation of ``--db`` or ``--defence``).
"""

from __future__ import annotations

import argparse
import os

from ..errors import SpecError

API_KEY_ENV = "HEADTHIEF_API_KEY"


def whole_number(what: str, lo: int = 1):
    """An argparse type: a whole number >= ``lo``; errors name ``what`` (e.g. ``--d``)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"{what} must be >= {lo}, got {n}")
        return n
    return parse


_dimension = whole_number("--d (the token dimension)")


def add_target_arguments(parser: argparse.ArgumentParser, *, required: bool = True, api_key: bool = True) -> None:
    """Add ``--target SPEC``, ``--d D``, ``--bias`` and (unless ``api_key=False``) ``--api-key KEY``.

    Args:
        parser: the command's parser.
        required: whether ``--target`` must be given.
        api_key: add ``--api-key`` (for commands that can reach an ``http://`` target).
    """
    parser.add_argument("--target", required=required, metavar="SPEC",
                        help="the target (see `headthief targets`): random:d=64,seed=1, py:model.py:f, "
                             "http://HOST:PORT, ...")
    parser.add_argument("--d", type=_dimension, default=None, metavar="D",
                        help="token dimension of a py: target (required for py:); for a target that fixes d "
                             "itself it must agree")
    parser.add_argument("--bias", action="store_true",
                        help="the py: target may have score/output biases (c, beta)")
    parser.add_argument("--output", choices=("value", "last", "all"), default=None,
                        help="what a py: target's function returns per sequence: value (one number, the default), "
                             "last (one vector, the last position's) or all (an (N, d_out) array)")
    parser.add_argument("--d-out", dest="d_out", type=whole_number("--d-out"), default=None, metavar="K",
                        help="the dimension of a py: target's answer vectors (default: d)")
    if api_key:
        parser.add_argument("--api-key", dest="api_key", default=None, metavar="KEY",
                            help=f"API key of an http:// target (default: the {API_KEY_ENV} environment variable)")


def target_from_args(args: argparse.Namespace):
    """The :class:`~headthief.targets.Target` the options name.

    Raises:
        SpecError: a malformed spec, a ``py:`` target without ``--d``, or ``--d`` that disagrees with the
            dimension the target fixes itself (``--d 16`` on ``random:d=8``).
    """
    from ..targets import resolve
    if not getattr(args, "target", None):
        raise SpecError("no target: give --target SPEC (see `headthief targets`)")
    d = getattr(args, "d", None)
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    from ..pipeline import Options, check_d
    target = resolve(args.target, d=d, bias=bool(getattr(args, "bias", False)), api_key=api_key,
                     output=getattr(args, "output", None), d_out=getattr(args, "d_out", None))
    check_d(target, Options(d=d))
    return target
