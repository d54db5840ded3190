"""Batch-OMP on a GPU with ``numba.cuda``: a block of 32 threads per signal, the numerics of ``kernels.omp``.

The threads of a signal's block share the loops over atoms (the argmax of the
residual's correlations, reduced in shared memory, then their update);
thread 0 extends the Cholesky factor and solves for the coefficients with
``build_extend``, the source the CPU kernel compiles, so the codes agree. One thread per signal,
the first version, was latency-bound: 0.3-0.45x of 16 CPU cores on an H100.
Signals go to the device in chunks so the work arrays stay bounded.
Tested on the CPU with ``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .omp import ORTHOGONAL, build_extend

_LANES = 32  # threads per signal: one warp
_CHUNK = 1 << 15  # signals per device round trip

_extend = build_extend(cuda.jit(device=True))


@cuda.jit
def _omp_kernel(gram, correlations, n_nonzero, codes, alpha, chol, support, gamma, work, chosen):
    """One block of 32 threads per signal: they share the loops over atoms; thread 0 extends the factor."""
    signal, lane = cuda.blockIdx.x, cuda.threadIdx.x
    values = cuda.shared.array(_LANES, numba.float64)
    indices = cuda.shared.array(_LANES, numba.int64)
    atoms = gram.shape[0]
    for k in range(lane, atoms, _LANES):
        alpha[signal, k] = correlations[signal, k]
        chosen[signal, k] = False
        codes[signal, k] = 0.0
    size = 0
    floor = 0.0  # as the CPU kernel's: relative to the signal's first correlation
    for _ in range(n_nonzero):
        cuda.syncthreads()
        best, best_value = -1, 0.0  # each lane: its first atom of largest |alpha|, as the CPU kernel picks
        for k in range(lane, atoms, _LANES):
            value = abs(alpha[signal, k])
            if not chosen[signal, k] and value > best_value:
                best, best_value = k, value
        values[lane], indices[lane] = best_value, best
        cuda.syncthreads()
        half = _LANES // 2
        while half > 0:  # the block's largest value, at its lowest atom
            if lane < half:
                other_value, other = values[lane + half], indices[lane + half]
                if other_value > values[lane] or (other_value == values[lane] and 0 <= other < indices[lane]):
                    values[lane], indices[lane] = other_value, other
            cuda.syncthreads()
            half //= 2
        best, best_value = indices[0], values[0]
        if best < 0 or best_value <= floor:
            break
        if size == 0:
            floor = ORTHOGONAL * best_value
        cuda.syncthreads()  # every thread has read the best atom before thread 0 reuses the slot
        if lane == 0:
            grown = _extend(gram, correlations[signal], chol[signal], support[signal], gamma[signal], work[signal],
                            size, best)  # fmt: skip
            if grown > 0:
                chosen[signal, best] = True
            indices[0] = grown
        cuda.syncthreads()
        grown = indices[0]
        if grown < 0:
            break
        size = grown
        for k in range(lane, atoms, _LANES):
            value = correlations[signal, k]
            for j in range(size):
                value -= gram[support[signal, j], k] * gamma[signal, j]
            alpha[signal, k] = value
    cuda.syncthreads()
    if lane == 0:
        for j in range(size):
            codes[signal, support[signal, j]] = gamma[signal, j]


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
        _omp_kernel[count, _LANES](
            device_gram, device_corr, n_nonzero, device_codes, alpha, chol, support, gamma, work, chosen
        )
        codes[start:stop] = device_codes.copy_to_host()
