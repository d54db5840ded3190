"""Lasso sparse coding by cyclic coordinate descent on the Gram matrix, as a Numba kernel.

Each signal's code minimises ``0.5 * ||x - c D||^2 + alpha * ||c||_1``. Like
Batch-OMP it needs only ``G = D D^T`` and the correlations ``D x``: the kernel
keeps ``q = D x - G c`` up to date, so one coordinate step costs O(K).
Signals are coded in parallel over Numba threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, inline="always")
def _code_one(gram, correlations, alpha, max_sweeps, tol, q, out):
    atoms = gram.shape[0]
    q[:] = correlations
    out[:] = 0.0
    for _ in range(max_sweeps):
        largest_change, largest_value = 0.0, 0.0
        for k in range(atoms):
            old = out[k]
            diagonal = gram[k, k]
            z = q[k] + diagonal * old
            if z > alpha:
                new = (z - alpha) / diagonal
            elif z < -alpha:
                new = (z + alpha) / diagonal
            else:
                new = 0.0
            change = new - old
            if change != 0.0:
                out[k] = new
                row = gram[k]
                for j in range(atoms):
                    q[j] -= row[j] * change
                largest_change = max(largest_change, abs(change))
            largest_value = max(largest_value, abs(new))
        if largest_change <= tol * largest_value or largest_value == 0.0:
            return


@njit(parallel=True, cache=True)
def lasso_cd_gram(
    gram: np.ndarray, correlations: np.ndarray, alpha: float, max_sweeps: int, tol: float, codes: np.ndarray
) -> None:
    """Write the Lasso codes of every signal into ``codes`` (signals x atoms).

    Stops a signal once a sweep changes no coefficient by more than ``tol``
    times the largest coefficient, or after ``max_sweeps`` sweeps.
    """
    signals, atoms = correlations.shape
    for signal in prange(signals):
        q = np.empty(atoms)
        _code_one(gram, correlations[signal], alpha, max_sweeps, tol, q, codes[signal])
