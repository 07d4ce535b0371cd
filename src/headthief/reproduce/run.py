"""Run the claims' experiments through the sweep engine and write the report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import SpecError
from .claims import EXPERIMENTS
from .engine import run_sweep
from .report import write_report


@dataclass(frozen=True)
class ReproduceResult:
    out: Path
    files: dict
    verdicts: dict          # experiment name -> verdict
    reused: int
    computed: int
    failed: int
    seconds: float


def select(only: list[str] | None):
    if not only:
        return list(EXPERIMENTS)
    names = {e.name for e in EXPERIMENTS}
    wanted = [w.strip() for item in only for w in item.split(",") if w.strip()]
    bad = [w for w in wanted if w not in names]
    if bad:
        raise SpecError(f"unknown experiment(s) {', '.join(bad)}; choose from {', '.join(e.name for e in EXPERIMENTS)}")
    return [e for e in EXPERIMENTS if e.name in wanted]


def reproduce(out: Path | str, *, quick: bool = False, only: list[str] | None = None, scheduler: str = "processes",
              workers: int | None = None, progress: Callable | None = None, command: str = "headthief reproduce"
              ) -> ReproduceResult:
    """Run the selected experiments (resuming finished tasks from ``out/tasks``) and write the report."""
    out = Path(out)
    exps = select(only)
    tasks = {e.name: e.tasks(quick) for e in exps}
    flat = [t for e in exps for t in tasks[e.name]]
    summary = run_sweep(flat, store=out / "tasks" / ("quick" if quick else "full"), scheduler=scheduler,
                        workers=workers, progress=progress)
    by_exp: dict = {}
    for r in summary.records:
        by_exp.setdefault(r["experiment"], []).append(r)
    findings = []
    for e in exps:
        recs = by_exp.get(e.name, [])
        try:
            f = e.judge(recs) if any(r.get("value") is not None for r in recs) else None
        except Exception as exc:  # a judge that cannot read its records is itself reported
            from .claims import Finding
            f = Finding(f"the measurements could not be judged: {type(exc).__name__}: {exc}", "not measured")
        if f is None:
            from .claims import Finding
            f = Finding("every task failed (errors below)", "not measured")
        findings.append((e, f, recs))
    line = (f"{len(flat)} tasks: {summary.computed} computed, {summary.reused} reused from an earlier run, "
            f"{summary.failed} failed; scheduler {summary.scheduler}")
    files = write_report(out, findings, quick=quick, command=command, summary_line=line)
    return ReproduceResult(out=out, files=files, verdicts={e.name: f.verdict for e, f, _ in findings},
                           reused=summary.reused, computed=summary.computed, failed=summary.failed,
                           seconds=summary.seconds)
