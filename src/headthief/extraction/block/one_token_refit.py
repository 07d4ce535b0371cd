"""Stage F's refit for coarse (float32) answers: the one-token map fitted to the answers already paid for.

A one-token query x is answered by ``y = LN2(u(m))`` with ``m = normalize(B x + b)`` (LN1's normalised
output) and ``u(m) = gamma * m + c + W2 f(W1m m + b1m)`` (:class:`~.ffn.FFNPart`; f: GELU or
``part.activation``). Stages L, V and F recover every part of it by exact algebra on finite differences;
with float32 answers those differences are good to the stencil's error (``eps^0.8 sqrt(d)``, ~7e-6 at
d = 16) only, and the span, the rank-one neurons and the profile fits built on them carry ~1e-3 (measured:
one-token fidelity 2.2e-3 at d = 16).

The answers themselves are good to float32's rounding (~6e-8 relative). So this stage takes the algebraic
parts as a start and minimises ``sum |y(x) - y_answer|^2`` over one-token answers to random tokens
(:func:`refit_from_oracle` sends them: :func:`random_queries`), in all the parameters at once (``B, b``,
LN1's gamma, the neurons, ``c``, LN2's gamma and beta), by L-BFGS with the exact gradient (written out
below, checked against finite differences in the tests). The fit is local: it needs the algebraic start
(a fit from random weights stalls: docs/block.md), and it says so per part (``info["fitted"]``).

Gauges the fit cannot see and which are fixed afterwards: LN1 ignores the scale and the ones-component of
``B x + b`` (``B, b`` are rescaled to stage V's scale, which the Jacobians fix, and centred); LN2 ignores
the scale of u (``|gamma| = sqrt(d)``); ``W1m`` acts on mean-zero m only (its ones-component is removed).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...errors import ConvergenceError
from .ffn import FFNPart
from .layernorm import OutputLayerNorm
from .lbfgs import (CHECK, CHECKPOINT_EVERY, colsum, diagonal_scale, minimize_in_chunks, normalize, normalize_back, pack,
                    signs, unpack)
from .value_sum import ValueSum, centre, with_map

MAX_ITER = 20000       # L-BFGS iterations at most (each one evaluation of the loss and its gradient)


def shapes(d: int, f: int) -> dict[str, tuple[int, ...]]:
    """The refitted parameters (name -> shape, in packing order) for width d and f neurons."""
    return {"B": (d, d), "b": (d,), "gam": (d,), "c": (d,), "W1": (f, d), "b1": (f,), "W2": (d, f), "g2": (d,),
            "be2": (d,)}


def loss_and_grad(theta: np.ndarray, X: np.ndarray, Y: np.ndarray, d: int, f: int,
                  activation: str = "gelu") -> tuple[float, np.ndarray]:
    """``0.5 sum |y(x) - Y|^2`` over the one-token answers and its gradient in the packed parameters
    (``activation``: the FFN's, :mod:`headthief.models.activations`)."""
    from ...models.activations import value_and_prime
    p = unpack(theta, shapes(d, f))
    m, r1 = normalize(X @ p["B"].T + p["b"])
    s = m @ p["W1"].T + p["b1"]
    g, fp = value_and_prime(activation, s)
    n, r2 = normalize(m * p["gam"] + p["c"] + g @ p["W2"].T)
    res = n * p["g2"] + p["be2"] - Y
    L = 0.5 * float(np.sum(res * res))
    dn = res * p["g2"]
    du = normalize_back(dn, n, r2)
    ds = (du @ p["W2"]) * fp
    dm = du * p["gam"] + ds @ p["W1"]
    dpre = normalize_back(dm, m, r1)
    grads = {"B": dpre.T @ X, "b": colsum(dpre), "gam": colsum(du * m), "c": colsum(du),
             "W1": ds.T @ m, "b1": colsum(ds), "W2": du.T @ g, "g2": colsum(res * n), "be2": colsum(res)}
    return L, pack(grads, shapes(d, f))


def _parts(p: dict, part: FFNPart, ln: OutputLayerNorm, vs: ValueSum) -> tuple[FFNPart, OutputLayerNorm, ValueSum]:
    """The refit's parameters ``p`` as the stages' parts, in their gauges: ``B, b`` to stage V's scale (LN1
    ignores it), centred; u's scale to ``|gamma| = sqrt(d)``."""
    d = vs.B.shape[0]
    k = float(np.sum(centre(p["B"]) * vs.B) / np.sum(centre(p["B"]) ** 2))
    Bn, bn = k * p["B"], k * p["b"]
    s = float(np.linalg.norm(p["gam"]) / np.sqrt(d)) * (1.0 if p["gam"].sum() > 0 else -1.0)
    P = np.eye(d) - 1.0 / d
    fitted = list(part.info.get("fitted", []))
    fitted += [] if "every one-token part (L-BFGS refit)" in fitted else ["every one-token part (L-BFGS refit)"]
    new_part = FFNPart(gamma=p["gam"] / s, c=P @ (p["c"] / s), W1m=p["W1"] @ P, b1m=p["b1"].copy(), W2=p["W2"] / s,
                       info={**part.info, "refit": True, "fitted": fitted}, activation=part.activation)
    return new_part, dataclasses.replace(ln, gamma=p["g2"].copy(), beta=p["be2"].copy()), with_map(vs, Bn, bn)


def refit_one_token(part: FFNPart, ln: OutputLayerNorm, vs: ValueSum, X: np.ndarray, Y: np.ndarray, *,
                    max_iter: int = MAX_ITER, progress=None,
                    rng: np.random.Generator | None = None,
                    scaled: bool = True, checkpoint=None, device: str | None = None,
                    history: list[float] | None = None,
                    target: float | None = None) -> tuple[FFNPart, OutputLayerNorm, ValueSum, dict]:
    """The parts refitted to the one-token answers ``Y`` (k, d) of tokens ``X`` (k, d) (module docstring):
    ``(part, ln, vs, info)``. L-BFGS runs in coordinates scaled by the Gauss-Newton diagonal
    (:func:`.lbfgs.diagonal_scale`, its random signs from ``rng``; ``None``: a Generator seeded 0;
    ``scaled=False``: in the parameters themselves, as first built); it stops when the last 500 iterations
    gained less than 10% rms, tested every ``lbfgs.CHECK`` = 100 iterations. ``info`` has the rms residual before and
    after (relative to the answers' rms), the iterations, and ``fitted``. Raises :class:`ConvergenceError`
    when L-BFGS stops on an error other than convergence or the iteration cap with the fit no better than its start.
    ``checkpoint(calls, (part, ln, vs), history)``, if given, gets the parts at the current parameters and the
    loss after every iteration so far every ``CHECKPOINT_EVERY`` evaluations (:mod:`.resume`: a refit cut
    short goes on from them, ``history`` given back: :func:`.lbfgs.minimize_in_chunks`). ``device``: a torch
    device for the loss and its gradient (:mod:`.torch_losses`; None: numpy). ``target``: an rms (relative to
    the answers' rms) at which the refit ends (:func:`.lbfgs.minimize_in_chunks`; info ``refit_target``)."""
    X = np.asarray(X, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    d, f = X.shape[1], part.W1m.shape[0]
    Bfull = np.linalg.inv(vs.Binv)                     # full-rank B (its ones-component is LN1's to ignore)
    start = {"B": Bfull, "b": Bfull @ vs.c0, "gam": part.gamma, "c": part.c, "W1": part.W1m, "b1": part.b1m,
             "W2": part.W2, "g2": ln.gamma, "be2": ln.beta}
    theta0 = pack(start, shapes(d, f))
    rms = float(np.sqrt(np.mean(Y * Y)))
    if device is None:
        def evaluate(th, shift=None):
            return loss_and_grad(th, X, Y if shift is None else Y - shift, d, f, part.activation)
    else:
        from .torch_losses import OneTokenLoss
        evaluate = OneTokenLoss(shapes(d, f), X, Y, device, activation=part.activation)
    L0, G0 = evaluate(theta0)
    rng = np.random.default_rng(0) if rng is None else rng
    scale = diagonal_scale(lambda: evaluate(theta0, signs(rng, Y.shape))[1] - G0) if scaled else None
    calls = [0]
    seen = [] if history is None else [float(v) for v in history]

    def fun(th):
        calls[0] += 1
        L, G = evaluate(th)
        if progress is not None and calls[0] % 50 == 0:
            progress(calls[0], np.sqrt(2 * L / Y.size) / rms)
        if checkpoint is not None and calls[0] % CHECKPOINT_EVERY == 0:
            checkpoint(calls[0], _parts(unpack(th, shapes(d, f)), part, ln, vs), list(seen))
        return L, G

    at = None if target is None else 0.5 * Y.size * (float(target) * rms) ** 2      # the target as a loss
    theta, L1, iters, message = minimize_in_chunks(fun, theta0, L0, max_iter, scale=scale, check=CHECK,
                                                   history=seen, target=at)
    L0 = seen[0]                                       # the fit's own start (before a resume, if any)
    before = float(np.sqrt(2 * L0 / Y.size) / rms)
    after = float(np.sqrt(2 * L1 / Y.size) / rms)
    if not np.isfinite(L1) or L1 >= L0:
        raise ConvergenceError(f"the one-token refit did not improve on the algebraic start (rms {before:.3g} -> "
                               f"{after:.3g}; L-BFGS: {message})")
    new_part, new_ln, new_vs = _parts(unpack(theta, shapes(d, f)), part, ln, vs)
    info = {"refit_rms_before": before, "refit_rms_after": after, "refit_iterations": iters,
            "refit_answers": int(len(X)), "refit_message": message,
            **({} if target is None else {"refit_target": float(target)})}
    return new_part, new_ln, new_vs, info


def random_queries(d: int, ffn: int) -> int:
    """One-token queries of random tokens added to the refit's answers: twice the parameters over d (at
    least 2000). The stencils' answers sit in small neighbourhoods of T points; random tokens of norms 0.5 to
    1.5 times the base scale cover LN1's sphere and fix ``B, b`` (measured at d = 16, float32: one-token
    fidelity 8.5e-4 from the stencils' answers alone, 6.8e-7 from 3,000 random ones alone)."""
    params = 2 * d * d + 5 * d + 2 * d * ffn + ffn
    return max(3000, 8 * params // d)


def random_answers(oracle, rng: np.random.Generator, *, scale: float, ffn: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`random_queries` one-token queries of random tokens (norms ``U(0.5, 1.5) scale``, within the
    input-norm bound when there is one) and their answers: ``(X (k, d), Y (k, d_out))``."""
    d = oracle.d
    k = random_queries(d, ffn)
    Xr = rng.standard_normal((k, d))
    norms = scale * rng.uniform(0.5, 1.5, (k, 1))
    if oracle.input_norm is not None:
        norms = np.minimum(norms, 0.99 * float(oracle.input_norm))
    Xr *= norms / np.linalg.norm(Xr, axis=1, keepdims=True)
    return Xr, np.asarray(oracle.query_packed(Xr[:, None, :]), dtype=np.float64)


def refit_from_oracle(oracle, part: FFNPart, ln: OutputLayerNorm, vs: ValueSum, rng: np.random.Generator, *,
                      scale: float, progress=None, max_iter: int = MAX_ITER, scaled: bool = True, start=None,
                      checkpoint=None, device: str | None = None, history: list[float] | None = None,
                      target: float | None = None):
    """Send :func:`random_queries` one-token queries of random tokens (norms ``U(0.5, 1.5) scale``, within
    the input-norm bound when there is one) and :func:`refit_one_token` the parts to their answers. Returns
    ``(part, ln, vs, info, (X, Y))`` with ``info["refit_queries"]`` and the tokens and
    answers. Stage F's stencil answers are not used: they sit in
    small neighbourhoods of its T points (measured at d = 16, float32: adding its 9,405 answers to 3,000
    random ones gave one-token fidelity 1.0e-5 in 272 s; the random ones alone 6.8e-7 in 42 s).
    ``start``: ``(part, ln, vs)`` to refit from instead of the given parts (a refit cut short,
    :mod:`.resume`) with ``history``, the cut fit's losses; ``checkpoint``, ``device``, ``target``:
    :func:`refit_one_token`'s."""
    Xr, Yr = random_answers(oracle, rng, scale=scale, ffn=part.W1m.shape[0])
    k = len(Xr)
    part, ln, vs = (part, ln, vs) if start is None else start
    new_part, new_ln, new_vs, info = refit_one_token(part, ln, vs, Xr, Yr, progress=progress, rng=rng,
                                                     max_iter=max_iter, scaled=scaled, checkpoint=checkpoint,
                                                     device=device, history=history, target=target)
    return new_part, new_ln, new_vs, {**info, "refit_queries": int(k)}, (Xr, Yr)


def model_jacobian(part: FFNPart, ln: OutputLayerNorm, vs: ValueSum):
    """``x -> dy/dx`` (d_out, d) of the recovered one-token map (float64 central differences on the model,
    step 1e-6 |x|: error ~1e-10 against the model), for stage A's pull-back in place of measured Jacobians."""
    from .ffn import predict_one_token

    def jac(x):
        x = np.asarray(x, dtype=np.float64)
        d = x.size
        h = 1e-6 * max(float(np.linalg.norm(x)), 1.0)
        E = np.eye(d) * h
        Y = predict_one_token(part, ln, vs, np.vstack([x + E, x - E]))
        return ((Y[:d] - Y[d:]) / (2 * h)).T
    return jac


__all__ = ["loss_and_grad", "model_jacobian", "random_answers", "random_queries", "refit_from_oracle",
           "refit_one_token"]
