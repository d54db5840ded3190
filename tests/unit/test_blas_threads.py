"""BLAS held to one thread while Numba's kernels run on several, and given back after."""

import numba
import numpy as np
from threadpoolctl import threadpool_info

from mpiscale.dictlearn import DictionaryLearning
from mpiscale.kernels.threads import blas_beside_numba


def blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_blas_runs_on_one_thread_beside_parallel_kernels_and_gets_its_threads_back():
    before, threads = blas_threads(), numba.get_num_threads()
    try:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        with blas_beside_numba():
            inside = blas_threads()
        numba.set_num_threads(1)
        with blas_beside_numba():
            alone = blas_threads()
    finally:
        numba.set_num_threads(threads)
    assert inside == [1] * len(before) if numba.config.NUMBA_NUM_THREADS > 1 else inside == before
    assert alone == before and blas_threads() == before


def test_the_estimators_steps_leave_blas_as_they_found_it():
    before = blas_threads()
    signals = np.random.default_rng(0).standard_normal((300, 12))
    estimator = DictionaryLearning(n_components=16, n_nonzero_coefs=3, batch_size=50, n_iter=4).fit(signals)
    estimator.partial_fit(signals[:50])
    assert blas_threads() == before and estimator.n_iter_ == 5
