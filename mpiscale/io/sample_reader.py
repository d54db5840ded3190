"""Batches of ragged and fixed-row arrays read ahead in a background thread, within a byte budget.

``SampleReader`` serves one rank the batches ``batching.EpochBatches`` cuts.
One thread reads batches ahead of the caller; every batch it reads reserves
its bytes first, and they are released when the batch's memory is: when the
caller drops its last reference to the arrays (a finalizer on each array's
memory, so a batch kept by the caller stays counted). So the batches in
memory (in use, kept, read ahead, being read) never exceed the limit:

- ``memory``: BATCH_BYTES + PREFETCH_BYTES (a padded batch never exceeds
  BATCH_BYTES, so its packed bytes do not either);
- ``adaptive``: MEMORY_BYTES, split between batch size and read-ahead depth
  from the measured read and consume times (``Tuner``);
- ``sequential`` and ``round-robin``: PREFETCH_BYTES of read-ahead plus the
  largest batch of the epoch (a batch of a fixed count is as large as its
  samples make it: the reason to batch by bytes).

The read-ahead always has room for one batch besides the caller's, so a
caller that drops each batch for the next never waits on memory; one that
keeps batches until nothing more can be read gets an error that says so,
never a hang.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections import deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np

from ..ranks import AnyComm, as_mpi, size_and_rank
from .abandon import leave_open
from .batching import Batching, EpochBatches, MiB, SampleSizes, check_budget
from .ragged import Ragged, RaggedDataset, mapped, read_in_runs
from .read_ahead import Budget, ReaderStats, SampleBatch, Serving, Tuner
from .sharded import ShardedDataset

DEFAULT_WINDOW_BYTES = 64 << 20  # shuffle window, as the fixed-row reader's
READ_THREADS = 8  # reads of a batch in flight at once (on this VM's disk 8 random reads match one in-order reader)


def _sized(nbytes: int, samples: int) -> str:
    """``1.2 MiB for 63,000 samples``."""
    return f"{nbytes / MiB:.3g} MiB for {samples:,} samples"


class SampleReader:
    """This rank's batches of same-length arrays, ragged (``RaggedDataset``) or fixed (``ShardedDataset``).

    ``arrays`` maps names to opened data sets of equal sample counts (the
    reader closes them). The epoch order is ``epoch_order``'s (shuffled
    within windows of WINDOW samples, by default 64 MiB of the mean sample).
    ``read`` names the arrays batches hold (default: all); the others only
    size the batches (a pipeline's last stage reads labels, batched as the
    first stage's sequences).
    """

    def __init__(
        self,
        arrays: dict[str, RaggedDataset | ShardedDataset],
        batching: Batching,
        comm: AnyComm | None = None,
        shuffle: bool = False,
        seed: int = 0,
        window: int | None = None,
        read: list[str] | None = None,
    ) -> None:
        self.arrays, self.batching, self.shuffle, self.seed = arrays, batching, shuffle, seed
        self.reads = list(arrays) if read is None else read  # the arrays read (all sized the batches)
        self.size, self.rank = size_and_rank(as_mpi(comm))
        counts = {name: len(data) for name, data in arrays.items()}
        if len(set(counts.values())) != 1:
            self.close()
            raise ValueError(f"arrays differ in their number of samples {counts}; a batch needs equal counts")
        ragged = [data for data in arrays.values() if isinstance(data, RaggedDataset)]
        samples = next(iter(counts.values()))
        lengths = np.stack([data.lengths for data in ragged], axis=1) if ragged else np.zeros((samples, 0), np.int64)
        fixed = sum(d.dtype.itemsize * math.prod(d.shape[1:]) for d in arrays.values() if isinstance(d, ShardedDataset))
        self.sizes = SampleSizes(lengths, np.array([d.unit_bytes for d in ragged], dtype=np.int64), fixed)
        try:
            check_budget(self.sizes, batching, ", ".join(sorted({d.path for d in arrays.values()})))
        except ValueError:
            self.close()
            raise
        mean = max(1.0, float(self.sizes.packed.mean())) if samples else 1.0
        self.window = window if window is not None else max(1, int(DEFAULT_WINDOW_BYTES // mean))
        self.stats = ReaderStats()
        self._plan: EpochBatches | None = None
        if batching.by_bytes:  # the budget must hold the reader's index and plan too: refused now, not mid-epoch
            try:
                self.limit(self.plan(0))
            except ValueError:
                self.close()
                raise
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="mpiscale-samples-wait")
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="mpiscale-samples-read")

    @property
    def samples(self) -> int:
        return self.sizes.samples

    def plan(self, epoch: int, ranks: int | None = None) -> EpochBatches:
        """The batches of ``epoch`` for this rank (kept for the last epoch asked), or for rank 0 of ``ranks``."""
        if ranks is not None and ranks != self.size:
            return EpochBatches(self.sizes, self.batching, epoch, self.seed, self.shuffle, self.window, ranks)
        if self._plan is None or self._plan.epoch != epoch:
            self._plan = EpochBatches(self.sizes, self.batching, epoch, self.seed, self.shuffle, self.window,
                                      self.size, self.rank)  # fmt: skip
        return self._plan

    def steps(self, epoch: int) -> int:
        """Global steps of ``epoch`` (the same on every rank; 0 for adaptive batching, which has none up front)."""
        return self.plan(epoch).steps

    def limit(self, plan: EpochBatches) -> int:
        """The most bytes of batches in memory while this reader serves ``plan``: one batch and the read-ahead,
        which must hold a batch at least (refused otherwise: the caller's batch and the next must fit).

        The reader's own index and plan (``apart``: about 50-150 bytes a sample) count within the budget: the
        read-ahead (``prefetch_bytes``), or adaptive batching's ``memory_bytes``, holds them and the batches.
        The default read-ahead (two batches) holds them beside two batches."""
        batching, apart = self.batching, self.held_apart(plan)
        if batching.strategy == "adaptive":
            room, largest = batching.memory_bytes - apart, int(self.sizes.packed.max(initial=1))
            if room < 2 * largest:
                raise ValueError(
                    f"memory_bytes {batching.memory_bytes:,} leaves {room:,} bytes beside the reader's own index and "
                    f"plan ({_sized(apart, self.samples)}), less than a batch of the largest sample and one read "
                    f"ahead ({2 * largest:,}): raise it to at least {apart + 2 * largest:,} bytes "
                    f"({(apart + 2 * largest) / MiB:.4g} MiB)"
                )
            return room
        memory = batching.strategy == "memory"
        batch = batching.batch_limit_bytes(self.sizes) if memory else plan.largest()
        self._check_read_ahead(batch, "at most" if memory else "the largest of the epoch", apart)
        return batch + (batching.prefetch_bytes - apart if batching.prefetch_bytes else 2 * batch)

    def held_apart(self, plan: EpochBatches) -> int:
        """Bytes the reader holds beside its batches: every sample's sizes and the epoch's plan, twice over (numpy's
        sorts and slices copy them while a plan is made: measured, 80 bytes a sample for 63,000 samples)."""
        return 2 * (self.sizes.nbytes + plan.nbytes)

    def check_read_ahead(self, plans: list[EpochBatches]) -> None:
        """Refuse, before any batch is read, a read-ahead that cannot hold the largest batch any rank gets in the
        epochs of ``plans`` (``plan(epoch, ranks)``'s, count strategies; memory batching is checked when the
        reader opens, adaptive batching has its own budget)."""
        if self.batching.strategy in ("memory", "adaptive") or not self.batching.prefetch_bytes:
            return
        for plan in plans:
            which = f"the largest a rank gets in epoch {plan.epoch + 1}"
            self._check_read_ahead(plan.largest_of_any_rank(), which, self.held_apart(plan))

    def _check_read_ahead(self, batch: int, which: str, apart: int) -> None:
        """Refuse a read-ahead that, beside the reader's own index and plan (``apart`` bytes), cannot hold a batch."""
        prefetch = self.batching.prefetch_bytes
        if prefetch and prefetch - apart < batch:
            beside = f" beside the reader's own index and plan ({_sized(apart, self.samples)})" if apart else ""
            raise ValueError(
                f"prefetch_bytes {prefetch:,} ({prefetch / MiB:.3g} MiB) cannot hold the next batch ({batch:,} bytes, "
                f"{which}){beside}: read-ahead must hold one batch at least; raise it to {batch + apart:,} bytes "
                f"({(batch + apart) / MiB:.4g} MiB) or more"
            )

    def read(self, ids: np.ndarray) -> dict[str, Ragged | np.ndarray]:
        """Every array's rows of the ascending ``ids``, runs of consecutive ids read by several threads at once."""
        data: dict[str, Ragged | np.ndarray] = {}
        for name in self.reads:
            array = self.arrays[name]
            if isinstance(array, RaggedDataset):
                data[name] = array.read(ids, self._readers.map)
                continue
            rows = mapped((len(ids), *array.shape[1:]), array.dtype)
            read_in_runs(ids, partial(_read_rows, array), partial(_rows_of, rows), self._readers.map)
            data[name] = rows
        return data

    def _batches(self, plan: EpochBatches, start_step: int, tuner: Tuner | None) -> Iterator[tuple[int, np.ndarray]]:
        """(step, ids) in order; adaptive: cut pool by pool, the rest of a pool cut again when the tuner says so."""
        if tuner is None:
            for step in range(start_step, plan.steps):
                yield step, plan.batch(step)
            return
        step = 0
        for pool in plan.pools():
            pending = deque(plan.cut(pool, tuner.batch_bytes))
            limit = tuner.batch_bytes
            while pending:
                if tuner.batch_bytes != limit:
                    limit = tuner.batch_bytes
                    pending = deque(plan.cut(np.concatenate(list(pending)), limit))
                ids = pending.popleft()
                if step >= start_step:
                    yield step, ids
                step += 1

    def _serve(self, epoch: int, start_step: int) -> Serving:
        plan = self.plan(epoch)
        limit, tuner = self.limit(plan), None
        if self.batching.strategy == "adaptive":
            smallest = int(self.sizes.packed.max(initial=1))  # the largest sample: a batch holds one at least
            tuner = Tuner(limit, smallest)
        return Serving(self, plan, self._batches(plan, start_step, tuner), Budget(limit), tuner)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[SampleBatch]:
        """This rank's batches of ``epoch`` from ``start_step``."""
        serving = self._serve(epoch, start_step)
        try:
            while (batch := serving.next()) is not None:
                yield batch
        finally:
            serving.stop()

    async def aepoch(self, epoch: int, start_step: int = 0) -> AsyncIterator[SampleBatch]:
        """As ``epoch``, awaiting a batch not yet read so the event loop keeps serving actors."""
        serving = self._serve(epoch, start_step)
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch = serving.ready()
                if batch is None:
                    batch = await loop.run_in_executor(self._waiter, serving.next)
                if batch is None:
                    return
                yield batch
        finally:
            serving.stop()

    def close(self) -> None:
        """Close the data sets and the helper thread."""
        for pool in (getattr(self, "_waiter", None), getattr(self, "_readers", None)):
            if pool is not None:
                pool.shutdown(wait=True)
        for array in self.arrays.values():
            array.close()

    def abandon(self) -> None:
        """After an error that may be this rank's alone: as ``BatchReader.abandon``, the threads stopped without
        waiting and the files left open."""
        for pool in (getattr(self, "_waiter", None), getattr(self, "_readers", None)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        leave_open(*self.arrays.values())

    def __enter__(self) -> SampleReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_rows(array: ShardedDataset, start: int, stop: int, out: np.ndarray) -> None:
    array.read(start, stop, out=out)


def _rows_of(rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return rows[lo:hi]


def open_arrays(
    path: str | os.PathLike, names: list[str], offsets: dict[str, str], comm: AnyComm | None = None
) -> dict[str, RaggedDataset | ShardedDataset]:
    """Each of ``names`` of ``path`` opened for a ``SampleReader``: ragged where ``offsets`` names its index
    (an empty index: a variable-length data set), fixed rows otherwise (independent reads)."""
    opened: dict[str, RaggedDataset | ShardedDataset] = {}
    try:
        for name in names:
            if name in offsets:
                opened[name] = RaggedDataset(path, name, offsets[name], comm)
            else:
                opened[name] = ShardedDataset(path, name)
    except BaseException:
        for data in opened.values():
            data.close()
        raise
    return opened
