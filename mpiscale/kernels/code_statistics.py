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
    codes: np.ndarray,
    signals: np.ndarray,
    dictionary: np.ndarray,
    a_upper: np.ndarray,
    b: np.ndarray,
    usage: np.ndarray,
    residual: np.ndarray,
) -> None:
    """Add the batch's A (packed upper triangle), B and atom usage; write each signal's residual ``x - c D``."""
    count, atoms = codes.shape
    features = signals.shape[1]
    support = np.empty(atoms, np.int64)
    for s in range(count):
        used = 0
        for k in range(atoms):
            if codes[s, k] != 0.0:
                support[used] = k
                used += 1
        for f in range(features):
            residual[s, f] = signals[s, f]
        for p in range(used):
            i = support[p]
            value = codes[s, i]
            usage[i] += 1.0
            row_start = i * atoms - (i * (i - 1)) // 2 - i  # packed index of (i, j) is row_start + j
            for q in range(p, used):
                j = support[q]
                a_upper[row_start + j] += value * codes[s, j]
            for f in range(features):
                b[i, f] += value * signals[s, f]
                residual[s, f] -= value * dictionary[i, f]


@njit(cache=True)
def fold_packed(a: np.ndarray, a_upper: np.ndarray, beta: float, count: float) -> None:
    """``a <- beta a + A / count`` for the symmetric ``A`` given as its packed upper triangle, in one pass.

    ``beta = 0, count = 1`` unpacks ``A`` into ``a`` (the old ``a`` is not read, so nothing of it survives).
    """
    atoms = a.shape[0]
    index = 0
    for i in range(atoms):
        for j in range(i, atoms):
            value = a_upper[index] / count if beta == 0.0 else beta * a[i, j] + a_upper[index] / count
            a[i, j] = value
            a[j, i] = value
            index += 1
