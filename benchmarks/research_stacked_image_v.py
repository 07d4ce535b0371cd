"""Research (issue 19, not a method): stage V on a previous LayerNorm's image at any width, its equations
solved stacked by alternating least squares with Anderson mixing. Kept as a measurement, not in the library:
its convergence is not reliable (below).

The equations are :mod:`headthief.extraction.block.value_sum_image`'s (``Y = J V T``, ``Z = J G T``, ``J (V n + c)
= 0``, ``J = [Z, 0, zeta] [G T, 1, G n]^{-1}``). Given ``V, c`` every ``zeta`` is a closed-form least squares;
given every ``zeta``, with ``[A, nu] = Qm^T [T, n]`` and ``M = [A, nu]^{-1}``, the equations read ``J (V_m + c
m^T) = Y M_k``: stacked over the bases one least squares in ``V_m`` with a shared unknown, and c from d x d
normal equations on what is left outside the stacked J's range. The dense Levenberg-Marquardt of
``value_sum_image`` is built to d = 88; this one costs O(bases d^3) a step.

Measured (2-core machine):

* random float64 blocks on random images (``--random D SEED``), d = 16, 24, 32: K within 2.6e-12 - 5.2e-12,
  the dense fit's figures, in 141 - 339 steps;
* ``--encoder bert-encoder:d=96,heads=2,ffn=8,layers=1,seed=2,positions=4 --seeds 0 4`` (float64, block 0
  behind LN_emb, forward paths): K within 7.3e-12 at 600 steps on one draw, but 4.7e-6, 3.2e-8 and 7.6e-12
  after up to 1,500 steps on three others: the alternation creeps (linear convergence, plateaus), and a
  stopped iterate can have a residual of 3.5e-11 with K 6% off (a nearly flat direction; measured through
  the encoder route with the offsets read). Not reliable enough to report a part from;
* ``--minilm-encoder 0`` (all-MiniLM-L6-v2 in float32, the true offsets, 6 bases, the step measured on a
  ladder: 16x the rule's): block 0's K within **1.6e-5** and c within 4.5e-5 (relative, Frobenius), residual
  2.5e-5 (the same as at the true B), 109 steps, 27,510 queries, 31 s of solve;
* ``--minilm-encoder 2``: the stacked equations' residual at the *true* B is 0.50. Block 2's inputs move only
  through blocks 0 and 1, and those moves are very unevenly scaled (the smallest of d - 2 singular values of
  the measured moves 2e-6 - 1.5e-4 of the largest at six points), so in float32 their weak directions are
  rounding: forward paths do not fix block 2's B at this precision (blocks 4 and 5 alike: 0.59, 0.70);
* MiniLM block 2 as a block on block 1's real output image (``--minilm-image 2``, float32, free image moves,
  6 bases): K within 4.6e-5 at the step 8x the rule's, 9.0e-5 at 4x, 5.2e-4 at 1x with 3 bases.

    .venv/bin/python benchmarks/research_stacked_image_v.py --random 16 1
    .venv/bin/python benchmarks/research_stacked_image_v.py --encoder bert-encoder:d=96,heads=2,ffn=8,layers=1,seed=2,positions=4 --seeds 0 4
    .venv/bin/python benchmarks/research_stacked_image_v.py --minilm-encoder 0
    .venv/bin/python benchmarks/research_stacked_image_v.py --minilm-image 2 --step 8
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from headthief.errors import ConvergenceError, ModelMismatch
from headthief.extraction.block.image import LayerNormImage, random_image
from headthief.extraction.block.value_sum import CONSISTENCY, centre, ladder_step, stencil_derivative
from headthief.extraction.block.value_sum import mean_zero_basis
from headthief.extraction.block.value_sum_image import ImageValueSum, _jacobians

MAX_ITER = 1500    # alternating steps (measured: 141 - 339 to 1e-12 in float64 at d = 16 - 32, ~600 at d = 96)
MEMORY = 8         # Anderson mixing's memory
STEP_TOL = 1e-13   # relative move of (V, c) that ends the iteration
STALL = 40         # steps without a 1% drop of the best residual that end it (float32: at its floor; Anderson
                   # plateaus for 20 steps on the way down in float64, measured at d = 16 and 24)


class _Stacked:
    def __init__(self, image: LayerNormImage, data: list):
        d = image.d
        self.d, self.G = d, np.asarray(image.gamma, np.float64)
        self.Qm = Qm = mean_zero_basis(d)
        self.pre = []
        for n, T, Z, Y in data:
            n, T, Z, Y = (np.asarray(a, np.float64) for a in (n, T, Z, Y))
            # an orthonormal basis of the moves (measured moves behind earlier blocks are far from orthogonal),
            # the Jacobians along it: Z R^-1 and Y R^-1 are exact rewrites of the same equations
            T, R = np.linalg.qr(T)
            Z, Y = np.linalg.solve(R.T, Z.T).T, np.linalg.solve(R.T, Y.T).T
            k = T.shape[1]
            Ei = np.linalg.inv(np.column_stack([self.G[:, None] * T, np.ones(d), self.G * n]))
            M = np.linalg.inv(np.column_stack([Qm.T @ T, Qm.T @ n]))
            self.pre.append((Qm.T @ T, Qm.T @ n, Z, Y, Ei, Y @ M[:k], M[k], k))
        self.S = np.vstack([p[5] for p in self.pre])
        self.scale = float(np.linalg.norm(self.S))

    def jacobians(self, Vm: np.ndarray, c: np.ndarray) -> list:
        """Every base's ``J = [Z, 0, zeta] E^{-1}`` with zeta by least squares given ``V_m, c``."""
        out = []
        for A, nu, Z, Y, Ei, _, _, k in self.pre:
            W = Ei @ (Vm @ A)
            al, ga = W[:k], W[k + 1]
            w0 = Ei @ (Vm @ nu + c)
            a0, g0 = w0[:k], w0[k + 1]
            z = ((Y - Z @ al) @ ga - (Z @ a0) * g0) / max(float(ga @ ga + g0 * g0), 1e-300)
            out.append(Z @ Ei[:k] + np.outer(z, Ei[k + 1]))
        return out

    def step(self, Vm: np.ndarray, c: np.ndarray):
        """``(V_m, c)`` by the stacked least squares given the zetas of ``(Vm, c)``, and the relative residual."""
        d = self.d
        Js = self.jacobians(Vm, c)
        Jst = np.vstack(Js)
        U, sv, Vt = np.linalg.svd(Jst, full_matrices=False)
        r = int(np.sum(sv > sv[0] * 1e-13))
        U, sv, Vt = U[:, :r], sv[:r], Vt[:r]
        rows = Js[0].shape[0]
        outside = self.S - U @ (U.T @ self.S)
        ms = [p[6] for p in self.pre]
        Fs = [U[i * rows:(i + 1) * rows].T @ J for i, J in enumerate(Js)]
        mm = np.array([[a @ b for b in ms] for a in ms])
        Gm, g = np.zeros((d, d)), np.zeros(d)
        for i, J in enumerate(Js):
            Gm += mm[i, i] * (J.T @ J) - Fs[i].T @ sum(mm[i, j] * Fs[j] for j in range(len(Js)))
            g += J.T @ (outside[i * rows:(i + 1) * rows] @ ms[i])
        c_new = np.linalg.lstsq(Gm, g, rcond=None)[0]
        C = np.vstack([np.outer(J @ c_new, ms[i]) for i, J in enumerate(Js)])
        Vm_new = Vt.T @ ((U.T @ (self.S - C)) / sv[:, None])
        res = float(np.linalg.norm(Jst @ Vm_new + C - self.S) / max(self.scale, 1e-300))
        return centre(Vm_new), c_new, res


