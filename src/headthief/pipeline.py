"""One extraction, end to end: ``headthief.extract(target, method="auto", **options) -> Report``.

This is what ``headthief extract`` does, as a library call that the command line, ``reproduce``,
``audit``, ``bench`` and users all share:

1. settings are validated (a bad option is a :class:`SpecError` naming it), output paths (``save``,
   ``journal``) are checked *before the first query*;
2. the target (a spec string such as ``"minilm:layer=2,head=5"``, a :class:`~headthief.targets.Target`,
   or any :class:`~headthief.oracles.base.Oracle`) becomes an oracle stack: the budget, the journal and
   the input-norm bound innermost, then the threat-model wrappers (``noise``, ``noise_mode``,
   ``sign_only``);
3. the method runs under the model check (the identities before, the fidelity verdict after);
4. the recovered model is verified on fresh sequences (``verify``), *inside the same query budget*:
   the budget bounds every query sent (extraction, check, verification);
5. the report row (the JSON object ``headthief extract --json`` prints) is built, and the result saved.

``method="auto"`` picks the method that suits the target (see :func:`auto_method`).

Exit codes (``Report.exit_code``, the command's status): 0 done; 2 bad settings, not identifiable or
refused; 3 the query budget ran out; 4 the oracle failed or a bounded procedure did not converge; 5
the target did not behave like the assumed model (the model check failed); 6 the result could not be
written (it is in the report and printed).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import numpy as np

from .errors import (BudgetExceeded, ComputeLimit, ConvergenceError, HeadthiefError, InvalidQuery, ModelMismatch,
                     NotIdentifiable, OracleError, SpecError)
from .extraction.precision import finite_or_none
from .heap import keep_freed_memory
from .oracles.base import Oracle, oracle_stack
from .targets import Target

EXIT_OK, EXIT_SETTINGS, EXIT_BUDGET, EXIT_ORACLE, EXIT_MISMATCH, EXIT_WRITE = 0, 2, 3, 4, 5, 6
EXIT_MEANING = {EXIT_OK: "extracted", EXIT_SETTINGS: "refused / not identifiable", EXIT_BUDGET: "budget spent",
                EXIT_ORACLE: "did not converge", EXIT_MISMATCH: "model check failed",
                EXIT_WRITE: "extracted, not written"}


@dataclass(frozen=True)
class Options:
    """Every setting of one extraction (the options of ``headthief extract``, same names and defaults).

    General: ``seed`` (the method's own randomness), ``budget`` (most queries sent in all: extraction,
    check and verification), ``verify`` (fresh sequences for the fidelity), ``check`` (the model check),
    ``journal`` (a crash-proof SQLite journal path), ``save`` (``.npz`` output), ``blas_threads`` (BLAS
    threads while extracting; default 1, see :func:`blas_limit`). Target: ``d``, ``bias``, ``output``,
    ``d_out``, ``causal`` (``py:`` targets; ``causal`` also for an oracle, read by ``vector`` only),
    ``api_key`` (``http://`` targets). Method settings: ``probes``, ``scales`` (exact),
    ``rank`` (lowrank, rop, multihead), ``oversample`` (lowrank), ``solver``, ``measurements``,
    ``oversampling`` (rop), ``heads``, ``max_heads`` (multi-head and transformer methods),
    ``subspace_bases`` (multihead-subspaces), ``sphere_queries``, ``eps_W`` (membership-paper),
    ``W_bound``, ``mu`` (noisy-paper, noisy, membership-paper), ``extra_probes`` (noisy). Threat models:
    ``noise``, ``noise_mode``, ``sign_only``, ``input_norm``.
    """

    target: str = ""
    method: str = "auto"
    seed: int = 0
    budget: int | None = None
    verify: int = 256
    check: bool = True
    journal: str | None = None
    save: str | None = None
    blas_threads: int | None = 1
    d: int | None = None
    bias: bool = False
    output: str | None = None         # a py: target's answer kind (value, last, all)
    d_out: int | None = None          # and its answer vectors' dimension
    causal: bool = False              # a py: target (or an oracle) declared causal, for --method vector
    api_key: str | None = None
    probes: str = "basis"
    scales: str = "adaptive"
    heads: str = "auto"
    ffn: int | None = None
    layers: int | None = None         # encoder: the number of blocks, where the target does not publish it
    stage_f: str = "auto"
    max_tflop: float = 100.0          # extraction.block.arithmetic.MAX_TFLOP (not imported here: import stays light)
    refit_device: str | None = None   # block: a torch device for the refits (extraction.block.torch_losses)
    activation: str = "gelu"          # block, encoder: the FFN's activation (models.activations.SMOOTH)
    ln_eps: float | str | None = None   # block, encoder: the LayerNorms' eps (None: BERT's 1e-12; "auto": measured)
    max_len: int = 16
    verify_len: int = 64
    max_heads: int = 16
    subspace_bases: str | None = None
    rank: str = "auto"
    oversample: int | None = None
    solver: str = "als"
    measurements: int | None = None
    oversampling: float | None = None
    noise: float | None = None
    noise_mode: str | None = None
    sign_only: bool = False
    sphere_queries: int | None = None
    eps_W: float = 0.1
    W_bound: float | None = None
    mu: float | None = None
    extra_probes: int = 0
    input_norm: float | None = None

    @property
    def no_check(self) -> bool:          # the methods' registry reads the CLI's name
        return not self.check

    @classmethod
    def from_namespace(cls, ns, **override) -> "Options":
        """The options an ``argparse`` namespace (``headthief extract``'s) carries."""
        kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        if hasattr(ns, "no_check"):
            kw["check"] = not ns.no_check
        kw.update(override)
        return cls(**kw)


DEFAULTS = Options()

# Method-specific settings: the methods that read each one. A setting changed from its default for a
# method that ignores it is refused (a silent no-op misleads).
SETTING_METHODS: dict[str, set[str]] = {
    "probes": {"exact"},
    "rank": {"lowrank", "rop", "multihead"},
    "oversample": {"lowrank"},
    "solver": {"rop"}, "measurements": {"rop"}, "oversampling": {"rop"},
    "heads": {"multihead", "multihead-hessian", "transformer-paper", "transformer", "vector", "block", "rope",
              "encoder"},
    "ffn": {"block", "encoder"}, "layers": {"encoder"}, "stage_f": {"block"}, "max_tflop": {"block", "encoder"},
    "refit_device": {"block"}, "activation": {"block", "encoder"}, "ln_eps": {"block", "encoder"},
    "max_len": {"rope"}, "verify_len": {"rope"},
    "max_heads": {"multihead", "transformer-paper", "transformer"},
    "subspace_bases": {"multihead-subspaces"},
    "sphere_queries": {"membership-paper"}, "eps_W": {"membership-paper"},
    "W_bound": {"noisy-paper", "noisy", "membership-paper"},
    "mu": {"noisy-paper", "membership-paper"},
    "extra_probes": {"noisy"},
    "causal": {"vector", "rope"},   # rope: always causal; the declaration is checked like the rest
}


@dataclass(frozen=True)
class Report:
    """What one extraction gave: the JSON row, the result object, and how it ended.

    Attributes:
        row: the report row (what ``headthief extract --json`` prints): target, method, queries, the
            parameter errors where the truth is known, the fidelity, the model check, the cost keys.
        result: the frozen extraction result (None when the run ended before one was made).
        exit_code: the command's exit status (0 done; see the module docstring).
        status: a word for the exit code (``extracted``, ``model check failed``, ...).
        error: the message of the error that ended the run (None on success).
        warnings: what the run warned about (verification skipped, a method's own warning).
        seconds: wall time of the whole call.
    """

    row: Mapping[str, Any]
    result: Any = None
    exit_code: int = 0
    status: str = "extracted"
    error: str | None = None
    warnings: tuple[str, ...] = ()
    seconds: float = 0.0
    target: Target | None = field(default=None, repr=False, compare=False)
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "row", MappingProxyType(dict(self.row)))

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def queries(self) -> int | None:
        return self.row.get("queries")

    def __getitem__(self, key: str) -> Any:
        return self.row[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.row.get(key, default)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.row)


# --------------------------------------------------------------------------------------------- choosing


def auto_method(target: Target, opts: Options) -> str:
    """The method ``method="auto"`` runs: what the answers allow first, then what the target is.

    Sign-only answers (``sign_only``, or an API that publishes ``sign``): ``membership``; answers within a
    tolerance (``noise``, ``noise_mode``, an API publishing ``noisy:TAU`` / ``rounded:K``): ``noisy``; a
    one-layer transformer: ``transformer``; an FFN: ``ffn``; several heads: ``multihead``; a head whose W
    has low rank (``rank=`` below d) or a real head (MiniLM, d = 384, rank 32): ``lowrank``; else
    ``exact`` (Theorem 4.1).
    """
    from .methods import published_output
    out = published_output(target)
    if getattr(target, "output", "value") in ("last", "all"):
        kind = target.spec.split(":", 1)[0]
        if kind in ("bert-block", "minilm-block", "minilm-block-hf"):
            return "block"
        if kind in ("bert-encoder", "minilm-encoder"):
            return "encoder"
        return "rope" if kind in ("rope-mha", "llama-attn") and target.output == "all" else "vector"
    if opts.sign_only or out == "sign":
        return "membership"
    if opts.noise is not None or opts.noise_mode is not None or out.startswith(("noisy:", "rounded:")):
        return "noisy"
    kind = target.spec.split(":", 1)[0]
    if "transformer" in kind:
        return "transformer"
    if kind == "ffn":
        return "ffn"
    from .models.multihead import MultiHeadAttention
    if isinstance(target.truth, MultiHeadAttention) or target.info.get("heads", 1) not in (None, 1) \
            or kind in ("multihead", "minilm-layer", "minilm-layer-hf"):
        return "multihead"
    true_rank = target.info.get("true_rank")
    if kind.startswith("minilm") or (true_rank is not None and true_rank < target.d):
        return "lowrank"
    return "exact"


# --------------------------------------------------------------------------------------------- checks


def check_output_path(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before any query, an output path that cannot be written: a missing or read-only folder,
    or a path that is a folder."""
    p = Path(path)
    if p.is_dir():
        raise SpecError(f"{what} {path}: is a directory (give a file path)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise SpecError(f"{what} {path}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise SpecError(f"{what} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise SpecError(f"{what} {path}: not writable")
    return p


def saved_path(path: str | os.PathLike) -> Path:
    """Where ``numpy.savez`` writes ``path`` (it adds ``.npz`` when missing)."""
    p = Path(path)
    return p if p.suffix in (".npz", ".safetensors") else p.with_name(p.name + ".npz")


def validate(opts: Options, methods: Mapping[str, Any]) -> None:
    """Refuse bad settings before anything is built or asked, naming the option."""
    if opts.method != "auto" and opts.method not in methods:
        raise SpecError(f"unknown method {opts.method!r} (known: auto, {', '.join(methods)})")
    if opts.seed < 0:
        raise SpecError(f"--seed must be >= 0, got {opts.seed}")
    if opts.budget is not None and opts.budget < 0:
        raise SpecError(f"--budget must be >= 0, got {opts.budget}")
    if opts.verify < 0:
        raise SpecError(f"--verify must be >= 0, got {opts.verify}")
    if opts.d is not None and opts.d < 1:
        raise SpecError(f"--d must be >= 1, got {opts.d}")
    if opts.blas_threads is not None and opts.blas_threads < 1:
        raise SpecError(f"--blas-threads must be >= 1, got {opts.blas_threads}")
    if opts.max_heads < 1:
        raise SpecError(f"--max-heads must be >= 1, got {opts.max_heads}")
    for name in ("ffn", "layers"):
        if getattr(opts, name) is not None and getattr(opts, name) < 1:
            raise SpecError(f"--{name} must be >= 1, got {getattr(opts, name)}")
    if opts.max_len < 4:
        raise SpecError(f"--max-len must be >= 4 (--method rope reads two offsets at least), got {opts.max_len}")
    if opts.verify_len < 1:
        raise SpecError(f"--verify-len must be >= 1, got {opts.verify_len}")
    if opts.stage_f not in ("auto", "full", "probes"):
        raise SpecError(f"--stage-f must be auto, full or probes, got {opts.stage_f!r}")
    if opts.activation != "gelu":
        from .models.activations import SMOOTH
        if opts.activation not in (*SMOOTH, "auto"):
            raise SpecError(f"--activation must be one of {', '.join(SMOOTH)} or auto, got {opts.activation!r}")
    if opts.ln_eps is not None:
        from .extraction.block.extract import ln_eps_named
        ln_eps_named(opts.ln_eps)
    if not opts.max_tflop > 0:                 # NaN too
        raise SpecError(f"--max-tflop must be > 0, got {opts.max_tflop}")
    if opts.refit_device not in (None, "numpy"):
        from .extraction.block.torch_losses import check_device
        check_device(opts.refit_device)            # a bad name, no torch, no CUDA: refused before any query
    if opts.save:
        check_output_path(saved_path(opts.save), "--save")
    if opts.journal:
        check_output_path(opts.journal, "--journal")


def check_settings_apply(opts: Options, method: str) -> None:
    """A method setting changed from its default for a method that does not read it is refused."""
    if opts.causal and method not in ("vector", "rope"):      # rope assumes a causal layer and checks it
        raise SpecError(f"--causal does not apply to --method {method}: it declares the mask of a layer that "
                        "answers with vectors, for --method vector (a py: target with --output last|all); "
                        f"--method {method} models no mask: it reads one number per sequence, the last token's, "
                        "and the last token attends to every token with or without one")
    unused = [k for k, ms in SETTING_METHODS.items()
              if method not in ms and getattr(opts, k) != getattr(DEFAULTS, k)]
    if unused:
        names = ", ".join("--" + k.replace("_", "-") for k in unused)
        users = sorted(set().union(*(SETTING_METHODS[k] for k in unused)))
        raise SpecError(f"{names} does not apply to --method {method} (used by: {', '.join(users)})")


def check_d(target: Target, opts: Options) -> None:
    """``--d`` given with a target that fixes d itself must agree with it."""
    if opts.d is not None and int(opts.d) != int(target.d):
        raise SpecError(f"--d {opts.d} disagrees with the target {target.spec}, whose tokens have d = {target.d}; "
                        f"leave --d out (it is for py: targets) or make it {target.d}")


def refuse_by_output(target: Target, method: str) -> None:
    """An API whose published answers are bits cannot serve a value method: refuse before the first query."""
    from .methods import SIGN_ONLY_METHODS, VECTOR_METHODS, published_output
    vector = getattr(target, "output", "value") in ("last", "all")
    if vector and method not in VECTOR_METHODS:
        raise SpecError(f"{target.spec} answers with vectors (output={target.output}, d_out={target.d_out}); "
                        f"--method {method} reads one number per sequence: use --method vector")
    if not vector and method in VECTOR_METHODS:
        raise SpecError(f"--method {method} needs vector answers (a hidden-state API); {target.spec} answers one "
                        "number per sequence (a scalar readout), from which the heads' output spaces cannot be "
                        "seen: use --method multihead (or give a vector target: output=last|all, or py: --output)")
    if published_output(target) == "sign" and method not in SIGN_ONLY_METHODS:
        raise SpecError(f"the target publishes sign-only answers ({target.spec}: output 'sign'), which --method "
                        f"{method} cannot use; use --method {' or '.join(sorted(SIGN_ONLY_METHODS))}")


class blas_limit:
    """Limit the BLAS threads while extracting (``threadpoolctl``, when installed).

    One thread is the default: the methods issue many small and medium products, where more threads
    gain nothing on an idle machine and, on a machine where another job runs, contend (measured: d = 384
    exact 17.3 s with the default threads vs 1.9 s with one; d = 4096 lowrank 678 s vs 67 s). ``None``
    leaves BLAS as it is. Without threadpoolctl nothing is limited (``applied`` False)."""

    def __init__(self, threads: int | None):
        self.threads, self.ctl, self.applied = threads, None, False

    def __enter__(self):
        if self.threads is None:
            return self
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return self
        self.ctl = threadpool_limits(limits=int(self.threads), user_api="blas")
        self.applied = True
        return self

    def __exit__(self, *exc):
        if self.ctl is not None:
            self.ctl.restore_original_limits()
        return False


def _as_target(target, opts: Options) -> Target:
    """A spec string, a Target, or an Oracle (used as the innermost oracle: it keeps its own budget)."""
    from .targets import TARGET_KINDS, resolve
    declared = {"causal": True} if opts.causal else {}
    if isinstance(target, Target):
        kind = target.spec.partition(":")[0]
        if opts.causal and (kind in TARGET_KINDS or kind in ("http", "https")):
            raise SpecError(f"causal=True declares a py: black box (or your own oracle or Target) causal; "
                            f"{target.spec} is a {kind}: target, whose kind states its mask in the spec "
                            "(mha:...,causal=1) or has it detected from answers at every position")
        return dataclasses.replace(target, info={**target.info, **declared}) if declared else target
    if isinstance(target, Oracle):
        oracle = target

        def make(**kw):
            return oracle
        vector = {"output": oracle.output.value, "d_out": oracle.d_out} if oracle.output.vector else {}
        return Target(spec=f"oracle:{type(oracle).__name__}", d=oracle.d, bias=bool(opts.bias), make_oracle=make,
                      info={"oracle": repr(oracle), **declared}, **vector)
    if not isinstance(target, str):
        raise SpecError(f"target must be a spec string, a Target or an Oracle, got {type(target).__name__}")
    try:
        return resolve(target, d=opts.d, bias=opts.bias, api_key=opts.api_key, output=opts.output, d_out=opts.d_out,
                       causal=opts.causal)
    except MemoryError:
        raise SpecError(f"{target}: not enough memory to build this target (its parameters do not fit in this "
                        "machine's memory; choose a smaller d)") from None


def _exit_code(exc: BaseException) -> int:
    from .oracles.journal import JournalError
    if isinstance(exc, BudgetExceeded):
        return EXIT_BUDGET
    if isinstance(exc, ModelMismatch):
        return EXIT_MISMATCH
    if isinstance(exc, (NotIdentifiable, ComputeLimit, InvalidQuery, SpecError, ValueError)):
        return EXIT_SETTINGS
    if isinstance(exc, (OracleError, ConvergenceError, JournalError)):
        return EXIT_ORACLE
    if isinstance(exc, MemoryError):
        return EXIT_SETTINGS
    return EXIT_ORACLE


# --------------------------------------------------------------------------------------------- the row


def _comparable(res, truth) -> bool:
    """Whether ``res.errors(truth)`` is defined: the truth is of the model class the method recovers
    (a head for single-head results, a MultiHeadAttention for multi-head ones, a CanonicalLayer for the
    vector method). A truth of another class (a RoPE layer, a whole BERT block given to a method that
    assumes less) has no parameter-wise comparison: the row's errors stay None and the model check says
    how the target behaved."""
    if truth is None:
        return False
    from .extraction.block.extract import BlockExtraction, BlockParts
    from .extraction.rope import RopeExtraction
    from .extraction.vector import VectorExtraction
    from .models.bert_block import BertBlock
    from .models.mha import CanonicalLayer
    from .models.multihead import MultiHeadAttention
    if isinstance(res, VectorExtraction):
        return isinstance(truth, CanonicalLayer)
    if isinstance(res, BlockParts):
        # stopped after stage V: LN2, B and b, which no activation enters (--activation auto records "auto" there)
        return isinstance(truth, BertBlock)
    if isinstance(res, BlockExtraction):
        # the FFN's activation is part of the class: the one the method assumed (--activation), GELU by default
        return isinstance(truth, BertBlock) and truth.activation == res.diagnostics.get("activation", "gelu")
    from .extraction.block.encoder import EncoderExtraction
    from .extraction.block.encoder_parts import EncoderParts
    if isinstance(res, (EncoderExtraction, EncoderParts)):
        from .models.bert_block import Encoder
        # the blocks' activation is part of the class where blocks are recovered (EncoderParts reads none)
        return isinstance(truth, Encoder) and (isinstance(res, EncoderParts) or all(
            b.activation == res.diagnostics.get("activation", "gelu") for b in truth.blocks))
    if isinstance(res, RopeExtraction):
        from .models.rope import RopeAttention
        return isinstance(truth, RopeAttention)
    return isinstance(truth, MultiHeadAttention) == hasattr(res, "V")


def report_row(target: Target, method: str, res, fidelity, seed: int) -> dict:
    """One JSON-able row: what was recovered, the errors where the truth is known, the cost, the check."""
    if _comparable(res, target.truth):
        errs = res.errors(target.truth)
    else:
        errs = {"W_rel_err": None, "v_rel_err": None, "c_rel_err": None, "beta_abs_err": None}
    per_head = errs.pop("per_head", None)
    mc = res.check
    if fidelity is not None:
        fid = finite_or_none(fidelity.max_rel_err)
    elif mc is not None and mc.figure is not None and mc.verdict in ("pass", "fail", "inconclusive"):
        fid = finite_or_none(mc.figure)
    else:
        fid = None
    out = {
        "target": target.spec, "method": method, "d": res.d, "rank": res.rank, "queries": res.queries,
        **({"heads": res.heads} if hasattr(res, "heads") else {}),
        **{k: finite_or_none(v) if isinstance(v, float) else v for k, v in errs.items()},
        "fidelity_max_rel_err": fid,
        "verify_queries": fidelity.queries if fidelity else (mc.verify_queries if mc is not None else 0),
        "check_queries": mc.check_queries if mc is not None else 0,
        "queries_fresh": res.diagnostics.get("queries_fresh"),
        "queries_replayed": res.diagnostics.get("queries_replayed"),
        "oracle_calls": res.diagnostics.get("oracle_calls"),
        "seconds": round(res.seconds, 4),
        "oracle_seconds": round(float(res.diagnostics.get("oracle_seconds", 0.0)), 4),
        "model_check": mc.as_dict() if mc is not None else None,
        "seed": seed,
    }
    if per_head is not None:
        out["per_head"] = per_head
    for k, v in res.diagnostics.items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            out.setdefault(k, finite_or_none(v) if isinstance(v, float) else v)
    out.update({f"target_{k}": v for k, v in target.info.items()})
    return out


def _failed_fidelity(exc: BaseException) -> float | None:
    """The fidelity that failed a model check (``fidelity``, ``fidelity next to kinks``), else None."""
    if isinstance(exc, ModelMismatch) and "fidelity" in str(exc.check):
        return finite_or_none(exc.figure)
    return None


def _failure_row(target: Target | None, spec: str, method: str, exc: BaseException, oracle, budget) -> dict:
    row: dict[str, Any] = {"target": target.spec if target is not None else spec, "method": method}
    if isinstance(exc, ModelMismatch):
        row["model_check"] = {"verdict": "fail", "check": exc.check, "figure": finite_or_none(exc.figure),
                              "threshold": finite_or_none(exc.threshold), "detail": str(exc)}
        if _failed_fidelity(exc) is not None:
            row["fidelity_max_rel_err"] = _failed_fidelity(exc)
    if oracle is not None:
        row["queries_sent"] = oracle_stack(oracle)[-1].queries
        if isinstance(exc, ModelMismatch):      # stopped by the identities, before the method asked anything
            row["check_queries"] = row["queries_sent"]
    if isinstance(exc, BudgetExceeded):
        row["budget"] = budget
    row["error"] = str(exc)
    return row


# --------------------------------------------------------------------------------------------- the call


def extract(target, method: str = "auto", *, progress: Callable[[int], None] | None = None,
            wrap: Callable[[Oracle], Oracle] | None = None, raise_errors: bool = True, **options) -> Report:
    """Run one extraction the way ``headthief extract`` does and return its :class:`Report`.

    Args:
        target: a target spec (``"random:d=64,seed=1"``, ``"minilm:layer=2,head=5"``, ``"http://..."``;
            ``headthief targets`` lists them), a :class:`~headthief.targets.Target`, or an oracle.
        method: a method name (``headthief extract --help``), or ``"auto"`` (:func:`auto_method`).
        progress: called with the number of queries of each answered batch; an object with a
            ``set_total(n)`` method is told the planned count first, when it is known.
        wrap: wraps the oracle stack outermost (an observer, e.g. a detector watching the queries).
        raise_errors: raise the typed error that ended a failed run (with ``.report`` attached); with
            False, return the report with its ``exit_code`` and ``error`` instead.
        **options: the settings of :class:`Options` (``seed``, ``budget``, ``verify``, ``journal``, ...).

    Example:
        >>> import headthief as ht
        >>> r = ht.extract("random:d=8,seed=1", method="exact", verify=16)
        >>> r.queries, r.ok
        (72, True)
    """
    from .methods import METHODS
    t0 = time.perf_counter()
    unknown = set(options) - {f.name for f in dataclasses.fields(Options)}
    if unknown:
        raise TypeError(f"extract() got unknown option(s): {', '.join(sorted(unknown))}")
    spec = target if isinstance(target, str) else getattr(target, "spec", type(target).__name__)
    opts = Options(target=spec, method=method, **options)
    tgt = oracle = None
    res = None
    journal = None
    warnings: list[str] = []
    opening = True          # settings, target and journal: a JournalError here is a bad --journal (exit 2)
    try:
        validate(opts, METHODS)
        tgt = _as_target(target, opts)
        check_d(tgt, opts)
        name = auto_method(tgt, opts) if method == "auto" else method
        opts = dataclasses.replace(opts, method=name)
        check_settings_apply(opts, name)
        refuse_by_output(tgt, name)
        journal = _open_journal(opts, warnings)
        opening = False
        m = METHODS[name]
        heap = keep_freed_memory()
        with blas_limit(opts.blas_threads) as blas:
            oracle = _build(tgt, opts, journal)
            if wrap is not None:
                oracle = wrap(oracle)
            if progress is not None and hasattr(progress, "set_total"):
                progress.set_total(m.expected(tgt, opts))
            res = m.run(oracle, tgt, opts, progress, clean=lambda: _clean_oracle(tgt, opts, oracle, journal))
            if res.diagnostics.get("warning"):
                warnings.append(str(res.diagnostics["warning"]))
            fidelity = _verify(res, tgt, opts, oracle, journal, warnings)
        row = report_row(tgt, name, res, fidelity, opts.seed)
        row["blas_threads"] = opts.blas_threads if blas.applied else None
        row["heap_thresholds_set"] = heap
        if method == "auto":
            row["method_requested"] = "auto"
        _transport(row, oracle, journal)
    except (HeadthiefError, ValueError, MemoryError) as exc:
        numpy_error = exc if isinstance(exc, np.linalg.LinAlgError) else None
        if numpy_error is not None:                 # numpy's bare "Singular matrix" says nothing to a user
            exc = NotIdentifiable(f"a linear solve inside the {opts.method} method failed (numpy.linalg: "
                                  f"{numpy_error}): the target is a degenerate case for this method's algebra")
        code = EXIT_SETTINGS if opening and isinstance(exc, HeadthiefError) else _exit_code(exc)
        partial = getattr(exc, "result", None)
        if partial is not None and tgt is not None:
            row = report_row(tgt, opts.method, partial, None, opts.seed)
            row["error"] = str(exc)
            if oracle is not None:
                row["queries_sent"] = oracle_stack(oracle)[-1].queries
                _transport(row, oracle, journal)        # a partial result's journal counts too
            if _failed_fidelity(exc) is not None:
                row["fidelity_max_rel_err"] = _failed_fidelity(exc)     # the figure that failed the check
        else:
            row = _failure_row(tgt, spec, opts.method, exc, oracle, opts.budget)
        if opts.journal and isinstance(exc, (BudgetExceeded, ModelMismatch, OracleError)):
            row["journal"] = opts.journal
        status = EXIT_MEANING.get(code, f"exit {code}")
        if code == EXIT_ORACLE and not isinstance(exc, ConvergenceError):
            status = "the oracle failed"             # exit 4 covers both: a wrong-shaped answer did not "converge"
        rep = Report(row=row, result=partial, exit_code=code, status=status,
                     error=str(exc), warnings=tuple(warnings), seconds=time.perf_counter() - t0, target=tgt,
                     exception=exc)
        if raise_errors:
            exc.report = rep
            if numpy_error is not None:
                raise exc from numpy_error
            raise
        return rep
    finally:
        if journal is not None:
            journal.close()
    code, err = EXIT_OK, None
    if opts.save:
        try:
            res.save(opts.save)
            row["saved"] = str(saved_path(opts.save))
        except (OSError, ValueError) as exc:      # the finished result is kept in the report all the same
            code, err = EXIT_WRITE, f"--save {opts.save}: could not write the result ({exc}); it is in the report"
            row["save_error"] = err
    rep = Report(row=row, result=res, exit_code=code, status=EXIT_MEANING[code], error=err,
                 warnings=tuple(warnings), seconds=time.perf_counter() - t0, target=tgt)
    if raise_errors and code != EXIT_OK:
        exc = OSError(err)
        exc.report = rep
        raise exc
    return rep


def _open_journal(opts: Options, warnings: list[str]):
    if not opts.journal:
        return None
    from .oracles.journal import Journal
    j = Journal(opts.journal, fingerprint(opts))
    if j.torn:
        warnings.append(f"journal {opts.journal}: the last write was torn by a crash ({j.torn} bytes of an "
                        "incomplete record); SQLite dropped it, the run asks that batch again")
    return j


# The settings that change which queries a run asks: a journal resumes only a run with the same ones.
FINGERPRINT = ("d", "bias", "probes", "scales", "rank", "oversample", "solver", "measurements", "oversampling",
               "noise", "noise_mode", "sign_only", "sphere_queries", "eps_W", "W_bound", "mu", "extra_probes",
               "input_norm", "heads", "max_heads", "subspace_bases", "ffn", "max_len", "verify_len")


def fingerprint(opts: Options) -> dict:
    fp = {"target": opts.target, "method": opts.method, "seed": opts.seed}
    for k in FINGERPRINT:
        fp[k] = getattr(opts, k)
    for k in ("output", "d_out", "layers"):  # only when given: journals written before they existed still resume
        if getattr(opts, k) is not None:
            fp[k] = getattr(opts, k)
    if opts.stage_f != "auto":              # likewise
        fp["stage_f"] = opts.stage_f
    if opts.activation != "gelu":           # likewise (stage F's checkpoints hold neurons fitted with it)
        fp["activation"] = opts.activation
    if opts.ln_eps is not None:             # likewise (stage L's check and the precision the stages assume)
        from .extraction.block.extract import ln_eps_named
        fp["ln_eps"] = ln_eps_named(opts.ln_eps)      # a float, or "auto"
    # (not causal: with answers at the last position it changes no query, only the recovered layer's mask; with
    # every position's answer a declaration is either what stage A detects or refused there)
    return fp


def _build(tgt: Target, opts: Options, journal) -> Oracle:
    from .methods import build_oracle
    return build_oracle(tgt, opts, budget=opts.budget, transcript=journal)


def _remaining(opts: Options, oracle: Oracle) -> int | None:
    if opts.budget is None:
        return None
    return max(0, opts.budget - oracle_stack(oracle)[-1].queries)


def _clean_oracle(tgt: Target, opts: Options, oracle: Oracle, journal) -> Oracle:
    """The target without threat-model wrappers, tokens under the input-norm bound, inside what is left of
    the budget, its answers journaled: what verification queries go to."""
    from .methods import input_norm_for
    inner = oracle_stack(oracle)[-1]
    if tgt.spec.startswith("oracle:"):       # a user's oracle: its own counters and budget
        return inner
    return tgt.make_oracle(input_norm=input_norm_for(opts), budget=_remaining(opts, oracle), transcript=journal)


def _verify(res, tgt: Target, opts: Options, oracle: Oracle, journal, warnings: list[str]):
    """The fidelity on fresh sequences: the model check's own figure when it was measured on the clean
    target; else ``verify`` fresh sequences on the clean target, within the budget left."""
    from .extraction.result import Fidelity
    mc = res.check
    clean = len(oracle_stack(oracle)) == 1
    if mc is not None and mc.figure is not None and clean:
        return Fidelity(n=opts.verify, queries=mc.verify_queries, max_abs_err=float("nan"), rms_true=float("nan"),
                        max_rel_err=mc.figure)
    if opts.verify <= 0:
        return None
    n = opts.verify
    left = _remaining(opts, oracle)
    if left is not None and left < n:
        if left <= 0:
            warnings.append(f"verification skipped: the budget of {opts.budget} queries is spent")
            return None
        warnings.append(f"verification on {left} fresh sequences, not {n}: what the budget leaves")
        n = left
    try:
        return res.verify(_clean_oracle(tgt, opts, oracle, journal), n, rng=np.random.default_rng(10_000 + opts.seed))
    except HeadthiefError as e:
        warnings.append(f"verification skipped: {e}")
        return None


def _transport(row: dict, oracle: Oracle, journal) -> None:
    from .oracles.http import HTTPOracle
    inner = oracle_stack(oracle)[-1]
    if isinstance(inner, HTTPOracle):
        row["http"] = inner.stats()
    if journal is not None:
        row["journal_replayed"] = inner.replayed
        row["journal_sent"] = inner.fresh
        row["transcript_replayed"], row["transcript_sent"] = inner.replayed, inner.fresh   # the old names
