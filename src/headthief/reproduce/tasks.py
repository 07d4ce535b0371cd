"""Task functions of the experiments behind ``headthief reproduce``: each is ``fn(params, rng)`` and
returns a JSON-able dict of measured figures (see :mod:`headthief.reproduce.engine`). One function per
kind of measurement; the claims and verdicts are in :mod:`headthief.reproduce.claims`."""

from __future__ import annotations

import math

import numpy as np

from ..errors import BudgetExceeded, ConvergenceError, HeadthiefError


def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(2 ** 31 - 1))


def _finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def exact_recovery(p: dict, rng: np.random.Generator) -> dict:
    """Theorem 4.1: one random head, ``extract_exact`` with the given probe design and dtype."""
    from ..extraction.single.exact import extract_exact
    from ..models.attention import random_head
    from ..oracles.base import ModelOracle
    d = int(p["d"])
    head = random_head(d, rng=_seed(rng), dtype=np.float32 if p.get("dtype") == "float32" else np.float64)
    res = extract_exact(ModelOracle(head), probes=p.get("probes", "basis"), rng=_seed(rng), check=False)
    e = res.errors(head)
    return {"queries": res.queries, "formula": d * d + d, "W_rel_err": e["W_rel_err"], "v_rel_err": e["v_rel_err"]}


def lowrank_transition(p: dict, rng: np.random.Generator) -> dict:
    """Theorem 5.1 / A.2: one rank-r head, ``m = ratio r(2d - r)`` measurements, one method."""
    from ..extraction.single.lowrank import extract_lowrank
    from ..extraction.single.rop import extract_rop
    from ..models.attention import random_head
    from ..oracles.base import ModelOracle
    d, r, ratio, method = int(p["d"]), int(p["r"]), float(p["ratio"]), p["method"]
    head = random_head(d, rng=_seed(rng), rank=r)
    m = max(1, int(round(ratio * r * (2 * d - r))))
    try:
        if method == "lowrank":
            res = extract_lowrank(ModelOracle(head, budget=d + m), rank=r, rng=_seed(rng), check=False)
        else:
            res = extract_rop(ModelOracle(head), rank=r, solver=method.split("-")[1], measurements=m,
                              rng=_seed(rng), check=False, **({"max_iter": 400} if method == "rop-als" else {}))
    except (BudgetExceeded, ConvergenceError) as exc:
        return {"m": m, "ok": False, "W_rel_err": None, "why": type(exc).__name__}
    err = res.errors(head)["W_rel_err"]
    return {"m": m, "ok": bool(err <= 1e-6), "W_rel_err": _finite(err), "queries": res.queries}


def noisy_theorem(p: dict, rng: np.random.Generator) -> dict:
    """Theorem 6.1 at its prescribed tolerance (adversarial answers), the paper's estimator and ours."""
    from ..extraction.robust.noisy import extract_noisy
    from ..extraction.robust.noisy_paper import extract_noisy_paper, theorem_tolerance
    from ..oracles import Tolerance
    from ..targets import resolve
    d, W, mu, eps = int(p["d"]), float(p["W"]), float(p["mu"]), float(p["eps"])
    seed = _seed(rng)
    spec = f"random:d={d},seed={seed},W_norm={W:g},v_norm=1,v_min={mu:g}" + (",sparse_v=0.25" if p.get("sparse") else "")
    target = resolve(spec)
    head = target.truth
    tau = theorem_tolerance(d, W, mu, eps, eps)
    res = extract_noisy_paper(Tolerance(target.make_oracle(input_norm=1.0), tau, "adversarial", key=seed),
                              W_bound=W, mu=mu, check=False)
    ours = extract_noisy(Tolerance(target.make_oracle(input_norm=1.0), tau, "adversarial", key=seed),
                         tau=tau, W_bound=W, check=False)
    return {"tau": tau, "queries": res.queries, "formula": d + d * d,
            "W_fro_err": float(np.linalg.norm(res.W - head.W)), "v_err": float(np.linalg.norm(res.v - head.v)),
            "ours_W_fro_err": float(np.linalg.norm(ours.W - head.W)), "ours_queries": ours.queries}


def membership_sphere(p: dict, rng: np.random.Generator) -> dict:
    """Theorem B.1, part 1: the sphere estimator's error after k sign queries."""
    from ..extraction.robust.membership_paper import sphere_estimate
    from ..models.attention import random_head
    from ..oracles import SignOnly
    from ..oracles.base import ModelOracle
    d, k = int(p["d"]), int(p["k"])
    head = random_head(d, rng=_seed(rng), W_norm=float(p["W"]), v_norm=1.0, v_min=float(p["mu"]))
    v_hat = sphere_estimate(SignOnly(ModelOracle(head)), k, rng=rng)
    return {"k": k, "v_inf_err": float(np.max(np.abs(v_hat - head.v)))}