def solve_stacked(image: LayerNormImage, data: list, *, expected: float, conditioning: float, step: float,
                  queries: int, max_iter: int = MAX_ITER, where: str = "", stall: bool = True,
                  check: str = "value-sum (image, stacked)") -> ImageValueSum:
    """Stage V's equations over the bases ``data`` (``(n, T, Z, Y)`` each: the base in n-coordinates, its
    tangent basis, the pair and one-token Jacobians along it), solved stacked (module docstring) from
    ``B = I, b = 0``. ``stall``: a residual at its floor ends the iteration too (coarse answers; float64 answers
    settle by the step, their residual creeping down linearly for hundreds of steps behind an encoder's
    LN_emb at d = 96, measured). :class:`ConvergenceError` if ``max_iter`` steps end neither settled nor stalled;
    :class:`ModelMismatch` if the residual is above ``CONSISTENCY x expected`` (two blocks given as one)."""
    fit = _Stacked(image, data)
    d, Qm = fit.d, fit.Qm
    x = np.concatenate([centre(fit.G[:, None] * Qm).ravel(), np.asarray(image.beta, np.float64)])
    shape = (d, d - 1)
    xs, fs, best, stalled, ended = [], [], np.inf, 0, False
    for it in range(1, max_iter + 1):
        Vm, c, res = fit.step(x[:-d].reshape(shape), x[-d:])
        gx = np.concatenate([Vm.ravel(), c])
        f = gx - x
        moved = float(np.linalg.norm(f) / max(np.linalg.norm(gx), 1e-300))
        if res < 0.99 * best:
            best, stalled = res, 0
        else:
            stalled += 1
        if moved <= STEP_TOL or (stall and stalled >= STALL):
            ended = True
            break
        xs.append(x.copy())
        fs.append(f)
        xs, fs = xs[-MEMORY - 1:], fs[-MEMORY - 1:]
        if len(fs) > 1:
            dF = np.stack([fs[i + 1] - fs[i] for i in range(len(fs) - 1)], axis=1)
            dX = np.stack([xs[i + 1] - xs[i] for i in range(len(xs) - 1)], axis=1)
            gam = np.linalg.lstsq(dF, f, rcond=None)[0]
            x = x + f - (dX + dF) @ gam
        else:
            x = gx
    if res > CONSISTENCY * expected:
        if not ended:
            raise ConvergenceError(f"{where}stage V (stacked) did not settle in {max_iter} steps (relative residual "
                                   f"{res:.3g})")
        raise ModelMismatch(
            f"{where}the tangent Jacobians at {len(data)} image points are not J_Phi (delta_ij I + (B - I)/2) G T for "
            f"one value-output map B (relative residual {res:.3g} > {CONSISTENCY:g} x the stencil's {expected:.2g}): "
            "not one post-LN block", check=check, figure=res, threshold=CONSISTENCY * expected)
    return ImageValueSum(K=centre(Vm @ Qm.T), c=centre(c), image=image, residual=res, conditioning=conditioning,
                         expected=expected, step=step, iterations=it, queries=queries)




