"""Running top-k of score rows: each query's best k (score descending, id ascending) over blocks of candidates.

Similar-search scores a block of candidates against every query with one
matrix product, then ``merge_top_k`` keeps, per query, the k best seen so far.
Candidates are compared as (score, id) pairs, so ties go to the smaller id and
the result is the same whatever the blocks are and however the candidates are
split over ranks: merging the ranks' lists with the same rule gives the
single-process answer. The insertion is O(k) only for a candidate that beats
the current k-th; most of a large block is one comparison each. It runs on one
thread: the matrix product before it is where the time goes, and Numba threads
next to BLAS's busy threads on the same cores made a single query 4x slower.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: The id of an empty slot: larger than any real id, so it loses every tie.
NO_ID = np.iinfo(np.int64).max


def empty_top_k(queries: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) with no candidates yet: -inf and ``NO_ID``."""
    return np.full((queries, k), -np.inf, np.float32), np.full((queries, k), NO_ID, np.int64)


def merge_top_k(
    scores: np.ndarray, ids: np.ndarray, allowed: np.ndarray, best: np.ndarray, best_ids: np.ndarray
) -> None:
    """Fold candidates (``scores``: queries x n, their ``ids`` and ``allowed`` mask: n) into ``best``/``best_ids``
    (queries x k, sorted, updated in place)."""
    _merge(np.ascontiguousarray(scores, np.float32), np.ascontiguousarray(ids, np.int64),
           np.ascontiguousarray(allowed, np.bool_), best, best_ids)  # fmt: skip


@njit(cache=True)
def _merge(scores, ids, allowed, best, best_ids):  # pragma: no cover - compiled
    queries, n = scores.shape
    k = best.shape[1]
    for q in range(queries):
        row, top, top_ids = scores[q], best[q], best_ids[q]
        for j in range(n):
            if not allowed[j]:
                continue
            score, candidate = row[j], ids[j]
            if score < top[k - 1] or (score == top[k - 1] and candidate >= top_ids[k - 1]):
                continue
            slot = k - 1
            while slot > 0 and (score > top[slot - 1] or (score == top[slot - 1] and candidate < top_ids[slot - 1])):
                top[slot] = top[slot - 1]
                top_ids[slot] = top_ids[slot - 1]
                slot -= 1
            top[slot] = score
            top_ids[slot] = candidate