def membership_bisection(p: dict, rng: np.random.Generator) -> dict:
    """Theorem B.1, part 2: the bisection for W given v within the theorem's eps_v."""
    from ..extraction.robust.membership_paper import (bisection_steps, eps_v_required, extract_membership_paper,
                                                     paper_probe_norm)
    from ..models.attention import random_head
    from ..oracles import SignOnly
    from ..oracles.base import ModelOracle
    d, W, mu, eps_W = int(p["d"]), float(p["W"]), float(p["mu"]), float(p["eps_W"])
    head = random_head(d, rng=_seed(rng), W_norm=W, v_norm=1.0, v_min=mu)
    ev = eps_v_required(d, eps_W, mu, W)
    v_hat = head.v + rng.uniform(-ev, ev, size=d)
    oracle = SignOnly(ModelOracle(head, input_norm=paper_probe_norm(W, mu)))
    res = extract_membership_paper(oracle, W_bound=W, mu=mu, eps_W=eps_W, k=0, v_hat=v_hat, rng=_seed(rng),
                                   check=False)
    return {"queries": res.queries, "formula": d * d * bisection_steps(d, eps_W, mu, W),
            "W_fro_err": float(np.linalg.norm(res.W - head.W)), "eps_W": eps_W}


def equivalent_sets(p: dict, rng: np.random.Generator) -> dict:
    """Proposition 7.1: a second parameter set, its gap to the first, and the output agreement."""
    from ..extraction.multihead.canonical import equivalent_parameters, parameter_gap
    from ..extraction.result import random_sequences
    from ..models.multihead import random_multihead
    d, H, n = int(p["d"]), int(p["heads"]), int(p["sequences"])
    model = random_multihead(d, H, rng=_seed(rng), identical=bool(p.get("identical")))
    other = equivalent_parameters(model, rng=_seed(rng))
    X = random_sequences(d, n, rng=rng)
    y1, y2 = model.evaluate(X), other.evaluate(X)
    rms = float(np.sqrt(np.mean(y1 ** 2)))
    return {"gap": parameter_gap(other, model), "heads_after": other.heads,
            "max_rel_diff": float(np.max(np.abs(y1 - y2)) / rms)}


def known_subspaces(p: dict, rng: np.random.Generator) -> dict:
    """Proposition C.2: heads in known orthogonal subspaces, recovered by Theorem 4.1 per subspace."""
    from ..extraction.multihead import extract_multihead_subspaces
    from ..extraction.multihead.subspaces import subspaces_query_count
    from ..models.multihead import random_multihead
    from ..oracles.base import ModelOracle
    d, H = int(p["d"]), int(p["heads"])
    model = random_multihead(d, H, rng=_seed(rng), subspaces="orthogonal",
                             dtype=np.float32 if p.get("dtype") == "float32" else np.float64)
    bases = model._cache["bases"]
    res = extract_multihead_subspaces(ModelOracle(model), bases, check=False)
    e = res.errors(model)
    return {"queries": res.queries, "formula": subspaces_query_count([b.shape[1] for b in bases]),
            "W_rel_err": e["W_rel_err"], "v_rel_err": e["v_rel_err"], "heads": res.heads}


def hessian_conjecture(p: dict, rng: np.random.Generator) -> dict:
    """Appendix C's conjecture: probe Hessians + finest block diagonalisation, success or why not."""
    from ..extraction.multihead import extract_multihead_hessian
    from ..models.multihead import random_multihead
    from ..oracles.base import ModelOracle
    d, H, prec = int(p["d"]), int(p["heads"]), p["precision"]
    model = random_multihead(d, H, rng=_seed(rng), subspaces="orthogonal", dtype=getattr(np, prec),
                             rank=p.get("rank"))
    oracle = ModelOracle(model)
    bar = 1e-6 if prec == "float64" else 1e-3
    try:
        res = extract_multihead_hessian(oracle, rng=_seed(rng), check=False)
    except HeadthiefError as exc:
        return {"ok": False, "why": type(exc).__name__, "queries": oracle.queries, "W_rel_err": None}
    e = res.errors(model)
    ok = res.heads == H and e["W_rel_err"] <= bar and e["v_rel_err"] <= bar
    why = "" if ok else (f"{res.heads} heads found, not {H}" if res.heads != H else
                         f"W err {e['W_rel_err']:.1e} > {bar:g}")
    return {"ok": bool(ok), "why": why,
            "queries": res.queries, "W_rel_err": _finite(e["W_rel_err"])}


