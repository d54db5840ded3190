"""Sparse coding of signals against a dictionary: Batch-OMP (CPU or CUDA) and Lasso.

Shapes follow scikit-learn: a dictionary is (atoms, features), signals are
(signals, features) and codes are (signals, atoms). Both coders work from the
Gram matrix ``D D^T`` and the correlations ``X D^T``, which callers that code
many batches against one dictionary compute once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from ..kernels.code_statistics import mirror_upper
from ..kernels.devices import resolve_device
from ..kernels.lasso import lasso_gram
from ..kernels.omp import batch_omp_gram, batch_omp_signals, chunk_rows


def gram_matrix(dictionary: np.ndarray) -> np.ndarray:
    """``D D^T`` (atoms x atoms), the inner products of the atoms every coder here works from.

    BLAS's symmetric product makes the upper triangle (half the multiply-adds) and a tiled kernel mirrors it: 141
    µs against the general product's 178 at 256 atoms of 64 on one thread, 0.62x at 1,024 of 256 (the same bits
    there, with this machine's OpenBLAS).
    numpy sends ``D @ D.T`` to the same symmetric product but then copies its triangle across column by column,
    which took 1.4x the general product's time.
    """
    if dictionary.dtype not in (np.float32, np.float64) or not dictionary.size:
        return dictionary @ np.ascontiguousarray(dictionary.T)
    gram = _symmetric_product(dictionary.dtype.char)(1.0, dictionary.T, trans=1, lower=1).T  # upper, C order
    mirror_upper(gram)
    return gram


@functools.lru_cache(maxsize=2)
def _symmetric_product(dtype: str):
    """scipy's BLAS ``syrk`` of the dtype ``dtype`` (``f`` or ``d``); scipy is imported on the first call."""
    from scipy.linalg.blas import get_blas_funcs

    return get_blas_funcs("syrk", dtype=np.dtype(dtype))


def correlations_of(signals: np.ndarray, dictionary: np.ndarray) -> np.ndarray:
    """``X D^T`` (signals x atoms), each signal's inner product with each atom."""
    return signals @ dictionary.T


def _finite(name: str, array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.float64)
    if not np.isfinite(array).all():
        bad = int(np.count_nonzero(~np.isfinite(array)))
        raise ValueError(f"{name} holds {bad} NaN or infinite values")
    return array


