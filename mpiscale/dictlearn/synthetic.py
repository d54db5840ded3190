"""Synthetic data with a planted dictionary (the K-SVD paper's experiment), and the recovery rate.

Atoms are random unit vectors (from ``seed``). Each signal combines
``nonzeros`` distinct atoms with standard normal coefficients, plus white noise
at a given signal-to-noise ratio. Supports, coefficients and noise of sample
``i`` come from ``SampleRandom`` keyed by ``i``, so the data set is the same
whatever the number of ranks that generate it.
"""

from __future__ import annotations

import os

import numpy as np

from ..io import SampleRandom, write_dataset
from ..ranks import Comm, rank_rows, size_and_rank

SIGNALS = "signals"
PLANTED = "planted_dictionary"
_SUPPORT, _COEFFICIENTS, _NOISE = 0, 1, 2  # SampleRandom streams
#: Signal-to-noise ratios from which on the noise is no noise: 10**(dB/10) overflows float64 past 3,080 dB.
_NOISELESS_DB = 3000.0


def planted_dictionary(atoms: int, features: int, seed: int) -> np.ndarray:
    """Random unit-norm atoms (atoms x features)."""
    dictionary = np.random.default_rng(seed).standard_normal((atoms, features))
    return dictionary / np.linalg.norm(dictionary, axis=1, keepdims=True)


def planted_signals(
    dictionary: np.ndarray, sample_ids: np.ndarray, nonzeros: int, snr_db: float, seed: int
) -> np.ndarray:
    """Signals ``sample_ids`` (rows x features) of the planted model; ``snr_db=inf`` for no noise."""
    atoms, features = dictionary.shape
    random = SampleRandom(seed)
    keys = random.uniform(0, sample_ids, atoms, stream=_SUPPORT)
    support = np.argpartition(keys, nonzeros - 1, axis=1)[:, :nonzeros]
    coefficients = random.normal(0, sample_ids, nonzeros, stream=_COEFFICIENTS)
    signals = np.einsum("sn,snf->sf", coefficients, dictionary[support])
    if snr_db < _NOISELESS_DB:  # (inf too)
        power = np.mean(signals**2, axis=1, keepdims=True)
        noise = random.normal(0, sample_ids, features, stream=_NOISE)
        signals += noise * np.sqrt(power / 10 ** (snr_db / 10))
    return signals


def write_planted_dataset(
    path: str | os.PathLike,
    samples: int,
    features: int,
    atoms: int,
    nonzeros: int,
    snr_db: float,
    seed: int,
    comm: Comm | None = None,
) -> np.ndarray:
    """Generate the data set into ``path`` (collective, each rank its block); returns the planted dictionary."""
    if nonzeros > atoms:
        raise ValueError(f"synthetic data: {nonzeros} non-zeros per signal need at least as many atoms, got {atoms}")
    size, rank = size_and_rank(comm)
    dictionary = planted_dictionary(atoms, features, seed)
    start, stop = rank_rows(samples, size, rank)
    signals = planted_signals(dictionary, np.arange(start, stop, dtype=np.int64), nonzeros, snr_db, seed)
    config = {"samples": samples, "features": features, "atoms": atoms, "nonzeros": nonzeros, "snr_db": snr_db}
    arrays = {SIGNALS: signals, PLANTED: dictionary if rank == 0 else dictionary[:0]}
    write_dataset(path, arrays, comm, config={"synthetic": config, "seed": seed})
    return dictionary


def recovery_rate(planted: np.ndarray, learned: np.ndarray, threshold: float = 0.99) -> float:
    """Fraction of planted atoms matched by some learned atom with |cosine| above ``threshold``."""
    planted = planted / np.linalg.norm(planted, axis=1, keepdims=True)
    norms = np.linalg.norm(learned, axis=1, keepdims=True)
    learned = learned / np.where(norms > 0, norms, 1.0)
    return float(np.mean(np.abs(planted @ learned.T).max(axis=1) > threshold))
