"""Stage A (the heads) on a real all-MiniLM-L6-v2 block (d = 384, 12 heads), against the checkpoint's weights:
what ``--method block`` reads of the attention at MiniLM's size, before the block refit.

    .venv/bin/python benchmarks/bench_minilm_stage_a.py --layer 2 --dtype float32 --jacobian truth
    .venv/bin/python benchmarks/bench_minilm_stage_a.py --layer 2 --dtype float32 --jacobian f32plus.pkl

Runs stages L and V (``B``, ``b``: what stage A's one-token queries ``x +- t B^{-1} e`` need) on the block, then
stage A (:func:`headthief.extraction.block.extract_heads`): 2 d + 1 = 769 second-order reads at 2 d + 8 = 776
base tokens, three step sizes each, 5.37 million queries. Its reads are pulled back through a one-token
Jacobian, which the method takes (float32 answers) from the refitted one-token map of stage F+:

- ``--jacobian FILE``: that map, from the parts ``bench_minilm_stage_f.py --refit-iterations N --save FILE``
  wrote (the method as it runs; stages L and V are not run again, the saved ``B`` is used);
- ``--jacobian truth``: the checkpoint's own one-token map (float64): stage A alone, with a one-token map
  better than any refit gives, so its figures bound what stage A can do from these answers;
- ``--jacobian measured``: the five-point stencil on the answers (float64's route; 4 d (2 d + 8) = 1.19
  million more queries, and in float32 the stencil's error dominates the reads).

Prints the reads' progress, then the heads against the checkpoint modulo the symmetries (docs/block.md): per
head (matched by the Hungarian method on ``P O_h``) the relative errors of ``P O_h`` (= ``P W_O^h V_h``),
``W_h`` (= ``K_h^T Q_h / sqrt(d_h)``) and ``c_h`` (= ``K_h^T b_Q^h / sqrt(d_h)``), median and worst; the head count
read from the reads (``--heads auto``), the alternating least squares' residual and sweeps, queries, minutes.
With float32 answers these heads are the start of the block refit (R), which this script does not run;
``--save`` keeps them (with the one-token parts they were read through, when loaded) for it.
"""

from __future__ import annotations

import argparse
import pickle
import time

import numpy as np

from headthief.extraction.block import extract_heads, fit_output_layernorm, value_sum
from headthief.extraction.block.one_token_refit import model_jacobian
from headthief.extraction.block.value_sum import centre
from headthief.models.bert_block import from_minilm
from headthief.oracles.base import ModelOracle


def true_jacobian(truth):
    """``x -> dy/dx`` of the checkpoint's one-token map in float64 (central differences, step 1e-6 |x|)."""
    def jac(x):
        x = np.asarray(x, dtype=np.float64)
        d = x.size
        h = 1e-6 * max(float(np.linalg.norm(x)), 1.0)
        E = np.eye(d) * h
        Y = truth.forward(np.vstack([x + E, x - E])[:, None, :])[:, 0]
        return ((Y[:d] - Y[d:]) / (2 * h)).T
    return jac


