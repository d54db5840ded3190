"""16-bit floats for the wire, as Numba kernels: IEEE half (float16) and bfloat16, held as uint16 bit patterns.

Gradient compression sends 16-bit values and adds them in float32. numpy
converts float32 to float16 in software, and gradients (small numbers,
divided by the ranks) are often float16 subnormals, its slowest case: a 50 MB
bucket took over half a second. Here encoding is integer arithmetic on the
float32 bit patterns (round to nearest, ties to even, as torch and numpy
round, with subnormals, overflow to infinity and NaN), decoding is a lookup
in a table of all 65,536 values, and the sum of several ranks' copies adds
them in float32 in rank order and rounds once. The uint16 buffers need no
bfloat16 type in numpy and no torch.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

FORMATS = ("float16", "bfloat16")


def _tables() -> dict[str, np.ndarray]:
    every = np.arange(1 << 16, dtype=np.uint32)
    return {
        "float16": every.astype(np.uint16).view(np.float16).astype(np.float32),  # numpy's widening is exact
        "bfloat16": (every << np.uint32(16)).view(np.float32),
    }


_VALUES = _tables()


@njit(inline="always", cache=True)
def _round_to_float16(f):
    """float32 bit pattern -> float16 bit pattern, round to nearest, ties to even."""
    sign = (f >> 16) & 0x8000
    exponent = (f >> 23) & 0xFF
    mantissa = f & 0x7FFFFF
    if exponent == 0xFF:  # infinity or NaN (NaN keeps a mantissa bit)
        return sign | 0x7C00 | (0x200 if mantissa else 0)
    biased = np.int64(exponent) - 112  # float16's exponent bias is 15, float32's 127
    if biased >= 31:
        return sign | 0x7C00
    if biased <= 0:  # float16 subnormal, or zero
        if biased < -10:
            return sign
        full = mantissa | 0x800000
        shift = 14 - biased
        half = full >> shift
        rest = full & ((np.uint32(1) << shift) - 1)
        middle = np.uint32(1) << (shift - 1)
        if rest > middle or (rest == middle and (half & 1)):
            half += 1  # a carry into bit 10 is the smallest normal: right
        return sign | half
    half = (np.uint32(biased) << 10) | (mantissa >> 13)
    rest = mantissa & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and (half & 1)):
        half += 1  # a carry past the largest finite value is infinity: right
    return sign | half


@njit(inline="always", cache=True)
def _round_to_bfloat16(f):
    """float32 bit pattern -> bfloat16 bit pattern, round to nearest, ties to even; NaN stays a quiet NaN."""
    if (f & 0x7FFFFFFF) > 0x7F800000:
        return np.uint32(0x7FC0)
    return (f + 0x7FFF + ((f >> 16) & 1)) >> 16


@njit(parallel=True, cache=True)
def _encode(bits32, out, bfloat):
    for i in prange(bits32.size):
        f = np.uint32(bits32[i])
        out[i] = _round_to_bfloat16(f) if bfloat else _round_to_float16(f)


@njit(parallel=True, cache=True)
def _decode(bits16, table, out):
    for i in prange(bits16.size):
        out[i] = table[bits16[i]]


@njit(parallel=True, cache=True)
def _sum_rows(stacked, table, out):
    rows, columns = stacked.shape
    for i in prange(columns):
        total = np.float32(0.0)
        for r in range(rows):  # rank order: the same bits wherever it runs
            total += table[stacked[r, i]]
        out[i] = total


def to_bits(values: np.ndarray, kind: str) -> np.ndarray:
    """float32 values as ``kind`` bit patterns (uint16, flat)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    out = np.empty(flat.size, np.uint16)
    _encode(flat.view(np.uint32), out, kind == "bfloat16")
    return out


def from_bits(bits: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """``kind`` bit patterns as float32 values (exact); into ``out`` (float32, same size) when given."""
    flat = np.ascontiguousarray(bits, dtype=np.uint16).reshape(-1)
    target = np.empty(flat.size, np.float32) if out is None else out.reshape(-1)
    _decode(flat, _VALUES[kind], target)
    return target if out is None else out


class SumOfBits:
    """The reduction "sum" of ``kind`` bit patterns, for ``Hierarchy.start_allreduce(op=SumOfBits(kind))``.

    Called with the contributions stacked in rank order (rows of uint16), it
    adds them in float32 in that order and rounds once.
    """

    def __init__(self, kind: str) -> None:
        if kind not in FORMATS:
            raise ValueError(f"16-bit format must be one of {', '.join(FORMATS)}, got {kind!r}")
        self.kind = kind
        self.__name__ = f"sum_{kind}"

    def __call__(self, stacked: np.ndarray) -> np.ndarray:
        if stacked.dtype != np.uint16:
            raise TypeError(f"{self.__name__} adds 16-bit patterns (uint16), got {stacked.dtype}")
        total = np.empty(stacked.shape[1], np.float32)
        _sum_rows(stacked, _VALUES[self.kind], total)
        return to_bits(total, self.kind)
