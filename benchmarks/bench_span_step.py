"""One step of stage F's span iteration on the probe route (``ffn._structured``) at a chosen size, timed:
what a block run at all-MiniLM-L6-v2's size (d = 384, FFN 1536) pays per step (``arithmetic.SPAN_STEPS`` of
them), split into its parts.

The data are random (the step's cost does not depend on them): T unit rows of d x p probe derivatives, the
points' LN2 directions, and the points themselves, laid out as :mod:`.ffn_probes` draws them: S inside the
probes' span, the rest orthogonal to it (``--layout narrow``, the library's), or every point anywhere on the
sphere (``--layout wide``, as the route was first built: every point then carries a (p + d - 1)-wide nuisance).

    .venv/bin/python benchmarks/bench_span_step.py                       # MiniLM's size, the library's layout
    .venv/bin/python benchmarks/bench_span_step.py --layout wide         # as first built (413 s, one core)
    .venv/bin/python benchmarks/bench_span_step.py --d 64 --ffn 256

Prints the seconds of the step's top principal subspace of the lifted matrices (:func:`.ffn.top_subspace`;
the route as first built took a thin SVD there) and of the points' nuisance solves, and the planned
operations (:func:`headthief.extraction.block.arithmetic.planned`).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief.extraction.block import arithmetic
from headthief.extraction.block.ffn import _structured, top_subspace
from headthief.extraction.block.ffn_probes import inside_count, probe_count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--layout", choices=("narrow", "wide"), default="narrow")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    d, ffn = args.d, args.ffn
    rng = np.random.default_rng(args.seed)
    p, S, T, r = probe_count(d, ffn), inside_count(d, ffn), 5 * (ffn + 1), ffn + 1
    E = np.linalg.svd(np.eye(d) - 1.0 / d)[0][:, :d - 1]
    V = np.linalg.qr(E @ rng.standard_normal((d - 1, p)))[0]
    ms = E @ rng.standard_normal((d - 1, T))
    ms = ms.T
    if args.layout == "narrow":
        ms[S:] -= (ms[S:] @ V) @ V.T
    ms[:S] = rng.standard_normal((S, p)) @ V.T
    ms /= np.linalg.norm(ms, axis=1, keepdims=True)
    ns = E @ rng.standard_normal((d - 1, T))
    ns = (ns / np.linalg.norm(ns, axis=0)).T
    Y = rng.standard_normal((T, d * p))
    Y /= np.linalg.norm(Y, axis=1, keepdims=True)
    timings = {}

    def lift(nu):
        return Y

    step = _structured(Y, ns, ms @ V, E, r, lift)
    nu = np.zeros((T, p + d - 1))
    t0 = time.perf_counter()
    top_subspace(Y, r)
    timings["subspace"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(nu)
    timings["step"] = time.perf_counter() - t0
    plan = arithmetic.planned(d, ffn, probes=True, coarse=False)["F span"] / arithmetic.SPAN_STEPS
    print(f"d {d}, ffn {ffn}: T {T} points ({S} inside the probes' span), p {p}, rank {r}, layout {args.layout}")
    print(f"step {timings['step']:.1f} s: top subspace {timings['subspace']:.1f} s, nuisance solves "
          f"{timings['step'] - timings['subspace']:.1f} s; planned {plan / 1e12:.3g} TFLOP a step "
          f"({plan / 1e9 / timings['step']:.3g} GFLOPS)")


if __name__ == "__main__":
    main()
