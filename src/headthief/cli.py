"""Command line: ``headthief extract``, ``headthief targets``.

Exit codes: 0 done; 2 not identifiable or bad input (one line on stderr); 3 query budget exceeded
(stderr says how many queries were spent); 4 the oracle failed or a bounded procedure did not
converge; 130 interrupted (the transcript, if one was asked for, is saved first).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import __version__
from .errors import (BudgetExceeded, ConvergenceError, HeadthiefError, InvalidQuery, NotIdentifiable,
                     OracleError, SpecError)
from .extraction.result import Extraction
from .oracles.base import Oracle, WrappedOracle
from .oracles.transcript import Transcript
from .targets import Target, describe, resolve


@dataclass(frozen=True)
class Method:
    """A CLI method: ``run(oracle, target, args, progress) -> Extraction``; ``expected`` gives the
    planned query count (for the progress bar), or None when it is not known in advance."""

    run: Callable[..., Extraction]
    expected: Callable[[Target, argparse.Namespace], int | None]
    help: str


def _run_exact(oracle, target, args, progress):
    from .extraction.single.exact import extract_exact
    return extract_exact(oracle, probes=args.probes, bias=target.bias, scales=args.scales,
                         rng=np.random.default_rng(args.seed), progress=progress)


def _expected_exact(target, args):
    from .extraction.single.exact import exact_query_count
    return exact_query_count(target.d, bias=target.bias)


def _noisy_settings(target, args, *, need: bool):
    """W bound and margin for the noisy methods: --W-bound / --mu, else the target spec's W_norm / v_min."""
    W_bound = args.W_bound if args.W_bound is not None else target.info.get("W_norm")
    mu = args.mu if args.mu is not None else target.info.get("v_min")
    if need and W_bound is None:
        raise SpecError(f"--method {args.method} needs --W-bound W (the known bound on ||W||_F, W >= 2); "
                        "random: targets with W_norm= set it")
    if need and mu is None:
        raise SpecError(f"--method {args.method} needs --mu M (the margin: every non-zero |v_i| >= M); "
                        "random: targets with v_min= set it")
    return W_bound, mu


def _run_noisy_paper(oracle, target, args, progress):
    from .extraction.robust.noisy_paper import extract_noisy_paper
    if target.bias:
        raise SpecError("noisy-paper is Theorem 6.1 for the paper's model (no biases); use --method noisy")
    W_bound, mu = _noisy_settings(target, args, need=True)
    return extract_noisy_paper(oracle, W_bound=W_bound, mu=mu, progress=progress)


def _expected_noisy_paper(target, args):
    from .extraction.robust.noisy_paper import noisy_paper_query_count
    return noisy_paper_query_count(target.d)


def _run_noisy(oracle, target, args, progress):
    from .extraction.robust.noisy import extract_noisy
    W_bound, _ = _noisy_settings(target, args, need=False)
    return extract_noisy(oracle, tau=noise_tau(args), W_bound=W_bound, bias=target.bias,
                         extra=args.extra_probes, rng=np.random.default_rng(args.seed), progress=progress)


def _expected_noisy(target, args):
    from .extraction.robust.noisy import noisy_query_count
    return noisy_query_count(target.d, bias=target.bias, extra=args.extra_probes)


def _membership_paper_settings(target, args):
    """Theorem B.1's known constants: --W-bound / --mu, else the random: spec's W_norm and v_min / v_norm."""
    W_bound = args.W_bound if getattr(args, "W_bound", None) is not None else target.info.get("W_norm")
    mu = getattr(args, "mu", None)
    if mu is None and target.info.get("v_min") is not None:
        mu = target.info["v_min"] / target.info.get("v_norm", 1.0)   # the theorem normalises ||v|| = 1
    if W_bound is None or mu is None:
        raise SpecError("--method membership-paper needs Theorem B.1's known constants: --W-bound W (>= 2, "
                        "a bound on ||W||_F) and --mu M (min |v_i| / ||v||); random: targets with W_norm=, "
                        "v_min= (and v_norm=) set them")
    return max(2.0, float(W_bound)), float(mu)


