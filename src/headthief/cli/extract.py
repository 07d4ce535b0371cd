"""``headthief extract``: run one method on one target and report what it recovered and what it cost."""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from ..errors import (BudgetExceeded, ConvergenceError, HeadthiefError, InvalidQuery, NotIdentifiable,
                      OracleError, SpecError)
from ..methods import METHODS, build_oracle, input_norm_for
from ..oracles.base import oracle_stack
from ..targets import Target, resolve


def add_arguments(e: argparse.ArgumentParser) -> None:
    """The options of ``headthief extract``."""
    e.add_argument("--target", required=True, help="target spec (see `headthief targets`)")
    e.add_argument("--method", default="exact", help=f"one of: {', '.join(METHODS)}")
    e.add_argument("--api-key", dest="api_key", default=None, metavar="KEY",
                   help="API key of an http:// target (default: the HEADTHIEF_API_KEY environment variable)")
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
    e.add_argument("--journal", "--transcript", dest="journal", metavar="PATH",
                   help="crash-proof journal (SQLite) of every answer; re-running the same command with the "
                        "same file replays what was paid for (--transcript is the old name)")
    e.add_argument("--no-check", dest="no_check", action="store_true",
                   help="skip the model check (the identities before, the fidelity verdict after)")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    # multi-head methods
    e.add_argument("--heads", default="auto", help="multihead: the number of heads, or 'auto' (default)")
    e.add_argument("--max-heads", dest="max_heads", type=int, default=16,
                   help="multihead: the most heads --heads auto accepts (default 16)")
    e.add_argument("--subspace-bases", dest="subspace_bases", metavar="FILE.npy", default=None,
                   help="multihead-subspaces: an (H, d, d_h) array of orthonormal head bases")
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


def report(target: Target, method: str, res, fidelity, args) -> dict:
    """One JSON-able row: what was recovered, the errors where the truth is known, the cost, the check."""
    from ..models.multihead import MultiHeadAttention
    if target.truth is not None and isinstance(target.truth, MultiHeadAttention) == hasattr(res, "V"):
        errs = res.errors(target.truth)
    else:
        errs = {"W_rel_err": None, "v_rel_err": None, "c_rel_err": None, "beta_abs_err": None}
    per_head = errs.pop("per_head", None)
    mc = res.check
    out = {
        "target": target.spec, "method": method, "d": res.d, "rank": res.rank, "queries": res.queries,
        **({"heads": res.heads} if hasattr(res, "heads") else {}),
        **{k: _num(v) if isinstance(v, float) else v for k, v in errs.items()},
        "fidelity_max_rel_err": _num(fidelity.max_rel_err) if fidelity else None,
        "verify_queries": fidelity.queries if fidelity else 0,
        "check_queries": mc.check_queries if mc is not None else 0,
        "queries_fresh": res.diagnostics.get("queries_fresh"),
        "queries_replayed": res.diagnostics.get("queries_replayed"),
        "oracle_calls": res.diagnostics.get("oracle_calls"),
        "seconds": round(res.seconds, 4),
        "oracle_seconds": round(float(res.diagnostics.get("oracle_seconds", 0.0)), 4),
        "model_check": mc.as_dict() if mc is not None else None,
        "seed": args.seed,
    }
    if per_head is not None:
        out["per_head"] = per_head
    for k, v in res.diagnostics.items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            out.setdefault(k, _num(v) if isinstance(v, float) else v)
    out.update({f"target_{k}": v for k, v in target.info.items()})
    return out


# The results table's first block: what was extracted, what it cost, how close it is.
HEADLINE = ("target", "method", "d", "heads", "rank", "queries", "W_rel_err", "v_rel_err", "v_dir_err", "c_rel_err",
            "beta_abs_err", "fidelity_max_rel_err", "model_check", "queries_fresh", "queries_replayed", "check_queries",
            "verify_queries", "oracle_calls", "seconds", "oracle_seconds")


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
        if k == "model_check" and isinstance(row.get(k), dict):
            mc = row[k]
            line(k, f"{mc['verdict']}: {mc['detail']}" if mc.get("detail") else mc["verdict"])
        elif k in row:
            line(k, row[k])
    for h in row.get("per_head") or []:
        line(f"  head {h['true_head']}", ", ".join(f"{k} {v:.2e}" for k, v in h.items() if isinstance(v, float)))
    rest = [k for k in row if k not in HEADLINE and k != "per_head"]
    if rest:
        print(f"{'-- diagnostics':<{width}}")
        for k in rest:
            line(k, row[k])


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: the run ends like Ctrl-C does (journal closed, a message, an exit code)."""

    def __init__(self, signum: int):
        import signal
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


def _install_signal_handlers():
    import signal

    def handler(signum, frame):
        raise Terminated(signum)

    old = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            try:
                old[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):      # not the main thread
                pass
    return old


def _restore_signal_handlers(old) -> None:
    import signal
    for sig, h in old.items():
        signal.signal(sig, h)


# The settings that change which queries a run asks: a journal resumes only a run with the same ones.
FINGERPRINT = ("d", "bias", "probes", "scales", "rank", "oversample", "solver", "measurements", "oversampling",
               "noise", "noise_mode", "sign_only", "sphere_queries", "eps_W", "W_bound", "mu", "extra_probes",
               "input_norm", "heads", "max_heads", "subspace_bases")


def fingerprint(args) -> dict:
    fp = {"target": args.target, "method": args.method, "seed": args.seed}
    for k in FINGERPRINT:
        if hasattr(args, k):
            fp[k] = getattr(args, k)
    return fp


def open_journal(args):
    """The journal the flags ask for (None without --journal); refuses another command's journal."""
    if not args.journal:
        return None
    from ..oracles.journal import Journal
    j = Journal(args.journal, fingerprint(args))
    if j.torn:
        print(f"headthief: journal {args.journal}: the last write was torn by a crash ({j.torn} bytes of an "
              "incomplete record); SQLite dropped it, the run asks that batch again", file=sys.stderr)
    return j


