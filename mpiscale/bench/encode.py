"""Sparse coding of new data as users call it: ours against scikit-learn's ``sparse_encode`` and SPAMS's ``omp``.

Each codes the same signals with the same unit-norm dictionary, from the raw
rows (the Gram matrix and correlations are inside the time), on every core of
this machine: ours on Numba threads, scikit-learn with ``n_jobs`` at the core
count, SPAMS on OpenMP threads. Two settings (K-SVD's synthetic one and 8x8
image patches, both planted atoms plus noise), each by sparsity (at most L
atoms) and to an error target (OMP until ``||x - cD|| <= eps``, eps set by the
noise as K-SVD denoising sets it; scikit-learn's ``sparse_encode`` has no
error target, so SPAMS alone there). The codes are compared before timing:
scikit-learn's OMP must give ours exactly. SPAMS's ``omp`` is Order Recursive
Matching Pursuit (it picks the atom that most lowers the residual once the
chosen atoms are refitted, where OMP picks the one most correlated with the
residual), so its codes differ; the mean residual norm of each is shown.
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from importlib.util import find_spec

import numpy as np

from ..dictlearn import omp_encode, omp_rows
from .report import Progress, best_of, table, write_json

SETTINGS = (  # (name, atoms, features, non-zeros, signals)
    ("K-SVD synthetic", 50, 20, 3, 50_000),
    ("8x8 image patches", 256, 64, 8, 20_000),
)
NOISE = 0.1  # of each value, against atoms of unit norm and codes of unit variance
DENOISING_GAIN = 1.15  # eps = gain * noise * sqrt(features) (Elad and Aharon 2006)


def planted_problem(atoms: int, features: int, nonzero: int, signals: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(dictionary, signals, eps): planted sparse combinations plus Gaussian noise."""
    rng = np.random.default_rng(0)
    dictionary = rng.standard_normal((atoms, features))
    dictionary /= np.linalg.norm(dictionary, axis=1, keepdims=True)
    codes = np.zeros((signals, atoms))
    rows = np.repeat(np.arange(signals), nonzero)
    codes[rows, np.argsort(rng.random((signals, atoms)), axis=1)[:, :nonzero].ravel()] = rng.standard_normal(rows.size)
    data = codes @ dictionary + NOISE * rng.standard_normal((signals, features))
    return dictionary, data, DENOISING_GAIN * NOISE * np.sqrt(features)


def _spams_omp(dictionary: np.ndarray, data: np.ndarray, nonzero: int, eps: float | None, cores: int):
    """SPAMS's omp (signals as columns) as a function of nothing, and a way to read its codes back as rows."""
    import spams

    columns, atoms = np.asfortranarray(data.T), np.asfortranarray(dictionary.T)
    target = {} if eps is None else {"eps": eps**2}  # SPAMS bounds the squared residual

    def run():
        return spams.omp(columns, atoms, L=nonzero, numThreads=cores, **target)

    return run, lambda: np.asarray(run().T.todense())


