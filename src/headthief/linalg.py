"""Linear algebra that holds on every machine.

LAPACK's divide-and-conquer SVD (``gesdd``, what ``numpy.linalg.svd`` calls) fails to converge on some finite,
well-scaled matrices, depending on the BLAS build and its thread count (a known OpenBLAS behaviour:
OpenMathLib/OpenBLAS#3044). Measured here: a 64 x 64 matrix of stage B of ``--method vector`` on
``random_layer(64, 4, seed=0)`` (entries below 0.45, singular values 2.3 down) with numpy 2.4.6's OpenBLAS 0.3.31
and one thread, where ``gesvd`` succeeds. :func:`svd` is numpy's, and retries such a matrix with ``gesvd`` (the
QR iteration: slower, the same decomposition to rounding). :func:`pinv` and :func:`lstsq` (numpy's SVD-based
pseudo-inverse and least squares, ``gelsd``) fall back the same way. Every ``svd``, ``pinv`` and ``lstsq`` call
in headthief goes through them (``matrix_rank``, ``cond`` and 2-norms, which need singular values only, call
numpy directly).
"""

from __future__ import annotations

import numpy as np


def _finite_or_raise(*arrays) -> None:
    if not all(np.all(np.isfinite(np.asarray(x))) for x in arrays):
        raise np.linalg.LinAlgError("SVD did not converge: the matrix has a NaN or an infinity")


def svd(a, full_matrices: bool = True, compute_uv: bool = True):
    """``numpy.linalg.svd(a, full_matrices, compute_uv)``; where LAPACK's ``gesdd`` does not converge on a finite
    ``a``, ``scipy.linalg.svd(..., lapack_driver="gesvd")`` instead (stacked matrices one by one).
    ``LinAlgError`` still for a matrix with a NaN or an infinity, or where ``gesvd`` fails too."""
    try:
        return np.linalg.svd(a, full_matrices=full_matrices, compute_uv=compute_uv)
    except np.linalg.LinAlgError:
        a = np.asarray(a)
        _finite_or_raise(a)
    from scipy.linalg import svd as scipy_svd

    def one(m):
        return scipy_svd(m, full_matrices=full_matrices, compute_uv=compute_uv, check_finite=False,
                         lapack_driver="gesvd")
    if a.ndim == 2:
        return one(a)
    parts = [one(m) for m in a.reshape(-1, *a.shape[-2:])]
    lead = a.shape[:-2]
    if not compute_uv:
        return np.stack(parts).reshape(*lead, -1)
    return tuple(np.stack([p[k] for p in parts]).reshape(*lead, *parts[0][k].shape) for k in range(3))


def pinv(a, rcond=None, hermitian: bool = False):
    """``numpy.linalg.pinv(a, rcond, hermitian)``; where its SVD does not converge on a finite ``a``, the same
    pseudo-inverse (singular values at most ``rcond`` times the largest dropped; numpy's default cut-off
    ``max(M, N) eps``) from :func:`svd`'s fallback."""
    try:
        return np.linalg.pinv(a, rcond=rcond, hermitian=hermitian)
    except np.linalg.LinAlgError:
        a = np.asarray(a)
        _finite_or_raise(a)
    U, s, Vt = svd(a, full_matrices=False)
    cut = (max(a.shape[-2:]) * np.finfo(a.dtype if a.dtype.kind == "f" else float).eps if rcond is None
           else np.asarray(rcond))
    big = s > np.asarray(cut)[..., None] * s.max(axis=-1, keepdims=True)
    inv = np.divide(1.0, s, out=np.zeros_like(s), where=big)
    return np.swapaxes(Vt, -1, -2) @ (inv[..., :, None] * np.swapaxes(U, -1, -2))


def lstsq(a, b, rcond=None):
    """``numpy.linalg.lstsq(a, b, rcond)`` (``(x, residuals, rank, singular values)``); where its SVD (``gelsd``)
    does not converge on finite inputs, LAPACK's ``gelss`` (the same minimum-norm solution from the QR-iteration
    SVD; the same cut-off, ``max(M, N) eps`` by default)."""
    try:
        return np.linalg.lstsq(a, b, rcond=rcond)
    except np.linalg.LinAlgError:
        _finite_or_raise(a, b)
    from scipy.linalg import lstsq as scipy_lstsq
    a, b = np.asarray(a), np.asarray(b)
    cond = max(a.shape) * np.finfo(float).eps if rcond is None else float(rcond)   # LAPACK reads cond < 0 as its eps
    x, res, rank, sv = scipy_lstsq(a, b, cond=cond, check_finite=False, lapack_driver="gelss")
    return x, np.atleast_1d(np.asarray(res, dtype=float)), int(rank), sv


__all__ = ["lstsq", "pinv", "svd"]
