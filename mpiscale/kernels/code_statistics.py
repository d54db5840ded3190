"""Sufficient statistics of sparse codes, Numba: the work of one rank's batch in online dictionary learning.

Codes have L non-zeros out of K atoms, so ``A = sum c c^T`` and ``B = sum c x^T``
need only the non-zero pairs: ``n L^2 / 2`` and ``n L F`` multiply-adds
instead of the ``n K^2`` and ``n K F`` of dense matrix products (for K = 256,
L = 8: 1,000 times fewer for A). A is kept as its packed upper triangle, in
``np.triu_indices`` order, which is what travels in the allreduce.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def accumulate_statistics(
    values: np.ndarray,
    chosen: np.ndarray,
    counts: np.ndarray,
    signals: np.ndarray,
    dictionary: np.ndarray,
    a_upper: np.ndarray,
    b: np.ndarray,
    usage: np.ndarray,
    residual: np.ndarray,
) -> None:
    """Add the batch's A (packed upper triangle), B and atom usage; write each signal's residual ``x - c D``.

    The codes come as rows: signal ``s`` uses atoms ``chosen[s, :counts[s]]``, in increasing order, with weights
    ``values[s, :counts[s]]``; a weight of exactly zero is no use of its atom.
    """
    atoms = dictionary.shape[0]
    features = signals.shape[1]
    for s in range(counts.shape[0]):
        for f in range(features):
            residual[s, f] = signals[s, f]
        used = counts[s]
        for p in range(used):
            value = values[s, p]
            if value == 0.0:
                continue
            i = chosen[s, p]
            usage[i] += 1.0
            row_start = i * atoms - (i * (i - 1)) // 2 - i  # packed index of (i, j) is row_start + j
            for q in range(p, used):
                if values[s, q] != 0.0:
                    a_upper[row_start + chosen[s, q]] += value * values[s, q]
            for f in range(features):
                b[i, f] += value * signals[s, f]
                residual[s, f] -= value * dictionary[i, f]


#: Side of the tiles in which ``fold_packed`` mirrors the upper triangle: a tile's rows and columns stay in cache.
TILE = 32


@njit(cache=True)
def fold_packed(a: np.ndarray, a_upper: np.ndarray, beta: float, count: float) -> None:
    """``a <- beta a + A / count`` for the symmetric ``A`` given as its packed upper triangle.

    ``beta = 0, count = 1`` unpacks ``A`` into ``a`` (the old ``a`` is not read, so nothing of it survives).
    The upper triangle is folded row by row, then copied below the diagonal a tile at a time: writing each
    column as its row was folded strode through the whole matrix, at 1.6x the time for 256 atoms.
    """
    atoms = a.shape[0]
    index = 0
    for i in range(atoms):
        row = a[i]
        if beta == 0.0:
            for j in range(i, atoms):
                row[j] = a_upper[index + j - i] / count
        else:
            for j in range(i, atoms):
                row[j] = beta * row[j] + a_upper[index + j - i] / count
        index += atoms - i
    for first_row in range(0, atoms, TILE):
        for first_column in range(first_row, atoms, TILE):
            for i in range(first_row, min(first_row + TILE, atoms)):
                for j in range(max(first_column, i + 1), min(first_column + TILE, atoms)):
                    a[j, i] = a[i, j]
