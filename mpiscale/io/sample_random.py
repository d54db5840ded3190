"""Deterministic per-sample random parameters, keyed by (seed, epoch, sample id).

Augmentation parameters, dropout seeds or noise for a sample are a pure function
of ``(seed, epoch, sample id, stream)``: the same sample gets the same numbers on
whatever rank or world size processes it, restarts included, and different
samples, epochs or streams are independent. Built on Philox4x32-10
(``mpiscale.kernels.philox``), computed for whole batches of samples at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

_MAX_STREAMS = 256
_BLOCKS_PER_STREAM = 1 << 24  # 2**25 values per sample per stream and epoch


class SampleRandom:
    """Counter-based random numbers per sample; see the module docstring."""

    def __init__(self, seed: int) -> None:
        if not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        self.seed = int(seed)
        self._key = np.array([self.seed & 0xFFFFFFFF, self.seed >> 32], dtype=np.uint64)

    def uniform(self, epoch: int, sample_ids: Iterable[int] | np.ndarray, count: int, stream: int = 0) -> np.ndarray:
        """Uniform doubles in [0, 1), shape ``(len(sample_ids), count)``."""
        ids = _ids(sample_ids)
        count = _count(count)
        out = np.empty((ids.shape[0], count), dtype=np.float64)
        if ids.size and count:
            from ..kernels.philox import uniform53  # numba: imported by the jobs that draw, not by every job

            uniform53(self._key, np.uint64(_epoch(epoch)), np.uint64(_stream(stream) * _BLOCKS_PER_STREAM), ids, out)
        return out

    def normal(self, epoch: int, sample_ids: Iterable[int] | np.ndarray, count: int, stream: int = 0) -> np.ndarray:
        """Standard normal doubles (Box-Muller on pairs of uniforms), shape ``(n, count)``."""
        count = _count(count)
        pairs = self.uniform(epoch, sample_ids, 2 * ((count + 1) // 2), stream)
        radius = np.sqrt(-2.0 * np.log1p(-pairs[:, 0::2]))  # 1 - u lies in (0, 1]
        angle = 2.0 * np.pi * pairs[:, 1::2]
        normals = np.empty_like(pairs)
        normals[:, 0::2] = radius * np.cos(angle)
        normals[:, 1::2] = radius * np.sin(angle)
        return normals[:, :count]

    def integers(
        self, epoch: int, sample_ids: Iterable[int] | np.ndarray, count: int, low: int, high: int, stream: int = 0
    ) -> np.ndarray:
        """Integers in [low, high), shape ``(n, count)``; bias below 2**-53 * (high - low)."""
        if not high > low:
            raise ValueError(f"integers needs high > low, got low={low}, high={high}")
        if high - low > 2**53:
            raise ValueError(f"integers supports ranges up to 2**53 values, got {high - low}")
        values = np.floor(self.uniform(epoch, sample_ids, count, stream) * (high - low)).astype(np.int64)
        return values + low

    def iter_uniform(
        self, epoch: int, sample_ids: Iterable[int], count: int, stream: int = 0, chunk: int = 65536
    ) -> Iterator[np.ndarray]:
        """Stream ``uniform`` over any number of samples with memory bounded by ``chunk`` rows."""
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        if isinstance(sample_ids, range):
            for start in range(0, len(sample_ids), chunk):
                yield self.uniform(epoch, sample_ids[start : start + chunk], count, stream)
            return
        batch: list[int] = []
        for sample_id in sample_ids:
            batch.append(sample_id)
            if len(batch) == chunk:
                yield self.uniform(epoch, batch, count, stream)
                batch = []
        if batch:
            yield self.uniform(epoch, batch, count, stream)


def _ids(sample_ids) -> np.ndarray:
    if isinstance(sample_ids, range):
        if sample_ids.start < 0 or (len(sample_ids) and sample_ids[-1] < 0):
            raise ValueError("sample ids must be non-negative")
        return np.arange(sample_ids.start, sample_ids.stop, sample_ids.step, dtype=np.uint64)
    ids = np.asarray(sample_ids)
    if ids.ndim != 1:
        raise ValueError(f"sample ids must be one-dimensional, got shape {ids.shape}")
    if ids.size == 0:
        return ids.astype(np.uint64)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"sample ids must be integers, got dtype {ids.dtype}")
    if np.issubdtype(ids.dtype, np.signedinteger) and ids.min() < 0:
        raise ValueError(f"sample ids must be non-negative, got {int(ids.min())}")
    return np.ascontiguousarray(ids, dtype=np.uint64)


def _count(count: int) -> int:
    if not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r}")
    if count > 2 * _BLOCKS_PER_STREAM:
        raise ValueError(f"count is limited to {2 * _BLOCKS_PER_STREAM} values per sample and stream, got {count}")
    return int(count)


def _epoch(epoch: int) -> int:
    if not isinstance(epoch, (int, np.integer)) or not 0 <= epoch < 2**32:
        raise ValueError(f"epoch must be an integer in [0, 2**32), got {epoch!r}")
    return int(epoch)


def _stream(stream: int) -> int:
    if not isinstance(stream, (int, np.integer)) or not 0 <= stream < _MAX_STREAMS:
        raise ValueError(f"stream must be an integer in [0, {_MAX_STREAMS}), got {stream!r}")
    return int(stream)
