"""Multi-head extraction when each head's subspace is known (Proposition C.2, Assumption C.1).

Under Assumption C.1 head h lives in a subspace ``U_h`` (``W_h = P_h W_h P_h``; ``v_h``, ``c_h`` in
``U_h``) and the subspaces are mutually orthogonal. A sequence whose tokens all lie in ``U_h`` is
orthogonal to every other head's ``v_g`` (and ``c_g``), so only head h answers: with an orthonormal
basis ``B_h`` (d, d_h) of ``U_h`` and tokens ``x = B_h z``,

    f(Z B_h^T) = alpha(Z, W~_h)^T (Z v~_h) + beta,   W~_h = B_h^T W_h B_h,  v~_h = B_h^T v_h,

the single head of dimension ``d_h``. The proof of Proposition C.2 runs Theorem 4.1 inside each
subspace; so does :func:`extract_multihead_subspaces` (it calls
:func:`~headthief.extraction.single.exact.extract_exact` on an oracle that maps ``z -> B_h z``) and lifts
back ``W_h = B_h W~_h B_h^T``, ``v_h = B_h v~_h`` (``c_h = B_h c~_h``).

Query count: ``sum_h (d_h^2 + d_h)`` for the paper's model (288 for d = 32, H = 4, d_h = 8). With biases
each head's run reads ``beta = f([0])`` again; the all-zero query is the same sequence in every
subspace, so it is asked once and replayed to the later heads: ``sum_h (d_h^2 + 2 d_h) + 1``.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ...errors import NotIdentifiable, SpecError
from ...oracles.base import Oracle, batch_key
from ..probes import Progress
from ..single.exact import extract_exact
from .result import MultiHeadExtraction

ORTHO_TOL = 1e-8
# extract_exact may carry the model check (extraction/check.py); the per-subspace runs skip it: the
# check's preflight and fidelity queries would be spent once per head and counted as extraction.
_NO_CHECK = {"check": False} if hasattr(extract_exact, "model_class") else {}


def check_bases(bases: np.ndarray | Sequence[np.ndarray], d: int, *, tol: float = ORTHO_TOL) -> list[np.ndarray]:
    """Validate head subspace bases: each (d, d_h) with orthonormal columns, mutually orthogonal.

    Args:
        bases: an (H, d, d_h) array, or a list of (d, d_h) arrays (the d_h may differ).
        d: the token dimension of the oracle.
        tol: largest entry allowed in ``B_h^T B_h - I`` and in ``B_g^T B_h`` (g != h).

    Returns:
        The bases as a list of float64 (d, d_h) arrays.

    Raises:
        SpecError: wrong shapes, non-orthonormal columns, or subspaces that are not orthogonal.
    """
    if isinstance(bases, np.ndarray) and bases.ndim == 3:
        out = [np.asarray(b, dtype=np.float64) for b in bases]
    elif isinstance(bases, np.ndarray) or isinstance(bases, (str, bytes)):
        raise SpecError(f"bases must be an (H, d, d_h) array or a list of (d, d_h) arrays, got an array of "
                        f"shape {np.shape(bases)}")
    else:
        out = [np.asarray(b, dtype=np.float64) for b in bases]
    if not out:
        raise SpecError("bases is empty: give at least one head subspace")
    for h, B in enumerate(out):
        if B.ndim != 2 or B.shape[1] < 1:
            raise SpecError(f"basis {h} must be a (d, d_h) matrix with d_h >= 1, got shape {B.shape}")
        if B.shape[0] != d:
            raise SpecError(f"basis {h} has {B.shape[0]} rows but the oracle's tokens have d = {d}")
        if not np.isfinite(B).all():
            raise SpecError(f"basis {h} has non-finite entries")
        dev = float(np.abs(B.T @ B - np.eye(B.shape[1])).max())
        if dev > tol:
            raise SpecError(f"basis {h} is not orthonormal: max |B^T B - I| = {dev:.3g} > {tol:g} "
                            "(orthonormalise it, e.g. with numpy.linalg.qr)")
    total = sum(B.shape[1] for B in out)
    if total > d:
        raise SpecError(f"the subspaces' dimensions add up to {total} > d = {d}: they cannot be orthogonal")
    for g in range(len(out)):
        for h in range(g + 1, len(out)):
            dev = float(np.abs(out[g].T @ out[h]).max())
            if dev > tol:
                raise SpecError(f"subspaces {g} and {h} are not orthogonal: max |B_{g}^T B_{h}| = {dev:.3g} "
                                f"> {tol:g} (Assumption C.1 needs mutually orthogonal head subspaces)")
    return out


def subspaces_query_count(dims: Sequence[int] | np.ndarray, *, bias: bool = False) -> int:
    """Queries :func:`extract_multihead_subspaces` spends when no probe is re-asked.

    Args:
        dims: the subspace dimensions d_h, or the bases themselves (an (H, d, d_h) array or a list of
            (d, d_h) arrays).
        bias: the target has score biases and an output bias.
    """
    if isinstance(dims, np.ndarray) and dims.ndim == 3:
        dims = [dims.shape[2]] * dims.shape[0]
    dims = [int(np.shape(x)[1]) if np.ndim(x) == 2 else int(x) for x in dims]
    if bias:
        return sum(k * k + 2 * k for k in dims) + 1
    return sum(k * k + k for k in dims)


class SubspaceOracle(Oracle):
    """Queries in the coordinates of one subspace: a (N, d_h) sequence ``Z`` is asked as ``Z B^T``.

    ``shared`` (a dict) holds answers by content hash of the lifted sequence, so a query that
    coincides across subspaces (the all-zero one that reads beta) reaches the black box once.
    """

    def __init__(self, inner: Oracle, basis: np.ndarray, shared: dict | None = None):
        super().__init__(basis.shape[1], input_norm=inner.input_norm)
        self.inner = inner
        self.basis = np.asarray(basis, dtype=np.float64)
        self.shared = {} if shared is None else shared

    def __repr__(self) -> str:
        return f"SubspaceOracle({self.inner!r}, d_h={self.d})"

    def _query(self, X):
        seqs = list(X) if isinstance(X, np.ndarray) else X
        lifted = [np.asarray(z, dtype=np.float64) @ self.basis.T for z in seqs]
        keys = [batch_key([x]) for x in lifted]
        out = np.empty(len(lifted))
        ask = [i for i, k in enumerate(keys) if k not in self.shared]
        for i, k in enumerate(keys):
            if k in self.shared:
                out[i] = self.shared[k]
        if ask:
            if isinstance(X, np.ndarray):
                y = self.inner.query(np.stack([lifted[i] for i in ask]))
            else:
                y = self.inner.query([lifted[i] for i in ask])
            out[ask] = y
            for i, yi in zip(ask, y):
                if not lifted[i].any():          # only all-zero sequences can recur across subspaces
                    self.shared[keys[i]] = float(yi)
        return out


def extract_multihead_subspaces(
    oracle: Oracle,
    bases: np.ndarray | Sequence[np.ndarray],
    *,
    bias: bool = False,
    probes: str = "basis",
    scales: str = "adaptive",
    progress: Progress = None,
    rng: np.random.Generator | int = 0,
) -> MultiHeadExtraction:
    """Recover every head from value queries when the head subspaces are known (Proposition C.2).

    Args:
        oracle: the black box (exact value answers), a layer satisfying Assumption C.1.
        bases: orthonormal bases of the head subspaces: an (H, d, d_h) array or a list of (d, d_h)
            arrays, mutually orthogonal (checked by :func:`check_bases`).
        bias: the target has score biases c_h and an output bias beta (read once for all heads).
        probes, scales: passed to :func:`~headthief.extraction.single.exact.extract_exact`.
        progress: called with the number of queries answered after each oracle call.
        rng: generator or seed (used by the Gaussian probe design).

    Returns:
        A :class:`MultiHeadExtraction` with one head per subspace, in the order of ``bases``, except
        that a subspace whose head is silent (``v~_h = 0``: the head contributes nothing, its W is not
        identifiable and the canonical form drops it) is left out and listed in
        ``diagnostics["silent"]``. ``queries`` is :func:`subspaces_query_count` plus re-asked probes.

    Raises:
        SpecError: malformed bases (see :func:`check_bases`).
        NotIdentifiable: every subspace is silent.
    """
    t0 = time.perf_counter()
    Bs = check_bases(bases, oracle.d)
    rng = np.random.default_rng(rng)
    q0 = oracle.queries
    shared: dict = {}
    W, V, C, silent, per_head = [], [], [], [], []
    beta = None
    for h, B in enumerate(Bs):
        sub = SubspaceOracle(oracle, B, shared)
        before = oracle.queries
        try:
            res = extract_exact(sub, probes=probes, bias=bias, scales=scales, rng=rng, progress=progress,
                                **_NO_CHECK)
        except NotIdentifiable:
            silent.append(h)
            continue
        W.append(B @ res.W @ B.T)
        V.append(B @ res.v)
        if bias:
            C.append(B @ res.c)
            beta = res.beta
        per_head.append({"subspace": h, "d_h": B.shape[1], "queries": oracle.queries - before,
                         "requeried": int(res.diagnostics["requeried"]),
                         "float32_answers": bool(res.diagnostics["float32_answers"])})
    if not W:
        raise NotIdentifiable("every head subspace is silent (v restricted to each subspace is 0): the layer "
                              "is a constant and no W is identifiable from value queries")
    diagnostics = {"subspaces": len(Bs), "dims": [B.shape[1] for B in Bs], "silent": silent,
                   "heads": per_head, "requeried": sum(p["requeried"] for p in per_head),
                   "expected_queries": subspaces_query_count([B.shape[1] for B in Bs], bias=bias)}
    return MultiHeadExtraction(
        method="subspaces", W=np.stack(W), V=np.stack(V), C=np.stack(C) if bias else None,
        beta=beta, queries=oracle.queries - q0, seconds=time.perf_counter() - t0, diagnostics=diagnostics)