def _run_membership_paper(oracle, target, args, progress):
    from .extraction.robust.membership_paper import extract_membership_paper
    if target.bias:
        raise SpecError("membership-paper is Theorem B.1 for the paper's model (no biases); use --method membership")
    W_bound, mu = _membership_paper_settings(target, args)
    k = args.sphere_queries if args.sphere_queries is not None else 64 * target.d ** 2
    return extract_membership_paper(oracle, W_bound=W_bound, mu=mu, eps_W=args.eps_W, k=k,
                                    rng=np.random.default_rng(args.seed), progress=progress)


def _expected_membership_paper(target, args):
    from .extraction.robust.membership_paper import paper_query_count
    try:
        W_bound, mu = _membership_paper_settings(target, args)
    except SpecError:
        return None
    k = args.sphere_queries if args.sphere_queries is not None else 64 * target.d ** 2
    return paper_query_count(target.d, k, args.eps_W, mu, W_bound)


def _membership_bias(target, args) -> bool:
    # a rounding API read through its sign answers [f > 0.5 * 10**-K]: an output-bias shift, so the
    # biased variant (which recovers the threshold) is used
    return bool(target.bias or (args.noise_mode or "").startswith("round:"))


def _run_membership(oracle, target, args, progress):
    from .extraction.robust.membership import extract_membership
    return extract_membership(oracle, bias=_membership_bias(target, args), rng=np.random.default_rng(args.seed),
                              progress=progress)


def _expected_membership(target, args):
    from .extraction.robust.membership import membership_query_bound
    return membership_query_bound(target.d, bias=_membership_bias(target, args))


def _rank_arg(args) -> int | None:
    """--rank for lowrank/rop: an integer, or None for 'auto'."""
    if args.rank is None or str(args.rank).strip().lower() == "auto":
        return None
    try:
        return int(args.rank)
    except ValueError:
        raise SpecError(f"--rank must be an integer or 'auto', got {args.rank!r}") from None


def _run_lowrank(oracle, target, args, progress):
    from .extraction.single.lowrank import extract_lowrank
    return extract_lowrank(oracle, rank=_rank_arg(args), bias=target.bias, oversample=args.oversample,
                           scales=args.scales, rng=np.random.default_rng(args.seed), progress=progress)


def _expected_lowrank(target, args):
    from .extraction.single.lowrank import lowrank_query_count
    r = _rank_arg(args)
    if r is None or not 1 <= r <= target.d or (args.oversample is not None and args.oversample < 0):
        return None     # rank auto: not known in advance (bad settings: the method says why)
    return lowrank_query_count(target.d, r, bias=target.bias, oversample=args.oversample or 0)


def _run_rop(oracle, target, args, progress):
    from .extraction.single.rop import extract_rop
    return extract_rop(oracle, rank=_rank_arg(args), measurements=args.measurements,
                       oversampling=args.oversampling, solver=args.solver, bias=target.bias,
                       scales=args.scales, rng=np.random.default_rng(args.seed), progress=progress)


def _expected_rop(target, args):
    from .extraction.single.rop import rop_query_count
    r = _rank_arg(args)
    if r is None or not 1 <= r <= target.d:
        return None
    try:
        return rop_query_count(target.d, r, measurements=args.measurements, oversampling=args.oversampling,
                               solver=args.solver, bias=target.bias)
    except ValueError:
        return None


