"""Batch-OMP sparse coding (Rubinstein, Zibulevsky and Elad, 2008) as a Numba kernel.

Orthogonal Matching Pursuit for many signals against one dictionary, working
only on the Gram matrix ``G = D D^T`` and the correlations ``D x`` (computed
once with BLAS for the whole batch). Each step picks the atom most correlated
with the residual, extends a Cholesky factor of the selected atoms' Gram
sub-matrix by one row (progressive Cholesky) and re-solves the coefficients, so
a step costs O(K n) instead of a least-squares solve. Signals are coded in
parallel over Numba threads, in chunks that reuse their work arrays.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_CHUNK = 128  # the most signals a thread codes with one set of work arrays (their correlations stay in cache)
_DEPENDENT = 1e-10  # relative pivot below which a new atom is linearly dependent on the chosen ones
#: A residual whose largest correlation is at most this times the signal's own first one is (numerically) orthogonal
#: to every atom: relative, so a signal's code is the same at any scale (an absolute 1e-14 coded 1e-16 data as zeros)
ORTHOGONAL = 1e-14


def build_extend(compile_function):
    """One OMP step after the atom ``best`` was picked, compiled by ``compile_function``.

    Extends the Cholesky factor of the chosen atoms' Gram sub-matrix by one row
    and solves for the coefficients ``gamma``; returns the new support size, or
    -1 when ``best`` is linearly dependent on the atoms already chosen. Shared by
    the CPU kernel and the GPU kernel, so the numerics are the same on each.
    """

    def forward_solve(chol, size, values):
        """Solve L y = values in place, L being the first ``size`` rows of the lower-triangular ``chol``."""
        for row in range(size):
            total = values[row]
            for col in range(row):
                total -= chol[row, col] * values[col]
            values[row] = total / chol[row, row]

    solve = compile_function(forward_solve)

    def extend(gram, correlations, chol, support, gamma, work, size, best):
        diagonal = gram[best, best]
        # Forward-solve L w = G[support, best]; the new Cholesky row is (w, sqrt(G_bb - w.w)).
        for row in range(size):
            work[row] = gram[support[row], best]
        solve(chol, size, work)
        norm = 0.0
        for row in range(size):
            norm += work[row] * work[row]
        pivot = diagonal - norm
        if pivot <= _DEPENDENT * diagonal:
            return -1
        for col in range(size):
            chol[size, col] = work[col]
        chol[size, size] = math.sqrt(pivot)
        support[size] = best
        size += 1
        # Solve L L^T gamma = correlations[support].
        for row in range(size):
            work[row] = correlations[support[row]]
        solve(chol, size, work)
        for row in range(size - 1, -1, -1):
            total = work[row]
            for col in range(row + 1, size):
                total -= chol[col, row] * gamma[col]
            gamma[row] = total / chol[row, row]
        return size

    return compile_function(extend)


_extend = build_extend(njit(inline="always"))


@njit(inline="always")
def _most_correlated(alpha):
    """The first ``k`` of largest ``|alpha[k]| > 0``, or -1 when all are 0. Four running maxima, one for each
    position modulo 4, are independent of each other, so the core keeps four compares in flight: 94 ns at 256
    atoms against 161 for one running maximum, the same atom (ties go to the lowest index in either)."""
    atoms = alpha.shape[0]
    best0 = best1 = best2 = best3 = -1
    value0 = value1 = value2 = value3 = 0.0
    k = 0
    while k + 4 <= atoms:
        a0, a1, a2, a3 = abs(alpha[k]), abs(alpha[k + 1]), abs(alpha[k + 2]), abs(alpha[k + 3])
        if a0 > value0:
            best0, value0 = k, a0
        if a1 > value1:
            best1, value1 = k + 1, a1
        if a2 > value2:
            best2, value2 = k + 2, a2
        if a3 > value3:
            best3, value3 = k + 3, a3
        k += 4
    for rest in range(k, atoms):
        if abs(alpha[rest]) > value0:
            best0, value0 = rest, abs(alpha[rest])
    best, value = best0, value0
    for lane_best, lane_value in ((best1, value1), (best2, value2), (best3, value3)):
        if lane_value > value or (lane_value == value and lane_best < best):  # (all 0: every best is -1)
            best, value = lane_best, lane_value
    return best


@njit(inline="always")
def _code_one(gram, correlations, n_nonzero, energy, target, alpha, chol, support, gamma, work):
    """OMP of one signal: at most ``n_nonzero`` atoms and, when ``target`` >= 0, only until the squared residual
    norm is at most ``target`` (``energy`` is the signal's squared norm). Returns the atoms chosen, ``size``: the
    code is ``gamma[:size]`` at atoms ``support[:size]``."""
    atoms = gram.shape[0]
    for k in range(atoms):
        alpha[k] = correlations[k]
    size = 0
    residual = energy
    floor = 0.0  # a signal orthogonal to every atom (or zero) takes none; then ORTHOGONAL times its first correlation
    for _ in range(n_nonzero):
        if target >= 0 and residual <= target:
            break
        best = _most_correlated(alpha)  # a chosen atom's alpha is 0 (below): no mask to test, a loop 2.5x as fast
        if best < 0 or abs(alpha[best]) <= floor:
            break
        if size == 0:
            floor = ORTHOGONAL * abs(alpha[best])
        grown = _extend(gram, correlations, chol, support, gamma, work, size, best)
        if grown < 0:
            break
        size = grown
        # alpha = correlations - G[:, support] gamma (G is symmetric: read rows, contiguously).
        for k in range(atoms):
            alpha[k] = correlations[k]
        for j in range(size):
            atom_row = gram[support[j]]
            weight = gamma[j]
            for k in range(atoms):
                alpha[k] -= atom_row[k] * weight
        for j in range(size):  # the residual is orthogonal to the chosen atoms: they are never picked again
            alpha[support[j]] = 0.0
        if target >= 0:  # least squares on the support: ||r||^2 = ||x||^2 - gamma . (D x)[support]
            residual = energy
            for j in range(size):
                residual -= gamma[j] * correlations[support[j]]
    return size


@njit(inline="always")
def _keep(values, atoms_of, signal, support, gamma, size):
    """Signal ``signal``'s code into its row of ``values`` and ``atoms_of``, in the order of the atoms (an insertion
    sort: a code holds few)."""
    for j in range(size):
        atom, weight, place = support[j], gamma[j], j
        while place > 0 and atoms_of[signal, place - 1] > atom:
            atoms_of[signal, place] = atoms_of[signal, place - 1]
            values[signal, place] = values[signal, place - 1]
            place -= 1
        atoms_of[signal, place] = atom
        values[signal, place] = weight


@njit(inline="always")
def _code_rows(gram, correlations, first, n_nonzero, energies, target, values, atoms_of, counts):
    """Code the signals whose correlations are the rows of ``correlations`` (signals ``first``, ``first + 1``...)
    into their rows of ``values``, ``atoms_of`` and ``counts``, with work arrays of their own."""
    atoms = gram.shape[0]
    alpha = np.empty(atoms)
    chol = np.zeros((n_nonzero, n_nonzero))
    support = np.empty(n_nonzero, dtype=np.int64)
    gamma = np.empty(n_nonzero)
    work = np.empty(n_nonzero)
    for row in range(correlations.shape[0]):
        signal = first + row
        energy = energies[signal] if target >= 0 else 0.0
        size = _code_one(gram, correlations[row], n_nonzero, energy, target, alpha, chol, support, gamma, work)
        counts[signal] = size
        _keep(values, atoms_of, signal, support, gamma, size)


def chunk_rows(count: int, threads: int) -> int:
    """Signals per chunk of a batch of ``count`` coded from its correlations on ``threads`` threads: at most
    ``_CHUNK``, and few enough that every thread gets a chunk (a batch of 256 in chunks of 128 kept 14 of a node's 16
    threads idle). A signal's code does not depend on its chunk there."""
    return max(1, min(_CHUNK, (count + threads - 1) // threads))


@njit(parallel=True, cache=True)
def batch_omp_gram(
    gram: np.ndarray,
    correlations: np.ndarray,
    n_nonzero: int,
    energies: np.ndarray,
    target: float,
    values: np.ndarray,
    atoms_of: np.ndarray,
    counts: np.ndarray,
    rows: int,
) -> None:
    """The OMP codes of every signal, sparse: signal ``s`` uses ``counts[s]`` atoms, ``atoms_of[s, :counts[s]]`` in
    increasing order, with weights ``values[s, :counts[s]]`` (``values`` and ``atoms_of`` are signals x
    ``n_nonzero``).

    ``gram`` is D D^T (atoms x atoms), ``correlations`` is X D^T (signals x
    atoms); at most ``n_nonzero`` atoms per signal. With ``target`` >= 0, a
    signal's coding stops once its squared residual norm is at most ``target``
    (``energies``: each signal's squared norm); with ``target`` < 0,
    ``energies`` is not read (it may be empty). Writing only the non-zeros
    keeps the output signals x ``n_nonzero``, not signals x atoms. Each thread codes chunks of ``rows`` signals
    (``chunk_rows``).
    """
    count = correlations.shape[0]
    for chunk in prange((count + rows - 1) // rows):
        lo, hi = chunk * rows, min(count, (chunk + 1) * rows)
        _code_rows(gram, correlations[lo:hi], lo, n_nonzero, energies, target, values, atoms_of, counts)


@njit(parallel=True, cache=True)
def batch_omp_signals(
    signals: np.ndarray,
    atoms_t: np.ndarray,
    gram: np.ndarray,
    n_nonzero: int,
    energies: np.ndarray,
    target: float,
    values: np.ndarray,
    atoms_of: np.ndarray,
    counts: np.ndarray,
) -> None:
    """As ``batch_omp_gram``, from the signals themselves (``atoms_t`` is D^T, features x atoms): each chunk of
    signals makes its own correlations, which stay in cache, and no signals x atoms array is ever made (at 256 atoms
    the whole batch's correlations cost as much as the coding). Call it with BLAS on one thread: each Numba
    thread multiplies its own chunk."""
    count = signals.shape[0]
    for chunk in prange((count + _CHUNK - 1) // _CHUNK):  # fixed chunks: a row's product, and so its code, is the
        lo, hi = chunk * _CHUNK, min(count, (chunk + 1) * _CHUNK)  # same bits on any number of threads
        _code_rows(gram, np.dot(signals[lo:hi], atoms_t), lo, n_nonzero, energies, target, values, atoms_of, counts)
