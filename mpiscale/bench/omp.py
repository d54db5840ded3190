"""OMP sparse-coding throughput: our Batch-OMP kernel against scikit-learn, one core, same run.

Both code the same signals against the same dictionary from the same Gram
matrix and correlations (computed once, outside the timing): scikit-learn's
``orthogonal_mp_gram`` limited to one BLAS thread, and ours with one Numba
thread. A row with all of this machine's cores shows how ours scales.
"""

from __future__ import annotations

import time
from functools import partial

import numba
import numpy as np

from ..dictlearn import omp_encode_gram
from .report import table, write_json

SETTINGS = (  # (name, atoms, features, non-zeros, signals)
    ("K-SVD synthetic", 50, 20, 3, 20_000),
    ("8x8 image patches", 256, 64, 8, 10_000),
)


def _best_rate(action, signals: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return signals / best


def run_omp_bench(json_path: str, quick: bool = False) -> dict:
    """Print the table, write JSON, return the record."""
    from sklearn.linear_model import orthogonal_mp_gram
    from threadpoolctl import threadpool_limits

    threads = numba.get_num_threads()
    repeats = 1 if quick else 3
    rows, records = [], []
    for name, atoms, features, nonzero, signals in SETTINGS:
        signals = signals // 10 if quick else signals
        rng = np.random.default_rng(0)
        dictionary = rng.standard_normal((atoms, features))
        dictionary /= np.linalg.norm(dictionary, axis=1, keepdims=True)
        data = rng.standard_normal((signals, features))
        gram, correlations = dictionary @ dictionary.T, data @ dictionary.T
        omp_encode_gram(gram, correlations[:10], nonzero)  # compile outside the timing
        theirs = partial(orthogonal_mp_gram, gram, correlations.T, n_nonzero_coefs=nonzero)
        ours = partial(omp_encode_gram, gram, correlations, nonzero)
        with threadpool_limits(1):
            baseline = _best_rate(theirs, signals, repeats)
        numba.set_num_threads(1)
        ours_one = _best_rate(ours, signals, repeats)
        numba.set_num_threads(threads)
        ours_all = _best_rate(ours, signals, repeats)
        setting = f"{name}: K={atoms}, n={features}, L={nonzero}"
        rows.append([setting, signals, baseline, ours_one, ours_one / baseline, threads, ours_all])
        records.append(
            {
                "setting": name,
                "atoms": atoms,
                "features": features,
                "nonzero": nonzero,
                "signals": signals,
                "baseline_signals_per_s": baseline,
                "ours_signals_per_s_1_thread": ours_one,
                "ratio_1_thread": ours_one / baseline,
                "threads": threads,
                "ours_signals_per_s_all_threads": ours_all,
            }
        )
    headers = ["setting", "signals", "sklearn/s (1 core)", "ours/s (1 core)", "ratio", "threads", "ours/s (all)"]
    print(table(headers, rows))
    path = write_json(
        json_path,
        "omp",
        1,
        {"baseline": "sklearn.linear_model.orthogonal_mp_gram, one BLAS thread", "settings": records},
    )
    print(f"wrote {path}")
    return {"settings": records}