def cmd_extract(args) -> int:
    from ..errors import ModelMismatch
    from ..oracles.journal import JournalError
    if args.method not in METHODS:
        return _fail(2, f"unknown method {args.method!r} (known: {', '.join(METHODS)})")
    if args.budget is not None and args.budget < 0:
        return _fail(2, f"--budget must be >= 0, got {args.budget}")
    if args.verify < 0:
        return _fail(2, f"--verify must be >= 0, got {args.verify}")
    try:
        target = resolve(args.target, d=args.d, bias=args.bias, api_key=getattr(args, "api_key", None))
        journal = open_journal(args)
    except JournalError as e:
        return _fail(2, str(e))
    except SpecError as e:
        return _fail(2, str(e))
    method = METHODS[args.method]
    oracle_kw = {"budget": args.budget, "transcript": journal}
    kept = f"; the answers paid for are in the journal {args.journal}" if journal is not None else ""
    bar = _ProgressBar(None, f"{args.method} {args.target}", enabled=not args.quiet)
    old_handlers = _install_signal_handlers()
    oracle = None
    try:
        oracle = build_oracle(target, args, **oracle_kw)
        total = method.expected(target, args)
        if bar.bar is not None and total:
            bar.bar.update(bar.task, total=total)
        res = method.run(oracle, target, args, bar)
    except BudgetExceeded as e:
        return _fail(3, str(e) + kept)
    except ModelMismatch as e:
        bar.close()
        res = getattr(e, "result", None)
        if res is not None and args.json:
            print(json.dumps(report(target, args.method, res, None, args)))
        elif args.json:
            print(json.dumps({"target": target.spec, "method": args.method, "model_check": {
                "verdict": "fail", "check": e.check, "figure": _num(e.figure), "threshold": _num(e.threshold),
                "detail": str(e)}, "check_queries": oracle.queries if oracle is not None else None}))
        return _fail(5, str(e) + kept)
    except (NotIdentifiable, InvalidQuery, SpecError, ValueError) as e:
        return _fail(2, str(e))
    except (OracleError, ConvergenceError, JournalError) as e:
        return _fail(4, str(e))
    except KeyboardInterrupt:
        return _fail(130, "interrupted (Ctrl-C)" + kept + ("; re-run the same command to resume" if kept else ""))
    except Terminated as e:
        return _fail(128 + e.signum, f"terminated by {e.name}" + kept
                     + ("; re-run the same command to resume" if kept else ""))
    finally:
        bar.close()
        _restore_signal_handlers(old_handlers)
        if journal is not None:
            journal.close()
    if res.diagnostics.get("warning"):
        print(f"headthief: warning: {res.diagnostics['warning']}", file=sys.stderr)
    fidelity = None
    mc = res.check
    clean = len(oracle_stack(oracle)) == 1
    if mc is not None and mc.figure is not None and clean:
        from ..extraction.result import Fidelity
        fidelity = Fidelity(n=args.verify, queries=mc.verify_queries, max_abs_err=float("nan"), rms_true=float("nan"),
                            max_rel_err=mc.figure)
    elif args.verify > 0:
        try:
            # against the clean target (no threat-model wrapper), tokens scaled to the input-norm bound
            fidelity = res.verify(target.make_oracle(input_norm=input_norm_for(args)), args.verify,
                                  rng=np.random.default_rng(10_000 + args.seed))
        except HeadthiefError as e:
            print(f"headthief: verification skipped: {e}", file=sys.stderr)
    if args.save:
        res.save(args.save)
    row = report(target, args.method, res, fidelity, args)
    from ..oracles.http import HTTPOracle
    inner = oracle_stack(oracle)[-1]
    if isinstance(inner, HTTPOracle):
        row["http"] = inner.stats()
    if journal is not None:
        row["journal_replayed"] = inner.replayed
        row["journal_sent"] = inner.fresh
        row["transcript_replayed"], row["transcript_sent"] = inner.replayed, inner.fresh   # the old names
    if args.json:
        print(json.dumps(row))
    else:
        print_table(row)
    return 0
