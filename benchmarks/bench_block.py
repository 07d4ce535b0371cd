"""``--method block`` end to end on random BERT blocks (issue 19's first acceptance line) and, with
``--relu`` / ``--stack``, the model-class refusals: the pipeline as ``headthief extract`` runs it.

    python benchmarks/bench_block.py                       # bert-block:d=32,heads=4,ffn=128, seeds 1..10
    python benchmarks/bench_block.py --d 16 --ffn 32 --seeds 900 920
    python benchmarks/bench_block.py --d 16 --ffn 32 --seeds 7000 7020 --dtype float32
    python benchmarks/bench_block.py --d 16 --ffn 32 --seeds 8000 8020 --stage-f probes
    python benchmarks/bench_block.py --d 12 --heads 2 --ffn 24 --act gelu_tanh --dtype float32   # --activation
    python benchmarks/bench_block.py --d 12 --heads 2 --ffn 24 --act gelu_tanh --assume gelu     # must refuse
    python benchmarks/bench_block.py --d 12 --heads 2 --ffn 24 --ln-eps 1e-5 --dtype float32      # --ln-eps
    python benchmarks/bench_block.py --d 12 --heads 2 --ffn 24 --ln-eps 1e-5 --dtype float32 --image
    python benchmarks/bench_block.py --d 12 --heads 2 --ffn 24 --ln-eps 1e-5 --tell auto --dtype float32  # measured

Prints per seed the worst relative error of every part (modulo the block's symmetries, docs/block.md),
the fidelity on fresh sequences, queries and seconds, and how many seeds have every part within 1e-8.
``--act A`` gives the blocks another smooth activation (``bert-block:...,act=A``) and the method assumes it
(``--activation A``); with ``--assume B`` (another) it counts the seeds refused with exit 5 instead; with
``--assume auto`` a seed counts only where the activation read (the row's ``activation``) is A. ``--ln-eps E``
gives the blocks' LayerNorms eps E (``bert-block:...,ln_eps=E``) and tells the method (``--ln-eps E``; ``--tell
F`` tells it F instead): the float32 route, so a seed counts within 1e-4 for float64 answers too, and the
eps fitted is printed.
"""

from __future__ import annotations

import argparse
import time

import headthief as ht

PARTS = ("ln2_gamma_rel_err", "ln2_beta_rel_err", "B_rel_err", "b_rel_err", "ln1_gamma_rel_err", "W1_rel_err",
         "W2_rel_err", "ffn_bias_rel_err", "O_rel_err", "W_rel_err", "c_rel_err")
SHORT = ("g2", "be2", "B", "b", "g1", "W1", "W2", "fb", "O_h", "W_h", "c_h")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--seeds", nargs=2, type=int, default=[1, 11], metavar=("FIRST", "STOP"))
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--within", type=float, default=None,
                    help="a seed counts as recovered when every part and the fidelity are within this "
                         "(default 1e-8 for float64 answers, 1e-4 for float32: the MiniLM line's level)")
    ap.add_argument("--stage-f", dest="stage_f", default="auto", choices=("auto", "full", "probes"),
                    help="stage F's route (headthief extract --stage-f)")
    ap.add_argument("--act", default="gelu", help="the blocks' FFN activation (bert-block:act=...)")
    ap.add_argument("--assume", default=None,
                    help="the activation the method assumes (headthief extract --activation; default: --act)")
    ap.add_argument("--ln-eps", dest="ln_eps", type=float, default=None,
                    help="the blocks' LayerNorm eps (bert-block:ln_eps=...), told to the method (--ln-eps)")
    ap.add_argument("--tell", type=_eps, default=None,
                    help="the eps told to the method instead of --ln-eps, or auto (measured from the answers)")
    ap.add_argument("--image", action="store_true", help="blocks answering on a previous LayerNorm's image only "
                                                         "(bert-block:...,inputs=image)")
    args = ap.parse_args()
    assume = args.assume or args.act
    told = args.tell if args.tell is not None else args.ln_eps
    refusal = assume not in (args.act, "auto")
    exact = args.dtype == "float64" and told is None

    def within_for(row):                         # auto: the exact route where stage L kept BERT's eps
        ex = exact or (args.dtype == "float64" and told == "auto" and row.get("ln_eps_auto_start") is None)
        return args.within if args.within is not None else (1e-8 if ex else 1e-4), ex
    within = within_for({})[0]
    print("seed " + " ".join(f"{s:>8s}" for s in SHORT) + "  fidelity  queries     sec  exit" + (
        "  eps fitted" if told is not None else ""))
    ok = 0
    seeds = range(*args.seeds)
    for seed in seeds:
        spec = f"bert-block:d={args.d},heads={args.heads},ffn={args.ffn},seed={seed}" + (
            f",dtype={args.dtype}" if args.dtype != "float64" else "") + (
            f",act={args.act}" if args.act != "gelu" else "") + (
            f",ln_eps={args.ln_eps:g}" if args.ln_eps is not None else "") + (",inputs=image" if args.image else "")
        t = time.perf_counter()
        rep = ht.extract(spec, "block", raise_errors=False, stage_f=args.stage_f, activation=assume, ln_eps=told)
        r = rep.row
        errs = [r.get(k) for k in PARTS]
        fid = r.get("fidelity_max_rel_err")
        lim, ex = within_for(r)
        good = rep.exit_code == 0 and all(e is not None and e <= lim for e in errs) and (
            ex or (fid is not None and fid <= lim))
        if refusal:
            good = rep.exit_code == 5
        elif assume == "auto":                   # the class read from the answers must be the block's
            good = good and r.get("activation") == args.act
        ok += good
        cells = " ".join(f"{e:8.1e}" if e is not None else "       -" for e in errs)
        print(f"{seed:4d} {cells}  {fid if fid is None else f'{fid:8.1e}'} {r.get('queries', r.get('queries_sent', 0)):8d} "
              f"{time.perf_counter() - t:7.1f}  {rep.exit_code}" + (f"  {r.get('ln_eps', 0):10.3g}" if told else "")
              + (f"  {rep.error}" if rep.error else ""), flush=True)
    if refusal:
        print(f"{args.act} blocks with {assume} assumed, refused with exit 5: {ok}/{len(seeds)}")
        return
    print(f"every part within {within:g}" + ("" if exact else " and the fidelity too")
          + f": {ok}/{len(seeds)}")


def _eps(text: str):
    return "auto" if text == "auto" else float(text)


if __name__ == "__main__":
    main()
