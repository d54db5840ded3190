"""The memory store's kernels on a GPU (``numba.cuda``): decay, reinforcement, and the iteration's fused pass.

They give the CPU kernels' bits (``kernels.memstore``): the same float32 decay
and clamp, the same histogram arithmetic in float64, and the exact sum's
integer exponent bins. The top-k is selected by radix: the pass counts the
qualities by the top 16 bits of an order-preserving key, the host finds the
bin that holds the k-th best, a second pass splits that bin by the low 16
bits when it is crowded, and the records at or above the threshold key (the
top-k and the ties of its last entry) are collected for the host's exact
ranking by (quality, id). The histogram and exponent counters are summed in
shared memory per block first, so there is one global atomic per block and
bin. The counters and the candidates' outputs live in ``PassBuffers``, made
once per partition and zeroed on the device each pass: no allocation, and no
host-to-device copy, per iteration. Tested on the CPU with
``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import device_memset

from .memstore import EXPONENT_BINS, PassOutput

_THREADS = 256
_KEY_BINS = 1 << 16
#: The histogram bins a block counts in shared memory; more bins go straight to global memory.
_SHARED_BINS = 1024
#: A threshold bin holding more candidates than this is split by the low 16 bits of the key.
_CROWDED = 4096


def _blocks(n: int) -> int:
    return max(1, (n + _THREADS - 1) // _THREADS)


@cuda.jit(device=True, inline=True)
def _key(bits):
    """An unsigned key in the order of the float32 whose bits these are (-0.0 as +0.0: they rank as equals)."""
    if bits == numba.uint32(0x80000000):
        return numba.uint32(0x80000000)
    if bits & numba.uint32(0x80000000):
        return ~bits
    return bits | numba.uint32(0x80000000)


@cuda.jit
def _decay(strength, rate):
    i = cuda.grid(1)
    if i < strength.size:
        value = numba.float32(strength[i] - rate)
        strength[i] = min(max(value, numba.float32(0.0)), numba.float32(1.0))


@cuda.jit
def _apply_deltas(strength, rows, deltas):
    i = cuda.grid(1)
    if i < rows.size:
        row = rows[i]
        value = numba.float32(strength[row] + deltas[i])
        strength[row] = min(max(value, numba.float32(0.0)), numba.float32(1.0))


@cuda.jit
def _pass(strength, quality, bits, rate, low, scale, bins, histogram, exponents, maximum, key_counts):
    """Decay; count the histogram, the exponent bins, the maximum and the keys' top 16 bits."""
    shared_histogram = cuda.shared.array(_SHARED_BINS, numba.int64)
    shared_exponents = cuda.shared.array(EXPONENT_BINS, numba.int64)
    t = cuda.threadIdx.x
    for b in range(t, _SHARED_BINS, _THREADS):
        shared_histogram[b] = 0
    for b in range(t, EXPONENT_BINS, _THREADS):
        shared_exponents[b] = 0
    cuda.syncthreads()
    i = cuda.grid(1)
    if i < strength.size:
        value = numba.float32(strength[i] - rate)
        strength[i] = min(max(value, numba.float32(0.0)), numba.float32(1.0))
        q = quality[i]
        cuda.atomic.max(maximum, 0, numba.float64(q))
        x = (q - low) * scale  # clamped as a float, as on the CPU: int() of a huge quality overflows
        b = 0 if x < 0 else (bins - 1 if x >= bins else int(x))
        if bins <= _SHARED_BINS:
            cuda.atomic.add(shared_histogram, b, 1)
        else:
            cuda.atomic.add(histogram, b, 1)
        word = bits[i]
        exponent = (word >> 23) & 0xFF
        mantissa = numba.int64(word & 0x7FFFFF)
        if exponent:
            mantissa |= 0x800000
        cuda.atomic.add(shared_exponents, exponent, -mantissa if word >> 31 else mantissa)
        cuda.atomic.add(key_counts, _key(word) >> 16, 1)
    cuda.syncthreads()
    if bins <= _SHARED_BINS:
        for b in range(t, bins, _THREADS):
            if shared_histogram[b]:
                cuda.atomic.add(histogram, b, shared_histogram[b])
    for b in range(t, EXPONENT_BINS, _THREADS):
        if shared_exponents[b]:
            cuda.atomic.add(exponents, b, shared_exponents[b])


@cuda.jit
def _split(bits, high, key_counts):
    """Count the keys whose top 16 bits are ``high`` by their low 16 bits."""
    i = cuda.grid(1)
    if i < bits.size:
        key = _key(bits[i])
        if key >> 16 == high:
            cuda.atomic.add(key_counts, key & 0xFFFF, 1)


@cuda.jit
def _collect(bits, quality, ids, threshold, out_quality, out_ids, used):
    """Append every record whose key is at least ``threshold``."""
    i = cuda.grid(1)
    if i < bits.size and _key(bits[i]) >= threshold:
        at = cuda.atomic.add(used, 0, 1)
        out_quality[at] = quality[i]
        out_ids[at] = ids[i]


