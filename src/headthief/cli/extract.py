"""``headthief extract``: run one method on one target and report what it recovered and what it cost."""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from ..errors import (BudgetExceeded, ConvergenceError, HeadthiefError, InvalidQuery, NotIdentifiable,
                      OracleError, SpecError)
from ..extraction.result import Extraction
from ..methods import METHODS, build_oracle, input_norm_for
from ..oracles.base import WrappedOracle
from ..oracles.transcript import Transcript
from ..targets import Target, resolve


def add_arguments(e: argparse.ArgumentParser) -> None:
    """The options of ``headthief extract``."""
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
