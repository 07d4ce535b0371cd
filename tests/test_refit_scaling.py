"""The refits' scaled coordinates (:mod:`headthief.extraction.block.lbfgs`): the Gauss-Newton diagonal read
by random-sign probes, and L-BFGS run in the coordinates it scales."""

from __future__ import annotations

import numpy as np
import pytest

from headthief.extraction.block.lbfgs import FLOOR, diagonal_scale, minimize_in_chunks, signs


def _spread_jacobian(rng, m=400, n=30):
    """A least-squares Jacobian whose columns' norms spread over six decades."""
    return rng.standard_normal((m, n)) * np.logspace(-3, 3, n)


def test_diagonal_scale_reads_the_gauss_newton_diagonal():
    rng = np.random.default_rng(0)
    J = _spread_jacobian(rng)
    exact = np.sqrt(np.sum(J * J, axis=0))
    probes = 400
    est = diagonal_scale(lambda: J.T @ signs(rng, J.shape[0]), probes=probes)
    # each diagonal entry is a mean of `probes` squares: relative spread at most sqrt(2 / probes) (7%), its
    # square root half that; 5 such spreads bound every one of the 30
    assert np.max(np.abs(est / exact - 1)) <= 5 * 0.5 * np.sqrt(2.0 / probes)


def test_diagonal_scale_floors_unseen_coordinates_and_refuses_nothing_seen():
    rng = np.random.default_rng(1)
    J = _spread_jacobian(rng)
    J[:, 4] = 0.0                                              # a direction no answer sees (a gauge)
    est = diagonal_scale(lambda: J.T @ signs(rng, J.shape[0]))
    assert est[4] == pytest.approx(FLOOR * est.max())
    assert np.all(diagonal_scale(lambda: np.zeros(5)) == 1.0)


def test_signs_are_plus_or_minus_one():
    s = signs(np.random.default_rng(2), (50, 3))
    assert s.shape == (50, 3) and set(np.unique(s)) == {-1.0, 1.0}


def test_scaled_lbfgs_reaches_the_same_least_squares_solution_in_fewer_iterations():
    """A badly scaled linear least squares (column norms over six decades): in scaled coordinates L-BFGS ends
    at the exact solution, in fewer iterations and at a lower loss than in the plain ones."""
    rng = np.random.default_rng(3)
    J = _spread_jacobian(rng)
    x_true = rng.standard_normal(J.shape[1])
    y = J @ x_true

    def fun(x):
        r = J @ x - y
        return 0.5 * float(r @ r), J.T @ r

    x0 = np.zeros(J.shape[1])
    L0 = fun(x0)[0]
    plain = minimize_in_chunks(fun, x0, L0, 3000)
    scale = diagonal_scale(lambda: J.T @ signs(rng, J.shape[0]))
    scaled = minimize_in_chunks(fun, x0, L0, 3000, scale=scale)
    assert np.max(np.abs(scaled[0] - x_true)) <= 1e-6 * np.max(np.abs(x_true))
    assert scaled[2] < plain[2] and scaled[1] < plain[1]


def test_a_sliding_check_stops_on_the_same_path_no_later():
    """``check`` < CHUNK tests the last CHUNK iterations' gain every ``check`` iterations: the same L-BFGS path
    (the chunks restart at the same points), cut no later than the chunks' own test, where that window gained
    less than the rule asks."""
    from headthief.extraction.block.lbfgs import CHUNK, GAIN
    rng = np.random.default_rng(5)
    J = rng.standard_normal((300, 100)) * np.logspace(0, -3, 100)
    y = J @ rng.standard_normal(100) + 1e-3 * rng.standard_normal(300)
    losses = []

    def fun(x):
        r = J @ x - y
        losses.append(0.5 * float(r @ r))
        return losses[-1], J.T @ r

    x0 = np.zeros(100)
    L0 = fun(x0)[0]
    whole = minimize_in_chunks(fun, x0, L0, 5000)
    cut = minimize_in_chunks(fun, x0, L0, 5000, check=100)
    assert CHUNK <= cut[2] < whole[2] and cut[2] % 100 == 0 and "gained less than" in cut[3]
    assert cut[1] >= whole[1]
    same = minimize_in_chunks(fun, x0, L0, cut[2])             # the chunks' rule, stopped at that iteration
    assert np.array_equal(same[0], cut[0]) and same[1] == cut[1]
    ahead = minimize_in_chunks(fun, x0, L0, cut[2] - CHUNK)   # CHUNK iterations before the cut
    assert cut[1] >= GAIN * ahead[1]
    with pytest.raises(ValueError, match="check must be"):
        minimize_in_chunks(fun, x0, L0, 10, check=0)


