"""The block's joint refit for coarse (float32) answers: every parameter fitted to answers of sequences.

With float32 answers stage A's second-order reads divide rounding by ``2 t^2`` and leave the heads at
~1e-3 (measured at d = 16: ``O_h`` 8.2e-4, ``W_h`` 6.7e-4, fidelity 4.2e-3 on fresh sequences), while
the answers are good to ~6e-8. So the assembled block (:func:`~.extract.assemble`: exact structure, coarse
numbers) is the start of a least-squares fit of all its parameters at once,

    min  sum over answered positions |block(X)_t - Y_t|^2,

over random sequences of several lengths plus the one-token answers the one-token refit paid for. The
gradient is written out below (softmax attention, LN1, GELU FFN, LN2; checked against finite differences
in the tests) and L-BFGS runs in chunks until a chunk gains less than 10% rms. No query is sent here.
Fixed in the fit (gauges or biases no answer sees): ``beta_1 = 0``, ``b_K = b_V = 0``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...errors import ConvergenceError
from .lbfgs import (CHECKPOINT_EVERY, GAIN, LEPS_RANGE, colsum, diagonal_scale, minimize_in_chunks, normalize,
                    normalize_back, pack, signs, unpack)

MAX_ITER = 20000
REFIT_LENGTHS = (2, 4, 8, 16)      # the random sequences' lengths (extract._refit_sequences asks them)
NAMES = ("Q", "K", "bq", "V", "Wo", "bo", "g1", "W1", "b1", "W2", "b2", "g2", "be2")
LN_EPS_MODES = ("off", "fixed", "fit")
SCORE_FACTOR = 3    # the image fit's sequences: each head's score unknowns told at least this many times (fit_counts)


def parameter_count(d: int, ffn: int) -> int:
    """The block refit's parameter count (:func:`params_of`; H d_h = d)."""
    return 4 * d * d + 6 * d + 2 * d * ffn + ffn