def ours_vs_anchor(p: dict, rng: np.random.Generator) -> dict:
    """A method of ours beside the count it is measured against (its anchor)."""
    from ..oracles.base import ModelOracle
    kind = p["kind"]
    if kind == "lowrank":
        from ..extraction.single.lowrank import extract_lowrank
        from ..models.attention import random_head
        d, r = int(p["d"]), int(p["r"])
        head = random_head(d, rng=_seed(rng), rank=r)
        res = extract_lowrank(ModelOracle(head), rng=_seed(rng), check=False)
        return {"queries": res.queries, "anchor": d * d + d, "anchor_name": "Theorem 4.1: d^2 + d",
                "floor": d + r * (2 * d - r), "W_rel_err": res.errors(head)["W_rel_err"]}
    if kind == "multihead":
        from ..extraction.multihead import extract_multihead
        from ..models.multihead import random_multihead
        d, H = int(p["d"]), int(p["heads"])
        model = random_multihead(d, H, rng=_seed(rng), rank=p.get("rank"))
        res = extract_multihead(ModelOracle(model), rng=_seed(rng), check=False)
        e = res.errors(model)
        return {"queries": res.queries, "anchor": 4 * H * d * d - 2 * H + 1,
                "anchor_name": "arXiv 2608.03294: 4Hd^2 - 2H + 1", "W_rel_err": e["W_rel_err"], "heads": res.heads}
    if kind == "membership":
        from ..extraction.robust.membership import extract_membership
        from ..models.attention import random_head
        from ..oracles import SignOnly
        d = int(p["d"])
        head = random_head(d, rng=_seed(rng))
        res = extract_membership(SignOnly(ModelOracle(head, input_norm=1.0)), check=False)
        W_err = float(np.linalg.norm(res.W - head.W) / np.linalg.norm(head.W))
        return {"queries": res.queries, "anchor": None, "anchor_name": "Theorem B.1 (needs ~1e7 at d=16 for W 0.19)",
                "W_rel_err": W_err}
    raise ValueError(f"unknown kind {kind!r}")


def vector_vs_scalar(p: dict, rng: np.random.Generator) -> dict:
    """Vector answers against the scalar readout on layers of one size: queries, errors, the information
    limit (the layer's degrees of freedom over the numbers one query returns)."""
    from ..oracles.base import ModelOracle
    d, H = int(p["d"]), int(p["heads"])
    r = d // H
    dof = H * (2 * (2 * d * r - r * r) + r) + d          # W_h, O_h (rank r each), c_h in W_h's key space, b
    if p["kind"] == "scalar":
        from ..extraction.multihead import extract_multihead
        from ..models.multihead import random_multihead
        model = random_multihead(d, H, rng=_seed(rng))
        res = extract_multihead(ModelOracle(model), rng=_seed(rng), check=False)
        e = res.errors(model)
        return {"queries": res.queries, "numbers": res.queries, "W_rel_err": e["W_rel_err"], "O_rel_err": None,
                "heads": res.heads, "limit": None}
    from ..extraction.vector import extract_vector
    from ..models.mha import random_layer
    out = p["output"]
    layer = random_layer(d, H, seed=_seed(rng)).with_output(out)
    oracle = ModelOracle(layer)
    res = extract_vector(oracle, rng=_seed(rng), check=False)
    e = res.errors(layer.canonical())
    per = d * (16 if out == "all" else 1)                  # numbers per query at the method's 16-token reads
    return {"queries": res.queries, "numbers": int(oracle.numbers), "W_rel_err": e["W_rel_err"],
            "O_rel_err": e["O_rel_err"], "c_rel_err": e["c_rel_err"], "heads": res.heads,
            "limit": int(np.ceil(dof / per)), "dof": dof}


def noisy_vs_tau(p: dict, rng: np.random.Generator) -> dict:
    """Theorem 6.1's error bound against tau: both estimators' ||W_hat - W||_F at one tolerance."""
    from ..extraction.robust.noisy import extract_noisy
    from ..extraction.robust.noisy_paper import extract_noisy_paper, theorem_W_bound
    from ..oracles import Tolerance
    from ..targets import resolve
    d, W, mu, tau = int(p["d"]), float(p["W"]), float(p["mu"]), float(p["tau"])
    seed = _seed(rng)
    target = resolve(f"random:d={d},seed={seed},W_norm={W:g},v_norm=1,v_min={mu:g}")
    Wt = target.truth.dense_W()
    paper = extract_noisy_paper(Tolerance(target.make_oracle(input_norm=1.0), tau, key=seed), W_bound=W, mu=mu,
                                check=False)
    ours = extract_noisy(Tolerance(target.make_oracle(input_norm=1.0), tau, key=seed), tau=tau, W_bound=W,
                         check=False)
    bound = theorem_W_bound(tau, d, W, mu)
    return {"tau": tau, "bound": _finite(bound), "paper": float(np.linalg.norm(paper.W - Wt)),
            "ours": float(np.linalg.norm(ours.W - Wt))}


