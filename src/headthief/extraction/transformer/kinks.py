"""Critical points of a piecewise-linear function of one variable, from value queries.

Along a segment ``z(t) = P + t (Q - P)`` a ReLU network is piecewise linear in ``t``; its kinks are
where the segment crosses a neuron's hyperplane. :func:`find_kinks` finds all of them with a bounded
search that keeps, for every open interval, the line of the piece at each end:

- the two end lines agree with the secant: no kink inside (two kinks whose slope changes cancel still
  move the secant, so they are seen);
- else the end lines meet at ``t*``; five queries at ``t* - h, t* - eta, t*, t* + eta, t* + h``
  (``eta = h / 1000``) confirm a single kink only if the left points lie on the left line and the right
  points on the right line (slopes on *both* sides, at two scales: two close kinks with opposite slope
  changes put ``t*`` outside both, where the outer lines still agree; the near pair sees them). Kinks
  closer than ``eta`` still merge; the method's second path, in another direction, separates them;
- else the interval is split where three collinear points give both end lines afresh (a split point
  next to a kink shows a second difference and is moved).

Tolerances are relative: the value tolerance is a multiple of the answers' rounding error at the
function's scale on the segment, and every comparison of slopes divides it by the distance the slope
was measured over (an absolute tolerance would drop the kinks of short intervals).

A confirmed kink's location is then recomputed from the two *wide* secants (the whole left and right
pieces seen), which puts it within a few rounding errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...errors import ConvergenceError


@dataclass(frozen=True)
class Kink:
    """One kink on a segment: parameter ``t``, the slopes on each side, and the stretches of the
    segment known to lie on each side's piece (``left = (t0, t1)``, ``right = (t2, t3)``)."""

    t: float
    slope_left: float
    slope_right: float
    left: tuple[float, float]
    right: tuple[float, float]
    merged: bool = False       # the search could not separate it further (interval below resolution)

    @property
    def jump(self) -> float:
        return self.slope_right - self.slope_left


@dataclass
class _Line:
    t: float        # anchor
    g: float        # value at the anchor
    s: float        # slope
    h: float        # the distance the slope was measured over


