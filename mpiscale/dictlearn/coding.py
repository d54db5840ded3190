"""Sparse coding of signals against a dictionary: Batch-OMP (CPU or CUDA) and Lasso.

Shapes follow scikit-learn: a dictionary is (atoms, features), signals are
(signals, features) and codes are (signals, atoms). Both coders work from the
Gram matrix ``D D^T`` and the correlations ``X D^T``, which callers that code
many batches against one dictionary compute once.
"""

from __future__ import annotations

import numpy as np

from ..kernels.devices import resolve_device
from ..kernels.lasso import lasso_cd_gram
from ..kernels.omp import batch_omp_gram


def gram_matrix(dictionary: np.ndarray) -> np.ndarray:
    """``D D^T`` (atoms x atoms), the inner products of the atoms every coder here works from."""
    return dictionary @ dictionary.T


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
    if (np.diag(gram) <= 0).any():
        raise ValueError(f"atoms {np.flatnonzero(np.diag(gram) <= 0).tolist()} are zero")
    return gram, correlations


def _checked_signals(signals: np.ndarray, dictionary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    signals = _finite("signals", signals)
    dictionary = _finite("dictionary", dictionary)
    if signals.ndim != 2 or dictionary.ndim != 2 or signals.shape[1] != dictionary.shape[1]:
        shapes = f"{signals.shape} and {dictionary.shape}"
        raise ValueError(f"signals (signals, features) and dictionary (atoms, features) disagree: {shapes}")
    return gram_matrix(dictionary), correlations_of(signals, dictionary)


def omp_encode_gram(
    gram: np.ndarray,
    correlations: np.ndarray,
    n_nonzero: int,
    device: str = "cpu",
    max_residual: float | None = None,
    energies: np.ndarray | None = None,
) -> np.ndarray:
    """Codes (signals x atoms) from the Gram matrix D D^T and the correlations X D^T, by Batch-OMP.

    At most ``n_nonzero`` atoms per signal. With ``max_residual`` (epsilon), a
    signal's coding also stops once ``||x - c D|| <= epsilon``: the
    error-constrained OMP of K-SVD denoising and of SPAMS's ``omp`` with ``eps``.
    It needs ``energies``, each signal's ``||x||^2``, and runs on the CPU
    kernel (``device="cuda"`` is refused; ``auto`` takes the CPU).
    """
    gram, correlations = _checked_gram(gram, correlations)
    atoms = gram.shape[0]
    if not 1 <= n_nonzero <= atoms:
        raise ValueError(f"n_nonzero must be between 1 and the number of atoms ({atoms}), got {n_nonzero}")
    codes = np.empty(correlations.shape)
    target, squared = -1.0, np.empty(0)
    if max_residual is not None:
        if not (max_residual >= 0 and np.isfinite(max_residual)):
            raise ValueError(f"max_residual must be a number >= 0, got {max_residual}")
        if device == "cuda":
            raise ValueError("OMP to an error target runs on the CPU: give device 'cpu' or 'auto'")
        if energies is None or np.shape(energies) != (len(correlations),):
            raise ValueError(f"an error target needs the {len(correlations)} signals' squared norms (energies)")
        target, squared, device = float(max_residual) ** 2, _finite("energies", energies), "cpu"
    if resolve_device(device) == "cuda":
        from ..kernels.omp_cuda import batch_omp_gram_cuda

        batch_omp_gram_cuda(gram, correlations, int(n_nonzero), codes)
    else:
        batch_omp_gram(gram, correlations, int(n_nonzero), squared, target, codes)
    return codes


def omp_encode(
    signals: np.ndarray, dictionary: np.ndarray, n_nonzero: int, device: str = "cpu", max_residual: float | None = None
) -> np.ndarray:
    """Codes (signals x atoms) with at most ``n_nonzero`` atoms each, by Batch-OMP; with ``max_residual``, each
    signal's coding stops once its residual norm is at most that (see ``omp_encode_gram``)."""
    gram, correlations = _checked_signals(signals, dictionary)
    energies = squared_norms(signals) if max_residual is not None else None
    return omp_encode_gram(gram, correlations, n_nonzero, device, max_residual, energies)


def squared_norms(signals: np.ndarray) -> np.ndarray:
    """Each signal's ``||x||^2`` (the energies an error target needs)."""
    return np.einsum("sf,sf->s", signals, signals)


def lasso_encode_gram(
    gram: np.ndarray, correlations: np.ndarray, alpha: float, max_sweeps: int = 1000, tol: float = 1e-8
) -> np.ndarray:
    """Codes minimising ``0.5 ||x - c D||^2 + alpha ||c||_1`` per signal, by coordinate descent."""
    gram, correlations = _checked_gram(gram, correlations)
    if not alpha > 0 or not np.isfinite(alpha):
        raise ValueError(f"the Lasso penalty alpha must be a positive number, got {alpha}")
    codes = np.empty(correlations.shape)
    lasso_cd_gram(gram, correlations, float(alpha), int(max_sweeps), float(tol), codes)
    return codes


def lasso_encode(
    signals: np.ndarray, dictionary: np.ndarray, alpha: float, max_sweeps: int = 1000, tol: float = 1e-8
) -> np.ndarray:
    """Lasso codes (signals x atoms); the same minimiser as scikit-learn's ``sparse_encode(..., 'lasso_cd')``."""
    return lasso_encode_gram(*_checked_signals(signals, dictionary), alpha, max_sweeps, tol)