def refit_counts(d: int, ffn: int) -> list[int]:
    """Sequences per length in REFIT_LENGTHS: a quarter of ``max(4000, 8 x params / d)`` positions each, with
    ``params`` the block refit's parameter count (:func:`parameter_count`)."""
    per = max(4000, 8 * parameter_count(d, ffn) // d) // len(REFIT_LENGTHS)
    return [-(-per // T) for T in REFIT_LENGTHS]


def fit_lengths(length: int | None = None) -> tuple[int, ...]:
    """The sequence lengths of REFIT_LENGTHS the image route's fit asks of a target answering at most ``length``
    tokens (None: all of them); what :func:`fit_counts` is given, and its plan (:func:`.arithmetic.image_planned`)."""
    return tuple(REFIT_LENGTHS) if length is None else tuple(T for T in REFIT_LENGTHS if T <= int(length))


def fit_counts(d: int, ffn: int, positions: int | None = None, *, heads: int | None = None,
               lengths=REFIT_LENGTHS) -> list[int]:
    """Sequences per length in ``lengths`` (REFIT_LENGTHS or its first few: an encoder answering shorter
    sequences) for the image route's fit (:mod:`.on_image`): a quarter of ``positions`` answered positions each
    (default ``max(1000, 8 x parameters / d)``: the fit starts from stages L, V, F's exact parts, so a quarter of
    what the float32 refit takes is enough; measured in docs/block.md).

    With ``heads``, the sequences also tell each head's scores at least :data:`SCORE_FACTOR` times over: a row
    of T tokens gives a head T - 1 softmax differences, and the head's score form ``Q_h^T K_h`` (rank d_h) has
    ``d_h (2 d - d_h)`` unknowns. Short of that the longest length gets more sequences. It binds where the
    lengths are short (measured: encoders of 4 positions at d = 64 and 96, 2 heads, had 0.73x and 0.47x, and
    the heads' fit stalled at in-sample 8.7e-3 and 9.4e-3 on every try; d = 32 with 1.6x was extracted)."""
    if positions is None:
        positions = max(1000, 8 * parameter_count(d, ffn) // d)
    lengths = tuple(int(T) for T in lengths)
    counts = [-(-int(positions) // (len(REFIT_LENGTHS) * T)) for T in lengths]
    if heads and lengths:
        dh = d // int(heads)
        short = SCORE_FACTOR * dh * (2 * d - dh) - score_rows(counts, lengths)
        if short > 0:
            T = lengths[-1]
            counts[-1] += -(-short // (T * (T - 1)))
    return counts


def score_rows(counts, lengths=REFIT_LENGTHS) -> int:
    """The softmax differences a head's scores get from ``counts`` sequences per length: ``n T (T - 1)``."""
    return int(sum(int(n) * int(T) * (int(T) - 1) for n, T in zip(counts, lengths)))


def params_of(block) -> dict:
    a = block.attention
    return {"Q": a.Q, "K": a.K, "bq": a.bq, "V": a.V, "Wo": a.Wo, "bo": a.bo, "g1": block.ln1_gamma,
            "W1": block.W1, "b1": block.b1, "W2": block.W2, "b2": block.b2, "g2": block.ln2_gamma,
            "be2": block.ln2_beta}


def gauged(block):
    """The same block with the parameters no answer sees moved into the ones the fit keeps (module docstring):
    ``b_K = b_V = 0`` (``W_O b_V`` into ``b_O``), ``beta_1 = 0`` (into ``b_1`` and ``b_2``). Its answers are
    the block's."""
    a = block.attention
    att = dataclasses.replace(a, bk=np.zeros_like(a.bk), bv=np.zeros_like(a.bv), bo=a.bo + a.Wo @ a.bv.reshape(-1))
    return dataclasses.replace(block, attention=att, ln1_beta=np.zeros(block.d),
                               b1=block.b1 + block.W1 @ block.ln1_beta, b2=block.b2 + block.ln1_beta)


def _group_loss(p: dict, X: np.ndarray, Y: np.ndarray, grads: dict, activation: str = "gelu") -> float:
    """One group of equal-length sequences X (N, T, d) with answers Y (N, T, d): adds its gradient to grads.
    ``activation``: the FFN's (:mod:`headthief.models.activations`; GELU's arrays are reused in place). Both
    LayerNorms' eps is ``exp(p["leps"])`` where the fit has it (its gradient in ``grads["leps"]``; log eps
    clipped to ``LEPS_RANGE``), else 0 (BERT's 1e-12, which moves nothing the fit sees)."""
    from scipy.special import erf
    eps = float(np.exp(np.clip(p["leps"], *LEPS_RANGE))) if "leps" in p else 0.0    # clipped: a step that left
    # the range (an early L-BFGS step from a poor start: exp overflowed) sees a flat loss there, not inf
    H, dh, d = p["Q"].shape
    N, T = X.shape[:2]
    sq = 1.0 / np.sqrt(dh)
    Xf = X.reshape(N * T, d)

    def heads(M):                      # (N*T, d) @ (H*dh, d)^T -> (N, H, T, dh): one BLAS product
        return (Xf @ M.reshape(H * dh, d).T).reshape(N, T, H, dh).transpose(0, 2, 1, 3)

    def to_params(G):                  # (N, H, T, dh) against X -> (H, dh, d): the transpose of heads()
        return (G.transpose(1, 3, 0, 2).reshape(H * dh, N * T) @ Xf).reshape(H, dh, d)

    v = heads(p["V"])
    if T == 1:                         # one token attends to itself alone: z = v, and Q, K, bq get no gradient
        z = v
    else:
        q = heads(p["Q"]) + p["bq"][None, :, None, :]
        k = heads(p["K"])
        S = (q @ k.swapaxes(-1, -2)) * sq
        S = S - S.max(axis=-1, keepdims=True)
        A = np.exp(S)
        A /= A.sum(axis=-1, keepdims=True)
        z = A @ v                                                            # (N, H, T, dh)
    # every product below on positions flattened to (N*T, .): one BLAS call each (numpy's matmul on (N, T, d)
    # stacks loops over N, 1.6 - 1.7x slower measured at MiniLM's size, and per token for one-token groups)
    zc = z.transpose(0, 2, 1, 3).reshape(N * T, H * dh)
    n1, r1 = normalize(Xf + zc @ p["Wo"].T + p["bo"], eps)
    zz = n1 * p["g1"]
    s = zz @ p["W1"].T + p["b1"]
    if activation == "gelu":
        Phi = 0.5 * (1.0 + erf(s * (1.0 / np.sqrt(2.0))))
        g = s * Phi
    else:
        from ...models.activations import value_and_prime
        g, Phi = value_and_prime(activation, s)                             # Phi: f'(s)
    n2, r2 = normalize(zz + g @ p["W2"].T + p["b2"], eps)
    res = n2 * p["g2"] + p["be2"] - Y.reshape(N * T, d)
    L = 0.5 * float(np.sum(res * res))
    grads["g2"] += colsum(res * n2)
    grads["be2"] += colsum(res)
    inside = "leps" in p and LEPS_RANGE[0] <= float(p["leps"]) <= LEPS_RANGE[1]
    if inside:                        # dL/d eps = -sum (dn . n) / (2 r^2) per LayerNorm, times eps for log eps
        grads["leps"] += -0.5 * eps * float(np.sum(np.sum(res * p["g2"] * n2, axis=-1) / r2[:, 0] ** 2))
    du = normalize_back(res * p["g2"], n2, r2)
    if activation == "gelu":
        s *= np.exp(-0.5 * s * s) * (1.0 / np.sqrt(2.0 * np.pi))            # s is not needed past here
        Phi += s                                                              # GELU'(s)
    ds = (du @ p["W2"]) * Phi
    grads["W2"] += du.T @ g
    grads["b2"] += colsum(du)
    grads["W1"] += ds.T @ zz
    grads["b1"] += colsum(ds)
    dzz = du + ds @ p["W1"]
    grads["g1"] += colsum(dzz * n1)
    if inside:
        grads["leps"] += -0.5 * eps * float(np.sum(np.sum(dzz * p["g1"] * n1, axis=-1) / r1[:, 0] ** 2))
    dpre = normalize_back(dzz * p["g1"], n1, r1)
    grads["bo"] += colsum(dpre)
    grads["Wo"] += dpre.T @ zc
    dz = (dpre @ p["Wo"]).reshape(N, T, H, dh).transpose(0, 2, 1, 3)         # (N, H, T, dh)
    if T == 1:
        grads["V"] += to_params(dz)
        return L
    dA = dz @ v.swapaxes(-1, -2)
    dv = A.swapaxes(-1, -2) @ dz
    dS = A * (dA - np.sum(dA * A, axis=-1)[..., None]) * sq
    dq = dS @ k
    dk = dS.swapaxes(-1, -2) @ q
    grads["Q"] += to_params(dq)
    grads["bq"] += dq.sum(axis=(0, 2))
    grads["K"] += to_params(dk)
    grads["V"] += to_params(dv)
    return L


def loss_and_grad(theta: np.ndarray, shapes: dict, groups, fixed: dict | None = None,
                  activation: str = "gelu") -> tuple[float, np.ndarray]:
    """``0.5 sum |block(X) - Y|^2`` over every group ``(X (N, T, d), Y (N, T, d))`` and its gradient with
    respect to the parameters in ``shapes`` (``fixed``: the others' values; ``activation``: the FFN's; a
    parameter ``leps``: the LayerNorms' log eps, :func:`_group_loss`)."""
    p = {**(fixed or {}), **unpack(theta, shapes)}
    grads = {k: np.zeros(np.shape(p[k])) for k in (*NAMES, "leps") if k in p}
    L = sum(_group_loss(p, X, Y, grads, activation) for X, Y in groups)
    return L, pack(grads, shapes)


def _with(block, p: dict):
    """``block`` with the parameters ``p`` (:func:`params_of`'s names; ``leps``: its LayerNorms' log eps, clipped
    to ``LEPS_RANGE``)."""
    if "leps" in p:
        block = dataclasses.replace(block, eps=float(np.exp(np.clip(p["leps"], *LEPS_RANGE))))
    att = dataclasses.replace(block.attention, Q=p["Q"].copy(), K=p["K"].copy(), bq=p["bq"].copy(),
                              V=p["V"].copy(), Wo=p["Wo"].copy(), bo=p["bo"].copy())
    return dataclasses.replace(block, attention=att, ln1_gamma=p["g1"].copy(), W1=p["W1"].copy(),
                               b1=p["b1"].copy(), W2=p["W2"].copy(), b2=p["b2"].copy(), ln2_gamma=p["g2"].copy(),
                               ln2_beta=p["be2"].copy())


def refit_block(block, groups, *, max_iter: int = MAX_ITER, progress=None, free=NAMES, gain: float = GAIN,
                rng: np.random.Generator | None = None, scaled: bool = True, checkpoint=None,
                device: str | None = None, history: list[float] | None = None, ln_eps: str = "off",
                floor: float | None = None):
    """``(block, info)``: the :class:`~headthief.models.bert_block.BertBlock` ``block`` refitted to the answered
    groups (module docstring); only the parameters named in ``free`` move. ``info``: rms residual before/after
    relative to the answers' rms, the largest in-sample error over that rms, the iterations. ``gain``: the
    chunks' stopping rule (:func:`.lbfgs.minimize_in_chunks`), run in coordinates scaled by the Gauss-Newton
    diagonal (:func:`.lbfgs.diagonal_scale`, its random signs from ``rng``; ``None``: a Generator seeded 0;
    ``scaled=False``: in the parameters themselves, as first built). :class:`ConvergenceError` if the fit
    cannot improve. ``checkpoint(calls, block, history)``, if given, gets the block at the current parameters
    and the loss after every iteration so far every ``CHECKPOINT_EVERY`` evaluations (a long refit's progress
    kept where the caller wants it; ``history`` given back resumes the fit's iteration count and stopping rule:
    :func:`.lbfgs.minimize_in_chunks`). ``device``: a torch device for the loss and its gradient
    (:mod:`.torch_losses`; None: numpy). ``ln_eps``: ``fit``: the LayerNorms' eps is fitted too (as log eps,
    from the block's own, within ``LEPS_RANGE``; info ``block_refit_ln_eps``); ``fixed``: the block's eps in the
    loss, not fitted; ``off``: the loss leaves it out (BERT's 1e-12 moves nothing here; RoBERTa's 1e-5 moves
    the answers by ~5e-6, 100x float32's rounding). ``floor``: an rms (relative to the answers' rms) at or
    below which the fit is at the answers' own noise; there it ends once 100 iterations gain less than 0.01% of
    the loss (:func:`.lbfgs.minimize_in_chunks`; info ``block_refit_message`` says so). None: the chunks' test
    alone."""
    if ln_eps not in LN_EPS_MODES:
        raise ValueError(f"ln_eps must be one of {LN_EPS_MODES}, got {ln_eps!r}")
    groups = [(np.asarray(X, np.float64), np.asarray(Y, np.float64)) for X, Y in groups]
    block = gauged(block)               # the loss's gauges (module docstring); the same answers
    start = {**params_of(block), **({"leps": np.log(float(block.eps))} if ln_eps != "off" else {})}
    shapes = {k: np.shape(start[k]) for k in (*NAMES, "leps") if k in free or (k == "leps" and ln_eps == "fit")}
    fixed = {k: np.asarray(start[k], np.float64) for k in start if k not in shapes}
    theta = pack(start, shapes)
    count = sum(Y.size for _, Y in groups)
    rms = float(np.sqrt(sum(float(np.sum(Y * Y)) for _, Y in groups) / count))
    if device is None:
        def evaluate(th, shift=None):
            moved = groups if shift is None else [(X, Y - w) for (X, Y), w in zip(groups, shift)]
            return loss_and_grad(th, shapes, moved, fixed, block.activation)
    else:
        from .torch_losses import BlockLoss
        evaluate = BlockLoss(shapes, groups, fixed, device, activation=block.activation)
    L0, G0 = evaluate(theta)
    rng = np.random.default_rng(0) if rng is None else rng
    scale = (diagonal_scale(lambda: evaluate(theta, [signs(rng, Y.shape) for _, Y in groups])[1] - G0)
             if scaled else None)
    calls = [0]
    seen = [] if history is None else [float(v) for v in history]

    def current(th):                  # the block at th (a held eps stays the block's own, bit for bit)
        p = {**fixed, **unpack(th, shapes)}
        if ln_eps != "fit":
            p.pop("leps", None)
        return _with(block, p)

    def fun(th):
        calls[0] += 1
        L, G = evaluate(th)
        if progress is not None and calls[0] % 50 == 0:
            progress(calls[0], float(np.sqrt(2 * L / count) / rms))
        if checkpoint is not None and calls[0] % CHECKPOINT_EVERY == 0:
            checkpoint(calls[0], current(th), list(seen))
        return L, G

    at = None if floor is None else 0.5 * count * (float(floor) * rms) ** 2      # the floor as a loss
    theta, L1, iters, message = minimize_in_chunks(fun, theta, L0, max_iter, gain, scale=scale, history=seen,
                                                   floor=at)
    L0 = seen[0]                                       # the fit's own start (before a resume, if any)
    before = float(np.sqrt(2 * L0 / count) / rms)
    after = float(np.sqrt(2 * L1 / count) / rms)
    if not np.isfinite(L1) or L1 >= L0:
        raise ConvergenceError(f"the block refit did not improve on the assembled block (rms {before:.3g} -> "
                               f"{after:.3g}; L-BFGS: {message})")
    new = current(theta)
    worst = max(float(np.max(np.abs(np.asarray(new.forward(X)) - Y))) for X, Y in groups) / rms
    return new, {"block_refit_rms_before": before, "block_refit_rms_after": after, "block_refit_insample": worst,
                 "block_refit_iterations": iters, "block_refit_answers": int(count // groups[0][1].shape[-1]),
                 "block_refit_message": message, **({"block_refit_ln_eps": float(new.eps)} if ln_eps == "fit" else {})}


__all__ = ["REFIT_LENGTHS", "SCORE_FACTOR", "fit_counts", "fit_lengths", "gauged", "loss_and_grad", "parameter_count", "params_of",
           "refit_block", "refit_counts", "score_rows"]
