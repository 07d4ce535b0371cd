"""Target specs: the pieces every target kind shares (Target, TargetKind, the registry, option parsing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import SpecError
from ..oracles.base import Oracle


@dataclass
class Target:
    """A resolved target: ``make_oracle(**oracle_kw)`` builds a fresh oracle on the black box.

    ``truth`` holds the true parameters where they are known (None for a user's black box); ``bias``
    says whether the target may have the score/output biases; ``info`` is printed with the results.
    """

    spec: str
    d: int
    bias: bool
    make_oracle: Callable[..., Oracle]
    truth: Any = None                 # AttentionHead or MultiHeadAttention (None: unknown)
    info: dict[str, Any] = field(default_factory=dict)
    bases: Any = None                 # known head subspaces (H, d, d_h), for multihead-subspaces
    output: str = "value"             # the answer kind (headthief.oracles.answers.Output's value)
    d_out: int | None = None          # the answer vectors' dimension (vector kinds)


@dataclass(frozen=True)
class TargetKind:
    name: str
    syntax: str
    description: str
    build: Callable[[str, dict[str, str], dict[str, Any]], Target]


TARGET_KINDS: dict[str, TargetKind] = {}


def register(kind: TargetKind) -> None:
    TARGET_KINDS[kind.name] = kind


def parse_options(text: str) -> dict[str, str]:
    opts: dict[str, str] = {}
    if not text:
        return opts
    for part in text.split(","):
        if not part:
            continue
        if "=" not in part:
            raise SpecError(f"target option {part!r} is not key=value")
        k, v = part.split("=", 1)
        k = k.strip()
        if k in opts:
            raise SpecError(f"target option {k}= is given twice ({k}={opts[k]} and {k}={v.strip()})")
        opts[k] = v.strip()
    return opts


def check_size(spec: str, floats: int) -> None:
    """Refuse a target whose parameters (``floats`` float64 numbers, a few working copies) would not fit
    in half of this machine's memory, before anything is allocated (instead of a MemoryError, or the
    kernel's OOM killer, half-way through)."""
    import os
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):      # not a POSIX system: no guard
        return
    need = 3 * 8 * int(floats)
    if need > total // 2:
        raise SpecError(f"{spec}: its parameters need about {need / 2**30:.1f} GiB of memory, more than half of "
                        f"this machine's {total / 2**30:.1f} GiB; choose a smaller size")


def _int(opts, key, default=None, *, lo=None):
    if key not in opts:
        if default is None:
            raise SpecError(f"target option {key}= is required")
        return default
    try:
        val = int(opts[key])
    except ValueError:
        raise SpecError(f"target option {key}={opts[key]!r} is not an integer") from None
    if lo is not None and val < lo:
        raise SpecError(f"target option {key}={val} must be >= {lo}")
    return val


def _float(opts, key, default):
    if key not in opts:
        return default
    try:
        return float(opts[key])
    except ValueError:
        raise SpecError(f"target option {key}={opts[key]!r} is not a number") from None


def output_option(kind: str, opts: dict, default: str | None = None) -> str | None:
    """The ``output=last|all`` option of a target kind that can answer with vectors (None: not given)."""
    out = opts.get("output", default)
    if out is None:
        return None
    if out not in ("last", "all"):
        raise SpecError(f"{kind}: output={out!r}: use output=last (the vector at the last position) or "
                        "output=all (a vector at every position)")
    return out


def _check_keys(kind: str, opts: dict, allowed: set[str]) -> None:
    extra = set(opts) - allowed
    if extra:
        raise SpecError(f"unknown option(s) for {kind}: target: {', '.join(sorted(extra))} "
                        f"(allowed: {', '.join(sorted(allowed))})")
