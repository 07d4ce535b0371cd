"""What the block's two refits share: LayerNorm's normalisation with its exact backward pass, packing named
parameters into one vector, and L-BFGS run in chunks until a chunk stops paying, in coordinates scaled by the
Gauss-Newton diagonal (:func:`diagonal_scale`).

The scaling: the refits' parameters differ in scale and in how strongly the answers see them (an FFN row
against LN2's gamma, a head's Q against its V), and L-BFGS from a near start spends most of its iterations
on that spread. Run in ``z = s * theta`` with ``s_i = sqrt((J^T J)_ii)`` (J the residuals' Jacobian), the
diagonal of the Gauss-Newton matrix is one. It is estimated by Hutchinson's rule, ``(J^T J)_ii = E[(J^T
w)_i^2]`` over random signs w, from ``PROBES`` gradients: ``J^T w`` is the loss's gradient with the answers
moved by ``-w`` minus its gradient at the answers. Measured on float32 blocks at d = 16 and 32: the
iterations to the answers' floor fall 2 - 3x from the algebra's own starts, and 1.2 - 1.7x counting the
stopping rule's last chunk (``benchmarks/bench_refit_scaling.py``; docs/block.md, "Refits in scaled
coordinates")."""

from __future__ import annotations

import numpy as np

CHUNK = 500            # L-BFGS iterations per chunk
CHECK = 100            # the one-token refit tests the last CHUNK iterations' gain every CHECK iterations
                       # (minimize_in_chunks); the block refit keeps the chunks' own test (see docs/block.md)
CHECKPOINT_EVERY = 50     # evaluations between the refits' checkpoint calls (block_refit, one_token_refit)
GAIN = 0.81            # a chunk must bring the loss below this fraction of its start (rms down by 10%)
SLOW_GAIN = 0.98       # ... for a fit in a slow valley (rms down by 1% a chunk; see encoder.POLISH)
FLAT_EVERY = 100       # a fit given a floor (minimize_in_chunks) ends where, at or below it, the last FLAT_EVERY
FLAT = 1e-4            # iterations gained less than FLAT of the loss (docs/block.md, "R ends at the answers' floor")
PROBES = 16            # random-sign probes of the Gauss-Newton diagonal (relative error ~ sqrt(2 / PROBES) each)
FLOOR = 1e-8           # a coordinate's scale at least this times the largest (directions no answer sees)
LEPS_RANGE = (float(np.log(1e-20)), float(np.log(1e-2)))   # a fitted LayerNorm log eps, clipped (block_refit)


def _row_mean(v: np.ndarray) -> np.ndarray:
    """The mean along the last axis, kept as a length-1 axis: one matrix-vector product with the ones (numpy's
    reduction over short rows costs ~2 ns a number, 6x the product's, measured on (3000, 8): 57 against 9 us;
    the two differ by rounding only)."""
    d = v.shape[-1]
    return (v @ np.full(d, 1.0 / d, dtype=v.dtype))[..., None]


def colsum(a: np.ndarray) -> np.ndarray:
    """The sum over the rows of a 2-D array (positions x features): one vector-matrix product with the ones,
    for the same reason as :func:`_row_mean` (numpy's column reduction: 52 against ~9 us on (3000, 8))."""
    return np.ones(a.shape[0], dtype=a.dtype) @ a


