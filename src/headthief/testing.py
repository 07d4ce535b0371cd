"""The shared recovery checker (the way PyLops ships its dot test): tests of every algorithm and
oracle kind call :func:`check_recovery` with the truth, the expected query count and error bounds."""

from __future__ import annotations

from .extraction.result import Extraction
from .models.attention import AttentionHead
from .oracles.base import ModelOracle


def check_recovery(res: Extraction, truth: AttentionHead, *, queries: int | None = None,
                   max_queries: int | None = None, W_tol: float = 1e-9, v_tol: float | None = None,
                   c_tol: float | None = None, beta_tol: float | None = None,
                   fidelity_tol: float | None = None, fidelity_n: int = 64, seed: int = 0) -> dict:
    """Assert that ``res`` recovered ``truth``; return the measured errors.

    ``queries`` is an exact expected count, ``max_queries`` an upper bound. Tolerances are relative
    errors (``beta_tol`` absolute); v, c, beta and fidelity default to ``W_tol``.
    """
    errs = res.errors(truth)
    problems = []
    if queries is not None and res.queries != queries:
        problems.append(f"queries {res.queries} != expected {queries}")
    if max_queries is not None and res.queries > max_queries:
        problems.append(f"queries {res.queries} > bound {max_queries}")
    v_tol = W_tol if v_tol is None else v_tol
    checks = [("W_rel_err", W_tol), ("v_rel_err", v_tol)]
    if truth.c is not None and res.c is not None:
        checks.append(("c_rel_err", W_tol if c_tol is None else c_tol))
    if truth.beta is not None and res.beta is not None:
        checks.append(("beta_abs_err", W_tol if beta_tol is None else beta_tol))
    if not res.v_scale_known:
        checks = [("W_rel_err", W_tol), ("v_dir_err", v_tol)]
    for key, tol in checks:
        val = errs.get(key)
        if val is None or not val <= tol:
            problems.append(f"{key} = {val} > {tol}")
    fid = None
    if fidelity_tol is not None or fidelity_n:
        fid = res.verify(ModelOracle(truth), fidelity_n, rng=seed)
        errs["fidelity_max_rel_err"] = fid.max_rel_err
        tol = W_tol if fidelity_tol is None else fidelity_tol
        if not fid.max_rel_err <= tol * 10 + 1e-12 and fidelity_tol is None:
            problems.append(f"fidelity {fid.max_rel_err} > {tol * 10}")
        elif fidelity_tol is not None and not fid.max_rel_err <= fidelity_tol:
            problems.append(f"fidelity {fid.max_rel_err} > {fidelity_tol}")
    if problems:
        raise AssertionError(f"{res.method} recovery failed: " + "; ".join(problems) + f" (errors: {errs})")
    return errs
