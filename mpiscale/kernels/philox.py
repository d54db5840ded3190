"""Philox4x32-10, the counter-based generator of Salmon et al. (SC'11), as Numba kernels.

A counter-based generator is a pure function ``(counter, key) -> 4 random words``:
any value can be computed without the ones before it, so every sample's random
numbers can be produced independently, in parallel, on any rank.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_MASK = np.uint64(0xFFFFFFFF)
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_TWO_POW_MINUS_53 = 1.0 / 9007199254740992.0


@njit(inline="always", cache=True)
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds on a 4x32-bit counter with a 2x32-bit key (uint64 holding 32 bits each)."""
    for round_index in range(10):
        if round_index:
            k0 = (k0 + _W0) & _MASK
            k1 = (k1 + _W1) & _MASK
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0), p1 & _MASK, ((p0 >> np.uint64(32)) ^ c3 ^ k1), p0 & _MASK
    return c0, c1, c2, c3


@njit(parallel=True, cache=True)
def uniform53(key: np.ndarray, epoch: np.uint64, block_base: np.uint64, ids: np.ndarray, out: np.ndarray) -> None:
    """Fill ``out[i, :]`` with uniform doubles in [0, 1) for sample ``ids[i]`` (53-bit resolution).

    Counter of block ``b``: (block_base + b, epoch, id low word, id high word);
    each block gives two doubles from its four words.
    """
    count = out.shape[1]
    k0 = np.uint64(key[0])
    k1 = np.uint64(key[1])
    for i in prange(ids.shape[0]):
        sample = np.uint64(ids[i])
        low = sample & _MASK
        high = sample >> np.uint64(32)
        for block in range((count + 1) // 2):
            w0, w1, w2, w3 = philox4x32_10(block_base + np.uint64(block), epoch, low, high, k0, k1)
            column = 2 * block
            out[i, column] = ((w0 >> np.uint64(5)) * 67108864 + (w1 >> np.uint64(6))) * _TWO_POW_MINUS_53
            if column + 1 < count:
                out[i, column + 1] = ((w2 >> np.uint64(5)) * 67108864 + (w3 >> np.uint64(6))) * _TWO_POW_MINUS_53


@njit(cache=True)
def block_words(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The four output words for one counter and key (for known-answer tests)."""
    w = philox4x32_10(
        np.uint64(counter[0]),
        np.uint64(counter[1]),
        np.uint64(counter[2]),
        np.uint64(counter[3]),
        np.uint64(key[0]),
        np.uint64(key[1]),
    )
    return np.array([w[0], w[1], w[2], w[3]], dtype=np.uint32)
