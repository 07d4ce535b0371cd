"""Nuclear-norm minimisation for rank-one-projection sensing: the paper's program (2) (Theorem 5.1).

    W_hat = argmin ||W||_*   subject to   a_k^T W b_k = t_k  (k = 1..m)

solved with cvxpy (the optional ``convex`` extra, imported when the solver runs). By Cai and Zhang
(2015, Theorem A.2 of the paper), Gaussian a_k, b_k with m = O(r d) measurements recover every rank-r W
exactly with high probability.

The equality-constrained program is solved first. When its constraints are numerically
inconsistent (more measurements than the d^2 unknowns, rounded: the interior-point solver then
reports failure), the relaxed program ``||A(W) - t||_2 <= 1e-9 ||t||`` is solved instead
(``info["program"] = "relaxed"``).

Limits, measured on the 2-core machine with CLARABEL (r = 2, m = 3 r(2d - r)): d = 20 in about 1 s,
d = 30 in 4 s (0.4 GB), d = 40 in 10 s (0.8 GB), d = 50 in 26 s (1.7 GB), d = 60 in 59 s (3.4 GB);
time grows like d^4.6 and memory like d^3.6, so d = 100 would need about 20 GB. :func:`solve_nuclear`
refuses d above :data:`CONVEX_MAX_D` with a :class:`ValueError` instead of hanging; the
alternating-least-squares solver (:mod:`.sensing_als`) handles the same measurements at d in the
thousands.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from ...errors import ConvergenceError
from .sensing_als import as_measurements

CONVEX_MAX_D = 60
"""Largest d the convex solver accepts (d = 60 already takes a minute and ~3.4 GB on 2 cores)."""

RELAX = 1e-9
"""The fallback program asks ``||A(W) - t|| <= RELAX ||t||`` instead of equality."""


def check_convex_size(d: int, max_d: int = CONVEX_MAX_D) -> None:
    """Raise :class:`ValueError` when a nuclear-norm solve at this d cannot finish in reasonable time."""
    if d > max_d:
        raise ValueError(
            f"the convex (nuclear-norm) solver is limited to d <= {max_d}: its semidefinite program has "
            f"d^2 = {d * d} unknowns (d = 60 takes a minute and ~3.4 GB on 2 cores, d = 100 would need "
            "~20 GB); use --solver als (solver='als') for this size")


def solve_nuclear(
    A: np.ndarray,
    B: np.ndarray,
    t: np.ndarray,
    *,
    solver: str | None = None,
    max_d: int = CONVEX_MAX_D,
    verbose: bool = False,
) -> tuple[np.ndarray, dict]:
    """Solve ``min ||W||_* s.t. a_k^T W b_k = t_k`` with cvxpy; return ``(W, info)``.

    Falls back to the relaxed program (module docstring) when the equality program fails.

    Args:
        A, B: (m, d) probe matrices; t: (m,) measurements.
        solver: a cvxpy solver name; default CLARABEL (interior point, ~1e-8 accurate) when
            installed, else SCS.
        max_d: refuse larger d (see :func:`check_convex_size`).
        verbose: let the solver print its progress.

    Raises:
        ValueError: d above ``max_d``. ImportError: cvxpy missing. ConvergenceError: the solver did
        not reach an optimal (or optimal-inaccurate) status.
    """
    A, B, t = as_measurements(A, B, t)
    m, d = A.shape
    check_convex_size(d, max_d)
    try:
        import cvxpy as cp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the convex solver needs cvxpy: pip install -e '.[convex]' in the headthief clone, or bash scripts/setup.sh "
                          "(or use solver='als')") from e
    if solver is None:
        solver = "CLARABEL" if "CLARABEL" in cp.installed_solvers() else "SCS"
    W = cp.Variable((d, d))
    measured = cp.sum(cp.multiply(A @ W, B), axis=1)
    programs = [("equality", [measured == t]),
                ("relaxed", [cp.norm(measured - t) <= RELAX * float(np.linalg.norm(t))])]
    t0 = time.perf_counter()
    failures = []
    for form, constraints in programs:
        problem = cp.Problem(cp.Minimize(cp.normNuc(W)), constraints)
        try:
            with warnings.catch_warnings():     # an inaccurate solve is reported in ``info["status"]``
                warnings.simplefilter("ignore", UserWarning)
                problem.solve(solver=solver, verbose=verbose)
        except cp.error.SolverError as e:
            failures.append(f"{form}: {e}")
            continue
        if problem.status in ("optimal", "optimal_inaccurate") and W.value is not None:
            break
        failures.append(f"{form}: status {problem.status!r}")
    else:
        raise ConvergenceError(f"the convex solver {solver} failed ({'; '.join(failures)})")
    seconds = time.perf_counter() - t0
    What = np.asarray(W.value, dtype=np.float64)
    info = {"solver": solver, "status": problem.status, "program": form, "nuclear_norm": float(problem.value),
            "solve_seconds": round(seconds, 3)}
    return What, info
