"""Sparse coding of signals against a dictionary with Batch-OMP (``kernels.omp``).

Shapes follow scikit-learn: a dictionary is (atoms, features), signals are
(signals, features) and codes are (signals, atoms).
"""

from __future__ import annotations

import numpy as np

from ..kernels.omp import batch_omp_gram


def _finite(name: str, array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.float64)
    if not np.isfinite(array).all():
        bad = int(np.count_nonzero(~np.isfinite(array)))
        raise ValueError(f"{name} holds {bad} NaN or infinite values")
    return array


def omp_encode_gram(gram: np.ndarray, correlations: np.ndarray, n_nonzero: int) -> np.ndarray:
    """Codes (signals x atoms) from the Gram matrix D D^T and the correlations X D^T."""
    gram = _finite("gram", gram)
    correlations = _finite("correlations", correlations)
    if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
        raise ValueError(f"gram must be square, got shape {gram.shape}")
    if correlations.ndim != 2 or correlations.shape[1] != gram.shape[0]:
        raise ValueError(f"correlations must be (signals, {gram.shape[0]}), got shape {correlations.shape}")
    atoms = gram.shape[0]
    if not 1 <= n_nonzero <= atoms:
        raise ValueError(f"n_nonzero must be between 1 and the number of atoms ({atoms}), got {n_nonzero}")
    if (np.diag(gram) <= 0).any():
        raise ValueError(f"atoms {np.flatnonzero(np.diag(gram) <= 0).tolist()} are zero")
    codes = np.empty(correlations.shape)
    batch_omp_gram(gram, correlations, int(n_nonzero), codes)
    return codes


def omp_encode(signals: np.ndarray, dictionary: np.ndarray, n_nonzero: int) -> np.ndarray:
    """Codes (signals x atoms) with at most ``n_nonzero`` atoms each, by Batch-OMP."""
    signals = _finite("signals", signals)
    dictionary = _finite("dictionary", dictionary)
    if signals.ndim != 2 or dictionary.ndim != 2 or signals.shape[1] != dictionary.shape[1]:
        shapes = f"{signals.shape} and {dictionary.shape}"
        raise ValueError(f"signals (signals, features) and dictionary (atoms, features) disagree: {shapes}")
    return omp_encode_gram(dictionary @ dictionary.T, signals @ dictionary.T, n_nonzero)
