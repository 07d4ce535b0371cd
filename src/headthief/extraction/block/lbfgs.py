"""What the block's two refits share: LayerNorm's normalisation with its exact backward pass, packing named
parameters into one vector, and L-BFGS run in chunks until a chunk stops paying."""

from __future__ import annotations

import numpy as np

CHUNK = 500            # L-BFGS iterations per chunk
GAIN = 0.81            # a chunk must bring the loss below this fraction of its start (rms down by 10%)
SLOW_GAIN = 0.98       # ... for a fit in a slow valley (rms down by 1% a chunk; see encoder.POLISH)


def normalize(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(v - mean) / rms`` along the last axis, and the rms (LayerNorm without gamma, beta and eps)."""
    vc = v - v.mean(axis=-1, keepdims=True)
    r = np.sqrt((vc * vc).mean(axis=-1, keepdims=True))
    return vc / r, r


def normalize_back(dn: np.ndarray, n: np.ndarray, r: np.ndarray) -> np.ndarray:
    """The gradient through :func:`normalize`: ``dL/dv`` from ``dL/dn``, n and r."""
    dvc = (dn - n * (dn * n).mean(axis=-1, keepdims=True)) / r
    return dvc - dvc.mean(axis=-1, keepdims=True)


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


def minimize_in_chunks(fun, theta0: np.ndarray, L0: float, max_iter: int,
                       gain: float = GAIN) -> tuple[np.ndarray, float, int, str]:
    """L-BFGS on ``fun`` (returns loss and gradient) from ``theta0`` (loss ``L0``) in chunks of CHUNK
    iterations until one leaves the loss above ``gain`` x its start (default: 10% rms) or ``max_iter``
    iterations are spent: ``(theta, loss, iterations, message)``, the best point seen (the start when nothing
    improved on it)."""
    from scipy.optimize import minimize
    theta, L1, iters, message = theta0, float(L0), 0, ""
    while iters < max_iter:
        sol = minimize(fun, theta, jac=True, method="L-BFGS-B",
                       options={"maxiter": min(CHUNK, max_iter - iters), "maxfun": 2 * CHUNK, "maxcor": 30,
                                "ftol": 0.0, "gtol": 0.0})
        iters += int(sol.nit)
        message = str(sol.message)
        gained = float(sol.fun) < gain * L1
        if float(sol.fun) < L1:
            theta, L1 = sol.x, float(sol.fun)
        if not gained or int(sol.nit) == 0:
            break
    return theta, L1, iters, message


__all__ = ["minimize_in_chunks", "normalize", "normalize_back", "pack", "unpack"]