def _errors(ivs, block, image):
    d = image.d
    B, b = block.astype(np.float64).value_output_sum()
    Kt = centre((B * np.asarray(image.gamma)[None, :]) @ (np.eye(d) - 1.0 / d))
    ct = centre(B @ np.asarray(image.beta) + b)
    return (float(np.linalg.norm(ivs.K - Kt) / np.linalg.norm(Kt)), float(np.linalg.norm(ivs.c - ct) / np.linalg.norm(Kt)))


def _report(tag, ivs, block, image, seconds):
    K, c = _errors(ivs, block, image)
    print(f"{tag}: K {K:.3g}  c {c:.3g}  residual {ivs.residual:.3g}  steps {ivs.iterations}  {seconds:.1f} s", flush=True)


def random_case(d: int, seed: int, dtype=np.float64) -> None:
    from headthief.extraction.block.image import ImageGuard
    from headthief.models.bert_block import random_block
    from headthief.oracles.base import ModelOracle
    block = random_block(d, 2 if d < 16 else 4, 2 * d, seed=seed, dtype=dtype)
    image = random_image(d, seed)
    o = ImageGuard(ModelOracle(block), image)
    rng = np.random.default_rng(seed)
    eps = 2.0 ** -53 if dtype is np.float64 else 6e-8
    h = eps ** 0.2
    data = []
    for n in image.points(rng, 3):
        T = image.tangent(n, rng)
        Y, Z, _ = _jacobians(o, image, n, T, h)
        data.append((n, T, Z, Y))
    t = time.perf_counter()
    ivs = solve_stacked(image, data, expected=eps ** 0.8 * np.sqrt(d), conditioning=0.0, step=h, queries=0,
                        stall=dtype is not np.float64)
    _report(f"random d={d} seed={seed}", ivs, block, image, time.perf_counter() - t)


def minilm_image(layer: int, step: float, bases: int) -> None:
    from headthief.extraction.block.image import ImageGuard
    from headthief.models.bert_block import from_minilm
    from headthief.oracles.base import ModelOracle
    block, prev = from_minilm(layer, dtype=np.float32), from_minilm(layer - 1, dtype=np.float64)
    image = LayerNormImage(np.asarray(prev.ln2_gamma, float), np.asarray(prev.ln2_beta, float))
    o = ImageGuard(ModelOracle(block), image, tol=1e-6)
    rng = np.random.default_rng(1)
    eps = 6e-8
    h = step * eps ** 0.2
    data = []
    for n in image.points(rng, bases):
        T = image.tangent(n, rng)
        Y, Z, _ = _jacobians(o, image, n, T, h)
        data.append((n, T, Z, Y))
    t = time.perf_counter()
    ivs = solve_stacked(image, data, expected=eps ** 0.8 * np.sqrt(block.d), conditioning=0.0, step=h, queries=0,
                        stall=True)
    _report(f"MiniLM block {layer} on block {layer - 1}'s image, step x{step:g}, {bases} bases", ivs, block, image,
            time.perf_counter() - t)


