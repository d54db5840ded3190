"""OMP sparse-coding throughput: our Batch-OMP kernel against scikit-learn, one core, same run.

Both code the same signals against the same dictionary from the same Gram
matrix and correlations (computed once, outside the timing): scikit-learn's
``orthogonal_mp_gram`` limited to one BLAS thread, and ours with one Numba
thread. A column with all of this machine's cores shows how ours scales, and
one with the ``numba.cuda`` kernel when a real GPU is present (transfers of the
correlations and codes included).
"""

from __future__ import annotations

import argparse
from functools import partial

import numba
import numpy as np

from ..dictlearn import correlations_of, gram_matrix, omp_encode_gram
from ..kernels.devices import cuda_usable
from .report import best_of, table, write_json

SETTINGS = (  # (name, atoms, features, non-zeros, signals)
    ("K-SVD synthetic", 50, 20, 3, 20_000),
    ("8x8 image patches", 256, 64, 8, 10_000),
)


def _best_rate(action, signals: int, repeats: int) -> float:
    return signals / best_of(action, repeats)


def measure_omp(name: str, atoms: int, features: int, nonzero: int, signals: int, repeats: int) -> dict:
    """Signals/s of scikit-learn (one BLAS thread) and ours (one, then all Numba threads) on one setting."""
    from sklearn.linear_model import orthogonal_mp_gram
    from threadpoolctl import threadpool_limits

    threads = numba.get_num_threads()
    rng = np.random.default_rng(0)
    dictionary = rng.standard_normal((atoms, features))
    dictionary /= np.linalg.norm(dictionary, axis=1, keepdims=True)
    data = rng.standard_normal((signals, features))
    gram, correlations = gram_matrix(dictionary), correlations_of(data, dictionary)
    omp_encode_gram(gram, correlations[:10], nonzero)  # compile outside the timing
    theirs = partial(orthogonal_mp_gram, gram, correlations.T, n_nonzero_coefs=nonzero)
    ours = partial(omp_encode_gram, gram, correlations, nonzero)
    with threadpool_limits(1):
        baseline = _best_rate(theirs, signals, repeats)
    numba.set_num_threads(1)
    try:
        ours_one = _best_rate(ours, signals, repeats)
    finally:
        numba.set_num_threads(threads)
    ours_all = _best_rate(ours, signals, repeats)
    gpu = None
    if cuda_usable():
        on_gpu = partial(omp_encode_gram, gram, correlations, nonzero, "cuda")
        on_gpu()  # compile and warm the device outside the timing
        gpu = _best_rate(on_gpu, signals, repeats)
    return {
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
        "ours_signals_per_s_gpu": gpu,
    }


OMP_HEADERS = [
    "setting",
    "signals",
    "sklearn/s (1 core)",
    "ours/s (1 core)",
    "ratio",
    "threads",
    "ours/s (all)",
    "ours/s (GPU)",
]


def omp_row(record: dict) -> list:
    """A table row of ``measure_omp``'s record."""
    setting = f"{record['setting']}: K={record['atoms']}, n={record['features']}, L={record['nonzero']}"
    return [
        setting,
        record["signals"],
        record["baseline_signals_per_s"],
        record["ours_signals_per_s_1_thread"],
        record["ratio_1_thread"],
        record["threads"],
        record["ours_signals_per_s_all_threads"],
        record["ours_signals_per_s_gpu"] or "no GPU",
    ]


def run_omp_bench(json_path: str, quick: bool = False) -> dict:
    """Print the table, write JSON, return the record."""
    repeats = 1 if quick else 3
    records = [
        measure_omp(name, atoms, features, nonzero, signals // 10 if quick else signals, repeats)
        for name, atoms, features, nonzero, signals in SETTINGS
    ]
    print(table(OMP_HEADERS, [omp_row(r) for r in records]))
    write_json(
        json_path,
        "omp",
        1,
        {"baseline": "sklearn.linear_model.orthogonal_mp_gram, one BLAS thread", "settings": records},
    )
    return {"settings": records}


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run_omp_bench(args.json, quick=args.quick)
    return 0