METHODS: dict[str, Method] = {
    "exact": Method(_run_exact, _expected_exact,
                    "Theorem 4.1: d^2 + d queries (d^2 + 2d + 1 with biases), exact recovery"),
    "lowrank": Method(_run_lowrank, _expected_lowrank,
                      "adaptive sketches W B, A^T W: d + r(2d - r) queries for rank r (--rank R|auto, "
                      "--oversample K)"),
    "rop": Method(_run_rop, _expected_rop,
                  "Theorem 5.1: d + m Gaussian rank-one measurements (--rank R, --solver als|convex, "
                  "--measurements M or --oversampling C)"),
    "noisy-paper": Method(_run_noisy_paper, _expected_noisy_paper,
                          "Theorem 6.1 as stated: d + d^2 queries, answers within +-tau (needs --W-bound, --mu)"),
    "noisy": Method(_run_noisy, _expected_noisy,
                    "answers within +-tau: probes chosen for the sigmoid inversion, d + d^2 queries"),
    "membership-paper": Method(_run_membership_paper, _expected_membership_paper,
                               "Theorem B.1 as stated: sign-only answers, k sphere queries for v + d^2 "
                               "bisections (needs --W-bound, --mu; its probes need --input-norm > 1)"),
    "membership": Method(_run_membership, _expected_membership,
                         "sign-only answers: bisection for v's direction and every W entry, about 42 (d^2 + d) queries"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headthief", description="Recover attention-head parameters from black-box queries.")
    p.add_argument("--version", action="version", version=f"headthief {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("extract", help="extract a head from a target and report errors and cost")
    e.add_argument("--target", required=True, help="target spec (see `headthief targets`)")
    e.add_argument("--method", default="exact", help=f"one of: {', '.join(METHODS)}")
    e.add_argument("--seed", type=int, default=0, help="seed of the extraction's own randomness (default 0)")
    e.add_argument("--budget", type=int, default=None, help="most queries the oracle may answer")
    e.add_argument("--save", metavar="OUT.npz", help="write the recovered W, v (c, beta) with numpy.savez")
    e.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    e.add_argument("--d", type=int, default=None, help="token dimension (py: targets)")
    e.add_argument("--bias", action="store_true", help="the py: target may have score/output biases")
    e.add_argument("--probes", choices=["basis", "gaussian"], default="basis",
                   help="probe design for exact: the paper's e_l / e_l+e_p probes, or Gaussian probes")
    e.add_argument("--scales", choices=["adaptive", "unit"], default="adaptive",
                   help="probe scales: chosen from the answers (default) or the paper's unit probes")
    e.add_argument("--verify", type=int, default=256, metavar="N",
                   help="fidelity check on N fresh random sequences (0 to skip; default 256)")
    e.add_argument("--transcript", metavar="PATH.npz",
                   help="keep every answer here; re-running with the same file replays what was paid for")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    # low-rank methods (lowrank, rop)
    e.add_argument("--rank", default="auto", help="rank of W for lowrank/rop: an integer or 'auto' (default)")
    e.add_argument("--oversample", type=int, default=None, metavar="K",
                   help="lowrank: extra sketch columns with a rank-truncated core (default: auto, 0 for float64)")
    e.add_argument("--solver", choices=["convex", "als"], default="als", help="rop: solver for the rank-one measurements")
    e.add_argument("--measurements", type=int, default=None, metavar="M", help="rop: number of rank-one measurements")
    e.add_argument("--oversampling", type=float, default=None, metavar="C",
                   help="rop: measurements as a multiple C of the degrees of freedom r(2d - r)")
    # threat models: what the oracle returns
    e.add_argument("--noise", type=float, default=None, metavar="TAU", help="answers within +-TAU of the truth")
    e.add_argument("--noise-mode", default=None,
                   help="adversarial (+-TAU, default) | uniform | round:K (rounding to K decimals, implies TAU)")
    e.add_argument("--sign-only", action="store_true",
                   help="the oracle answers only 1 if f(X) > 0 else 0 (implied by the membership methods)")
    e.add_argument("--sphere-queries", type=int, default=None, metavar="K",
                   help="membership-paper: random sphere queries for v (default 64 d^2)")
    e.add_argument("--eps-W", dest="eps_W", type=float, default=0.1, metavar="EPS",
                   help="membership-paper: target ||W_hat - W||_F, sets the bisection accuracy (default 0.1)")
    e.add_argument("--W-bound", dest="W_bound", type=float, default=None, metavar="W",
                   help="noisy-paper/noisy: known bound on ||W||_F (default: the random: spec's W_norm)")
    e.add_argument("--mu", type=float, default=None, metavar="M",
                   help="noisy-paper: margin, every non-zero |v_i| >= M (default: the random: spec's v_min)")
    e.add_argument("--extra-probes", type=int, default=0, metavar="K",
                   help="noisy: K extra probes per column, solved by least squares (default 0)")
    e.add_argument("--input-norm", type=float, default=None, metavar="R",
                   help="the oracle refuses tokens with ||x|| > R (noisy/membership methods default to R = 1)")

    sub.add_parser("targets", help="list the available target kinds")

    b = sub.add_parser("bench", help="run a benchmark job and print its table")
    jobs = b.add_subparsers(dest="job", required=True)
    from . import bench_real
    bench_real.add_arguments(jobs.add_parser(
        "real", help="extract all 72 heads of all-MiniLM-L6-v2 (and one head per black-box module)"))
    return p


class _ProgressBar:
    """A rich progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, total: int | None, label: str, enabled: bool):
        self.bar = None
        self.count = 0
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task(label, total=total)
            self.bar.start()

    def __call__(self, n: int) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(self.task, advance=n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _fail(code: int, msg: str) -> int:
    print(f"headthief: {msg}", file=sys.stderr)
    return code


def _num(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def report(target: Target, method: str, res: Extraction, fidelity, args) -> dict:
    errs = res.errors(target.truth) if target.truth is not None else {
        "W_rel_err": None, "v_rel_err": None, "c_rel_err": None, "beta_abs_err": None}
    out = {
        "target": target.spec, "method": method, "d": res.d, "rank": res.rank, "queries": res.queries,
        **{k: _num(v) for k, v in errs.items()},
        "fidelity_max_rel_err": _num(fidelity.max_rel_err) if fidelity else None,
        "verify_queries": fidelity.queries if fidelity else 0,
        "seconds": round(res.seconds, 4),
        "seed": args.seed,
    }
    for k, v in res.diagnostics.items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            out.setdefault(k, _num(v) if isinstance(v, float) else v)
    out.update({f"target_{k}": v for k, v in target.info.items()})
    return out


# The results table's first block: what was extracted, what it cost, how close it is.
HEADLINE = ("target", "method", "d", "rank", "queries", "W_rel_err", "v_rel_err", "v_dir_err", "c_rel_err",
            "beta_abs_err", "fidelity_max_rel_err", "verify_queries", "seconds")


def print_table(row: dict) -> None:
    """The results first, then the method's diagnostics and what the target says about itself."""
    width = max(len(k) for k in row)

    def line(k, v):
        if isinstance(v, float):
            v = f"{v:.3e}" if (v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6)) else f"{v:.6g}"
        elif isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
            v = f"{v:,}"
        print(f"{k:<{width}}  {'-' if v is None else v}")

    for k in HEADLINE:
        if k in row:
            line(k, row[k])
    rest = [k for k in row if k not in HEADLINE]
    if rest:
        print(f"{'-- diagnostics':<{width}}")
        for k in rest:
            line(k, row[k])


# Methods whose oracle has an input-norm bound by default (R = 1): under noise, a bound on ||x_i|| is
# what keeps additive noise from being made negligible just by scaling the inputs up (Section 6).
NORM_BOUND_METHODS = {"noisy-paper", "noisy", "membership-paper", "membership"}
# Methods that read only the sign of each answer: --sign-only is implied for them.
SIGN_ONLY_METHODS = {"membership-paper", "membership"}


def input_norm_for(args) -> float | None:
    """The input-norm bound R: ``--input-norm``, else 1 for the noisy/membership methods, else none."""
    if args.input_norm is not None:
        if not (math.isfinite(args.input_norm) and args.input_norm > 0):
            raise SpecError(f"--input-norm must be a positive number, got {args.input_norm}")
        return float(args.input_norm)
    return 1.0 if args.method in NORM_BOUND_METHODS else None


def noise_tau(args) -> float:
    """The tolerance the oracle's answers have: ``--noise``, or ``0.5 * 10**-K`` for round:K, else 0."""
    from .oracles.tolerance import parse_mode, round_tolerance
    if args.noise_mode is not None:
        kind, K = parse_mode(args.noise_mode)
        if kind == "round":
            return round_tolerance(K)
    return float(args.noise) if args.noise is not None else 0.0


def build_oracle(target: Target, args, **oracle_kw) -> Oracle:
    """The oracle stack the flags ask for, innermost first.

    1. the target's oracle, with the budget, transcript and the input-norm bound R (``--input-norm``);
    2. ``Tolerance`` (``--noise TAU --noise-mode MODE``; ``--noise-mode round:K`` alone implies TAU);
    3. ``SignOnly`` (``--sign-only``), outermost.
    """
    from .oracles.tolerance import Tolerance, parse_mode
    oracle = target.make_oracle(input_norm=input_norm_for(args), **oracle_kw)
    if args.noise is not None and not (math.isfinite(args.noise) and args.noise >= 0):
        raise SpecError(f"--noise must be a number >= 0, got {args.noise}")
    if args.noise_mode is not None:
        kind, _ = parse_mode(args.noise_mode)
        if kind != "round" and args.noise is None:
            raise SpecError(f"--noise-mode {args.noise_mode} needs --noise TAU")
        oracle = Tolerance(oracle, args.noise, args.noise_mode)
    elif args.noise is not None:
        oracle = Tolerance(oracle, args.noise, "adversarial")
    if args.sign_only or args.method in SIGN_ONLY_METHODS:  # Appendix B's membership oracle, outermost
        if args.method not in SIGN_ONLY_METHODS:
            raise SpecError(f"--sign-only: the oracle answers only 0/1, which --method {args.method} cannot use; "
                            f"use --method {' or '.join(sorted(SIGN_ONLY_METHODS))}")
        from .oracles.sign_only import SignOnly
        oracle = SignOnly(oracle)
    return oracle


def cmd_extract(args) -> int:
    if args.method not in METHODS:
        return _fail(2, f"unknown method {args.method!r} (known: {', '.join(METHODS)})")
    if args.budget is not None and args.budget < 0:
        return _fail(2, f"--budget must be >= 0, got {args.budget}")
    try:
        target = resolve(args.target, d=args.d, bias=args.bias)
    except SpecError as e:
        return _fail(2, str(e))
    method = METHODS[args.method]
    transcript = None
    if args.transcript:
        from pathlib import Path
        transcript = Transcript.load(args.transcript) if Path(args.transcript).exists() else Transcript()
    oracle_kw = {"budget": args.budget, "transcript": transcript}
    bar = _ProgressBar(None, f"{args.method} {args.target}", enabled=not args.quiet)
    try:
        oracle = build_oracle(target, args, **oracle_kw)
        total = method.expected(target, args)
        if bar.bar is not None and total:
            bar.bar.update(bar.task, total=total)
        res = method.run(oracle, target, args, bar)
    except BudgetExceeded as e:
        return _fail(3, str(e) + (f"; their answers are saved in {args.transcript}" if transcript is not None else ""))
    except (NotIdentifiable, InvalidQuery, SpecError, ValueError) as e:
        return _fail(2, str(e))
    except (OracleError, ConvergenceError) as e:
        return _fail(4, str(e))
    except KeyboardInterrupt:
        return _fail(130, "interrupted" + (f"; answers so far saved in {args.transcript}" if transcript is not None else ""))
    finally:
        bar.close()
        if transcript is not None:
            transcript.save(args.transcript)
    if res.diagnostics.get("warning"):
        print(f"headthief: warning: {res.diagnostics['warning']}", file=sys.stderr)
    fidelity = None
    if args.verify > 0:
        try:
            # against the clean target (no noise wrapper), tokens scaled to the input-norm bound
            fidelity = res.verify(target.make_oracle(input_norm=input_norm_for(args)), args.verify, rng=np.random.default_rng(10_000 + args.seed))
        except HeadthiefError as e:
            print(f"headthief: verification skipped: {e}", file=sys.stderr)
    if args.save:
        res.save(args.save)
    row = report(target, args.method, res, fidelity, args)
    if transcript is not None:
        # what this run paid for versus what the transcript already held
        o = oracle
        while o.transcript is None and isinstance(o, WrappedOracle):
            o = o.inner
        row["transcript_replayed"] = o.replayed
        row["transcript_sent"] = o.fresh
    if args.json:
        print(json.dumps(row))
    else:
        print_table(row)
    return 0


def cmd_targets(args) -> int:
    rows = describe()
    width = max(len(s) for s, _ in rows)
    for syntax, desc in rows:
        print(f"{syntax:<{width}}  {desc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "extract":
        return cmd_extract(args)
    if args.command == "targets":
        return cmd_targets(args)
    if args.command == "bench" and args.job == "real":
        from . import bench_real
        return bench_real.run(args)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