def encoder_case(spec: str, k: int, seed: int, true_offsets: bool) -> None:
    from headthief.extraction.block.embeddings import Embeddings, embedding_stage
    from headthief.extraction.block.encoder import _Paths, value_sum_data
    from headthief.targets import resolve
    t = resolve(spec)
    o, truth = t.make_oracle(), t.truth
    rng = np.random.default_rng(seed)
    d, L = t.d, len(truth.blocks)
    P = min(16, int(t.info.get("positions", 16)))
    emb = embedding_stage(o, rng, length=P, d_hidden=d)
    if true_offsets:
        c = centre((np.asarray(truth.position[:P], float) + np.asarray(truth.token_type, float)).T).T
        emb = Embeddings(ln=emb.ln, offsets=c, residual=emb.residual, queries=emb.queries)
    paths = _Paths(o, emb, L)
    img0 = paths.image
    coarse = str(t.info.get("dtype", "float64")) == "float32"
    eps = 6e-8 if coarse else 2.0 ** -53
    h, expected = eps ** 0.2, eps ** 0.8 * np.sqrt(d)
    if k == 0:
        image = img0
    else:
        pb = truth.blocks[k - 1]
        image = LayerNormImage(np.asarray(pb.ln2_gamma, float), np.asarray(pb.ln2_beta, float))
    if coarse:
        n = img0.points(rng, 1)[0]
        T8 = img0.tangent(n, rng)[:, :8]
        h, expected, _, _ = ladder_step(lambda s: stencil_derivative(
            paths.states(img0.tokens(img0.stencil(n, T8, s))[:, None, :])[k + 1][:, 0], 8, s), h, limit=0.25 * np.sqrt(d))
    q0 = o.queries
    data, _ = value_sum_data(paths, k, image, rng, h, 6 if coarse else 3)
    conds = [float(np.linalg.svd(T, compute_uv=False)[-1] / np.linalg.svd(T, compute_uv=False)[0]) for _, T, _, _ in data]
    print(f"{spec} block {k} seed {seed}: step {h:.3g}, {o.queries - q0} queries, moves' conditioning "
          f"{min(conds):.2g} - {max(conds):.2g}", flush=True)
    fit = _Stacked(image, data)
    B, b = truth.blocks[k].astype(np.float64).value_output_sum()
    at_truth = fit.step(centre((B * np.asarray(image.gamma)[None, :]) @ fit.Qm), B @ np.asarray(image.beta) + b)[2]
    print(f"  the equations' residual at the true B: {at_truth:.3g}", flush=True)
    t0 = time.perf_counter()
    try:
        ivs = solve_stacked(image, data, expected=float(expected), conditioning=0.0, step=h, queries=0, stall=coarse)
        _report("  stacked", ivs, truth.blocks[k], image, time.perf_counter() - t0)
    except (ConvergenceError, ModelMismatch) as e:
        print("  stacked:", e, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", nargs=2, type=int, metavar=("D", "SEED"))
    ap.add_argument("--encoder", metavar="SPEC")
    ap.add_argument("--seeds", nargs=2, type=int, default=[0, 1], metavar=("FIRST", "STOP"))
    ap.add_argument("--minilm-encoder", dest="minilm_encoder", type=int, metavar="BLOCK")
    ap.add_argument("--minilm-image", dest="minilm_image", type=int, metavar="BLOCK")
    ap.add_argument("--step", type=float, default=8.0, help="--minilm-image: the step, times the rule's")
    ap.add_argument("--bases", type=int, default=6)
    a = ap.parse_args()
    if a.random:
        random_case(*a.random)
    if a.encoder:
        for s in range(*a.seeds):
            encoder_case(a.encoder, 0, s, False)
    if a.minilm_encoder is not None:
        encoder_case("minilm-encoder:hidden=all", a.minilm_encoder, 0, True)
    if a.minilm_image is not None:
        minilm_image(a.minilm_image, a.step, a.bases)


if __name__ == "__main__":
    main()