def measure(name: str, atoms: int, features: int, nonzero: int, signals: int, repeats: int, cores: int) -> list[dict]:
    """Signals/s of each coder on one setting: by sparsity, and to the error target.

    Ours is timed as each peer gives its codes: dense (signals x atoms, ``omp_encode``) against scikit-learn,
    sparse (``omp_rows``) against SPAMS, whose ``omp`` returns a sparse matrix.
    """
    from sklearn.decomposition import sparse_encode

    dictionary, data, eps = planted_problem(atoms, features, nonzero, signals)
    omp_encode(data[:10], dictionary, nonzero)  # compile outside the timing
    spams = find_spec("spams") is not None
    records = []
    for target in (None, eps):
        most = nonzero if target is None else features
        rows = omp_rows(data, dictionary, most, "cpu", target)
        ours_codes = rows.dense()
        record: dict = {"setting": name, "atoms": atoms, "features": features, "nonzero": nonzero,
                        "signals": signals, "cores": cores, "eps": target,
                        "ours_nonzeros_per_signal": float(rows.counts.mean()),
                        "ours_residual": _mean_residual(data, ours_codes, dictionary)}  # fmt: skip
        record["ours_sparse_signals_per_s"] = signals / best_of(
            partial(omp_rows, data, dictionary, most, "cpu", target), repeats
        )
        if target is None:
            record["ours_dense_signals_per_s"] = signals / best_of(
                partial(omp_encode, data, dictionary, nonzero), repeats
            )
            theirs = partial(sparse_encode, data, dictionary, algorithm="omp", n_nonzero_coefs=nonzero, n_jobs=cores)
            record["sklearn_differing_codes"] = int(np.count_nonzero(np.abs(theirs() - ours_codes).max(axis=1) > 1e-8))
            record["sklearn_signals_per_s"] = signals / best_of(theirs, repeats)
            record["ratio_to_sklearn"] = record["ours_dense_signals_per_s"] / record["sklearn_signals_per_s"]
        if spams:
            run, codes = _spams_omp(dictionary, data, most, target, cores)
            theirs_codes = codes()
            record["spams_differing_codes"] = int(
                np.count_nonzero(np.abs(theirs_codes - ours_codes).max(axis=1) > 1e-8)
            )
            record["spams_residual"] = _mean_residual(data, theirs_codes, dictionary)
            record["spams_signals_per_s"] = signals / best_of(run, repeats)
            record["ratio_to_spams"] = record["ours_sparse_signals_per_s"] / record["spams_signals_per_s"]
        records.append(record)
    return records


def _mean_residual(data: np.ndarray, codes: np.ndarray, dictionary: np.ndarray) -> float:
    return float(np.linalg.norm(data - codes @ dictionary, axis=1).mean())


HEADERS = ["setting", "coding", "signals", "cores", "ours/s dense", "sklearn/s", "ours/sklearn", "ours/s sparse",
           "SPAMS/s", "ours/SPAMS", "codes differing (sklearn, SPAMS)", "mean residual (ours, SPAMS)"]  # fmt: skip


def row(record: dict) -> list:
    """A table row of one ``measure`` record."""
    coding = f"L={record['nonzero']}" if record["eps"] is None else f"eps={record['eps']:.3g}"
    coding += f" ({record['ours_nonzeros_per_signal']:.2f} a signal)"
    differing = f"{record.get('sklearn_differing_codes', '-')}, {record.get('spams_differing_codes', '-')}"
    residuals = f"{record['ours_residual']:.4f}, " + (f"{record['spams_residual']:.4f}" if "spams_residual" in record
                                                      else "-")  # fmt: skip
    return [
        f"{record['setting']}: K={record['atoms']}, n={record['features']}",
        coding,
        record["signals"],
        record["cores"],
        record.get("ours_dense_signals_per_s", "-"),
        record.get("sklearn_signals_per_s", "no error target"),
        record.get("ratio_to_sklearn", "-"),
        record["ours_sparse_signals_per_s"],
        record.get("spams_signals_per_s", "not installed"),
        record.get("ratio_to_spams", "-"),
        differing,
        residuals,
    ]


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench encode``: the table printed and the JSON record written."""
    cores = len(os.sched_getaffinity(0))
    repeats = 1 if args.quick else 3
    records, said = [], Progress()
    for name, atoms, features, nonzero, signals in SETTINGS:
        count = signals // (5 if args.quick else 1)
        records += measure(name, atoms, features, nonzero, count, repeats, cores)
        said(f"{name} ({count:,} signals, K={atoms}, L={nonzero}) measured")
    print(table(HEADERS, [row(record) for record in records]))
    if find_spec("spams") is None:
        print("SPAMS: not installed (pip install spams-bin), so not measured")
    baselines = {"sklearn": "sklearn.decomposition.sparse_encode(algorithm='omp', n_jobs=cores)",
                 "spams": "spams.omp(L=..., eps=eps**2, numThreads=cores)"}  # fmt: skip
    write_json(args.json, "encode", 1, {"baselines": baselines, "settings": records})
    return 0
