"""headthief.linalg.svd: numpy's SVD, and LAPACK's QR-iteration SVD where numpy's divide and conquer does not
converge on a finite matrix (it happens with some BLAS builds and thread counts; here it is made to happen)."""

import numpy as np
import pytest

from headthief import linalg


@pytest.fixture
def gesdd_fails(monkeypatch):
    def fails(*a, **kw):
        raise np.linalg.LinAlgError("SVD did not converge")
    monkeypatch.setattr(linalg.np.linalg, "svd", fails)


def test_numpys_svd_where_it_converges():
    a = np.random.default_rng(0).standard_normal((6, 4))
    U, s, Vt = linalg.svd(a, full_matrices=False)
    np.testing.assert_allclose(s, np.linalg.svd(a, compute_uv=False), rtol=1e-14, atol=0)
    np.testing.assert_allclose((U * s) @ Vt, a, rtol=0, atol=1e-13)


@pytest.mark.parametrize("shape", [(7, 5), (5, 7), (3, 6, 4)])
@pytest.mark.parametrize("full", [True, False])
def test_a_matrix_gesdd_fails_on_is_decomposed_by_gesvd(gesdd_fails, shape, full):
    a = np.random.default_rng(1).standard_normal(shape)
    U, s, Vt = linalg.svd(a, full_matrices=full)
    m, n = shape[-2:]
    k = min(m, n)
    assert U.shape == (*shape[:-2], m, m if full else k) and s.shape == (*shape[:-2], k)
    assert Vt.shape == (*shape[:-2], n if full else k, n)
    np.testing.assert_allclose((U[..., :, :k] * s[..., None, :]) @ Vt[..., :k, :], a, rtol=0, atol=1e-12)
    np.testing.assert_allclose(linalg.svd(a, compute_uv=False), s, rtol=1e-14, atol=0)
    assert np.all(np.diff(s, axis=-1) <= 0)


def test_a_matrix_with_a_nan_still_raises(gesdd_fails):
    a = np.eye(3)
    a[1, 2] = np.nan
    with pytest.raises(np.linalg.LinAlgError):
        linalg.svd(a)


@pytest.mark.parametrize("shape, hermitian", [((7, 5), False), ((4, 6, 3), False), ((5, 5), True)])
def test_pinv_falls_back_to_the_same_pseudo_inverse(monkeypatch, shape, hermitian):
    a = np.random.default_rng(2).standard_normal(shape)
    if hermitian:
        a = a @ a.T
    a[..., :, -1] = a[..., :, 0]                       # rank deficient: the cut-off drops a singular value
    if hermitian:
        a[..., -1, :] = a[..., 0, :]
    want = np.linalg.pinv(a, hermitian=hermitian)

    def fails(*a, **kw):
        raise np.linalg.LinAlgError("SVD did not converge")
    monkeypatch.setattr(linalg.np.linalg, "pinv", fails)
    monkeypatch.setattr(linalg.np.linalg, "svd", fails)
    np.testing.assert_allclose(linalg.pinv(a, hermitian=hermitian), want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("bshape", [(9,), (9, 3)])
def test_lstsq_falls_back_to_the_same_minimum_norm_solution(monkeypatch, bshape):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((9, 4))
    a[:, 3] = a[:, 1] + a[:, 2]                        # rank 3: the minimum-norm solution
    b = rng.standard_normal(bshape)
    want = np.linalg.lstsq(a, b, rcond=None)
    full = np.linalg.lstsq(a[:, :3], b, rcond=None)

    def fails(*a, **kw):
        raise np.linalg.LinAlgError("SVD did not converge in Linear Least Squares")
    monkeypatch.setattr(linalg.np.linalg, "lstsq", fails)
    x, res, rank, s = linalg.lstsq(a, b)
    np.testing.assert_allclose(x, want[0], rtol=0, atol=1e-12)
    assert rank == want[2] == 3 and res.size == 0
    np.testing.assert_allclose(s, want[3], rtol=1e-12, atol=1e-12)
    x3, res3, rank3, _ = linalg.lstsq(a[:, :3], b)      # full rank, more rows: the residuals as numpy gives them
    np.testing.assert_allclose(x3, full[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(res3, full[1], rtol=1e-10, atol=0)
    with pytest.raises(np.linalg.LinAlgError):
        linalg.lstsq(np.full((3, 2), np.nan), np.ones(3))
