"""Rank-aware batch reader over sharded datasets, with prefetch and a bounded block cache.

The global order of an epoch depends only on ``(seed, epoch)``: in order
(``shuffle=False``) or a permutation drawn from ``SampleRandom`` keys. Step
``t`` covers positions ``[t*B, (t+1)*B)`` of that order for a global batch size
``B``, and each rank takes its block of that step (as ``np.array_split``). So a
job restarted on another number of ranks sees exactly the same global batches,
and every rank runs the same number of steps (some batches may be empty when
there are more ranks than samples in a step).
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .sample_random import SampleRandom
from .sharded import ShardedDataset, rank_rows

SHUFFLE_STREAM = 255  # SampleRandom stream reserved for the epoch permutation


def epoch_order(samples: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Global sample order of ``epoch``: a pure function of its arguments."""
    if not shuffle:
        return np.arange(samples, dtype=np.int64)
    keys = SampleRandom(seed).uniform(epoch, np.arange(samples, dtype=np.int64), 1, stream=SHUFFLE_STREAM)
    return np.argsort(keys[:, 0], kind="stable")


@dataclass
class Batch:
    """One rank's share of global step ``step``: sample ids and the rows of each array."""

    epoch: int
    step: int
    ids: np.ndarray
    data: dict[str, np.ndarray]


class _BlockCache:
    """Least-recently-used blocks of ``block_rows`` rows, at most ``max_bytes`` in all."""

    def __init__(self, source: ShardedDataset, block_rows: int, max_bytes: int) -> None:
        self.source = source
        self.block_rows = block_rows
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self.bytes = 0
        self.reads = 0

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (any order), reading missing blocks in contiguous runs."""
        out = np.empty((len(ids), *self.source.shape[1:]), dtype=self.source.dtype)
        if not len(ids):
            return out
        block_of = ids // self.block_rows
        self._load([int(b) for b in np.unique(block_of) if int(b) not in self.blocks])
        by_block = np.argsort(block_of, kind="stable")
        for group in np.split(by_block, np.flatnonzero(np.diff(block_of[by_block])) + 1):
            block = int(block_of[group[0]])
            self.blocks.move_to_end(block)
            out[group] = self.blocks[block][ids[group] - block * self.block_rows]
        self._evict()
        return out

    def _load(self, missing: list[int]) -> None:
        run_start = 0
        for i in range(1, len(missing) + 1):
            if i == len(missing) or missing[i] != missing[i - 1] + 1:
                first, last = missing[run_start], missing[i - 1]
                start = first * self.block_rows
                rows = self.source.read(start, min((last + 1) * self.block_rows, len(self.source)))
                self.reads += 1
                for block in range(first, last + 1):
                    piece = rows[(block - first) * self.block_rows : (block - first + 1) * self.block_rows]
                    self.blocks[block] = piece
                    self.bytes += piece.nbytes
                run_start = i

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self.blocks:
            _, rows = self.blocks.popitem(last=False)
            self.bytes -= rows.nbytes


class BatchReader:
    """Batches of one or more same-length arrays of a sharded dataset, for this rank.

    ``batch_size`` is the *global* batch. Reads happen in one background thread,
    ``prefetch`` steps ahead, through a cache of at most ``cache_bytes`` per array.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        names: list[str] | tuple[str, ...],
        batch_size: int,
        comm=None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        prefetch: int = 2,
        cache_bytes: int = 256 << 20,
        block_bytes: int = 1 << 20,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be 0 or more, got {prefetch}")
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.batch_size = batch_size
        self.shuffle, self.seed, self.drop_last, self.prefetch = shuffle, seed, drop_last, prefetch
        self._datasets: dict[str, ShardedDataset] = {}
        try:
            for name in names:
                self._datasets[name] = ShardedDataset(path, name, comm)
        except BaseException:
            self.close()
            raise
        lengths = {name: len(ds) for name, ds in self._datasets.items()}
        if len(set(lengths.values())) > 1:
            self.close()
            raise ValueError(f"{os.fspath(path)}: arrays differ in length {lengths}; a batch needs equal row counts")
        self.samples = next(iter(lengths.values()), 0)
        self._caches = {}
        for name, ds in self._datasets.items():
            row_bytes = max(ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64)), 1)
            self._caches[name] = _BlockCache(ds, max(1, block_bytes // row_bytes), cache_bytes)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mpiscale-reader")

    @property
    def steps(self) -> int:
        """Global steps per epoch (the same on every rank)."""
        whole, rest = divmod(self.samples, self.batch_size)
        return whole + (1 if rest and not self.drop_last else 0)

    def step_ids(self, order: np.ndarray, step: int) -> np.ndarray:
        """This rank's sample ids of global step ``step`` of an epoch with global ``order``."""
        step_rows = order[step * self.batch_size : (step + 1) * self.batch_size]
        start, stop = rank_rows(len(step_rows), self.size, self.rank)
        return step_rows[start:stop]

    def _read(self, epoch: int, step: int, ids: np.ndarray) -> Batch:
        return Batch(epoch, step, ids, {name: cache.take(ids) for name, cache in self._caches.items()})

    def _futures(self, epoch: int, start_step: int) -> Iterator[Future]:
        order = epoch_order(self.samples, epoch, self.seed, self.shuffle)
        ahead: deque[Future] = deque()
        steps = iter(range(start_step, self.steps))
        try:
            for step in steps:
                ahead.append(self._pool.submit(self._read, epoch, step, self.step_ids(order, step)))
                if len(ahead) > self.prefetch:
                    yield ahead.popleft()
            while ahead:
                yield ahead.popleft()
        finally:
            for future in ahead:
                future.cancel()

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """This rank's batches of ``epoch``, from ``start_step`` (to resume mid-epoch)."""
        for future in self._futures(epoch, start_step):
            yield future.result()

    async def aepoch(self, epoch: int, start_step: int = 0) -> AsyncIterator[Batch]:
        """As ``epoch``, awaiting each batch so the event loop keeps serving actors."""
        for future in self._futures(epoch, start_step):
            yield await asyncio.wrap_future(future)

    def close(self) -> None:
        """Stop the reader thread and close the files (collective when opened with ``comm``)."""
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=True, cancel_futures=True)
        for ds in self._datasets.values():
            ds.close()
        self._datasets.clear()

    def __enter__(self) -> BatchReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