def membership_vs_queries(p: dict, rng: np.random.Generator) -> dict:
    """Sign-only answers: W error against queries, the paper's estimator at k sphere queries or ours at a
    bisection tolerance (d = 8: W = 2, mu = 0.2; the paper's probes need the norm bound sqrt(2/(W mu)))."""
    from ..extraction.robust.membership import extract_membership
    from ..extraction.robust.membership_paper import extract_membership_paper, paper_probe_norm
    from ..models.attention import random_head
    from ..oracles import SignOnly
    from ..oracles.base import ModelOracle
    d, W, mu = int(p["d"]), float(p["W"]), float(p["mu"])
    head = random_head(d, rng=_seed(rng), W_norm=W, v_norm=1.0, v_min=mu)
    if p["method"] == "paper":
        res = extract_membership_paper(SignOnly(ModelOracle(head, input_norm=paper_probe_norm(W, mu))), W_bound=W,
                                       mu=mu, eps_W=0.1, k=int(p["k"]), rng=_seed(rng), check=False)
    else:
        res = extract_membership(SignOnly(ModelOracle(head, input_norm=1.0)), tol=float(p["tol"]), check=False)
    return {"method": p["method"], "queries": res.queries,
            "W_rel_err": float(np.linalg.norm(res.W - head.W) / np.linalg.norm(head.W))}


def run_extract(p: dict, rng: np.random.Generator) -> tuple[int, dict, list[str]]:
    """One extraction through the library pipeline (:func:`headthief.pipeline.extract`: the oracle stack,
    model check, verification and cost keys of ``headthief extract``), with the settings ``p["options"]``
    and the seed drawn from ``rng``. Returns (exit code, the report row, the error and warning lines)."""
    from ..pipeline import extract
    opts = dict(p.get("options", {}))
    rep = extract(p["target"], p["method"], seed=_seed(rng), raise_errors=False, **opts)
    return rep.exit_code, dict(rep.row), [*rep.warnings, *([rep.error] if rep.error else [])]


def extract_task(p: dict, rng: np.random.Generator) -> dict:
    """The report row's figures of :func:`run_extract`. Used where the pipeline's own verification is the
    measurement (Section 4.1: fidelity on random sequences and next to every kink)."""
    code, row, msg = run_extract(p, rng)
    keep = ("queries", "attention_queries", "ffn_queries", "W_rel_err", "v_rel_err", "fidelity_max_rel_err",
            "fidelity_kinks_max_rel_err", "neurons", "neurons_needed", "neurons_true", "ffn_neurons",
            "flips_resolved", "neuron_rel_err", "function_rel_err", "heads")
    return {"exit": code, "message": msg[-1][:300] if msg else "",
            **{k: row.get(k) for k in keep if k in row},
            "check": (row.get("model_check") or {}).get("verdict")}


def robustness_run(p: dict, rng: np.random.Generator) -> dict:
    """One extraction of the robustness experiment: exactly what ``headthief extract --target T --method M
    --seed S`` runs (:func:`headthief.pipeline.extract`: the model check, the verification on fresh
    sequences), on the target ``p["target"]`` seeded by ``p["seed"]``, which is also the method's seed.

    Returns how it ended (exit code, the error's first 300 characters), the queries, the fidelity, the
    parameter errors where the truth is known and the model check's verdict and threshold. No timings, so
    runs on different schedulers compare bit for bit. (``rng`` is unused: the seeds are fixed per task.)
    """
    from ..pipeline import extract
    rep = extract(p["target"], p["method"], seed=int(p["seed"]), raise_errors=False, **dict(p.get("options", {})))
    row = rep.row
    mc = row.get("model_check") or {}
    return {"exit": rep.exit_code, "status": rep.status, "error": (rep.error or "")[:300],
            "queries": row.get("queries", row.get("queries_sent")),
            "fidelity_max_rel_err": row.get("fidelity_max_rel_err"),
            "W_rel_err": row.get("W_rel_err"), "v_rel_err": row.get("v_rel_err"), "v_dir_err": row.get("v_dir_err"),
            "check": mc.get("verdict"), "check_name": mc.get("check"), "check_threshold": mc.get("threshold")}
