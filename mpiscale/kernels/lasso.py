"""Lasso sparse coding on the Gram matrix, as Numba kernels: the exact homotopy path, and coordinate descent where
the path cannot be followed.

Each signal's code minimises ``0.5 * ||x - c D||^2 + alpha * ||c||_1``. Both
methods need only ``G = D D^T`` and the correlations ``b = D x``.

The homotopy (LARS with the Lasso modification, Efron et al., 2004; what
SPAMS's ``lasso`` runs) starts from ``c = 0`` at the penalty ``max |b|`` and
follows the minimisers, piecewise linear in the penalty, down to ``alpha``.
Along a piece the atoms in use keep ``|b - G c|`` equal to the penalty; a piece
ends where another atom's correlation reaches theirs (it joins) or a weight
crosses zero (its atom leaves). A step costs O(K s) for s atoms in use: the
inverse of their Gram sub-matrix is kept up to date, O(s^2) a change, so no
system is solved. The end point is solved once more from that inverse and
checked against the optimality conditions.

A signal whose path meets an atom linearly dependent on those in use, needs
more than ``MAX_ACTIVE`` of them or more than ``STEPS_PER_ATOM * K`` steps, or
fails the check, is coded by cyclic coordinate descent instead: it keeps
``q = b - G c`` up to date (O(K) a coordinate step) and stops at a tolerance,
at the same minimiser. Signals are coded in parallel over Numba threads, in
chunks that reuse their work arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

#: The most atoms a signal's path may use at once (the inverse kept is their square); past it, descent codes it.
MAX_ACTIVE = 512
#: Steps of the path per atom of the dictionary before descent takes the signal over (a path that cycles).
STEPS_PER_ATOM = 4
_DEPENDENT = 1e-10  # relative pivot below which a joining atom is linearly dependent on those in use
_SLACK = 1e-9  # relative room an unused atom's correlation has over alpha at the end point (rounding)
_CHUNK = 64  # signals a thread codes with one set of work arrays
_END, _JOIN, _LEAVE = 0, 1, 2


@njit(cache=True, inline="always")
def _direction_product(gram, active, w, size, a):
    """``a = G[:, active] w`` as rows of the symmetric ``G``, four at a time (one pass over ``a`` per four)."""
    atoms = a.shape[0]
    p = size % 4
    if p == 0:
        a[:] = 0.0
    elif p == 1:
        r0, w0 = gram[active[0]], w[0]
        for j in range(atoms):
            a[j] = w0 * r0[j]
    elif p == 2:
        r0, w0, r1, w1 = gram[active[0]], w[0], gram[active[1]], w[1]
        for j in range(atoms):
            a[j] = w0 * r0[j] + w1 * r1[j]
    else:
        r0, w0, r1, w1, r2, w2 = gram[active[0]], w[0], gram[active[1]], w[1], gram[active[2]], w[2]
        for j in range(atoms):
            a[j] = w0 * r0[j] + w1 * r1[j] + w2 * r2[j]
    while p < size:
        r0, w0, r1, w1 = gram[active[p]], w[p], gram[active[p + 1]], w[p + 1]
        r2, w2, r3, w3 = gram[active[p + 2]], w[p + 2], gram[active[p + 3]], w[p + 3]
        for j in range(atoms):
            a[j] += w0 * r0[j] + w1 * r1[j] + w2 * r2[j] + w3 * r3[j]
        p += 4


@njit(cache=True, inline="always")
def _times_inverse(inverse, values, size, out):
    """``out = inverse @ values`` over the first ``size`` entries, as a sum of the (symmetric) inverse's rows."""
    out[:size] = 0.0
    for q in range(size):
        value = values[q]
        row = inverse[q]
        for p in range(size):
            out[p] += value * row[p]


@njit(cache=True, inline="always")
def _join(gram, inverse, active, signs, size, atom, sign, column, u) -> bool:
    """Add ``atom`` to the ``size`` in use, the inverse bordered by its row (block inverse, Schur complement);
    False when it is linearly dependent on them."""
    row = gram[atom]
    for q in range(size):
        column[q] = row[active[q]]
    _times_inverse(inverse, column, size, u)
    schur = row[atom]
    for p in range(size):
        schur -= column[p] * u[p]
    if not schur > _DEPENDENT * row[atom]:
        return False
    scale = 1.0 / schur
    for p in range(size):
        up = u[p] * scale
        inverse_row = inverse[p]
        for q in range(size):
            inverse_row[q] += up * u[q]
        inverse_row[size] = -up
        inverse[size, p] = -up
    inverse[size, size] = scale
    active[size], signs[size] = atom, sign
    return True


@njit(cache=True, inline="always")
def _leave(inverse, active, signs, size, p) -> None:
    """Remove the ``p``-th atom in use: the inverse of the rest is the Schur complement of its pivot; the last atom
    in use takes its place."""
    pivot = 1.0 / inverse[p, p]
    for i in range(size):
        if i != p:
            factor = inverse[i, p] * pivot
            row = inverse[i]
            for k in range(size):
                row[k] -= factor * inverse[p, k]
    last = size - 1
    if p != last:
        for k in range(size):
            inverse[p, k] = inverse[last, k]
        for i in range(size):
            inverse[i, p] = inverse[i, last]
        active[p], signs[p] = active[last], signs[last]


