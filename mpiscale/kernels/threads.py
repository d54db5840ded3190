"""Share a host's cores among the ranks on it: Numba and BLAS threads per rank = its cores / ranks sharing them.

Numba's parallel kernels and OpenBLAS each start one thread per core by
default. With several ranks on one host that oversubscribes the cores many
times over, and idle worker threads spin while an MPI collective waits: on
this 2-core machine four ranks ran 14 times slower because of Numba's threads
and another 8 times slower because of OpenBLAS's. An explicit
``NUMBA_NUM_THREADS`` or ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` is left alone. Where
numba is not imported yet, its share goes into ``NUMBA_NUM_THREADS``, which numba reads when it is.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import AbstractContextManager, nullcontext

from threadpoolctl import ThreadpoolController, threadpool_limits


def share_cores(ranks_sharing: int, scipy_blas: bool = False) -> int:
    """Set Numba and BLAS threads to this rank's cores / the ranks that may run on them; returns Numba's.

    ``ranks_sharing`` comes from ``mpiscale.ranks.ranks_sharing_cores``: 1
    for a rank bound to cores of its own, the host's ranks for unbound ones.
    ``scipy_blas``: load scipy's BLAS first, so that the limit reaches it too,
    for a job whose kernels call Numba's ``np.dot`` or scipy's solvers (a
    quarter of a second of start-up the other jobs do not pay).
    """
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // ranks_sharing)
    if scipy_blas:
        _load_numbas_blas()
    if not {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"} & set(os.environ):
        threadpool_limits(threads, user_api="blas")
    if "numba" not in sys.modules:  # a job without kernels does not pay numba's import: it reads this when imported
        os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))
        return int(os.environ["NUMBA_NUM_THREADS"])
    import numba

    if "NUMBA_NUM_THREADS" in os.environ:
        return numba.get_num_threads()
    numba.set_num_threads(min(numba.config.NUMBA_NUM_THREADS, threads))
    return numba.get_num_threads()


def _load_numbas_blas() -> None:
    """Load scipy's BLAS, the one Numba's ``np.dot`` calls, so that a limit on BLAS threads reaches it: a BLAS
    loaded after the limit starts a thread per core."""
    import scipy.linalg  # noqa: F401


@functools.lru_cache(maxsize=1)
def _pools(modules: int) -> ThreadpoolController:
    """The thread pools of the libraries loaded while ``modules`` modules were (kept until the next import: finding
    them costs over a millisecond, and a step of ``partial_fit`` takes a few)."""
    return ThreadpoolController()


def blas_beside_numba() -> AbstractContextManager:
    """Hold BLAS to one thread while Numba's kernels run on several (a context; nothing to do on one).

    The idle threads of each pool spin-wait for work a while before they sleep: a product between two parallel
    kernels left OpenBLAS's threads spinning on the cores the kernels needed. One rank of
    256-atom dictionary learning on two threads ran 2.5x slower than on one thread (2026-11-30). Products that
    must run in parallel belong inside the kernels, each thread multiplying its own rows.
    """
    import numba

    if numba.get_num_threads() <= 1:
        return nullcontext()
    _load_numbas_blas()
    return _pools(len(sys.modules)).limit(limits=1, user_api="blas")