def normalize(v: np.ndarray, eps: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``(v - mean) / sqrt(var + eps)`` along the last axis, and that root (LayerNorm without gamma and beta;
    ``eps`` 0: BERT's 1e-12, which moves nothing the refits see). :func:`normalize_back` holds for any eps."""
    vc = v - _row_mean(v)
    r = np.sqrt(_row_mean(vc * vc) + eps)          # + 0.0 changes no bit
    return vc / r, r


def normalize_back(dn: np.ndarray, n: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The gradient through :func:`normalize`: ``dL/dv`` from ``dL/dn``, n and r."""
    dvc = (dn - n * _row_mean(dn * n)) / r
    return dvc - _row_mean(dvc)


def pack(params: dict, shapes: dict) -> np.ndarray:
    """The parameters named in ``shapes`` (in its order) as one float64 vector."""
    return np.concatenate([np.asarray(params[k], dtype=np.float64).ravel() for k in shapes])


def unpack(theta: np.ndarray, shapes: dict) -> dict:
    """:func:`pack`'s inverse: views of ``theta`` shaped as ``shapes`` (name -> shape, in packing order)."""
    out, i = {}, 0
    for k, shape in shapes.items():
        n = int(np.prod(shape))
        out[k] = theta[i:i + n].reshape(shape)
        i += n
    return out


def diagonal_scale(jt_signs, probes: int = PROBES) -> np.ndarray:
    """``sqrt`` of the Gauss-Newton matrix's diagonal (module docstring), from ``probes`` calls of
    ``jt_signs()``, each ``J^T w`` for fresh random signs w; coordinates no probe sees get ``FLOOR`` times the
    largest scale (all ones when no coordinate is seen)."""
    acc = None
    for _ in range(probes):
        g = np.asarray(jt_signs(), dtype=np.float64)
        acc = g * g if acc is None else acc + g * g
    s = np.sqrt(acc / probes)
    top = float(s.max()) if s.size else 0.0
    if not np.isfinite(top) or top <= 0.0:
        return np.ones_like(s)
    return np.maximum(s, FLOOR * top)


def signs(rng: np.random.Generator, shape) -> np.ndarray:
    """Random signs (+1 / -1) of ``shape``: the Hutchinson probes."""
    return rng.integers(0, 2, shape) * 2.0 - 1.0


def minimize_in_chunks(fun, theta0: np.ndarray, L0: float, max_iter: int, gain: float = GAIN,
                       scale: np.ndarray | None = None, check: int = CHUNK,
                       history: list[float] | None = None,
                       floor: float | None = None, target: float | None = None) -> tuple[np.ndarray, float, int, str]:
    """L-BFGS on ``fun`` (returns loss and gradient) from ``theta0`` (loss ``L0``) in chunks of CHUNK
    iterations until one leaves the loss above ``gain`` x its start (default: 10% rms) or ``max_iter``
    iterations are spent: ``(theta, loss, iterations, message)``, the best point seen (the start when nothing
    improved on it). ``scale``: run in ``z = scale * theta`` (:func:`diagonal_scale`); theta is returned.
    ``check`` < CHUNK: every ``check`` iterations, the last CHUNK iterations (across chunks) must have brought
    the loss below ``gain`` x where it was, else the fit stops there: the same test on a window that slides by
    ``check``, so at most CHUNK - ``check`` fewer iterations are spent without gain at the end (``check =
    CHUNK``: the chunks' own test).

    ``history``: a list the fit keeps the loss after every iteration in (index 0: the start), appended to in
    place, so a caller can checkpoint it with the parameters. A fit resumed from a checkpoint passes the list it
    kept: ``theta0`` then continues it (its loss ``L0`` stands for the last entry), the iterations before the
    cut count toward ``max_iter`` and the stopping rule's window, and the first chunk ends where the cut one
    would have, so a resumed fit stops where an uninterrupted one would (its L-BFGS memory aside). The
    iterations returned are the whole fit's.

    ``floor``: a loss the answers' own noise explains (the block refit: 4x the one-token refit's in-sample
    loss on the same oracle's answers). Every ``FLAT_EVERY`` iterations, a fit at or below it whose last
    ``FLAT_EVERY`` iterations gained less than ``FLAT`` of the loss ends there: at the noise floor the
    iterations left move nothing the answers see (measured on float32 blocks, d = 8 and 16: the fresh-sequence
    fidelity flat from the ~250th iteration on, while the chunks' test ran 500 - 950). Above the floor (a slow
    valley) only the chunks' test applies.

    ``target``: a loss at which the fit has done its part (the one-token refit F+, a start the block refit R
    refines: ``F_TARGET`` x the answers' measured noise, :mod:`.extract`); the fit ends at the first iteration
    at or below it."""
    from scipy.optimize import minimize
    seen = [] if history is None else history          # the loss after every iteration so far
    if scale is not None:
        s = np.asarray(scale, dtype=np.float64)

        def scaled(z):
            L, G = fun(z / s)
            return L, G / s
        z, L1, iters, message = minimize_in_chunks(scaled, theta0 * s, L0, max_iter, gain, check=check,
                                                   history=seen, floor=floor, target=target)
        return z / s, L1, iters, message
    if not 1 <= int(check) <= CHUNK:
        raise ValueError(f"check must be 1..{CHUNK} iterations, got {check}")
    if seen:
        seen[-1] = float(L0)                          # resumed: the start stands where the cut fit was
    else:
        seen.append(float(L0))
    done = len(seen) - 1                              # iterations before a resume (0: a fresh fit)
    theta, L1, iters, message = theta0, float(L0), done, ""
    if done >= max_iter:
        return theta, L1, iters, f"the iteration cap ({max_iter}) was reached before the resume"

    flat, reached = [False], [False]

    def stalled(intermediate_result):
        seen.append(float(intermediate_result.fun))
        k = len(seen) - 1
        if target is not None and seen[k] <= target:
            reached[0] = True
            raise StopIteration
        if check < CHUNK and k >= CHUNK and k % check == 0 and seen[k] >= gain * seen[k - CHUNK]:
            raise StopIteration                       # scipy ends the run there, with its current point
        if (floor is not None and k >= FLAT_EVERY and k % FLAT_EVERY == 0 and seen[k] <= floor
                and seen[k] >= (1.0 - FLAT) * seen[k - FLAT_EVERY]):
            flat[0] = True
            raise StopIteration

    first = done % CHUNK                              # a resumed fit first ends the chunk that was cut
    while iters < max_iter:
        start = seen[iters - first] if first else L1
        sol = minimize(fun, theta, jac=True, method="L-BFGS-B", callback=stalled,
                       options={"maxiter": min(CHUNK - first, max_iter - iters), "maxfun": 2 * CHUNK, "maxcor": 30,
                                "ftol": 0.0, "gtol": 0.0})
        first = 0
        iters += int(sol.nit)
        del seen[iters + 1:]                          # the callback's count matches the iterations taken
        message = str(sol.message)
        if float(sol.fun) < L1:
            theta, L1 = sol.x, float(sol.fun)
        if "StopIteration" in message and reached[0]:
            message = f"reached its target (a loss of {target:.3g})"
            break
        if "StopIteration" in message and flat[0]:
            message = (f"at the answers' floor, the last {FLAT_EVERY} iterations gained less than {FLAT:g} "
                       "of the loss")
            break
        if "StopIteration" in message:
            message = f"the last {CHUNK} iterations gained less than {1 - gain:.3g} of the loss (checked every {check})"
            break
        if int(sol.nit) == 0 or (check == CHUNK and not float(sol.fun) < gain * start):
            break
    return theta, L1, iters, message


__all__ = ["CHECK", "colsum", "diagonal_scale", "minimize_in_chunks", "normalize", "normalize_back", "pack", "signs",
           "unpack"]
