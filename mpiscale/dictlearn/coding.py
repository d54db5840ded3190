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


def omp_encode_gram(gram: np.ndarray, correlations: np.ndarray, n_nonzero: int, device: str = "cpu") -> np.ndarray:
    """Codes (signals x atoms) from the Gram matrix D D^T and the correlations X D^T, by Batch-OMP."""
    gram, correlations = _checked_gram(gram, correlations)
    atoms = gram.shape[0]
    if not 1 <= n_nonzero <= atoms:
        raise ValueError(f"n_nonzero must be between 1 and the number of atoms ({atoms}), got {n_nonzero}")
    codes = np.empty(correlations.shape)
    if resolve_device(device) == "cuda":
        from ..kernels.omp_cuda import batch_omp_gram_cuda

        batch_omp_gram_cuda(gram, correlations, int(n_nonzero), codes)
    else:
        batch_omp_gram(gram, correlations, int(n_nonzero), codes)
    return codes


def omp_encode(signals: np.ndarray, dictionary: np.ndarray, n_nonzero: int, device: str = "cpu") -> np.ndarray:
    """Codes (signals x atoms) with at most ``n_nonzero`` atoms each, by Batch-OMP."""
    return omp_encode_gram(*_checked_signals(signals, dictionary), n_nonzero, device)


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
