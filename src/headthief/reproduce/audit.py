"""``headthief audit``: for one target, every applicable method against every defence, through the sweep
engine. Each cell is one call of the extraction pipeline (:func:`headthief.pipeline.extract`, what
``headthief extract`` runs: the same oracle stack, model check and cost keys as a user's run) and keeps
its report row and exit code: queries spent, parameter errors, fidelity, and whether the defence stopped
or fooled the method."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import SpecError
from .engine import Task
from ..pipeline import EXIT_MEANING
from .tasks import run_extract

VALUE_METHODS = ("exact", "lowrank", "noisy")
SIGN_METHODS = ("membership",)


@dataclass(frozen=True)
class Defence:
    name: str
    options: tuple          # (name, value) pairs of pipeline options
    sign_only: bool = False
    budget_fraction: float | None = None    # budget = fraction of d^2 (resolved per target)


def defences(d: int) -> list[Defence]:
    """The audit's defences: none; noise tau in {1e-6, 1e-4, 1e-2} in adversarial and uniform mode;
    rounding to 4 decimals; sign-only answers; an input-norm bound of 1; a budget of d^2 / 2 queries.
    (The PRADA-style detector, ``prada``, is added by :func:`audit_tasks`.)"""
    out = [Defence("none", ())]
    for mode in ("adversarial", "uniform"):
        for tau in ("1e-6", "1e-4", "1e-2"):
            out.append(Defence(f"noise {mode} {tau}", (("noise", float(tau)), ("noise_mode", mode))))
    out.append(Defence("round:4", (("noise_mode", "round:4"),)))
    out.append(Defence("sign-only", (("sign_only", True),), sign_only=True))
    out.append(Defence("input-norm 1", (("input_norm", 1.0),)))
    out.append(Defence(f"budget {d * d // 2}", (("budget", d * d // 2),)))
    return out


def audit_cell(p: dict, rng: np.random.Generator) -> dict:
    """One (method, defence) cell: one pipeline call, as ``headthief extract ... --json`` runs it."""
    code, row, msg = run_extract(p, rng)
    spent = row.get("queries")
    if spent is None:           # ended early (the budget ran out): what was sent
        spent = row.get("queries_sent")
    mc = row.get("model_check") or {}
    return {"exit": code, "outcome": EXIT_MEANING.get(code, f"exit {code}"), "queries": spent,
            "check_queries": row.get("check_queries"),
            "W_rel_err": row.get("W_rel_err"), "v_rel_err": row.get("v_rel_err"),
            "fidelity": row.get("fidelity_max_rel_err") if row.get("fidelity_max_rel_err") is not None else mc.get("figure"),
            "check": mc.get("verdict"), "message": msg[-1][:300] if msg else ""}


def audit_prada_cell(p: dict, rng: np.random.Generator) -> dict:
    """One method under the PRADA-style detector of ``headthief serve`` (Juuti et al. 2019: minimum
    distances of each new query to the client's earlier ones, tested for normality with Shapiro-Wilk),
    in flag mode: the run goes on and the query count at which it was first flagged is kept. The detector
    is the server's own class, here watching the oracle in this process."""
    from ..oracles.base import WrappedOracle
    from ..pipeline import extract
    from ..server.defences import Prada

    class Watched(WrappedOracle):
        def __init__(self, inner, detector):
            super().__init__(inner)
            self.detector = detector

        def _transform(self, X, y):
            self.detector.observe(X)
            return y

    detector = Prada()
    rep = extract(p["target"], p["method"], seed=int(rng.integers(2 ** 31 - 1)), raise_errors=False,
                  wrap=lambda o: Watched(o, detector), **dict(p.get("options", {})))
    mc = rep.row.get("model_check") or {}
    out = {"flagged_at": None, "queries": rep.row.get("queries", rep.row.get("queries_sent")),
           "W_rel_err": rep.row.get("W_rel_err"), "check": mc.get("verdict"), "fidelity": mc.get("figure"),
           "outcome": "extracted" if rep.ok else type(rep.exception).__name__, "exit": rep.exit_code}
    out["flagged_at"] = detector.flagged_at
    out["seen"] = detector.seen
    out["last_W"] = detector.last_W
    return out


def audit_tasks(spec: str, *, methods: list[str] | None = None, names: list[str] | None = None,
                d: int | None = None, bias: bool = False) -> list[Task]:
    """The audit's cells for ``spec`` (``d``, ``bias``: the target options of a ``py:`` target)."""
    from ..pipeline import check_d
    from ..targets import resolve
    target = resolve(spec, d=d, bias=bias)
    if d is not None:
        from ..pipeline import Options
        check_d(target, Options(d=d))
    base = ([["d", d]] if d is not None else []) + ([["bias", True]] if bias else [])
    d = target.d
    ds = defences(d)
    if names:
        known = {x.name for x in ds} | {"prada"}
        bad = [n for n in names if n not in known]
        if bad:
            raise SpecError(f"unknown defence(s) {bad}; known: {sorted(known)}")
        ds = [x for x in ds if x.name in names]
    meths = list(methods) if methods else list(VALUE_METHODS + SIGN_METHODS)
    from ..methods import METHODS
    bad = [m for m in meths if m not in METHODS]
    if bad:
        raise SpecError(f"unknown method(s) {bad}")
    tasks = []
    if not names or "prada" in names:
        for m in meths:
            tasks.append(Task("audit", f"{spec}|{m}|prada", "headthief.reproduce.audit:audit_prada_cell",
                              {"target": spec, "method": m, "defence": "prada", "options": list(base)}))
    for dfc in ds:
        for m in meths:
            if (m in SIGN_METHODS) != dfc.sign_only:
                continue      # sign-only answers only suit the sign-only methods, and vice versa
            tasks.append(Task("audit", f"{spec}|{m}|{dfc.name}", "headthief.reproduce.audit:audit_cell",
                              {"target": spec, "method": m, "defence": dfc.name,
                               "options": base + [list(kv) for kv in dfc.options]}))
    return tasks


def audit_table(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        v = r.get("value") or {}
        row = {"defence": r["params"]["defence"], "method": r["params"]["method"],
               "outcome": v.get("outcome", r.get("error")), "queries": v.get("queries"),
               "W_rel_err": v.get("W_rel_err"), "fidelity": v.get("fidelity"), "check": v.get("check")}
        if r["params"]["defence"] == "prada":
            fa = v.get("flagged_at")
            row["outcome"] = (f"flagged at query {fa:,}" if fa else "not flagged") + (
                "" if v.get("outcome") == "extracted" else f" ({v.get('outcome')})")
        rows.append(row)
    return rows


def draw_audit(rows: list[dict], path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = {"exact": "o", "lowrank": "s", "noisy": "^", "membership": "D"}
    names = list(dict.fromkeys(r["defence"] for r in rows))
    cmap = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        for r in rows:
            if r["defence"] != name or not r["queries"] or r["W_rel_err"] is None:
                continue
            ax.scatter(r["queries"], max(r["W_rel_err"], 1e-17), color=cmap(i % 20),
                       marker=markers.get(r["method"], "x"), s=40,
                       label=name if r is next(x for x in rows if x["defence"] == name and x["queries"]
                                               and x["W_rel_err"] is not None) else None)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("queries spent")
    ax.set_ylabel("W relative error")
    ax.set_title("what each defence costs the attacker (marker = method)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
