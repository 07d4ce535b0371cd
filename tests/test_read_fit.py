"""Stage A's reads fitted in output space (read_fit): exact recovery modulo the gauge, the least-squares
error bound with noise, and that the per-token pull-back it replaces loses to it on weak Jacobians."""

import numpy as np
import pytest

from headthief.errors import ConvergenceError
from headthief.extraction.block.heads import _fit_reads, _gauge, _pull_backs
from headthief.extraction.block.read_fit import fit_in_output_space


def _problem(rng, d=8, P=40, K=3, weak=1e-4):
    """Jacobians with stage A's null spaces (a common c1 on the right, and x_p + c0 per token), one weak
    direction of singular value ``weak`` per token (a different one at each token), and K random reads."""
    c1 = rng.standard_normal(d)
    c1 /= np.linalg.norm(c1)
    c0 = rng.standard_normal(d)
    c0 -= c1 * (c1 @ c0)
    X = rng.standard_normal((P, d))
    X *= np.sqrt(d) / np.linalg.norm(X, axis=1, keepdims=True)
    J = np.empty((P, d, d))
    for p in range(P):
        Q, _ = np.linalg.qr(np.column_stack([c1, X[p] + c0, rng.standard_normal((d, d - 2))]))
        V = Q[:, 2:]                                                      # the row space: off both null directions
        U, _ = np.linalg.qr(rng.standard_normal((d, d - 2)))
        s = rng.uniform(0.5, 2.0, d - 2)
        s[rng.integers(d - 2)] = weak
        J[p] = (U * s) @ V.T
    G = rng.standard_normal((K, d, d + 1))
    Xh = np.hstack([X, np.ones((P, 1))])
    S = np.einsum("pij,kjq,pq->kpi", J, G, Xh)
    return S, X, J, G, c1, c0


def _off_gauge(G, c1, c0):
    """G with the gauge stage A cannot see removed: ``c1 v^T`` and the least-squares multiple of ``[P1, P1 c0]``."""
    P1, _ = _gauge(c1)
    G = P1 @ G
    g = np.hstack([P1, (P1 @ c0)[:, None]])
    return G - (np.sum(G * g) / np.sum(g * g)) * g


def _err(Ghat, G, c1, c0):
    return max(float(np.linalg.norm(_off_gauge(a - b, c1, c0)) / np.linalg.norm(_off_gauge(b, c1, c0)))
               for a, b in zip(Ghat, G))


def test_exact_reads_give_every_read_back_modulo_the_gauge():
    S, X, J, G, c1, c0 = _problem(np.random.default_rng(71))
    Ghat, res = fit_in_output_space(S, X, J, tol=1e-13, c1=c1)
    assert np.all(res < 1e-10)
    assert _err(Ghat, G, c1, c0) < 1e-9
    assert np.abs(c1 @ Ghat).max() < 1e-12 * np.abs(Ghat).max()          # c1 kept out exactly


def test_noisy_reads_within_the_least_squares_bound_and_better_than_the_pull_back():
    rng = np.random.default_rng(72)
    S, X, J, G, c1, c0 = _problem(rng)
    P, d = X.shape
    noise = 1e-3 * np.abs(S).max() * rng.standard_normal(S.shape)
    Ghat, res = fit_in_output_space(S + noise, X, J, tol=1e-13, c1=c1)
    # the bound: |dG| <= |noise| / s_min of the linear map G -> (J_p G xh_p)_p off the gauge
    Xh = np.hstack([X, np.ones((P, 1))])
    A = np.concatenate([np.kron(J[p], Xh[p][None]) for p in range(P)])  # rows: outputs, cols: G row-major
    s = np.linalg.svd(A, compute_uv=False)
    smin = s[s > 1e-10 * s[0]][-1]
    for k in range(len(G)):
        dG = _off_gauge(Ghat[k] - G[k], c1, c0)
        assert np.linalg.norm(dG) <= np.linalg.norm(noise[k]) / smin * (1 + 1e-6)
    P1, _ = _gauge(c1)
    pulled = _fit_reads(np.einsum("pij,kpj->kpi", _pull_backs(J), S + noise), X, c0, P1)
    assert _err(Ghat, G, c1, c0) < 0.1 * _err([g for g, _ in pulled], G, c1, c0)