@cuda.jit
def _fill(array, value):
    i = cuda.grid(1)
    if i < array.size:
        array[i] = value


class PassBuffers:
    """The device arrays an iteration's pass fills, kept from one iteration to the next: counters are zeroed on the
    device, and the candidates' outputs grow only when a partition outgrows them."""

    def __init__(self) -> None:
        self._kept: dict[str, Any] = {}
        #: Device arrays made so far (tests: none after the first pass of a partition's size).
        self.allocations = 0

    def filled(self, name: str, size: int, dtype: type, value: float = 0) -> Any:
        """The counter ``name`` of ``size`` elements, every one set to ``value`` on the device."""
        array = self._kept.get(name)
        if array is None or array.size != size:
            array = self._kept[name] = cuda.device_array(size, dtype)
            self.allocations += 1
        if value == 0:  # the driver's memset: a fill kernel of 65,536 threads took 21 s on the simulator
            device_memset(array, 0, array.size * array.dtype.itemsize)
        else:
            _fill[_blocks(size), _THREADS](array, dtype(value))
        return array

    def room(self, name: str, size: int, dtype: type) -> Any:
        """At least ``size`` elements for the output ``name`` (contents undefined)."""
        array = self._kept.get(name)
        if array is None or array.size < size:
            array = self._kept[name] = cuda.device_array(max(size, 1), dtype)
            self.allocations += 1
        return array


def _threshold_bin(counts: np.ndarray, wanted: int) -> tuple[int, int]:
    """(the highest bin b such that bins >= b hold at least ``wanted``, how many bins > b hold)."""
    above = np.cumsum(counts[::-1])[::-1]  # above[b]: the count in bins >= b
    reaching = np.flatnonzero(above >= wanted)
    b = int(reaching[-1]) if len(reaching) else 0
    return b, int(above[b + 1]) if b + 1 < len(counts) else 0


def decay(strength, rate: np.float32) -> None:
    """``strength -= rate``, clamped to [0, 1], on a device array."""
    if strength.size:
        _decay[_blocks(strength.size), _THREADS](strength, rate)


def apply_deltas(strength, rows: np.ndarray, deltas: np.ndarray) -> None:
    """``strength[rows] += deltas``, clamped to [0, 1], on a device array (rows unique)."""
    if len(rows):
        _apply_deltas[_blocks(len(rows)), _THREADS](strength, cuda.to_device(rows), cuda.to_device(deltas))


def iteration_pass(
    strength, quality, ids, rate: np.float32, low: float, high: float, bins: int, k: int,
    buffers: PassBuffers | None = None,
) -> PassOutput:  # fmt: skip
    """Decay and the aggregates of device arrays in one pass; then the top-k's candidates by radix selection.
    ``buffers``: the partition's kept device arrays (fresh ones when None)."""
    n = strength.size
    kept = buffers if buffers is not None else PassBuffers()
    histogram = kept.filled("histogram", bins, np.int64)
    exponents = kept.filled("exponents", EXPONENT_BINS, np.int64)
    maximum = kept.filled("maximum", 1, np.float64, -np.inf)
    key_counts = kept.filled("key_counts", _KEY_BINS, np.int32)
    bits = quality.view(np.uint32)
    if n:
        _pass[_blocks(n), _THREADS](
            strength, quality, bits, rate, low, bins / (high - low), bins, histogram, exponents, maximum, key_counts
        )
    threshold = 0
    wanted = min(k, n)
    if wanted:
        counts = key_counts.copy_to_host()
        high_bin, above = _threshold_bin(counts, wanted)
        threshold = high_bin << 16
        if counts[high_bin] > _CROWDED:
            low_counts = kept.filled("low_counts", _KEY_BINS, np.int32)
            _split[_blocks(n), _THREADS](bits, np.uint32(high_bin), low_counts)
            low_bin, _ = _threshold_bin(low_counts.copy_to_host(), wanted - above)
            threshold |= low_bin
    found_quality, found_ids = np.empty(0, np.float32), np.empty(0, np.int64)
    if wanted:
        used = kept.filled("used", 1, np.int64)
        out_quality, out_ids = kept.room("out_quality", n, np.float32), kept.room("out_ids", n, np.int64)
        _collect[_blocks(n), _THREADS](bits, quality, ids, np.uint32(threshold), out_quality, out_ids, used)
        size = int(used.copy_to_host()[0])
        found_quality, found_ids = out_quality[:size].copy_to_host(), out_ids[:size].copy_to_host()
    return PassOutput(
        count=n,
        maximum=float(maximum.copy_to_host()[0]),
        histogram=histogram.copy_to_host(),
        exponents=exponents.copy_to_host(),
        candidates_quality=found_quality,
        candidates_ids=found_ids,
    )
