"""``headthief extract``: run one method on one target and report what it recovered and what it cost."""

from __future__ import annotations

import argparse
import json
import sys
import time


from ..methods import METHODS
from ..models.activations import SMOOTH
from ..pipeline import DEFAULTS as D
from .target_options import add_target_arguments


def _ln_eps_arg(text: str) -> float | str:
    """``--ln-eps``: a number or ``auto`` (its range is checked with the other options, before any query)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number (e.g. 1e-5) or auto, got {text!r}") from None


def add_arguments(e: argparse.ArgumentParser) -> None:
    """The options of ``headthief extract``."""
    add_target_arguments(e)
    e.add_argument("--causal", action="store_true", default=D.causal,
                   help="the py: target is causal (each position attends to itself and earlier ones); --method "
                        "vector then recovers a causal layer, also from --output last answers, where the mask "
                        "cannot be seen (with --output all it is checked: a contradiction is exit 5)")
    e.add_argument("--method", default=D.method,
                   help=f"auto (default: chosen from the target and the answers) or one of: {', '.join(METHODS)}")
    e.add_argument("--seed", type=int, default=D.seed, help="seed of the extraction's own randomness (>= 0; default 0)")
    e.add_argument("--budget", type=int, default=D.budget,
                   help="most queries sent to the target in all (one query = one sequence): the extraction, the "
                        "model check and the verification (default: no limit)")
    e.add_argument("--blas-threads", dest="blas_threads", type=int, default=D.blas_threads, metavar="N",
                   help="BLAS threads while extracting (default 1: more gain nothing here and contend with other "
                        "jobs on a busy machine; 0 leaves BLAS's own setting)")
    e.add_argument("--save", metavar="OUT.npz", help="write the recovered W, v (c, beta) with numpy.savez; --method "
                   "vector: OUT.safetensors writes the layer in transformers' BertSelfAttention + BertSelfOutput.dense "
                   "naming (load it with headthief.models.bert_export.load_bert_attention)")
    e.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
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
    e.add_argument("--heads", default="auto", help="multihead, vector, block: the number of heads, or 'auto' (default)")
    e.add_argument("--ffn", type=int, default=None, metavar="M",
                   help="block: the FFN's width (default: what the target publishes, e.g. bert-block:ffn=M)")
    e.add_argument("--layers", type=int, default=None, metavar="L",
                   help="encoder: the number of blocks (default: what the target publishes, e.g. "
                        "bert-encoder:layers=L; for a py: encoder answering every layer's hidden states, "
                        "--d-out / --d - 1)")
    e.add_argument("--stage-f", dest="stage_f", default="auto", choices=("auto", "full", "probes"),
                   help="block: stage F from full tangent Jacobians or from probe Jacobians (a quarter of the "
                        "queries or fewer from d = 64 at ffn = 4 d); auto (default) takes probes where they save that")
    e.add_argument("--activation", default="gelu", choices=(*SMOOTH, "auto"),
                   help="block, encoder: the FFN's activation the method assumes: gelu (BERT's exact, erf form; the "
                        "default), "
                        "gelu_tanh (transformers' gelu_new / gelu_pytorch_tanh: GPT-2, ALBERT), silu, quick_gelu. A "
                        "block whose answers another explains is refused (exit 5), as a ReLU block is. auto (block, "
                        "free inputs): each class fitted at stage F (and, in float32, refitted), the best kept")
    e.add_argument("--ln-eps", dest="ln_eps", type=_ln_eps_arg, default=None, metavar="E|auto",
                   help="block, encoder: the LayerNorms' eps, e.g. 1e-5 (RoBERTa, XLM-R; default: BERT's 1e-12). "
                        "The stages' algebra leaves an eps out, so above 1e-10 its figures are a start at float32's "
                        "precision and the block fits fit the answers with the eps (on free inputs fitted from this "
                        "value; held on a LayerNorm's image and in --method encoder). auto: measured from the "
                        "answers (free inputs: stage L's distance from LN2's ellipsoid, then fitted; encoder: "
                        "stage E fits LN_emb's eps from inputs_embeds that nearly cancel the position offsets)")
    e.add_argument("--max-tflop", dest="max_tflop", type=float, default=D.max_tflop, metavar="T",
                   help="block, encoder: the most arithmetic (TFLOP) the stages after V may plan (default 100: at most "
                        "hours on a 2-core machine); above it a block on free inputs stops after stage V with LN2, B "
                        "and b and the plan, a block on a LayerNorm's image is refused before the first query, and "
                        "--method encoder reads only the parts it can without a block; exit 2 (MiniLM's blocks in "
                        "float32: about 4,300; its whole encoder: about 180,000)")
    e.add_argument("--refit-device", dest="refit_device", default=None, metavar="DEV",
                   help="block: where the two refits' losses run: numpy (default), cpu (torch), cuda or cuda:N (a "
                        "GPU: the refits are most of a MiniLM block's arithmetic)")
    e.add_argument("--max-len", dest="max_len", type=int, default=D.max_len, metavar="N",
                   help="rope: the longest query the extraction sends, in tokens (default 16)")
    e.add_argument("--verify-len", dest="verify_len", type=int, default=D.verify_len, metavar="N",
                   help="rope: the model check's fresh sequences have 1 to N tokens (default 64: longer than any "
                        "extraction query, the test of length generalisation)")
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


LOG_EVERY = 60.0     # seconds between progress lines when stderr is not a terminal (a log file, nohup)


class _ProgressBar:
    """A rich progress bar on stderr when stderr is a terminal; otherwise (a log file) plain timestamped lines:
    one when a method's stage changes, and at most one every ``LOG_EVERY`` seconds in between (the queries
    so far, a long fit's evaluation), so a run of hours shows it is alive in its log."""

    def __init__(self, total: int | None, label: str, enabled: bool, *, clock=time.monotonic):
        self.bar = None
        self.count = 0
        self.label = label
        self.log = enabled and not sys.stderr.isatty()
        self.clock = clock
        self.stage: str | None = None
        self.text = ""
        self.last = clock()
        self.total = total
        if enabled and not self.log:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task(label, total=total)
            self.bar.start()

    def set_total(self, total: int | None) -> None:
        if total:
            self.total = int(total)
            if self.bar is not None:
                self.bar.update(self.task, total=total)

    def shrink(self, n: int) -> None:
        """A stage sent ``n`` fewer queries than the planned total counted (stage A's float32 reads at the
        levels its pilot chose): the bar's total comes down by them, so it ends full."""
        if self.total and n > 0:
            self.set_total(max(self.total - int(n), self.count, 1))

    def describe(self, text: str) -> None:
        """What the run is doing now, beside the bar (a method's stages, a long fit's evaluations)."""
        if self.bar is not None:
            self.bar.update(self.task, description=f"{self.label}: {text}")
        elif self.log:
            self.text = text
            stage = text.split(",")[0]
            if stage != self.stage or self.clock() - self.last >= LOG_EVERY:
                self.stage = stage
                self._line()

    def _line(self) -> None:
        self.last = self.clock()
        now = f"{self.text}, " if self.text else ""
        print(f"{time.strftime('%H:%M:%S')} headthief {self.label}: {now}{self.count:,} queries",
              file=sys.stderr, flush=True)

    def __call__(self, n: int) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(self.task, advance=n)
        elif self.log and self.clock() - self.last >= LOG_EVERY:
            self._line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _fail(code: int, msg: str) -> int:
    print(f"headthief: {msg}", file=sys.stderr)
    return code


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
        line(f"  head {h.get('true_head', h.get('head'))}", ", ".join(f"{k} {v:.2e}" for k, v in h.items() if isinstance(v, float)))
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