def test_bad_shapes_and_too_few_iterations_are_refused():
    S, X, J, G, c1, c0 = _problem(np.random.default_rng(73))
    with pytest.raises(ValueError, match="do not agree"):
        fit_in_output_space(S[:, :-1], X, J, tol=1e-13)
    with pytest.raises(ConvergenceError, match="did not settle in 2"):
        fit_in_output_space(S, X, J, tol=1e-13, c1=c1, max_iter=2)


def test_rank_descent_separates_heads_where_noise_blurs_the_pencil():
    """Mixed maps ``Wt_k = sum_h T_hk M_h`` of rank-r heads M_h with 3 % noise (no pencil of these splits into
    clean groups): every head found as well as the true unmixing ``T^{-1}`` would find it from these maps (its
    error is the noise passed through T^{-1}; within 1.5x of that), and the starts stay bounded (None when H
    cannot be reached)."""
    from headthief.extraction.block.heads import _group, rank_descent
    rng = np.random.default_rng(74)
    H, r, d = 4, 6, 24
    M = np.stack([rng.standard_normal((d + 1, r)) @ rng.standard_normal((r, d)) for _ in range(H)])
    M /= np.linalg.norm(M, axis=(1, 2), keepdims=True)
    T = rng.standard_normal((H, H))
    Wt = np.einsum("hk,hab->kab", T, M)
    noise = rng.standard_normal(Wt.shape)
    noise *= 0.03 * np.linalg.norm(Wt) / np.linalg.norm(noise)
    Wn = Wt + noise
    for _ in range(8):
        Y1, Y2 = np.tensordot(rng.standard_normal(H), Wn, 1), np.tensordot(rng.standard_normal(H), Wn, 1)
        assert _group(np.linalg.eigvals(np.linalg.solve(Y1[:d], Y2[:d])), H, r) is None
    found = rank_descent(Wn, r, H, np.random.default_rng(75))
    assert found is not None and len(found) == H
    Ti = np.linalg.inv(T)
    for h in range(H):
        best = min(np.linalg.norm((np.sum(Y * M[h]) / np.sum(Y * Y)) * Y - M[h]) for Y in found)
        assert best <= 1.5 * np.linalg.norm(np.einsum("k,kab->ab", Ti[:, h], noise))
    assert rank_descent(Wn, r, H, np.random.default_rng(76), starts=H - 1) is None


@pytest.mark.parametrize("regime", ["truncation", "rounding"])
def test_the_pilot_reads_choose_the_levels_that_fit_best(regime):
    """Coarse answers' reads are a trade between truncation (cancelled by more levels) and rounding (less with
    fewer, larger steps): second-order answers S(h) = 2 h^2 J G [x; 1] + h^4 T4 + h^6 T6 + N, the T off the
    affine model and N the rounding (the same size at every step), read at the levels 1, 2, 3 (in units of t).
    Where the truncation dominates all three levels (which cancel both terms) are chosen; where N does, a
    single large step; and the chosen reads are the closest to the exact ones, which the choice never saw."""
    from headthief.extraction.block.heads import LEVELS, choose_levels, richardson
    g = np.random.default_rng(81 if regime == "truncation" else 82)
    exact, X, J, G, c1, c0 = _problem(g, d=8, P=40, K=3, weak=0.5)
    t = 0.1
    trunc, noise = (30.0, 1e-7) if regime == "truncation" else (0.3, 3e-4)
    T4, T6 = (trunc * k * np.einsum("pij,kpj->kpi", J, g.standard_normal(exact.shape)) for k in (1.0, 10.0))
    S = {c: 2 * (c * t) ** 2 * exact + (c * t) ** 4 * T4 + (c * t) ** 6 * T6 + noise * g.standard_normal(exact.shape)
         for c in LEVELS}
    levels, fits = choose_levels(S, X, J, t, tol=1e-12, c1=c1)
    assert len(fits) == 5 and fits[levels] == min(fits.values())
    if regime == "truncation":
        assert levels == (1.0, 2.0, 3.0)
    else:
        assert len(levels) == 1
    errors = {lv: float(np.linalg.norm(sum(w * S[c] for c, w in zip(lv, richardson(lv, t))) - exact))
              for lv in fits}
    assert errors[levels] <= 1.5 * min(errors.values())
