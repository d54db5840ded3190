"""Lasso coding throughput on one core: ours against SPAMS's ``lasso`` and scikit-learn's ``sparse_encode``.

Each codes the same signals with the same unit-norm dictionary from the raw rows
(the Gram matrix and correlations inside the time), on one core: ours with one
Numba thread and BLAS on one thread, SPAMS with ``numThreads=1`` (LARS, its
``mode=2``: ``0.5 ||x - D c||^2 + lambda1 ||c||_1``, the objective ours
minimises), scikit-learn's ``sparse_encode(algorithm="lasso_lars")`` with one
job, on a sample of the signals (it codes a few hundred a second). Two
dictionaries: random atoms (nearly orthogonal) and atoms cut from photos (they
overlap as learned atoms do, and paths are longer), each at three penalties.
The objectives are compared before the speeds count: all three solve the same
convex problem, so each signal's objective must agree to rounding.
"""

from __future__ import annotations

import argparse
from functools import partial
from importlib.util import find_spec

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from ..dictlearn import correlations_of, gram_matrix, lasso_encode, sample_image_patches
from ..dictlearn.coding import DESCENT_SWEEPS, DESCENT_TOL
from ..kernels.lasso import lasso_gram
from .encode import planted_problem
from .report import Progress, best_of, table, write_json

#: (name, signals, penalties): the penalties give about 6, 35 and 57 atoms a signal (random atoms), 5, 17 and 31
#: (atoms from photos).
SETTINGS = (
    ("random atoms", 10_000, (0.5, 0.1, 0.02)),
    ("atoms from photos", 10_000, (0.05, 0.01, 0.002)),
)
ATOMS, FEATURES = 256, 64
SKLEARN_SIGNALS = 500  # scikit-learn's sample: its LARS runs in Python per signal


def problem(name: str, signals: int) -> tuple[np.ndarray, np.ndarray]:
    """(dictionary, signals) of a setting."""
    if name == "random atoms":
        dictionary, data, _ = planted_problem(ATOMS, FEATURES, 8, signals)
        return dictionary, data
    patches = sample_image_patches(8, signals + ATOMS, seed=0)  # (mean-removed rows; twice as many as needed)
    patches = patches[np.linalg.norm(patches, axis=1) > 1e-3]  # not flat: a flat one makes no atom
    order = np.random.default_rng(1).permutation(len(patches))
    dictionary = patches[order[:ATOMS]]
    dictionary /= np.linalg.norm(dictionary, axis=1, keepdims=True)
    data = patches[order[ATOMS : ATOMS + signals]]
    return dictionary, data / np.linalg.norm(data, axis=1).max()


def _objectives(data: np.ndarray, dictionary: np.ndarray, codes: np.ndarray, alpha: float) -> np.ndarray:
    return 0.5 * ((data - codes @ dictionary) ** 2).sum(axis=1) + alpha * np.abs(codes).sum(axis=1)


def measure(name: str, signals: int, alphas: tuple[float, ...], repeats: int, sklearn_signals: int) -> list[dict]:
    """Signals/s of each coder on one core, per penalty, with the objectives compared first."""
    from sklearn.decomposition import sparse_encode

    dictionary, data = problem(name, signals)
    gram, correlations = gram_matrix(dictionary), correlations_of(data, dictionary)  # lasso_encode's own
    spams = find_spec("spams") is not None
    records = []
    for alpha in alphas:
        ours = partial(lasso_encode, data, dictionary, alpha)
        codes = np.empty(correlations.shape)  # lasso_encode's codes, with how many signals the descent coded
        descended = lasso_gram(gram, correlations, alpha, DESCENT_SWEEPS, DESCENT_TOL, codes)
        objective = _objectives(data, dictionary, codes, alpha)
        record: dict = {"setting": name, "atoms": ATOMS, "features": FEATURES, "signals": signals, "alpha": alpha,
                        "nonzeros_per_signal": float(np.count_nonzero(codes) / signals),
                        "signals_by_descent": int(descended),
                        "ours_signals_per_s": signals / best_of(ours, repeats)}  # fmt: skip
        sample = slice(0, min(signals, sklearn_signals))
        theirs = partial(sparse_encode, data[sample], dictionary, algorithm="lasso_lars", alpha=alpha, n_jobs=1)
        record["sklearn_objective_excess"] = _excess(objective[sample], data[sample], dictionary, theirs(), alpha)
        record["sklearn_signals_per_s"] = (sample.stop - sample.start) / best_of(theirs, 1)
        record["ratio_to_sklearn"] = record["ours_signals_per_s"] / record["sklearn_signals_per_s"]
        if spams:
            run = _spams_lasso(dictionary, data, alpha)
            record["spams_objective_excess"] = _excess(objective, data, dictionary, run().T.toarray(), alpha)
            record["spams_signals_per_s"] = signals / best_of(run, repeats)
            record["ratio_to_spams"] = record["ours_signals_per_s"] / record["spams_signals_per_s"]
        records.append(record)
    return records


def _excess(ours: np.ndarray, data: np.ndarray, dictionary: np.ndarray, theirs: np.ndarray, alpha: float) -> float:
    """The largest relative amount by which our objective exceeds a peer's on a signal (<= 0: ours at least as
    low everywhere)."""
    peer = _objectives(data, dictionary, theirs, alpha)
    return float(np.max((ours - peer) / np.maximum(peer, 1e-300)))


def _spams_lasso(dictionary: np.ndarray, data: np.ndarray, alpha: float):
    """SPAMS's lasso on one thread (signals as columns), as a function of nothing."""
    import spams

    columns, atoms = np.asfortranarray(data.T), np.asfortranarray(dictionary.T)
    return partial(spams.lasso, columns, D=atoms, lambda1=alpha, mode=2, numThreads=1)


HEADERS = ["setting", "alpha", "atoms a signal", "ours/s", "SPAMS/s", "ours/SPAMS", "sklearn/s", "ours/sklearn",
           "objective over (SPAMS, sklearn)", "by descent"]  # fmt: skip


def row(record: dict) -> list:
    """A table row of one ``measure`` record."""
    excess = f"{record.get('spams_objective_excess', float('nan')):.1e}, {record['sklearn_objective_excess']:.1e}"
    return [f"{record['setting']}: K={record['atoms']}, n={record['features']}", record["alpha"],
            record["nonzeros_per_signal"], record["ours_signals_per_s"],
            record.get("spams_signals_per_s", "not installed"), record.get("ratio_to_spams", "-"),
            record["sklearn_signals_per_s"], record["ratio_to_sklearn"], excess,
            record["signals_by_descent"]]  # fmt: skip


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench lasso``: the table printed and the JSON record written."""
    repeats = 1 if args.quick else 3
    sampled = SKLEARN_SIGNALS // (5 if args.quick else 1)
    records, said = [], Progress()
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with threadpool_limits(1):
            for name, signals, alphas in SETTINGS:
                count = signals // (10 if args.quick else 1)
                records += measure(name, count, alphas, repeats, sampled)
                said(f"{name} ({count:,} signals) measured")
    finally:
        numba.set_num_threads(threads)
    print(table(HEADERS, [row(record) for record in records]))
    if find_spec("spams") is None:
        print("SPAMS: not installed (pip install spams-bin), so not measured")
    baselines = {"spams": "spams.lasso(mode=2, lambda1=alpha, numThreads=1)",
                 "sklearn": f"sklearn.decomposition.sparse_encode(algorithm='lasso_lars', n_jobs=1), the first "
                            f"{sampled} signals"}  # fmt: skip
    write_json(args.json, "lasso", 1, {"baselines": baselines, "settings": records})
    return 0