@njit(cache=True, error_model="numpy")
def _homotopy(gram, b, alpha, inverse, active, signs, in_use, u, w, a, r, steps, code) -> bool:
    """The Lasso code of the signal of correlations ``b`` into ``code`` along the homotopy path; False (``code``
    then undefined) when the path cannot be followed to the end (see the module notes)."""
    atoms, capacity = gram.shape[0], inverse.shape[0]
    code[:] = 0.0
    in_use[:] = False
    penalty, joining = 0.0, -1
    for j in range(atoms):
        r[j] = b[j]
        if abs(b[j]) > penalty:
            penalty, joining = abs(b[j]), j
    if penalty <= alpha:
        return True
    size, left, ended = 0, -1, False
    for _ in range(STEPS_PER_ATOM * atoms):
        if joining >= 0:
            sign = 1.0 if r[joining] > 0.0 else -1.0
            if size == capacity or not _join(gram, inverse, active, signs, size, joining, sign, w, u):
                return False
            in_use[joining] = True
            size += 1
        _times_inverse(inverse, signs, size, w)  # the direction of the weights in use
        _direction_product(gram, active, w, size, a)  # and of every correlation
        # The piece ends at the first event: alpha reached, an unused atom's |r_j - g a_j| reaching the penalty
        # less g, a weight reaching zero. Every atom's g is found in one branch-free pass (vectorised: a test and a
        # running minimum per atom took twice the time), then the least: a zero denominator gives an infinite or
        # NaN g, which never wins (hence numpy's error model: no exception on a division by zero).
        for j in range(atoms):
            g_plus = (penalty - r[j]) / (1.0 - a[j])  # r_j - g a_j reaching +(penalty - g)
            g_minus = (penalty + r[j]) / (1.0 + a[j])  # ... reaching -(penalty - g)
            g = g_plus if (g_plus > 0.0 and (g_plus < g_minus or not g_minus > 0.0)) else g_minus
            steps[j] = g if (g > 0.0 and not in_use[j]) else np.inf
        if left >= 0:
            steps[left] = np.inf  # (the atom that left may not join again at once: its g is 0)
        first = int(np.argmin(steps))
        gamma, event, who = penalty - alpha, _END, -1
        if steps[first] < gamma:
            gamma, event, who = steps[first], _JOIN, first
        for p in range(size):
            if w[p] != 0.0:
                g = -code[active[p]] / w[p]
                if 0.0 < g < gamma:
                    gamma, event, who = g, _LEAVE, p
        for p in range(size):
            code[active[p]] += gamma * w[p]
        for j in range(atoms):
            r[j] -= gamma * a[j]
        penalty -= gamma
        if event == _END:
            ended = True
            break
        if event == _JOIN:
            joining, left = who, -1
            continue
        joining, left = -1, active[who]
        code[left] = 0.0
        in_use[left] = False
        _leave(inverse, active, signs, size, who)
        size -= 1
    if not ended:
        return False
    return _end_point(gram, b, alpha, inverse, active, signs, in_use, size, u, w, r, code)


@njit(cache=True, inline="always")
def _end_point(gram, b, alpha, inverse, active, signs, in_use, size, u, w, r, code) -> bool:
    """Solve the weights in use at the end of the path, ``G_AA^-1 (b_A - alpha s_A)``, and check the optimality
    conditions: each weight of its atom's sign, every unused atom's correlation within alpha."""
    for q in range(size):
        u[q] = b[active[q]] - alpha * signs[q]
    _times_inverse(inverse, u, size, w)
    for p in range(size):
        if w[p] * signs[p] < 0.0:
            return False
        code[active[p]] = w[p]
    r[:] = b
    for p in range(size):
        row, weight = gram[active[p]], w[p]
        for j in range(r.shape[0]):
            r[j] -= weight * row[j]
    bound = alpha * (1.0 + _SLACK)
    for j in range(r.shape[0]):
        if not in_use[j] and abs(r[j]) > bound:
            return False
    return True


@njit(cache=True, inline="always")
def _descend(gram, correlations, alpha, max_sweeps, tol, q, out):
    """Cyclic coordinate descent from zero, keeping ``q = b - G c``; stops once a sweep changes no weight by more
    than ``tol`` times the largest, or after ``max_sweeps`` sweeps."""
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
def lasso_gram(
    gram: np.ndarray, correlations: np.ndarray, alpha: float, max_sweeps: int, tol: float, codes: np.ndarray
) -> int:
    """Write the Lasso codes of every signal into ``codes`` (signals x atoms); returns how many signals descent
    coded (``max_sweeps`` and ``tol`` are its limits; see the module notes)."""
    signals, atoms = correlations.shape
    capacity = min(atoms, MAX_ACTIVE)
    descended = 0
    for chunk in prange((signals + _CHUNK - 1) // _CHUNK):
        inverse = np.empty((capacity, capacity))
        active = np.empty(capacity, np.int64)
        signs, u, w = np.empty(capacity), np.empty(capacity), np.empty(capacity)
        in_use = np.empty(atoms, np.bool_)
        a, r, steps = np.empty(atoms), np.empty(atoms), np.empty(atoms)
        for signal in range(chunk * _CHUNK, min(signals, (chunk + 1) * _CHUNK)):
            b, code = correlations[signal], codes[signal]
            if not _homotopy(gram, b, alpha, inverse, active, signs, in_use, u, w, a, r, steps, code):
                _descend(gram, b, alpha, max_sweeps, tol, r, code)
                descended += 1
    return descended
