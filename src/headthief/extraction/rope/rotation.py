"""Stage R of ``--method rope``: theta and every head's ``W_q``, ``W_k`` from the score forms at each offset.

In the query/key space coordinates the form at offset D is ``T_h(D) = A_h^T R(-D theta) B_g / sqrt(d_h)``
(``A_h = Q_h Ua_h``, ``B_g = K_g Ub_g``, both d_h x d_h). So the pencil

    T_h(1)^{-1} T_h(D) = B_g^{-1} R(-(D - 1) theta) B_g

is the same for every head of a group, and its eigenvalues are ``exp(-+ i (D - 1) theta_f)``, one conjugate
pair per frequency plane f: the frequencies are read from the answers, not assumed. Their phases over
D = 2 .. D_max are unwrapped and fitted by least squares; the base follows from
``theta_f = base^(-2 f / d_h)`` (a weighted fit over the planes; the planes' own frequencies must agree with it,
or the layer is not default RoPE: :class:`ModelMismatch`).

The eigenvectors give ``B_g = E V^{-1}`` (E the rotation's own eigenvectors, plane by plane in transformers'
layout: coordinates f and f + d_h/2), up to one complex number per plane: a rotation and a scale of that
plane, which ``A_h`` takes back (``A_h -> A_h diag(...)^{-T}``): the symmetry of every RoPE layer. Then each
``A_h`` by least squares from all its offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import ModelMismatch, NotIdentifiable
from ...models.rope import apply_rotary
from ...linalg import lstsq, svd

TRIALS = 16     # combinations of the pencils tried for their common eigenvectors
STILL = 3       # a pencil eigenvalue that turns less than this x the pencil's own imprecision: a still plane


@dataclass(frozen=True)
class Rotation:
    Q: np.ndarray         # (H, dh, d)
    K: np.ndarray         # (G, dh, d)
    theta: float          # the base
    freqs: np.ndarray     # (dh/2,) every plane's frequency as read from the answers
    info: dict = field(default_factory=dict)


def rotation_parts(T: np.ndarray, offsets, group: np.ndarray, Ua, Ub, *, tol: float) -> Rotation:
    """Theta and the heads' Q, K (see the module). ``T`` (H, len(offsets), dh, dh): the forms at the offsets
    read (ascending)."""
    H, nD, dh, _ = T.shape
    offsets = np.asarray(offsets, dtype=float)
    steps = offsets[1:] - offsets[0]                       # the pencil T(D_0)^{-1} T(D) turns by -(D - D_0) theta
    Dmax = int(offsets[-1])
    if dh % 2:
        raise ModelMismatch(f"the head dimension {dh} is odd: RoPE turns pairs of coordinates", check="rotation")
    if nD < 2:
        raise NotIdentifiable("theta needs the score forms at two offsets at least (queries of 4 tokens or more)")
    half = dh // 2
    G = int(group.max()) + 1
    E = np.zeros((dh, dh), complex)
    for f in range(half):
        E[f, f], E[f + half, f] = 1 / np.sqrt(2), -1j / np.sqrt(2)          # eigenvalue exp(i phi) of R(phi)
        E[f, f + half], E[f + half, f + half] = 1 / np.sqrt(2), 1j / np.sqrt(2)
    Bs, freqs_g, phase_rms, unit_dev, still_planes = [], [], 0.0, 0.0, 0
    for g in range(G):
        members = np.flatnonzero(group == g)
        P = np.stack([np.mean([np.linalg.solve(T[h, 0], T[h, k]) for h in members], axis=0)
                      for k in range(1, nD)])                                # P[k - 1]: step steps[k - 1]
        V = _eigenbasis(P, steps, np.random.default_rng(12345 + g))
        lam = np.einsum("ij,Djk,ki->Di", np.linalg.inv(V), P, V)               # (nD - 1, dh): P's eigenvalues
        dev_g = float(np.max(np.abs(np.abs(lam) - 1)))                        # the pencil's own imprecision
        unit_dev = max(unit_dev, dev_g)
        noise = max(dev_g, 1e-15)
        ph = np.angle(lam)                                                     # -(D - 1) theta_f for e^-
        # the sign of each eigenvalue's turn: at the first step, or for a slow plane over the largest step (it
        # does not wrap there); a plane that turns less than the noise over every step read is still: its
        # frequency is below what these answers resolve, and it is given the fitted base's
        ref = np.where(np.abs(ph[0]) > STILL * noise, ph[0], ph[-1])
        still = np.abs(ref) <= STILL * noise
        neg = np.flatnonzero((ref < 0) & ~still)
        if len(neg) == 0 or 2 * len(neg) + int(still.sum()) != dh:
            raise ModelMismatch(
                f"the score forms of key/value group {g} do not turn with the offset (pencil eigenvalues "
                f"{np.round(lam[0], 6).tolist()}): not a rotary layer (no rotation: --method vector; or a position "
                "bias of another form)", check="rotation", figure=float(np.max(np.abs(ph[0]))), threshold=0.0)
        th = []
        for j in neg:
            est = -ph[0, j] / steps[0]
            phases = [-ph[0, j]]
            for k in range(1, nD - 1):
                raw = -ph[k, j]
                phases.append(raw + 2 * np.pi * np.round((steps[k] * est - raw) / (2 * np.pi)))
                xs = steps[:len(phases)]
                est = float(np.dot(xs, phases) / np.dot(xs, xs))
            xs = steps[:len(phases)]
            phase_rms = max(phase_rms, float(np.sqrt(np.mean((np.asarray(phases) - est * xs) ** 2))))
            th.append(est)
        th = np.asarray(th)
        order = np.argsort(-th)
        if np.min(th) <= 0:
            raise ModelMismatch(f"a frequency plane of group {g} does not turn (theta_f {th.min():.3g})",
                                check="rotation", figure=float(th.min()), threshold=0.0)
        r = len(neg)
        Vsel = V[:, neg[order]]
        Winv = np.linalg.inv(np.concatenate([Vsel, Vsel.conj(), V[:, still]], axis=1))
        W = np.zeros((dh, dh), complex)
        W[:r], W[half:half + r] = Winv[:r], Winv[r:2 * r]
        if r < half:
            # the still planes: any real basis of their (left) invariant subspace, two rows per plane
            Z = Winv[2 * r:]
            Zr = svd(np.vstack([Z.real, Z.imag]))[2][:dh - 2 * r]
            z1, z2 = Zr[0::2], Zr[1::2]
            W[r:half], W[half + r:] = (z1 + 1j * z2) / np.sqrt(2), (z1 - 1j * z2) / np.sqrt(2)
        B = E @ W
        still_planes = max(still_planes, half - r)
        if float(np.max(np.abs(B.imag))) > 1e3 * tol * float(np.max(np.abs(B.real))):
            raise ModelMismatch(f"group {g}: the rotation's eigenvectors do not pair into real planes",
                                check="rotation")
        Bs.append(B.real)
        freqs_g.append(np.concatenate([th[order], np.full(half - r, np.nan)]))
    freqs_g = np.asarray(freqs_g)
    read = ~np.isnan(freqs_g).any(axis=0)                                     # planes every group resolved
    freqs = np.mean(np.where(read, freqs_g, 0.0), axis=0)                     # (half,): the groups' average
    # base: theta_f = base^(-2f/dh); weights by each plane's sensitivity to the base
    f = np.arange(half)
    use = read & (f >= 1)
    if half >= 2 and not use.any():
        raise NotIdentifiable(f"only the fastest rotation plane turns measurably over offsets 1..{Dmax} at this "
                              "answer precision: the base cannot be read (longer queries: --max-len)")
    if half >= 2:
        logb = -(dh / (2.0 * f[use])) * np.log(freqs[use])
        w = (2.0 * f[use] / dh * freqs[use]) ** 2
        base = float(np.exp(np.sum(w * logb) / np.sum(w)))
    else:
        base = 10000.0
    model = base ** (-2.0 * f / dh)
    dev = float(np.max(np.abs(freqs - model)[read]) * Dmax)    # the misfit as a phase at the largest offset
    freqs = np.where(read, freqs, model)                       # the still planes: the base's frequencies
    lim = max(30 * phase_rms, 1e3 * tol) + 1e3 * tol
    if dev > lim:
        raise ModelMismatch(
            f"the planes' frequencies {np.array2string(freqs, precision=6)} are not base^(-2f/d_h) for one base "
            f"(best base {base:.6g}, largest phase misfit {dev:.3g} over {Dmax} offsets > {lim:.3g}): not the default "
            "rotary embedding", check="rotation frequencies", figure=dev, threshold=lim)
    # every head's A from all its offsets, with the frequencies of the fitted base
    sq = np.sqrt(dh)
    Q = np.zeros((H, dh, Ua[0].shape[0]))
    K = np.stack([Bs[g] @ Ub[g].T for g in range(G)])
    fit = 0.0
    for h in range(H):
        B = Bs[group[h]]
        lhs = np.concatenate([_rot(-D * model, dh) @ B for D in offsets], axis=1)      # (dh, nD dh)
        rhs = np.concatenate([sq * T[h, k] for k in range(nD)], axis=1)
        At = lstsq(lhs.T, rhs.T, rcond=None)[0].T                   # A^T (dh, dh)
        fit = max(fit, float(np.linalg.norm(At @ lhs - rhs) / np.linalg.norm(rhs)))
        Q[h] = At.T @ Ua[h].T
    info = {"theta": base, "freqs_read": freqs.tolist(), "freq_misfit": dev, "phase_rms": phase_rms,
            "pencil_unit_dev": unit_dev, "form_rotation_fit": fit, "planes_still": still_planes}
    return Rotation(Q=Q, K=K, theta=base, freqs=freqs, info=info)


def _eigenbasis(P: np.ndarray, steps: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Common eigenvectors of the pencils ``P[k]`` (step ``steps[k]``): those of a combination ``sum_k c_k P[k]``.
    A slow plane's eigenvalue there is ~ ``sum_k c_k (1 - i steps[k] theta_f)``, so weights that grow with the
    step (``c_k = steps[k] u_k``) set neighbouring slow planes furthest apart (random normal weights left the
    slowest planes of a d_h = 32 float32 layer mixed: key planes to 0.1-0.4, against 3e-3 with these weights);
    of ``TRIALS`` draws of ``u_k ~ U(0.5, 1.5)``, the one whose closest two eigenvalues are furthest apart
    (relative to |c|), so no two fast planes happen to coincide."""
    best, basis = -1.0, None
    for _ in range(TRIALS):
        c = steps * rng.uniform(0.5, 1.5, len(steps))
        lam, V = np.linalg.eig(np.tensordot(c, P, axes=1))
        gaps = np.abs(lam[:, None] - lam[None, :]) + np.diag(np.full(len(lam), np.inf))
        sep = float(np.min(gaps)) / float(np.linalg.norm(c))
        if sep > best:
            best, basis = sep, V
    return basis


def _rot(angles: np.ndarray, dh: int) -> np.ndarray:
    """R(angle) as a matrix in transformers' layout (plane f turns coordinates f and f + dh/2 by angles[f]):
    :func:`headthief.models.rope.apply_rotary` applied to the basis vectors."""
    cos, sin = np.cos(np.concatenate([angles, angles])), np.sin(np.concatenate([angles, angles]))
    return apply_rotary(np.eye(dh), cos, sin).T


__all__ = ["Rotation", "rotation_parts"]