def stages_l_v(block, truth, rng):
    """Stages L and V on ``block``'s answers as stage A's research scripts take them (``rng`` drawn as
    ``extract_block`` draws it): ``(oracle, exact, eps, vs, vs_true)``, ``exact`` the float64 ``truth``'s oracle
    and ``vs_true`` stage V's parts with ``truth``'s own ``B`` and ``b``."""
    from headthief.extraction.block.value_sum import with_map
    d = block.d
    oracle, exact = ModelOracle(block), ModelOracle(truth)
    ln = fit_output_layernorm(np.asarray(oracle.query_packed(rng.standard_normal((4, (d + 2) // 4 + 2, d)))))
    eps = max(float(ln.sphere_residual), 1e-15)
    vs = value_sum(oracle, rng, precision=eps)
    return oracle, exact, eps, vs, with_map(vs, *truth.value_output_sum())


def head_errors(att, truth) -> list[dict]:
    """Per true head: the recovered head nearest in ``P O_h`` (Hungarian) and its relative errors."""
    from scipy.optimize import linear_sum_assignment

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    can = truth.attention.canonical()
    H = truth.heads
    cost = np.array([[rel(att.O[i], centre(can.O(j))) for j in range(H)] for i in range(att.heads)])
    rows, cols = linear_sum_assignment(cost)
    return sorted(({"head": int(j), "as": int(i), "O": rel(att.O[i], centre(can.O(j))), "W": rel(att.W[i], can.W(j)),
                    "c": rel(att.c[i], can.C[j])} for i, j in zip(rows, cols)), key=lambda r: r["head"])


def _cache_reads(path: str) -> None:
    """Stage A's reads (:func:`headthief.extraction.block.heads.reads`) kept in ``path``: computed and saved
    when it does not exist, else loaded (for the stages after the reads, run again at no query cost); their
    output-space fit likewise in ``path + ".fit.npz"``."""
    import os

    from headthief.extraction.block import heads as heads_module
    sent = heads_module.reads

    def cached(oracle, vs, X, dirs, t, *, progress=None):
        if os.path.exists(path):
            out = np.load(path)
            if out.shape == (len(dirs), len(X), oracle.d_out):
                print(f"  reads from {path}", flush=True)
                return out
        out = sent(oracle, vs, X, dirs, t, progress=progress)
        np.save(path, out)
        return out
    heads_module.reads = cached
    fitted, fits = heads_module.fit_in_output_space, path + ".fit.npz"

    def cached_fit(S, X, J, **kw):                      # the reads' output-space fit (50 min of one core) kept too
        if os.path.exists(fits):
            z = np.load(fits)
            if z["G"].shape == (len(S), X.shape[1], X.shape[1] + 1):
                print(f"  reads' fit from {fits}", flush=True)
                return z["G"], z["res"]
        t = time.perf_counter()
        G, res = fitted(S, X, J, **kw)
        print(f"  reads' output-space fit: {(time.perf_counter() - t) / 60:.1f} min", flush=True)
        np.savez(fits, G=G, res=res)
        return G, res
    heads_module.fit_in_output_space = cached_fit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jacobian", default="truth",
                    help="truth | measured | a pickle of refitted one-token parts (bench_minilm_stage_f.py --save)")
    ap.add_argument("--heads", default="auto", help="H, or auto (read from the reads' rank, the method's default)")
    ap.add_argument("--points", type=int, default=None, help="base tokens (default 2 d + 8)")
    ap.add_argument("--reads-cache", default=None,
                    help="keep the reads (J_Phi r, 1.8 GB at d = 384) in this .npy file, or take them from it when it "
                    "exists (same --seed and stages: no read is sent again; the queries count only those sent)")
    ap.add_argument("--save", default=None, help="pickle the heads (with the one-token parts and B used) here")
    args = ap.parse_args()
    if args.save is not None:
        open(args.save, "ab").close()                   # the output path checked before the first query
    block = from_minilm(args.layer, dtype=np.float32 if args.dtype == "float32" else np.float64)
    truth = from_minilm(args.layer, dtype=np.float64)
    d = block.d
    oracle = ModelOracle(block)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    saved, q_before, min_before = {}, 0, 0.0            # the loaded parts and what they cost in earlier runs
    if args.jacobian in ("truth", "measured"):
        ln = fit_output_layernorm(np.asarray(oracle.query_packed(rng.standard_normal((4, (d + 2) // 4 + 2, d)))))
        eps = max(float(ln.sphere_residual), 1e-15)
        vs = value_sum(oracle, rng, precision=eps)
        jac = true_jacobian(truth) if args.jacobian == "truth" else None
        print(f"stages L, V: {oracle.queries} queries, {time.perf_counter() - t0:.0f} s (answers' precision "
              f"{eps:.2g})", flush=True)
    else:
        with open(args.jacobian, "rb") as fh:
            saved = pickle.load(fh)
        q_before, min_before = int(saved["queries"]), float(saved["minutes"])
        vs, eps = saved["vs"], saved["precision"]
        jac = model_jacobian(saved["part"], saved["ln"], vs)
        print(f"loaded {args.jacobian}: the one-token map after {saved.get('refit', {}).get('refit_iterations', 0)} "
              f"F+ iterations, {saved['queries']} queries and {saved['minutes']:.1f} min before", flush=True)
    q0 = oracle.queries
    t1 = time.perf_counter()
    step = [0]

    def progress(done, total):
        if done * 10 // total > step[0] or done == total:
            step[0] = done * 10 // total
            print(f"  reads: {done} / {total} directions, {oracle.queries - q0} queries, "
                  f"{(time.perf_counter() - t1) / 60:.1f} min", flush=True)

    if args.reads_cache is not None:
        _cache_reads(args.reads_cache)
    att = extract_heads(oracle, vs, rng, heads=None if args.heads == "auto" else int(args.heads), precision=eps,
                        points=args.points, jacobian=jac, progress=progress)
    minutes = (time.perf_counter() - t1) / 60
    if args.save is not None:                           # before the report: a finished stage is never lost
        with open(args.save, "wb") as fh:
            pickle.dump({**saved, "layer": args.layer, "dtype": args.dtype, "vs": vs, "precision": eps, "heads": att,
                         "jacobian": args.jacobian, "queries": q_before + oracle.queries,
                         "minutes": min_before + (time.perf_counter() - t0) / 60}, fh)
    per = head_errors(att, truth)
    i = att.info
    print(f"MiniLM block {args.layer}, {args.dtype}, Jacobian {args.jacobian}: {att.heads} heads "
          f"({'read from the reads' if i['heads_detected'] else 'given'}; true {truth.heads}); read fit residual "
          f"{i['read_fit_residual']:.2e}, (H+1)-th singular value {i['read_rank']:.2e}, H-th {i['read_weakest']:.2e}")
    print(f"  pencil spread {i['pencil_spread']:.2e}, transport residual {i['transport_residual']:.2e}; polish "
          f"{i['polish_sweeps']} sweeps, residual {i['residual_before_polish']:.2e} -> {i['heads_residual']:.2e}; "
          f"value-sum residual {i['value_sum_residual']:.2e}")
    for k, name in (("O", "P O_h"), ("W", "W_h"), ("c", "c_h")):
        v = [r[k] for r in per]
        print(f"  {name}: median {np.median(v):.2e}, worst {max(v):.2e} (head {per[int(np.argmax(v))]['head']})")
    print(f"  stage A: {i['queries']} queries, {minutes:.1f} min; in all {oracle.queries} queries, "
          f"{(time.perf_counter() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