def _checked_gram(gram: np.ndarray, correlations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    gram = _finite("gram", gram)
    correlations = _finite("correlations", correlations)
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
        raise ValueError(f"gram must be square, got shape {gram.shape}")
    if correlations.ndim != 2 or correlations.shape[1] != gram.shape[0]:
        raise ValueError(f"correlations must be (signals, {gram.shape[0]}), got shape {correlations.shape}")
    _no_zero_atoms(gram)
    return gram, correlations


def _no_zero_atoms(gram: np.ndarray) -> None:
    if (np.diag(gram) <= 0).any():
        raise ValueError(f"atoms {np.flatnonzero(np.diag(gram) <= 0).tolist()} are zero")


#: How far an atom's squared norm may be from 1 for OMP to take it as a unit atom.
UNIT_SQUARED_NORM = 2e-6
#: Error targets from which on the squared target is past float64 (and every residual is within it).
_SQUARES_OVERFLOW = math.sqrt(np.finfo(np.float64).max)


def _atom_norms(gram: np.ndarray) -> np.ndarray | None:
    """The atoms' norms where any is not of unit norm, else None. OMP picks the atom most correlated with the
    residual; for atoms of other norms that pick is made on unit atoms, and the codes scaled back, so that an
    atom's scale changes its weight alone, never which atoms a signal is coded with."""
    squared = np.diag(gram)
    return None if (np.abs(squared - 1.0) <= UNIT_SQUARED_NORM).all() else np.sqrt(squared)


def _for_atoms_of_norms(rows: CodeRows, norms: np.ndarray | None) -> CodeRows:
    """``rows`` coded on unit atoms, as the weights of atoms of ``norms`` (None: unit atoms, as they are)."""
    if norms is not None:
        used = np.arange(rows.values.shape[1]) < rows.counts[:, None]
        rows.values[used] /= norms[rows.atoms[used]]
    return rows


def _checked_pair(signals: np.ndarray, dictionary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Signals and dictionary as finite float64 arrays of matching shapes (signals x features, atoms x features)."""
    signals = _finite("signals", signals)
    dictionary = _finite("dictionary", dictionary)
    if signals.ndim != 2 or dictionary.ndim != 2 or signals.shape[1] != dictionary.shape[1]:
        shapes = f"{signals.shape} and {dictionary.shape}"
        raise ValueError(f"signals (signals, features) and dictionary (atoms, features) disagree: {shapes}")
    return signals, dictionary


def _checked_signals(signals: np.ndarray, dictionary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    signals, dictionary = _checked_pair(signals, dictionary)
    return gram_matrix(dictionary), correlations_of(signals, dictionary)


@dataclass(frozen=True)
class CodeRows:
    """Sparse codes row by row: signal ``s`` uses atoms ``atoms[s, :counts[s]]`` (increasing) with weights
    ``values[s, :counts[s]]``; ``values`` and ``atoms`` are signals x the most atoms a code may hold."""

    values: np.ndarray
    atoms: np.ndarray
    counts: np.ndarray
    n_atoms: int  # the dictionary's

    def _used(self) -> np.ndarray:
        return np.arange(self.values.shape[1]) < self.counts[:, None]

    def dense(self) -> np.ndarray:
        """The codes as signals x atoms."""
        codes = np.zeros((len(self.counts), self.n_atoms))
        used = self._used()
        codes[np.nonzero(used)[0], self.atoms[used]] = self.values[used]
        return codes

    def csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, their atoms as int32, row starts with the end last): CSR, as scipy's ``csr_matrix`` takes it."""
        used = self._used()
        starts = np.zeros(len(self.counts) + 1, np.int64)
        np.cumsum(self.counts, out=starts[1:])
        return self.values[used], self.atoms[used].astype(np.int32), starts

    def l1(self) -> float:
        """The sum of the codes' absolute values (the Lasso penalty's)."""
        return float(np.abs(self.values[self._used()]).sum())

    def rebuilt(self, dictionary: np.ndarray) -> np.ndarray:
        """The signals the codes make: ``codes @ dictionary``, without the dense codes."""
        used = self._used()  # the slots past a row's count hold whatever the kernel's buffers held
        weights = np.where(used, self.values, 0.0)
        return np.einsum("sl,slf->sf", weights, dictionary[np.where(used, self.atoms, 0)])


def omp_rows_gram(
    gram: np.ndarray,
    correlations: np.ndarray,
    n_nonzero: int,
    device: str = "cpu",
    max_residual: float | None = None,
    energies: np.ndarray | None = None,
) -> CodeRows:
    """Batch-OMP codes from the Gram matrix D D^T and the correlations X D^T, kept sparse (``CodeRows``).

    At most ``n_nonzero`` atoms per signal. With ``max_residual`` (epsilon), a
    signal's coding also stops once ``||x - c D|| <= epsilon``: the
    error-constrained OMP of K-SVD denoising and of SPAMS's ``omp`` with ``eps``.
    It needs ``energies``, each signal's ``||x||^2``, and runs on the CPU
    kernel (``device="cuda"`` is refused; ``auto`` takes the CPU).
    """
    gram, correlations = _checked_gram(gram, correlations)
    signals, atoms = correlations.shape
    target, squared, device = _omp_checks(atoms, signals, n_nonzero, device, max_residual, energies)
    norms = _atom_norms(gram)
    if norms is not None:  # coded on unit atoms (see _atom_norms)
        gram, correlations = gram / np.outer(norms, norms), correlations / norms
    if resolve_device(device) == "cuda":
        from ..kernels.omp_cuda import batch_omp_gram_cuda

        codes = np.empty(correlations.shape)
        batch_omp_gram_cuda(gram, correlations, int(n_nonzero), codes)
        return _for_atoms_of_norms(rows_of_dense(codes, int(n_nonzero)), norms)
    rows = _empty_rows(signals, atoms, n_nonzero)
    chunk = chunk_rows(signals, numba.get_num_threads())
    batch_omp_gram(gram, correlations, int(n_nonzero), squared, target, rows.values, rows.atoms, rows.counts, chunk)
    return _for_atoms_of_norms(rows, norms)


def _omp_checks(
    atoms: int, signals: int, n_nonzero: int, device: str, max_residual: float | None, energies: np.ndarray | None
) -> tuple[float, np.ndarray, str]:
    """(the kernel's squared target, or -1; the energies it reads; the device) of checked OMP settings."""
    if not 1 <= n_nonzero <= atoms:
        raise ValueError(f"n_nonzero must be between 1 and the number of atoms ({atoms}), got {n_nonzero}")
    if max_residual is None:
        return -1.0, np.empty(0), device
    if not (max_residual >= 0 and np.isfinite(max_residual)):
        raise ValueError(f"max_residual must be a number >= 0, got {max_residual}")
    if device == "cuda":
        raise ValueError("OMP to an error target runs on the CPU: give device 'cpu' or 'auto'")
    if energies is None or np.shape(energies) != (signals,):
        raise ValueError(f"an error target needs the {signals} signals' squared norms (energies)")
    squared = float(max_residual) ** 2 if max_residual < _SQUARES_OVERFLOW else math.inf  # (inf: codes empty)
    return squared, _finite("energies", energies), "cpu"


def _empty_rows(signals: int, atoms: int, n_nonzero: int) -> CodeRows:
    return CodeRows(np.empty((signals, n_nonzero)), np.empty((signals, n_nonzero), np.int64),
                    np.empty(signals, np.int64), atoms)  # fmt: skip


def rows_of_dense(codes: np.ndarray, n_nonzero: int) -> CodeRows:
    """``CodeRows`` of dense codes with at most ``n_nonzero`` non-zeros a row (the GPU kernel's, the Lasso's)."""
    signals, atoms = codes.shape
    values, chosen = np.zeros((signals, n_nonzero)), np.zeros((signals, n_nonzero), np.int64)
    rows, columns = np.nonzero(codes)
    counts = np.bincount(rows, minlength=signals)
    places = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    values[rows, places], chosen[rows, places] = codes[rows, columns], columns
    return CodeRows(values, chosen, counts.astype(np.int64), atoms)


def omp_encode_gram(
    gram: np.ndarray,
    correlations: np.ndarray,
    n_nonzero: int,
    device: str = "cpu",
    max_residual: float | None = None,
    energies: np.ndarray | None = None,
) -> np.ndarray:
    """Codes (signals x atoms) from the Gram matrix D D^T and the correlations X D^T, by Batch-OMP (see
    ``omp_rows_gram`` for the error target)."""
    return omp_rows_gram(gram, correlations, n_nonzero, device, max_residual, energies).dense()


def omp_rows(
    signals: np.ndarray,
    dictionary: np.ndarray,
    n_nonzero: int,
    device: str = "cpu",
    max_residual: float | None = None,
    gram: np.ndarray | None = None,
) -> CodeRows:
    """Sparse OMP codes of ``signals`` (``CodeRows``): what ``omp_encode`` gives, without a signals x atoms array of
    codes, nor of correlations on the CPU (each chunk of signals makes its own, in cache). ``gram``: ``D D^T`` when
    the caller codes many batches with one dictionary."""
    signals, dictionary = _checked_pair(signals, dictionary)
    energies = squared_norms(signals) if max_residual is not None else None
    count, atoms = len(signals), len(dictionary)
    target, squared, device = _omp_checks(atoms, count, n_nonzero, device, max_residual, energies)
    # BLAS on one thread from here: each Numba thread multiplies its own chunk, and BLAS threads woken by a product
    # just before would spin on the cores the kernel needs (at 256 atoms the coding ran at 0.6x)
    with threadpool_limits(1, user_api="blas"):
        gram = gram_matrix(dictionary) if gram is None else gram
        _no_zero_atoms(gram)
        if resolve_device(device) == "cuda":
            return omp_rows_gram(gram, correlations_of(signals, dictionary), n_nonzero, "cuda")
        norms = _atom_norms(gram)
        if norms is not None:  # coded on unit atoms (see _atom_norms)
            gram, dictionary = gram / np.outer(norms, norms), dictionary / norms[:, None]
        rows = _empty_rows(count, atoms, n_nonzero)
        batch_omp_signals(signals, np.ascontiguousarray(dictionary.T), gram, int(n_nonzero), squared, target,
                          rows.values, rows.atoms, rows.counts)  # fmt: skip
    return _for_atoms_of_norms(rows, norms)


def omp_encode(
    signals: np.ndarray, dictionary: np.ndarray, n_nonzero: int, device: str = "cpu", max_residual: float | None = None
) -> np.ndarray:
    """Codes (signals x atoms) with at most ``n_nonzero`` atoms each, by Batch-OMP; with ``max_residual``, each
    signal's coding stops once its residual norm is at most that (see ``omp_rows_gram``)."""
    return omp_rows(signals, dictionary, n_nonzero, device, max_residual).dense()


def squared_norms(signals: np.ndarray) -> np.ndarray:
    """Each signal's ``||x||^2`` (the energies an error target needs)."""
    return np.einsum("sf,sf->s", signals, signals)


#: The limits of the coordinate descent that codes a Lasso signal whose path meets dependent atoms: sweeps, and
#: the change relative to the largest weight at which it stops.
DESCENT_SWEEPS, DESCENT_TOL = 1000, 1e-8


def lasso_encode_gram(
    gram: np.ndarray,
    correlations: np.ndarray,
    alpha: float,
    max_sweeps: int = DESCENT_SWEEPS,
    tol: float = DESCENT_TOL,
) -> np.ndarray:
    """Codes minimising ``0.5 ||x - c D||^2 + alpha ||c||_1`` per signal: the exact homotopy path (LARS), or
    coordinate descent (at most ``max_sweeps`` sweeps, to ``tol``) for a signal whose path meets linearly dependent
    atoms (``mpiscale.kernels.lasso``)."""
    gram, correlations = _checked_gram(gram, correlations)
    if not alpha > 0 or not np.isfinite(alpha):
        raise ValueError(f"the Lasso penalty alpha must be a positive number, got {alpha}")
    codes = np.empty(correlations.shape)
    lasso_gram(gram, correlations, float(alpha), int(max_sweeps), float(tol), codes)
    return codes


def lasso_encode(
    signals: np.ndarray,
    dictionary: np.ndarray,
    alpha: float,
    max_sweeps: int = DESCENT_SWEEPS,
    tol: float = DESCENT_TOL,
) -> np.ndarray:
    """Lasso codes (signals x atoms); the same minimiser as scikit-learn's ``sparse_encode(..., 'lasso_cd')``."""
    return lasso_encode_gram(*_checked_signals(signals, dictionary), alpha, max_sweeps, tol)