def cmd_extract(args) -> int:
    """``headthief extract``: the pipeline (:func:`headthief.pipeline.extract`) with a progress bar, the
    row printed as a table or one JSON object, and the exit code of how it ended."""
    import dataclasses

    from ..pipeline import Options, extract
    kw = dataclasses.asdict(Options.from_namespace(args, **({"blas_threads": None} if args.blas_threads == 0 else {})))
    del kw["target"], kw["method"]
    kept = f"; the answers paid for are in the journal {args.journal}" if args.journal else ""
    bar = _ProgressBar(None, f"{args.method} {args.target}", enabled=not args.quiet)
    old_handlers = _install_signal_handlers()
    try:
        rep = extract(args.target, args.method, progress=bar, raise_errors=False, **kw)
    except KeyboardInterrupt:
        return _fail(130, "interrupted (Ctrl-C)" + kept + ("; re-run the same command to resume" if kept else ""))
    except Terminated as e:
        return _fail(128 + e.signum, f"terminated by {e.name}" + kept
                     + ("; re-run the same command to resume" if kept else ""))
    finally:
        bar.close()
        _restore_signal_handlers(old_handlers)
    for w in rep.warnings:
        print(f"headthief: warning: {w}", file=sys.stderr)
    row = dict(rep.row)
    if args.json:                       # one JSON object, whatever the outcome (the exit code says how it ended)
        print(json.dumps({**row, "exit": rep.exit_code, "status": rep.status}))
    elif rep.result is not None:
        print_table(row)
    if rep.exit_code != 0:
        msg = rep.error or rep.status
        if rep.exit_code in (3, 5) and kept:
            msg += kept
        return _fail(rep.exit_code, msg)
    return 0
