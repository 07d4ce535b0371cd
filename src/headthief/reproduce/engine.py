"""One sweep engine for experiments, ``audit`` and ``bench real``: independent tasks run serially, on a
dask LocalCluster on this machine, or on an existing dask scheduler, with identical numbers.

* A :class:`Task` names an importable function (``"package.module:function"``) and JSON parameters. It
  is called as ``fn(params, rng)`` with ``rng = numpy.random.default_rng(task_seed(task))``: the seed comes
  from ``numpy.random.SeedSequence`` keyed by the task (experiment and key), never by the worker, so a
  serial run, a local cluster and a remote cluster give bit-identical values. BLAS runs single-threaded
  inside a task (``threadpoolctl``) for the same reason.
* Every finished task is written to ``OUT/tasks/<id>.json`` atomically (a temporary file, then
  ``os.replace``) as soon as it finishes, so a run killed at any point and started again recomputes no
  finished task (:class:`SweepSummary` says how many it reused).
* A task that raises is recorded with its parameters and the error; the others go on.

``scheduler``: ``"serial"`` (this process), ``"processes"`` (a ``distributed.LocalCluster`` of worker
processes on 127.0.0.1, the default) or ``"tcp://HOST:PORT"`` (an existing ``dask scheduler``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import SpecError

SCHEDULERS = ("serial", "processes")


@dataclass(frozen=True)
class Task:
    """One independent unit of a sweep: ``fn(params, rng)`` returns a JSON-able dict."""

    experiment: str
    key: str
    fn: str
    params: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        blob = json.dumps([self.experiment, self.key, self.fn, self.params], sort_keys=True, default=str)
        return hashlib.blake2b(blob.encode(), digest_size=10).hexdigest()


def task_seed(task: Task) -> np.random.SeedSequence:
    """The task's seed: a SeedSequence keyed by (experiment, key), the same on every machine."""
    digest = hashlib.blake2b(f"{task.experiment}/{task.key}".encode(), digest_size=16).digest()
    return np.random.SeedSequence(int.from_bytes(digest, "little"))


def _resolve(fn: str) -> Callable:
    mod, _, name = fn.partition(":")
    if not name:
        raise SpecError(f"task function must be 'module:function', got {fn!r}")
    return getattr(importlib.import_module(mod), name)


def run_task(task: Task) -> dict:
    """Run one task here (also what a dask worker runs). Never raises: errors are recorded."""
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"id": task.id, "experiment": task.experiment, "key": task.key, "fn": task.fn,
                           "params": task.params}
    try:
        try:
            from threadpoolctl import threadpool_limits
            single_blas = threadpool_limits(1)
        except ImportError:            # pragma: no cover - threadpoolctl is in the sweep extra
            single_blas = contextlib.nullcontext()
        rng = np.random.default_rng(task_seed(task))
        with single_blas:
            value = _resolve(task.fn)(dict(task.params), rng)
        rec["value"] = json.loads(json.dumps(value, default=_jsonable))
        rec["error"] = None
    except Exception as exc:  # a failing task must not sink the others
        rec["value"] = None
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc(limit=6)
    rec["seconds"] = round(time.perf_counter() - t0, 4)
    return rec


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.bool_):
        return bool(x)
    raise TypeError(f"not JSON-able: {type(x).__name__}")


@dataclass(frozen=True)
class SweepSummary:
    """What a sweep did: records in task order, and how many were reused, computed, failed."""

    records: list
    reused: int
    computed: int
    failed: int
    scheduler: str
    seconds: float


class TaskStore:
    """Finished tasks as one JSON file each under ``root`` (atomic writes; damaged files are redone)."""

    def __init__(self, root: Path | str | None):
        self.root = None if root is None else Path(root)
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    def path(self, task: Task) -> Path | None:
        return None if self.root is None else self.root / f"{task.id}.json"

    def load(self, task: Task) -> dict | None:
        p = self.path(task)
        if p is None or not p.exists():
            return None
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        if rec.get("id") != task.id or rec.get("error"):
            return None           # failed tasks are retried on the next run
        return rec

    def save(self, rec: dict) -> None:
        if self.root is None:
            return
        p = self.root / f"{rec['id']}.json"
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as fh:
            json.dump(rec, fh, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)


def check_scheduler(scheduler: str) -> str:
    s = str(scheduler).strip()
    if s in SCHEDULERS or s.startswith("tcp://"):
        return s
    raise SpecError(f"--scheduler must be 'serial', 'processes' or a dask scheduler address tcp://HOST:PORT, "
                    f"got {scheduler!r}")


def run_sweep(tasks: list[Task], *, store: Path | str | None = None, scheduler: str = "processes",
              workers: int | None = None, progress: Callable[[int, int, dict], None] | None = None
              ) -> SweepSummary:
    """Run ``tasks`` (skipping those already in ``store``) and return every record in task order.

    ``progress(done, total, record)`` is called after each task (reused ones included).
    """
    scheduler = check_scheduler(scheduler)
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        dup = next(t for t in tasks if ids.count(t.id) > 1)
        raise SpecError(f"two tasks share experiment/key/params: {dup.experiment} {dup.key}")
    st = TaskStore(store)
    t0 = time.perf_counter()
    done: dict[str, dict] = {}
    for t in tasks:
        rec = st.load(t)
        if rec is not None:
            done[t.id] = rec
    reused = len(done)
    total = len(tasks)
    count = 0
    if progress is not None:
        for t in tasks:
            if t.id in done:
                count += 1
                progress(count, total, done[t.id])
    todo = [t for t in tasks if t.id not in done]

    def finish(rec):
        nonlocal count
        st.save(rec)
        done[rec["id"]] = rec
        count += 1
        if progress is not None:
            progress(count, total, rec)

    if todo:
        if scheduler == "serial":
            for t in todo:
                finish(run_task(t))
        else:
            _run_dask(todo, scheduler, workers, finish)
    records = [done[t.id] for t in tasks]
    failed = sum(1 for r in records if r.get("error"))
    return SweepSummary(records=records, reused=reused, computed=len(todo), failed=failed,
                        scheduler=scheduler, seconds=time.perf_counter() - t0)


def _run_dask(todo: list[Task], scheduler: str, workers: int | None, finish) -> None:
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError as exc:
        raise SpecError("--scheduler processes / tcp:// needs dask.distributed: "
                        "pip install -e '.[sweep]' in the headthief clone, or bash scripts/setup.sh (or use --scheduler serial)") from exc
    cluster = None
    if scheduler == "processes":
        n = workers or max(1, min(2, os.cpu_count() or 1))
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address="127.0.0.1:0", silence_logs=40)
        client = Client(cluster)
    else:
        try:
            client = Client(scheduler, timeout="10s")
        except OSError as exc:
            raise SpecError(f"cannot reach the dask scheduler at {scheduler}: {exc}") from exc
    try:
        futures = {client.submit(run_task, t, key=f"headthief-{t.id}", pure=False): t for t in todo}
        for fut in as_completed(list(futures)):
            try:
                rec = fut.result()
            except Exception as exc:  # the worker died (KilledWorker) or the task could not be shipped
                t = futures[fut]
                rec = {"id": t.id, "experiment": t.experiment, "key": t.key, "fn": t.fn, "params": t.params,
                       "value": None, "error": f"{type(exc).__name__}: {exc}", "seconds": None}
            finish(rec)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