def find_kinks(g: Callable[[np.ndarray], np.ndarray], *, tau: float, max_evals: int, rng: np.random.Generator,
               h0: float = 1e-3, min_width: float = 1e-11) -> tuple[list[Kink], int, dict[float, float]]:
    """All kinks of ``g`` on ``[0, 1]``.

    Args:
        g: batched evaluation ``g(ts) -> values``.
        tau: value tolerance (the answers' rounding error at the function's scale, times a margin).
        max_evals: cap on evaluations; :class:`ConvergenceError` past it.
        rng: jitters split points.
        h0: the relative spacing of the three-point line probes.
        min_width: intervals narrower than this (in t) are not split further; a kink found there is
            flagged ``merged``.

    Returns:
        ``(kinks sorted by t, evaluations spent, every evaluated point t -> value)``.
    """
    seen: dict[float, float] = {}
    spent = 0

    def ev(ts) -> np.ndarray:
        nonlocal spent
        ts = [float(t) for t in ts]
        new = [t for t in dict.fromkeys(ts) if t not in seen]
        if new:
            if spent + len(new) > max_evals:
                raise ConvergenceError(f"kink search: more than {max_evals} evaluations on one segment "
                                       "(more kinks than the cap allows, or answers that are not piecewise linear)")
            vals = g(np.array(new))
            spent += len(new)
            for t, v in zip(new, vals):
                seen[t] = float(v)
        return np.array([seen[t] for t in ts])

    def tol_line(L: _Line, t: float) -> float:
        return tau * (2.0 + 2.0 * abs(t - L.t) / L.h)

    def on_line(L: _Line, t: float, v: float, extra: float = 1.0) -> bool:
        return abs(v - (L.g + L.s * (t - L.t))) <= extra * tol_line(L, t)

    def three(c: float, h: float) -> tuple[float, float, float] | None:
        """Values at c-h, c, c+h, or None when they are not collinear (a kink inside)."""
        a, b, e = ev([c - h, c, c + h])
        if abs(a - 2 * b + e) <= 6 * tau:
            return a, b, e
        return None

    def end_line(t: float, inward: float) -> _Line:
        """The line of the piece at an end of [0, 1] (``inward`` = +1 at 0, -1 at 1)."""
        h = h0
        for _ in range(12):
            pts = [t, t + inward * h, t + inward * 2 * h]
            v = ev(pts)
            if abs(v[0] - 2 * v[1] + v[2]) <= 6 * tau:
                return _Line(t, v[0], (v[2] - v[0]) / (pts[2] - pts[0]), 2 * h)
            h /= 8
        raise ConvergenceError("kink search: no linear stretch at the end of a segment (answers not piecewise linear?)")

    def split_lines(a: float, b: float) -> tuple[float, _Line, _Line] | None:
        L = b - a
        h = max(min(h0 * L, L / 16), min_width / 4)
        for _ in range(6):
            c = a + L * (0.5 + 0.2 * (rng.random() - 0.5))
            r = three(c, h)
            if r is not None:
                s = (r[2] - r[0]) / (2 * h)
                return c, _Line(c, r[1], s, 2 * h), _Line(c, r[1], s, 2 * h)
            h /= 4
        return None

    kinks: list[Kink] = []
    La = end_line(0.0, +1.0)
    Lb = end_line(1.0, -1.0)
    stack = [(La, Lb)]
    steps = 0
    while stack:
        steps += 1
        if steps > max_evals:
            raise ConvergenceError("kink search: step cap reached")
        La, Lb = stack.pop()
        a, b = La.t, Lb.t
        L = b - a
        sec = (Lb.g - La.g) / L
        ts = 2 * tau * (1 / La.h + 1 / Lb.h)
        lin_a = abs(sec - La.s) <= 2 * tau * (2 / L + 1 / La.h)
        lin_b = abs(sec - Lb.s) <= 2 * tau * (2 / L + 1 / Lb.h)
        if lin_a and lin_b:
            continue                                    # one piece
        if L < min_width:
            if abs(La.s - Lb.s) > ts:
                tk = _meet(La, Lb, a, b)
                kinks.append(Kink(tk, La.s, Lb.s, (a, a), (b, b), merged=True))
            continue
        if abs(La.s - Lb.s) > ts:
            tk = _meet(La, Lb, None, None)
            if a + 1e-3 * L < tk < b - 1e-3 * L:
                h = max(min(h0 * L, (tk - a) / 4, (b - tk) / 4), min_width / 8)
                eta = max(1e-3 * h, min_width / 16)
                vl, vm, vr, vl2, vr2 = ev([tk - h, tk, tk + h, tk - eta, tk + eta])
                # slopes on both sides at two scales: two close kinks with opposite slope changes put t*
                # outside both, where the outer lines still agree; the near pair t* +- eta sees them
                if (on_line(La, tk - h, vl) and on_line(Lb, tk + h, vr)
                        and on_line(La, tk, vm, 4.0) and on_line(Lb, tk, vm, 4.0)
                        and on_line(La, tk - eta, vl2, 4.0) and on_line(Lb, tk + eta, vr2, 4.0)):
                    # one kink: recompute it from the wide secants of both pieces
                    sl = (vl - La.g) / (tk - h - a)
                    sr = (Lb.g - vr) / (b - tk - h)
                    tk2 = _meet(_Line(a, La.g, sl, tk - h - a), _Line(b, Lb.g, sr, b - tk - h), a, b)
                    kinks.append(Kink(tk2, sl, sr, (a, tk - h), (tk + h, b)))
                    continue
                if abs(vl - 2 * vm + vr) <= 6 * tau:       # t* is inside a piece: split there
                    s = (vr - vl) / (2 * h)
                    mid = _Line(tk, vm, s, 2 * h)
                    stack.append((La, mid))
                    stack.append((_Line(tk, vm, s, 2 * h), Lb))
                    continue
        sp = split_lines(a, b)
        if sp is None:
            raise ConvergenceError("kink search: no collinear split point in an interval (kinks closer than "
                                   "the resolution everywhere, or answers not piecewise linear)")
        c, Lc1, Lc2 = sp
        stack.append((La, Lc1))
        stack.append((Lc2, Lb))
    kinks.sort(key=lambda k: k.t)
    return kinks, spent, seen


def _meet(La: _Line, Lb: _Line, lo: float | None, hi: float | None) -> float:
    """Where two lines meet (clipped to [lo, hi] when given)."""
    ds = La.s - Lb.s
    if ds == 0:
        t = 0.5 * (La.t + Lb.t)
    else:
        t = (Lb.g - La.g + La.s * La.t - Lb.s * Lb.t) / ds
    if lo is not None:
        t = min(max(t, lo), hi)
    return float(t)
