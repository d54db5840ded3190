"""Block-coordinate dictionary update of online dictionary learning (Mairal et al., 2009), Numba.

Given the sufficient statistics ``A = sum c c^T`` (atoms x atoms) and
``B = sum c x^T`` (atoms x features), each atom in turn moves to the minimiser
of the surrogate objective with the other atoms fixed,
``d_j <- d_j + (B_j - A_j D) / A_jj``, and is rescaled to unit norm.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True)
def block_coordinate_update(dictionary: np.ndarray, a: np.ndarray, b: np.ndarray, min_weight: float) -> None:
    """Update ``dictionary`` (atoms x features) in place, one sweep over the atoms.

    Atoms whose weight ``A_jj`` is at most ``min_weight`` are left as they are
    (they carry no information; the caller replaces them).
    """
    atoms, features = dictionary.shape
    step = np.empty(features)
    for j in range(atoms):
        weight = a[j, j]
        if weight <= min_weight:
            continue
        for f in range(features):
            step[f] = b[j, f]
        for k in range(atoms):
            coefficient = a[j, k]
            if coefficient != 0.0:
                row = dictionary[k]
                for f in range(features):
                    step[f] -= coefficient * row[f]
        norm = 0.0
        for f in range(features):
            value = dictionary[j, f] + step[f] / weight
            step[f] = value
            norm += value * value
        if norm <= 0.0:
            continue
        scale = 1.0 / math.sqrt(norm)
        for f in range(features):
            dictionary[j, f] = step[f] * scale


@njit(cache=True)
def near_duplicates(gram: np.ndarray, threshold: float) -> np.ndarray:
    """Pairs ``(i, j)``, ``i < j``, with ``|gram[i, j]| > threshold``, in row-major order (no temporaries)."""
    atoms = gram.shape[0]
    found = 0
    for i in range(atoms):
        for j in range(i + 1, atoms):
            if abs(gram[i, j]) > threshold:
                found += 1
    pairs = np.empty((found, 2), np.int64)
    found = 0
    for i in range(atoms):
        for j in range(i + 1, atoms):
            if abs(gram[i, j]) > threshold:
                pairs[found, 0] = i
                pairs[found, 1] = j
                found += 1
    return pairs
