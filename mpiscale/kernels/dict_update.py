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

#: Atoms whose steps one matrix product makes: their sum over the other atoms runs in BLAS, and only the
#: corrections for the atoms of the block already moved run here.
BLOCK = 32


@njit(cache=True)
def block_coordinate_update(dictionary: np.ndarray, a: np.ndarray, b: np.ndarray, min_weight: float) -> None:
    """Update ``dictionary`` (atoms x features, C-contiguous) in place, one sweep over the atoms in order.

    Atoms whose weight ``A_jj`` is at most ``min_weight`` are left as they are
    (they carry no information; the caller replaces them). Each atom's step
    ``B_j - A_j D`` needs the atoms before it as already moved: a block's steps
    are one product ``B_J - A_J D`` with the atoms before the block moved, and
    each atom of the block then subtracts ``A_ji (d_i' - d_i)`` for those of
    the block moved before it. The sweep is the atom-by-atom one (Mairal et al.)
    in another order of additions; its products run at BLAS's speed, about 2x the
    loop's at 256 atoms of 64 values.
    """
    atoms, features = dictionary.shape
    moved = np.empty(features)
    for lo in range(0, atoms, BLOCK):
        hi = min(atoms, lo + BLOCK)
        steps = b[lo:hi] - np.dot(a[lo:hi], dictionary)
        for j in range(lo, hi):
            weight = a[j, j]
            if weight <= min_weight:
                continue
            step = steps[j - lo]
            norm = 0.0
            for f in range(features):
                value = dictionary[j, f] + step[f] / weight
                step[f] = value
                norm += value * value
            if norm <= 0.0:
                continue
            scale = 1.0 / math.sqrt(norm)
            for f in range(features):
                value = step[f] * scale
                moved[f] = value - dictionary[j, f]
                dictionary[j, f] = value
            for later in range(j + 1, hi):
                coefficient = a[later, j]
                if coefficient != 0.0:
                    for f in range(features):
                        steps[later - lo, f] -= coefficient * moved[f]


@njit(cache=True)
def near_duplicates(gram: np.ndarray, threshold: float) -> np.ndarray:
    """Pairs ``(i, j)``, ``i < j``, with ``|gram[i, j]| > threshold``, in row-major order (no temporaries).

    A first pass counts them, branch-free, and the second, which records them, runs only when there are any: an
    iteration of the learner checks a dictionary that has none nearly every time (32 µs against 17 at 256 atoms).
    """
    atoms = gram.shape[0]
    found = 0
    for i in range(atoms):
        row, in_row = gram[i], 0
        for j in range(i + 1, atoms):
            in_row += 1 if abs(row[j]) > threshold else 0
        found += in_row
    pairs = np.empty((found, 2), np.int64)
    if found == 0:
        return pairs
    found = 0
    for i in range(atoms):
        for j in range(i + 1, atoms):
            if abs(gram[i, j]) > threshold:
                pairs[found, 0] = i
                pairs[found, 1] = j
                found += 1
    return pairs
