"""Batch-OMP on a GPU with ``numba.cuda``: one thread per signal, the very steps of ``kernels.omp``.

The per-signal OMP (``build_code_one``) is compiled a second time as a CUDA
device function; each thread codes one signal with work arrays in device
memory. Signals go to the device in chunks so the work arrays stay bounded.
Tested on the CPU with ``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .omp import build_code_one

_THREADS = 128
_CHUNK = 1 << 15  # signals per device round trip

_code_one = build_code_one(cuda.jit(device=True))


def cuda_usable() -> bool:
    """True when a real CUDA device is present (the simulator does not count)."""
    from numba import config

    return not config.ENABLE_CUDASIM and cuda.is_available()


def select_gpu(rank_on_host: int) -> int:
    """Use GPU ``rank_on_host`` modulo the GPUs present (one rank per GPU); returns its index."""
    index = rank_on_host % len(cuda.gpus)
    cuda.select_device(index)
    return index


@cuda.jit
def _omp_kernel(gram, correlations, n_nonzero, codes, alpha, chol, support, gamma, work, chosen):
    signal = cuda.grid(1)
    if signal < correlations.shape[0]:
        _code_one(
            gram,
            correlations[signal],
            n_nonzero,
            alpha[signal],
            chol[signal],
            support[signal],
            gamma[signal],
            work[signal],
            chosen[signal],
            codes[signal],
        )


def batch_omp_gram_cuda(gram: np.ndarray, correlations: np.ndarray, n_nonzero: int, codes: np.ndarray) -> None:
    """As ``kernels.omp.batch_omp_gram``, computed on the current CUDA device."""
    signals, atoms = correlations.shape
    device_gram = cuda.to_device(np.ascontiguousarray(gram))
    rows = min(signals, _CHUNK)
    alpha = cuda.device_array((rows, atoms))
    chol = cuda.device_array((rows, n_nonzero, n_nonzero))
    support = cuda.device_array((rows, n_nonzero), dtype=np.int64)
    gamma = cuda.device_array((rows, n_nonzero))
    work = cuda.device_array((rows, n_nonzero))
    chosen = cuda.device_array((rows, atoms), dtype=np.bool_)
    for start in range(0, signals, _CHUNK):
        stop = min(signals, start + _CHUNK)
        count = stop - start
        device_corr = cuda.to_device(np.ascontiguousarray(correlations[start:stop]))
        device_codes = cuda.device_array((count, atoms))
        blocks = (count + _THREADS - 1) // _THREADS
        _omp_kernel[blocks, _THREADS](
            device_gram, device_corr, n_nonzero, device_codes, alpha, chol, support, gamma, work, chosen
        )
        codes[start:stop] = device_codes.copy_to_host()
