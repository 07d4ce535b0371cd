"""What the float32 block route would cost at MiniLM's size (d = 384, 12 heads, FFN 1536): the block
refit's loss-and-gradient evaluation and one step of stage F's span iteration, timed on random numbers
of that size (torch; CUDA when there is a GPU, else the CPU).

    python benchmarks/bench_block_minilm_cost.py [--device cpu|cuda] [--repeats 5]

The block refit (``block/block_refit.py``) evaluates its loss and gradient once per L-BFGS iteration (the
runs at d = 16 and 32 took 1,000 to 4,500); stage F's span iteration (``block/ffn.py::span``) takes an SVD
of the lifted Jacobians (T x d^2, T >= ffn + 1 points) per step (60 to 210 steps measured at d <= 32).
Prints one row per (what, dtype): the shape, seconds per evaluation and the implied hours for the counts above.
"""

from __future__ import annotations

import argparse
import math
import time

D, HEADS, FFN = 384, 12, 1536
LENGTHS = (2, 4, 8, 16)


def _params(torch, dev, dt, gen):
    dh = D // HEADS
    r = lambda *s: (torch.randn(*s, generator=gen, dtype=torch.float64) / math.sqrt(s[-1])).to(dev, dt).requires_grad_()
    return {"Q": r(HEADS, dh, D), "K": r(HEADS, dh, D), "V": r(HEADS, dh, D), "Wo": r(D, D), "bq": r(HEADS, dh),
            "bo": r(D), "g1": r(D), "W1": r(FFN, D), "b1": r(FFN), "W2": r(D, FFN), "b2": r(D), "g2": r(D),
            "be2": r(D)}


def _norm(v):
    vc = v - v.mean(-1, keepdim=True)
    return vc / vc.pow(2).mean(-1, keepdim=True).sqrt()


def _loss(torch, p, X, Y):
    dh = D // HEADS
    q = torch.einsum("ntd,hkd->nhtk", X, p["Q"]) + p["bq"][None, :, None, :]
    k = torch.einsum("ntd,hkd->nhtk", X, p["K"])
    v = torch.einsum("ntd,hkd->nhtk", X, p["V"])
    A = torch.softmax(torch.einsum("nhtk,nhsk->nhts", q, k) / math.sqrt(dh), -1)
    z = torch.einsum("nhts,nhsk->nthk", A, v).reshape(X.shape[0], X.shape[1], D)
    zz = _norm(X + z @ p["Wo"].T + p["bo"]) * p["g1"]
    s = zz @ p["W1"].T + p["b1"]
    g = 0.5 * s * (1 + torch.erf(s / math.sqrt(2)))
    y = _norm(zz + g @ p["W2"].T + p["b2"]) * p["g2"] + p["be2"]
    return 0.5 * (y - Y).pow(2).sum()


def _timed(torch, dev, fn, repeats):
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    import torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = args.device
    print(f"device: {torch.cuda.get_device_name(0) if dev == 'cuda' else 'cpu'}")
    gen = torch.Generator().manual_seed(0)
    params = 4 * D * D + 6 * D + 2 * D * FFN + FFN
    positions = max(4000, 8 * params // D)
    print(f"{'what':40s} {'dtype':8s} {'shape':28s} {'s each':>9s} {'hours for':>10s}")
    for dt in (torch.float32, torch.float64):
        p = _params(torch, dev, dt, gen)
        groups = []
        for T in LENGTHS:
            n = -(-positions // len(LENGTHS) // T)
            X = torch.randn(n, T, D, generator=gen, dtype=torch.float64).to(dev, dt)
            groups.append((X, torch.randn(n, T, D, generator=gen, dtype=torch.float64).to(dev, dt)))

        def step():
            for v in p.values():
                v.grad = None
            sum(_loss(torch, p, X, Y) for X, Y in groups).backward()

        s = _timed(torch, dev, step, args.repeats)
        name = "block refit: loss + gradient"
        print(f"{name:40s} {str(dt)[6:]:8s} {f'{params:,} params, {positions:,} pos':28s} {s:9.3f} "
              f"{4500 * s / 3600:10.2f}")
        del p, groups
    for T in (FFN + 1, 5 * (FFN + 1)):
        try:
            L = torch.randn(T, D * D, generator=gen, dtype=torch.float64).to(dev)
        except RuntimeError as e:                                          # out of memory
            print(f"span step T={T}: {e}")
            continue
        # one step's principal subspace: eigenvectors of the T x T Gram matrix
        s = _timed(torch, dev, lambda: torch.linalg.eigh(L @ L.T), args.repeats)
        name = f"span step (Gram + eigh), T = {T}"
        print(f"{name:40s} {'float64':8s} {f'{T} x {D * D}':28s} {s:9.3f} {210 * s / 3600:10.2f}")
        del L
    print("hours for: 4,500 refit iterations, 210 span steps (the most measured at d <= 32)")


if __name__ == "__main__":
    main()
