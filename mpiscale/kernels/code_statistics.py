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


#: Side of the tiles in which the upper triangle is mirrored below the diagonal: a tile's rows stay in cache.
TILE = 8


@njit(cache=True)
def fold_packed(a: np.ndarray, a_upper: np.ndarray, beta: float, count: float) -> None:
    """``a <- beta a + A / count`` for the symmetric ``A`` given as its packed upper triangle.

    ``beta = 0, count = 1`` unpacks ``A`` into ``a`` (the old ``a`` is not read, so nothing of it survives).
    The upper triangle is folded row by row, then mirrored below the diagonal (``mirror_upper``).
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
    mirror_upper(a)


@njit(cache=True)
def mirror_upper(a: np.ndarray) -> None:
    """Copy the upper triangle of square ``a`` below its diagonal, in place.

    ``TILE`` rows at a time, each lower row written whole from their columns: writing down columns strode through
    the whole matrix, and tiles of 32 written down their columns took 3.4x this (92 µs against 27 at 256 atoms, 7x
    at 1,024).
    """
    atoms = a.shape[0]
    for top in range(0, atoms, TILE):
        for j in range(top + 1, atoms):
            lower = a[j]
            for i in range(top, min(top + TILE, j)):
                lower[i] = a[i, j]
