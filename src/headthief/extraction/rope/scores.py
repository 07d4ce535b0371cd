"""Stage S of ``--method rope``: every head's attention weights read from the answers, then its query and key
spaces and its score form at every offset.

With every ``O_h`` known (stage H), the answer at row t of a sequence whose token 0 is the zero vector is
``y_t - b = sum_h O_h sum_{1 <= i <= t} a_{h,t,i} x_i`` (the zero token adds nothing to the values; its score is
exactly 0 at every row, so ``a_{h,t,0} = 1 - sum_i a_{h,t,i}`` is the reference). Each head's part is read in the
coordinates of its output space, so up to ``d_h`` weights per row are solved exactly, and::

    log(a_{h,t,i} / a_{h,t,0}) = x_t^T M_h(i - t) x_i,     M_h(-D) = Q_h^T R(-D theta) K_g / sqrt(d_h)

is a bilinear form of the two tokens, one per offset D = t - i. (A score with a position bias of its own, such
as ALiBi's, or absolute positions, is not: the fits below leave a residual and the model check says so.)

* query spaces: fixed keys, a varying query q: each reading is linear in q, ``q^T M_h(-D) k_i``, so least
  squares over d + 16 queries gives the vectors ``M_h(-D) k_i``, which span ``row(Q_h)``;
* key spaces: a fixed query, varying keys: the vectors ``M_h(-D)^T q`` span ``row(K_g)``; heads that share a
  key space are one key/value group (checked against stage H's value groups);
* score forms: random sequences; in the two spaces' coordinates ``M_h(-D) = Ua_h T_h(D) Ub_g^T`` with
  ``T_h(D)`` a d_h x d_h matrix per offset, fitted by linear least squares from every reading at that offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import ModelMismatch, NotIdentifiable
from ...oracles.base import Oracle
from .partitions import Heads, _subspace_gap
from ...linalg import lstsq, svd

EXTRA = 16           # queries beyond the unknowns of each least-squares fit
GAP_LIMIT = 0.01    # a (d_h + 1)-th direction this strong (of the d_h-th): not a d_h-dimensional space, unless
GAP_PER_FIT = 1000  # the readings' misfit explains it: a d_h-dimensional space read through readings that fit
                    # linear functions to `fit` (relative) shows a (d_h + 1)-th direction of ~150-300 x fit (measured:
                    # float64, float32 with exact and with stage H's O_h, the old reader), so up to this x fit
GAP_CAP = 0.2       # and never above this: no d_h-dimensional space
PRECISE = 1e-10     # answers this precise (float64) read the weights to ~1e-12: a misfit is the model's
FORM_ROWS = 4       # readings per unknown of a form T_h(D) (d_h^2 unknowns), at most
READ_CHUNK = 2**22  # numbers of O_h x_i held at once by the weight reader (32 MiB)
FIT_LIMIT = 0.01    # readings that fit linear functions of the varied token worse than this (relative) are not
                    # bilinear forms: not the model


class WeightReader:
    """Reads every head's attention weights at every row of sequences that start with the zero token.

    At row t the answer is ``y_t - b = sum_h sum_{i visible} a_{h,t,i} O_h x_i``: linear in the H |vis| weights
    of the visible (non-zero) tokens, with the vectors ``O_h x_i`` known. One least-squares solve per row
    reads them all, to the answers' precision times the conditioning of those vectors (random vectors in R^d,
    well conditioned while ``H |vis|`` is well below d). (Going through each head's output coordinates
    first, a change of basis onto all of R^d when ``H d_h = d``, costs its condition, ~d: 249 at d = 256,
    too much for float32 answers.) Each weight comes with its standard deviation relative to the answers'
    noise (the diagonal of ``(A^T A)^{-1}``), which weights the logarithms' fits."""

    def __init__(self, heads: Heads):
        O = heads.O
        H, d, _ = O.shape
        dh = heads.head_dim
        if H * dh > d:
            raise NotIdentifiable(f"{H} heads of dimension {dh} have output spaces of {H * dh} > d = {d} "
                                  "dimensions: their parts of an answer cannot be told apart")
        self.O = np.asarray(O, dtype=np.float64)
        self.b = heads.b
        self.H, self.dh = H, dh

    def weights(self, X: np.ndarray, Y: np.ndarray, rows=None) -> tuple[np.ndarray, np.ndarray]:
        """``(a, s)``: ``a[k, h, t, i]`` for sequences X (n, N, d) and their answers Y (n, N, d), and ``s`` the
        standard deviation of each (per unit noise on the answers). Token 0 and any other token that is zero
        in every sequence are zero tokens: each has score 0, so they share the weight the visible tokens
        leave. Rows with more than d_h - 1 visible tokens are left NaN (fewer unknowns than the answer's d
        numbers, with room to spare), and so are the rows not in ``rows`` (default: every row)."""
        n, N, d = X.shape
        zero = ~np.any(X != 0, axis=(0, 2))
        if not zero[0]:
            raise ValueError("the weights are read against a zero token at position 0")
        a = np.full((n, self.H, N, N), np.nan)
        s = np.full((n, self.H, N, N), np.nan)
        step = max(1, READ_CHUNK // (N * self.H * d))            # sequences per chunk: O_h x_i is the big temporary
        for k in range(0, n, step):
            self._read(X[k:k + step], Y[k:k + step], zero, rows, a[k:k + step], s[k:k + step])
        return a, s

    def _read(self, X, Y, zero, rows, a, s) -> None:
        n, N, d = X.shape
        H, dh = self.H, self.dh
        OX = np.einsum("hed,ktd->kthe", self.O, X, optimize=True)  # (n, N, H, d): O_h x_i
        R = Y - self.b
        for t in (range(N) if rows is None else rows):
            vis = np.flatnonzero(~zero[:t + 1])
            zs = np.flatnonzero(zero[:t + 1])
            if len(vis) > dh - 1:
                continue
            w = np.zeros((n, H, 0))
            var0 = np.zeros((n, H))
            if len(vis):
                A = OX[:, vis].transpose(0, 3, 2, 1).reshape(n, d, H * len(vis))      # columns (h, i)
                q, r = np.linalg.qr(A)                  # QR, not the normal equations: the condition, not its square
                w = np.linalg.solve(r, np.einsum("kdu,kd->ku", q, R[:, t])[..., None])[..., 0].reshape(n, H, len(vis))
                a[:, :, t, vis] = w
                rinv = np.linalg.inv(r)
                C = (rinv @ rinv.transpose(0, 2, 1)).reshape(n, H, len(vis), H, len(vis))     # (A^T A)^{-1}
                s[:, :, t, vis] = np.sqrt(np.maximum(np.einsum("khihi->khi", C), 0.0))
                var0 = np.maximum(np.einsum("khihj->kh", C), 0.0)     # var(sum_i a_i) = 1^T C_h 1
            a[:, :, t, zs] = ((1.0 - w.sum(-1)) / len(zs))[..., None]
            s[:, :, t, zs] = (np.sqrt(var0) / len(zs))[..., None]


def log_ratios(a: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``log(a_i / a_0)`` and each reading's weight for least squares, the inverse of its standard deviation
    ``sqrt((s_i/a_i)^2 + (s_0/a_0)^2)`` (a weight is read to an absolute precision s, so a small one gives an
    imprecise logarithm); a weight that is not positive (a masked or windowed key) gives NaN."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a0, s0 = a[..., :1], s[..., :1]
        ok = (a > 0) & (a0 > 0) & np.isfinite(s) & np.isfinite(s0)
        L = np.where(ok, np.log(np.where(ok, a, 1.0)) - np.log(np.where(a0 > 0, a0, 1.0)), np.nan)
        rel = np.where(ok, (np.where(ok, s, 0.0) / np.where(ok, a, 1.0)) ** 2
                       + (np.where(ok, s0, 0.0) / np.where(a0 > 0, a0, 1.0)) ** 2, np.inf)
        w = np.where(ok, 1.0 / np.sqrt(np.maximum(rel, 1e-300)), 0.0)
    return L, w


def wlstsq(A: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    """Weighted least squares over the finite readings: the solution and the weighted rms residual."""
    ok = np.isfinite(y) & (w > 0)
    Aw, yw = A[ok] * w[ok, None], y[ok] * w[ok]
    sol = lstsq(Aw, yw, rcond=None)[0]
    r = Aw @ sol - yw
    return sol, float(np.sqrt(np.mean(r ** 2))) if r.size else 0.0


@dataclass(frozen=True)
class Spaces:
    Ua: tuple            # per head: (d, dh) orthonormal basis of row(Q_h)
    Ub: tuple            # per group: (d, dh) orthonormal basis of row(K_g)
    queries: int
    info: dict = field(default_factory=dict)


def _wrms(y: np.ndarray, w: np.ndarray) -> float:
    ok = np.isfinite(y) & (w > 0)
    return max(float(np.sqrt(np.mean((y[ok] * w[ok]) ** 2))) if ok.any() else 0.0, 1e-300)


def _ask(oracle: Oracle, X: np.ndarray, reader: WeightReader, progress, rows=None):
    """The answers to X, and every head's logits against the zero token with their weights at ``rows``
    (default: all): (L, W, Y)."""
    Y = np.asarray(oracle.query(X), dtype=np.float64)
    if progress is not None:
        progress(X.shape[0])
    return (*log_ratios(*reader.weights(X, Y, rows)), Y)


def _basis(vectors: np.ndarray, dh: int, what: str, fit: float) -> tuple[np.ndarray, float]:
    """Orthonormal basis of the span of the rows of ``vectors`` (which should have rank dh), and the gap
    ``s_{dh+1} / s_dh``. ``fit``: the readings' relative misfit to linear functions of the varied tokens (at most
    FIT_LIMIT: :func:`find_spaces` has refused a larger one already), so a wide gap here is imprecision:
    NotIdentifiable."""
    _, s, Vt = svd(vectors, full_matrices=False)
    gap = float(s[dh] / s[dh - 1]) if s.size > dh else 0.0
    if s.size < dh or s[dh - 1] <= 1e-8 * s[0]:
        raise NotIdentifiable(f"the {what} readings span fewer than d_h = {dh} dimensions")
    if gap > gap_limit(fit):
        raise NotIdentifiable(f"the {what} readings are too imprecise to fix a {dh}-dimensional space (singular "
                              f"value {dh + 1} is {gap:.3g} of the {dh}-th, more than the readings' misfit "
                              f"{fit:.2g} explains: {gap_limit(fit):.3g})")
    return Vt[:dh].T, gap


def gap_limit(fit: float) -> float:
    """The largest (d_h + 1)-th direction (of the d_h-th) that readings of relative misfit ``fit`` explain."""
    return float(min(GAP_CAP, max(GAP_LIMIT, GAP_PER_FIT * fit)))


def space_layout(dh: int, max_len: int) -> tuple[int, int, int, int]:
    """(rows, m, p, batches) of the space queries: rows t <= d_h - 1 (fewer weights than numbers, an
    overdetermined solve), m keys at positions 1..m and p queries at m + 1..rows after the zero token; each
    batch is two sets of queries (varying queries, varying keys)."""
    rows = int(min(dh - 1, max_len - 1))
    m = (rows + 1) // 2
    p = rows - m
    return rows, m, p, max(2, int(np.ceil((dh + 4) / max(m * p, 1))))


def form_layout(dh: int, max_len: int) -> tuple[int, int]:
    """(N, k) of the form queries: N = min(max_len, d_h) tokens (rows t <= d_h - 1); where max_len > N + 1, a
    second design of max_len tokens with k keys after the zero token and k queries at the end (k = 0: none)."""
    N = int(min(max_len, dh))
    k = (dh - 1) // 2
    return N, (k if max_len > N + 1 and k >= 1 else 0)


def oversample(precision: float) -> int:
    """Queries per unknown beyond the floor: float64 answers read the weights to ~1e-12, float32 ones to ~1e-3
    (4x more readings)."""
    return 1 if precision <= PRECISE else 4


def find_spaces(oracle: Oracle, heads: Heads, reader: WeightReader, rng: np.random.Generator, *, max_len: int,
                precision: float, progress=None) -> Spaces:
    """Query spaces per head and key spaces per group (see the module)."""
    d, H, dh = oracle.d, heads.heads, heads.head_dim
    rows, m, p, batches = space_layout(dh, max_len)
    if m < 1 or p < 1:
        raise NotIdentifiable(f"max_len={max_len} (head dimension {dh}) leaves no room for keys and queries after "
                              "the zero token")
    n = oversample(precision) * d + EXTRA
    qvec = [[] for _ in range(H)]
    kvec = [[] for _ in range(H)]
    queries, fit_q, fit_k = 0, 0.0, 0.0
    keys, qs = np.arange(1, m + 1), np.arange(m + 1, rows + 1)
    for _ in range(batches):
        # fixed keys, varying queries: each reading q_t^T (M(i - t) k_i) is linear in the query; then fixed
        # queries, varying keys: each reading k_i^T (M(i - t)^T q_t) is linear in the key
        for vary_queries, out in ((True, qvec), (False, kvec)):
            X = np.zeros((n, rows + 1, d))
            X[:, keys] = rng.standard_normal((m, d))[None] if vary_queries else rng.standard_normal((n, m, d))
            X[:, qs] = rng.standard_normal((n, p, d)) if vary_queries else rng.standard_normal((p, d))[None]
            L, W, _ = _ask(oracle, X, reader, progress, qs)           # (n, H, N, N)
            for h in range(H):
                for t in qs:
                    for i in keys:
                        v, r = wlstsq(X[:, t if vary_queries else i], L[:, h, t, i], W[:, h, t, i])
                        out[h].append(v)
                        rel = r / _wrms(L[:, h, t, i], W[:, h, t, i])
                        fit_q, fit_k = (max(fit_q, rel), fit_k) if vary_queries else (fit_q, max(fit_k, rel))
        queries += 2 * n
    fit = max(fit_q, fit_k)
    if fit > FIT_LIMIT and precision <= PRECISE:
        raise ModelMismatch(
            f"the attention logits log(a_i / a_0) are not bilinear in the query and key tokens at a fixed offset "
            f"(relative misfit {fit:.3g} > {FIT_LIMIT}): a position bias of its own in the scores (ALiBi), absolute "
            "positions, or biases on the queries or keys", check="score form", figure=fit, threshold=FIT_LIMIT)
    if fit > FIT_LIMIT:
        raise NotIdentifiable(
            f"the attention logits are too imprecise at this answer precision ({precision:.2g}): they fit bilinear "
            f"forms of the tokens only to {fit:.3g} (> {FIT_LIMIT}), and as the heads' weights are read through stage "
            "H's O_h, a wrong score form cannot be told from a wrong split of the heads or imprecision here")
    # without a rotation the form is the same at every offset: one query's key vectors then coincide
    spread = max(float(np.max(np.abs(np.stack(kvec[h][j * m:(j + 1) * m]) - kvec[h][j * m])))
                 / max(float(np.max(np.abs(kvec[h][j * m]))), 1e-300)
                 for h in range(H) for j in range(len(kvec[h]) // m))
    if spread <= max(1e-6, 100 * fit_k):
        raise ModelMismatch(f"the score forms do not change with the offset (one query's key vectors at offsets "
                            f"1..{rows - 1} agree to {spread:.2g}): not a rotary layer (no rotation: use --method "
                            "vector)", check="rotation", figure=spread, threshold=max(1e-6, 100 * fit_k))
    Ua, qgaps = zip(*[_basis(np.stack(qvec[h]), dh, "query space", fit_q) for h in range(H)])
    kb, kgaps = zip(*[_basis(np.stack(kvec[h]), dh, "key space", fit_k) for h in range(H)])
    qgap, kgap = max(qgaps), max(kgaps)
    # key groups: heads whose key spaces coincide
    G = int(heads.group.max()) + 1
    same = np.array([[_subspace_gap(kb[i].T, kb[j].T) for j in range(H)] for i in range(H)])
    within = max([same[i, j] for i in range(H) for j in range(H) if heads.group[i] == heads.group[j]] + [0.0])
    across = min([same[i, j] for i in range(H) for j in range(H) if heads.group[i] != heads.group[j]] + [1.0])
    lim = gap_limit(fit_k)
    if within > lim or across < max(10 * GAP_LIMIT, 3 * lim):
        raise ModelMismatch(f"the heads' key spaces do not fall into the value groups of stage H (largest angle "
                            f"sine within a group {within:.3g}, smallest across {across:.3g}; the readings' misfit "
                            f"{fit_k:.2g} explains up to {lim:.3g}): keys and values are not shared by the same "
                            "groups of heads", check="key/value groups", figure=within, threshold=lim)
    Ub = []
    for g in range(G):
        members = np.flatnonzero(heads.group == g)
        Ub.append(_basis(np.vstack([np.stack(kvec[h]) for h in members]), dh, "key space", fit_k)[0])
    info = {"space_queries": queries, "keys_per_space_query": m, "queries_per_space_query": p,
            "query_fit_rms": fit_q, "key_fit_rms": fit_k, "query_space_gap": qgap, "key_space_gap": kgap,
            "key_angle_within_group": within, "key_angle_across_groups": across}
    return Spaces(Ua=tuple(Ua), Ub=tuple(Ub), queries=queries, info=info)


@dataclass(frozen=True)
class Forms:
    T: np.ndarray        # (H, len(offsets), dh, dh): T_h(D) for each offset read
    offsets: np.ndarray  # the offsets D read, ascending (1 first)
    residual: float      # rms residual of the fits over the rms of the readings
    queries: int
    reads: tuple         # (X, Y): the random sequences and their answers, kept for the in-sample error
    logits: tuple = ()   # per design (X, L, W): every head's logits and their weights (stage Q refits from them)
    info: dict = field(default_factory=dict)


def _fit_forms(X, L, W, Ua, Ub, group) -> tuple[dict, float, int]:
    """Per head and offset D, T_h(D) by weighted least squares over the readings (t, t - D) of every design,
    at most ``FORM_ROWS`` x d_h^2 of them (the small offsets have many more than the largest, which sets the
    number of queries). One (h, D) at a time, from the normal equations of its features (the outer products of
    the two tokens' space coordinates: well conditioned), so memory stays ~d_h^4 whatever the number of
    readings; the residual from a second pass over the same readings (not by cancellation)."""
    H = len(Ua)
    dh = Ua[0].shape[1]
    cap = FORM_ROWS * dh * dh + EXTRA
    coords = []                # per design: (qa (H, n, N, dh), kb (G, n, N, dh), pairs by offset)
    for Xs in X:
        n, N, _ = Xs.shape
        live = np.any(Xs != 0, axis=(0, 2))                          # the tokens that are not zero tokens
        by_D = {}
        for t in range(N):
            for i in range(1, t):
                if live[t] and live[i]:
                    by_D.setdefault(t - i, []).append((t, i))
        coords.append((np.einsum("ktd,hde->hkte", Xs, np.stack(Ua)),
                       np.einsum("ktd,gde->gkte", Xs, np.stack(Ub)), by_D))
    offsets = sorted({D for _, _, by_D in coords for D in by_D})

    def readings(h, D):
        """The readings of (h, D), in chunks: (features, logits, weights), at most cap rows in all."""
        left = cap
        for (qa, kb, by_D), Ls, Ws in zip(coords, L, W):
            for t, i in by_D.get(D, []):
                if left <= 0:
                    return
                y, w = Ls[:, h, t, i], Ws[:, h, t, i]
                ok = np.flatnonzero(np.isfinite(y) & (w > 0))[:left]
                left -= len(ok)
                f = np.einsum("ka,kb->kab", qa[h, ok, t], kb[group[h], ok, i]).reshape(len(ok), -1)
                yield f * w[ok, None], y[ok] * w[ok]

    T, num, den, bad = {}, 0.0, 0.0, 0
    for h in range(H):
        for D in offsets:
            A = np.zeros((dh * dh, dh * dh))
            rhs = np.zeros(dh * dh)
            rows = 0
            for f, y in readings(h, D):
                A += f.T @ f
                rhs += f.T @ y
                rows += len(y)
            if rows < dh * dh + EXTRA:
                continue
            sol = np.linalg.solve(A, rhs)
            T[(h, D)] = sol.reshape(dh, dh)
            r2 = y2 = 0.0
            for f, y in readings(h, D):
                r2 += float(np.sum((f @ sol - y) ** 2))
                y2 += float(np.sum(y ** 2))
            num += r2 / rows
            den += y2 / rows
    for (_, _, by_D), Ls in zip(coords, L):            # readings that are not positive weights (masked keys)
        for pairs in by_D.values():
            t, i = np.asarray(pairs).T
            bad += int(np.sum(~np.isfinite(Ls[:, :, t, i])))
    return T, float(np.sqrt(num / max(den, 1e-300))), bad


def read_forms(oracle: Oracle, heads: Heads, spaces: Spaces, reader: WeightReader, rng: np.random.Generator, *,
               max_len: int, precision: float, progress=None) -> Forms:
    """Every head's score form ``T_h(D)`` at the offsets D = 1 .. N - 2 (N = min(max_len, d_h)): random
    sequences after the zero token. Where max_len > d_h, also long sequences with zero tokens in the middle
    (a block of keys after the zero token, zeros, a block of queries at the end) read the large offsets
    (more turn of the slow planes, hence their frequencies and planes more precisely)."""
    d, H, dh = oracle.d, heads.heads, heads.head_dim
    N, k = form_layout(dh, max_len)
    if N - 2 < 1:
        raise NotIdentifiable(f"max_len={max_len}: sequences of {N} tokens read no offset")
    n = 2 * oversample(precision) * dh * dh + EXTRA
    X = np.zeros((n, N, d))
    X[:, 1:] = rng.standard_normal((n, N - 1, d))
    designs = [X]
    if k:
        Xl = np.zeros((n, int(max_len), d))
        Xl[:, 1:k + 1] = rng.standard_normal((n, k, d))
        Xl[:, max_len - k:] = rng.standard_normal((n, k, d))
        designs.append(Xl)
    Ls, Ws, Ys = zip(*[_ask(oracle, Xs, reader, progress) for Xs in designs])
    T, residual, bad = _fit_forms(designs, Ls, Ws, spaces.Ua, spaces.Ub, heads.group)
    offsets = sorted({D for (_, D) in T})
    offsets = [D for D in offsets if all((h, D) in T for h in range(H))]
    Tarr = np.stack([np.stack([T[(h, D)] for D in offsets]) for h in range(H)])
    q = sum(x.shape[0] for x in designs)
    info = {"form_queries": q, "form_tokens": int(max(x.shape[1] for x in designs)), "offsets_read": offsets,
            "form_residual": residual, "readings_not_positive": bad}
    return Forms(T=Tarr, offsets=np.asarray(offsets), residual=residual, queries=q,
                 reads=(designs[0], Ys[0]), logits=tuple(zip(designs, Ls, Ws)), info=info)


__all__ = ["Forms", "Spaces", "WeightReader", "find_spaces", "form_layout", "log_ratios", "oversample", "read_forms",
           "space_layout"]
