"""Running top-k of cosines: each query's best k (score descending, id ascending) over blocks of candidates.

Similar-search scores a block of candidates against every query with one
float32 matrix product; ``merge_top_k`` then keeps, per query, the k best seen
so far. The product's rounding depends on where a row sits in it (BLAS
blocks and vectorises by position), so two identical rows can get different
float32 cosines, and the order would depend on how the rows were split over
blocks and ranks. So the product only screens: a candidate that could enter
the top k (its screened score within ``margin`` of the current k-th, the
product's error bound) is scored again exactly, a float64 sum of its exact
float64 products in a fixed order, then rounded to float32: the same bits for
the same row wherever it sits. Candidates are compared as (exact score, id)
pairs, so ties go to the smaller id and the result is the same whatever the
blocks are and however the candidates are split over ranks: merging the
ranks' lists with the same rule gives the single-process answer. Most of a
large block is one comparison each. It runs on one thread: the matrix product
before it is where the time goes, and Numba threads next to BLAS's busy
threads on the same cores made a single query 4x slower.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: The id of an empty slot: larger than any real id, so it loses every tie.
NO_ID = np.iinfo(np.int64).max


def empty_top_k(queries: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) with no candidates yet: -inf and ``NO_ID``."""
    return np.full((queries, k), -np.inf, np.float32), np.full((queries, k), NO_ID, np.int64)


def screening_margin(dimension: int) -> float:
    """How far a float32 product's cosine of unit rows of ``dimension`` numbers may be from the exact one: eight
    times the textbook bound (``dimension`` roundings of 2**-24), so every candidate that could rank is rescored."""
    return 8.0 * (dimension + 2) * 2.0**-24


def merge_top_k(
    screened: np.ndarray, queries: np.ndarray, vectors: np.ndarray, ids: np.ndarray, allowed: np.ndarray,
    best: np.ndarray, best_ids: np.ndarray,
) -> None:  # fmt: skip
    """Fold candidates into ``best``/``best_ids`` (queries x k, sorted, updated in place): ``screened`` (queries x n)
    are the float32 product's cosines of the unit ``queries`` and ``vectors`` (n rows), with their ``ids`` and
    ``allowed`` mask (n); the candidates that could rank are scored exactly (see the module docstring)."""
    margin = np.float32(screening_margin(queries.shape[1]))
    _merge(np.ascontiguousarray(screened, np.float32), np.ascontiguousarray(queries, np.float32),
           np.ascontiguousarray(vectors, np.float32), np.ascontiguousarray(ids, np.int64),
           np.ascontiguousarray(allowed, np.bool_), margin, best, best_ids)  # fmt: skip


@njit(cache=True)
def exact_cosine(queries, q, vectors, j):  # pragma: no cover - compiled
    """Row ``q`` of ``queries`` against row ``j`` of ``vectors``: the float32 rounding of a float64 sum of their
    products (each exact in float64). Four running sums, over the coordinates by their index mod 4, then added in
    one fixed order: the same bits wherever the rows sit, a quarter of one sum's chain of dependent additions."""
    s0 = s1 = s2 = s3 = 0.0
    dimension = queries.shape[1]
    whole = dimension - dimension % 4
    for c in range(0, whole, 4):
        s0 += np.float64(queries[q, c]) * np.float64(vectors[j, c])
        s1 += np.float64(queries[q, c + 1]) * np.float64(vectors[j, c + 1])
        s2 += np.float64(queries[q, c + 2]) * np.float64(vectors[j, c + 2])
        s3 += np.float64(queries[q, c + 3]) * np.float64(vectors[j, c + 3])
    for c in range(whole, dimension):
        s0 += np.float64(queries[q, c]) * np.float64(vectors[j, c])
    return np.float32((s0 + s1) + (s2 + s3))


@njit(cache=True)
def _merge(screened, queries, vectors, ids, allowed, margin, best, best_ids):  # pragma: no cover - compiled
    count, n = screened.shape
    k = best.shape[1]
    kth = np.empty(k, np.float32)
    for q in range(count):
        row, top, top_ids = screened[q], best[q], best_ids[q]
        # While the list is not full, the block's k-th best screened score first: the block's k best are exactly
        # at least that less the margin, so a row screened below it less twice the margin cannot rank, and is
        # never rescored (a full list's own k-th bounds the rescoring as well).
        kth[:] = -np.inf
        for j in range(n if top[k - 1] == -np.inf else 0):
            if allowed[j] and row[j] > kth[k - 1]:
                slot = k - 1
                while slot > 0 and row[j] > kth[slot - 1]:
                    kth[slot] = kth[slot - 1]
                    slot -= 1
                kth[slot] = row[j]
        cut = max(kth[k - 1] - 2 * margin, top[k - 1] - margin)
        for j in range(n):
            if not allowed[j] or row[j] < cut or row[j] + margin < top[k - 1]:
                continue
            score, candidate = exact_cosine(queries, q, vectors, j), ids[j]
            if score < top[k - 1] or (score == top[k - 1] and candidate >= top_ids[k - 1]):
                continue
            slot = k - 1
            while slot > 0 and (score > top[slot - 1] or (score == top[slot - 1] and candidate < top_ids[slot - 1])):
                top[slot] = top[slot - 1]
                top_ids[slot] = top_ids[slot - 1]
                slot -= 1
            top[slot] = score
            top_ids[slot] = candidate
