"""``headthief reproduce``: every claim of the paper as an experiment, run through one sweep engine
(serial, a dask LocalCluster, or a dask scheduler), written to a report (md, html, json, plots)."""

from .engine import SweepSummary, Task, run_sweep, run_task, task_seed

__all__ = ["Task", "SweepSummary", "run_sweep", "run_task", "task_seed", "reproduce"]


def reproduce(*args, **kw):
    from .run import reproduce as _r
    return _r(*args, **kw)
