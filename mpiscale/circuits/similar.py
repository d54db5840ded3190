"""Similar circuits: exact cosine top-k over a space's embeddings, each rank its block, with a metadata filter.

The stored vectors have unit norm, so a block's cosines against every query
are one float32 matrix product, which screens; ``kernels.topk`` scores the
candidates that could rank exactly (a row's score does not depend on where it
sits in the block) and keeps each query's best k as (score, circuit row)
pairs, ties to the smaller row. Each rank searches its
block of the space (read in slices of ``block`` rows: bounded memory), and the
ranks' lists are merged with the same rule, so the answer is the one a single
process finds, on any number of ranks. A circuit the filter rejects is never a
candidate (the filter reads only the metadata of the block's circuits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.topk import NO_ID, empty_top_k, merge_top_k
from ..ranks import Comm, rank_rows
from .catalogue import Catalogue, Space
from .filters import Filter, matching
from .store import CatalogueError, row_norms

BLOCK_ROWS = 65536


@dataclass(frozen=True)
class Neighbours:
    """Each query's best circuits: cosines and catalogue rows (queries x k), best first; ``NO_ID`` pads a short
    list (fewer circuits than k pass the filter)."""

    scores: np.ndarray
    rows: np.ndarray


def unit_queries(queries: np.ndarray, where: str) -> np.ndarray:
    """Queries as unit rows (float32); one query may be a plain vector. Refuses NaN and zero vectors."""
    queries = np.atleast_2d(np.asarray(queries, np.float64))
    if queries.ndim != 2:
        raise ValueError(f"{where}: queries must be a vector or a matrix (one query a row), got shape {queries.shape}")
    if not np.isfinite(queries).all():
        raise ValueError(f"{where}: a query holds NaN or infinite values")
    norms = row_norms(queries)
    if (norms == 0).any():
        raise ValueError(f"{where}: query {int(np.flatnonzero(norms == 0)[0])} is all zeros: it has no direction")
    return (queries / norms[:, None]).astype(np.float32)


def search_block(
    catalogue: Catalogue, space: Space, queries: np.ndarray, k: int, filters: list[Filter], start: int, stop: int,
    block: int = BLOCK_ROWS,
) -> Neighbours:  # fmt: skip
    """Each query's best ``k`` among the space's rows ``start:stop`` that pass ``filters`` (one process)."""
    found = Neighbours(*empty_top_k(len(queries), k))
    for lo in range(start, stop, block):
        hi = min(lo + block, stop)
        vectors, circuits = catalogue.vectors(space.index, lo, hi)
        allowed = np.ones(hi - lo, bool)
        if filters and hi > lo:
            first, last = int(circuits.min()), int(circuits.max()) + 1
            allowed = matching(catalogue, filters, first, last)[circuits - first]
        nearest(vectors, circuits, allowed, queries, found)
    return found


def nearest(
    vectors: np.ndarray, ids: np.ndarray, allowed: np.ndarray, queries: np.ndarray, found: Neighbours,
    block: int = BLOCK_ROWS,
) -> None:  # fmt: skip
    """Fold unit ``vectors`` (with their ``ids`` and ``allowed`` mask) into each query's running best ``found``,
    ``block`` rows per matrix product (bounded scratch memory). A block the filter mostly rejects is cut to its
    allowed rows first: a copy of a few rows costs less than the products it saves."""
    for lo in range(0, len(vectors), block):
        hi = min(lo + block, len(vectors))
        rows, keys, passes = vectors[lo:hi], ids[lo:hi], allowed[lo:hi]
        if passes.sum() < len(passes) // 2:
            rows, keys, passes = rows[passes], keys[passes], np.ones(int(passes.sum()), bool)
        merge_top_k(queries @ rows.T, queries, rows, keys, passes, found.scores, found.rows)


def merge_neighbours(parts: list[Neighbours], k: int) -> Neighbours:
    """The best ``k`` of several lists per query, by (score descending, row ascending)."""
    scores = np.concatenate([part.scores for part in parts], axis=1)
    rows = np.concatenate([part.rows for part in parts], axis=1)
    order = np.lexsort((rows, -scores), axis=1)[:, :k]
    return Neighbours(np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1))


def similar(
    catalogue: Catalogue, space: Space, queries: np.ndarray, k: int, filters: list[Filter], comm: Comm | None = None,
) -> Neighbours | None:  # fmt: skip
    """The best ``k`` circuits per query: this rank's block searched, the lists merged on rank 0 (None elsewhere)."""
    if queries.shape[1] != space.dimension:
        raise CatalogueError(catalogue.path, f"space {space.name!r} holds vectors of {space.dimension} numbers; the "
                                             f"queries have {queries.shape[1]}")  # fmt: skip
    size, rank = (comm.Get_size(), comm.Get_rank()) if comm is not None else (1, 0)
    start, stop = rank_rows(space.count, size, rank)
    mine = search_block(catalogue, space, queries, k, filters, start, stop)
    parts = comm.gather(mine, root=0) if comm is not None else [mine]
    return merge_neighbours(parts, k) if parts is not None else None


def drop_rows(found: Neighbours, rows: list[int | None], k: int) -> Neighbours:
    """Each query's list without its own circuit (``rows[q]``; None keeps all), cut to ``k``."""
    scores, kept = np.full((len(rows), k), -np.inf, np.float32), np.full((len(rows), k), NO_ID, np.int64)
    for query, own in enumerate(rows):
        keep = found.rows[query] != own if own is not None else np.ones(found.rows.shape[1], bool)
        scores[query], kept[query] = found.scores[query][keep][:k], found.rows[query][keep][:k]
    return Neighbours(scores, kept)