def _noisy_least_squares(seed: int, decades: float):
    """A 300 x 100 least squares whose columns' scales fall over ``decades`` decades, answers with noise 1e-3:
    ``(J, y, fun, x0, L0)``, fun returning the loss and its gradient."""
    rng = np.random.default_rng(seed)
    J = rng.standard_normal((300, 100)) * np.logspace(0, -decades, 100)
    y = J @ rng.standard_normal(100) + 1e-3 * rng.standard_normal(300)

    def fun(x):
        r = J @ x - y
        return 0.5 * float(r @ r), J.T @ r

    x0 = np.zeros(100)
    return J, y, fun, x0, fun(x0)[0]


def test_a_resumed_fit_keeps_its_iteration_count_and_stopping_window():
    """A fit cut short and resumed with the losses it kept (``history``) stops where the uninterrupted fit's rule
    would, not a whole window later, and its iteration cap counts the iterations before the cut."""
    from headthief.extraction.block.lbfgs import CHUNK
    _, _, fun, x0, L0 = _noisy_least_squares(6, 3)
    history: list[float] = []
    whole = minimize_in_chunks(fun, x0, L0, 5000, check=100, history=history)
    stop = whole[2]
    assert CHUNK < stop < 5000 and len(history) == stop + 1 and history[0] == L0
    cut_at = stop - 30                                   # cut inside the window that ended the fit
    kept: list[float] = []
    x_cut, L_cut, n_cut, _ = minimize_in_chunks(fun, x0, L0, cut_at, check=100, history=kept)
    assert n_cut == cut_at and len(kept) == cut_at + 1
    resumed = minimize_in_chunks(fun, x_cut, L_cut, 5000, check=100, history=list(kept))
    afresh = minimize_in_chunks(fun, x_cut, L_cut, 5000, check=100)
    assert cut_at < resumed[2] <= stop + 100 and "gained less than" in resumed[3]
    assert afresh[2] >= CHUNK                            # without its history a resumed fit spends a whole window
    capped = minimize_in_chunks(fun, x_cut, L_cut, cut_at, check=100, history=list(kept))
    assert capped[2] == cut_at and "cap" in capped[3] and np.array_equal(capped[0], x_cut)
    # the chunks' own rule: the first chunk after the resume ends where the cut one would have
    chunks: list[float] = []
    minimize_in_chunks(fun, x0, L0, 730, history=chunks)
    x1 = minimize_in_chunks(fun, x0, L0, 730)[0]
    total = minimize_in_chunks(fun, x1, fun(x1)[0], 1000, history=chunks)[2]
    assert total == 1000 and len(chunks) == 1001


def test_a_fit_at_its_floor_ends_once_a_hundred_iterations_gain_nothing_and_above_it_runs_on():
    """``floor``: a noisy least squares whose loss floor is its noise. Given a floor above the minimum, the fit
    ends at the first FLAT_EVERY-th iteration at or below it where the last FLAT_EVERY gained less than FLAT, on
    the chunks' own path (the point the chunks' rule reaches when capped there), within 1% of the least-squares
    minimum. A floor below the minimum (a fit in a slow valley above the noise) changes nothing."""
    from headthief.extraction.block.lbfgs import FLAT, FLAT_EVERY
    J, y, fun, x0, L0 = _noisy_least_squares(7, 2)
    best = float(0.5 * np.sum((y - J @ np.linalg.lstsq(J, y, rcond=None)[0]) ** 2))    # the noise's own loss
    hist: list[float] = []
    whole = minimize_in_chunks(fun, x0, L0, 5000, history=hist)
    flat: list[float] = []
    at = minimize_in_chunks(fun, x0, L0, 5000, history=flat, floor=4 * best)
    k = at[2]
    assert k % FLAT_EVERY == 0 and k < whole[2] and "floor" in at[3]
    assert flat[k] <= 4 * best and flat[k] >= (1 - FLAT) * flat[k - FLAT_EVERY]
    assert all(not (flat[j] <= 4 * best and flat[j] >= (1 - FLAT) * flat[j - FLAT_EVERY])
               for j in range(FLAT_EVERY, k, FLAT_EVERY))                     # no earlier window qualified
    same = minimize_in_chunks(fun, x0, L0, k)                                 # the chunks' path, cut at k
    assert np.array_equal(same[0], at[0]) and at[1] <= 1.01 * best
    below = minimize_in_chunks(fun, x0, L0, 5000, floor=0.5 * best)           # never reached: no effect
    assert below[2] == whole[2] and np.array_equal(below[0], whole[0])
