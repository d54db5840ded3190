"""An epoch served from a thread that reads batches ahead within a byte budget, and the adaptive choice of how
many batches it reads ahead (``SampleReader``'s machinery: :mod:`.sample_reader` says what it guarantees)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .batching import EpochBatches, SampleSizes
from .ragged import Ragged

TUNE_EVERY = 4  # batches between the adaptive tuner's decisions
MAX_DEPTH = 6  # batches the adaptive tuner reads ahead at most
STUCK_S = 1.0  # seconds the caller waits before it checks whether the reader waits for memory it keeps


@dataclass
class SampleBatch:
    """One rank's batch: ascending sample ids and each array's rows (``Ragged`` for ragged arrays)."""

    epoch: int
    step: int
    ids: np.ndarray
    data: dict[str, Ragged | np.ndarray]
    nbytes: int


@dataclass
class ReaderStats:
    """What a reader did: counts, bytes, and where the time went (seconds)."""

    batches: int = 0
    samples: int = 0
    packed_bytes: int = 0
    padded_bytes: int = 0
    stall_s: float = 0.0  # the caller waiting for a batch
    read_s: float = 0.0  # the reader thread reading
    consume_s: float = 0.0  # the caller holding a batch
    peak_held: int = 0  # most bytes held at once
    batch_bytes: list[int] = field(default_factory=list)  # the adaptive tuner's choices, in order

    @property
    def padding_share(self) -> float:
        return 1.0 - self.packed_bytes / self.padded_bytes if self.padded_bytes else 0.0


class Budget:
    """Bytes held, with a limit that a reservation waits for (unless nothing is held)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held, self.peak = limit, 0, 0
        self._changed = threading.Condition()
        self.stopped = False
        self.waiting = False  # a reservation waits for memory

    def reserve(self, nbytes: int) -> bool:
        with self._changed:
            while self.held and self.held + nbytes > self.limit and not self.stopped:
                self.waiting = True
                self._changed.wait()
            self.waiting = False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return not self.stopped

    def hold_until_freed(self, arrays: list[np.ndarray], reserved: int) -> None:
        """Release each array's bytes when its memory is freed, and at once what ``reserved`` held beyond them."""
        counted = 0
        for array in arrays:
            owner: object = array
            while isinstance(owner, np.ndarray) and owner.base is not None:
                owner = owner.base  # a view's memory: a mapping, or the array that owns it
            weakref.finalize(owner, self.release, array.nbytes)
            counted += array.nbytes
        self.release(reserved - counted)

    def release(self, nbytes: int) -> None:
        with self._changed:
            self.held -= nbytes
            self._changed.notify_all()

    def stop(self) -> None:
        with self._changed:
            self.stopped = True
            self._changed.notify_all()


class Tuner:
    """Adaptive batching's choice of batch bytes: MEMORY_BYTES / (1 + DEPTH), DEPTH batches read ahead.

    It starts as ``memory`` batching's default (two batches ahead) and moves
    only on a clear signal, every few batches, from the seconds the caller
    stalled, consumed and the reader read: when the caller stalled more than
    5% of the time although reading was faster than consuming (uneven reads
    the read-ahead could not absorb), one batch more is read ahead, in
    smaller batches; after three rounds without stalls (below 1%), one batch
    fewer, in larger batches (fewer per-batch costs). When the disk is the
    limit (reading slower than consuming) nothing changes: depth would not
    help and smaller batches would only add per-batch costs.
    """

    def __init__(self, limit: int, smallest: int) -> None:
        self.limit, self.smallest, self.depth, self.calm = limit, smallest, 2, 0

    @property
    def batch_bytes(self) -> int:
        return max(self.smallest, self.limit // (1 + self.depth))

    def decide(self, stall: float, consume: float, read: float) -> bool:
        """Update from the seconds of the last batches; True when the batch size changes."""
        before = self.batch_bytes
        share = stall / max(stall + consume, 1e-12)
        self.calm = self.calm + 1 if share < 0.01 else 0
        if share > 0.05 and read < consume:
            self.depth = min(self.depth + 1, MAX_DEPTH)
        elif self.calm >= 3 and self.depth > 1:
            self.depth, self.calm = self.depth - 1, 0
        return self.batch_bytes != before


class _Source(Protocol):
    """What an epoch's reader thread needs of the reader: the samples' sizes, reading a batch, its stats."""

    sizes: SampleSizes
    stats: ReaderStats

    def read(self, ids: np.ndarray) -> dict[str, Ragged | np.ndarray]: ...


_END = object()


class Serving:
    """One epoch being served: the reader thread, the batches it read ahead, and the caller's side."""

    def __init__(self, reader: _Source, plan: EpochBatches, batches, budget: Budget, tuner: Tuner | None) -> None:
        self.reader, self.plan, self.budget, self.tuner = reader, plan, budget, tuner
        self.stats = reader.stats
        self._queue: deque = deque()
        self._ready = threading.Condition()
        self._handed: float | None = None  # when the caller got its batch
        self._recent = np.zeros(3)  # stall, consume, read seconds since the tuner last decided
        self._count = 0
        self._thread = threading.Thread(target=self._read_ahead, args=(batches,), name="mpiscale-samples", daemon=True)
        self._thread.start()

    def _read_ahead(self, batches) -> None:
        try:
            for step, ids in batches:
                nbytes = int(self.reader.sizes.packed[ids].sum()) if len(ids) else 0
                if not self.budget.reserve(nbytes):
                    self.budget.release(nbytes)
                    break
                began = time.perf_counter()
                try:
                    data = self.reader.read(ids)
                except BaseException:
                    self.budget.release(nbytes)
                    raise
                self.budget.hold_until_freed([a.values if isinstance(a, Ragged) else a for a in data.values()], nbytes)
                spent = time.perf_counter() - began
                padded = self.reader.sizes.padded(ids)
                self._put(SampleBatch(self.plan.epoch, step, ids, data, nbytes), spent, padded)
        except BaseException as error:  # handed to the caller, raised there
            self._put(error, 0.0, 0)
        finally:  # also when stopped: a caller still waiting for a batch gets the end
            self._put(_END, 0.0, 0)

    def _put(self, item, spent: float, padded: int) -> None:
        with self._ready:
            self.stats.read_s += spent
            self.stats.padded_bytes += padded
            self._recent[2] += spent
            self._queue.append(item)
            self._ready.notify_all()

    def _consumed(self) -> None:
        """The caller asks for the next batch: the time it spent on its last one."""
        if self._handed is not None:
            consumed = time.perf_counter() - self._handed
            self.stats.consume_s += consumed
            self._recent[1] += consumed
            self._handed = None

    def _take(self) -> SampleBatch | None:
        item = self._queue.popleft()
        if item is _END:
            self._queue.appendleft(item)
            return None
        if isinstance(item, BaseException):
            raise item
        self._handed = time.perf_counter()
        stats = self.stats
        stats.batches += 1
        stats.samples += len(item.ids)
        stats.packed_bytes += item.nbytes
        stats.peak_held = max(stats.peak_held, self.budget.peak)
        self._tune()
        return item

    def _tune(self) -> None:
        self._count += 1
        if self.tuner is None or self._count % TUNE_EVERY:
            return
        stall, consume, read = self._recent
        with self._ready:
            self._recent[:] = 0
        if self.tuner.decide(stall, consume, read):
            self.stats.batch_bytes.append(self.tuner.batch_bytes)

    def ready(self) -> SampleBatch | None:
        """The next batch if it is read already, else None."""
        with self._ready:
            if not self._queue:
                return None
        self._consumed()
        with self._ready:
            return self._take() if self._queue[0] is not _END else None

    def next(self) -> SampleBatch | None:
        """The next batch, waiting for it; None at the end of the epoch. Refused when the reader waits for memory
        that only batches the caller keeps hold."""
        self._consumed()
        waited = time.perf_counter()
        with self._ready:
            blocked = 0
            while not self._queue:
                self._ready.wait(STUCK_S)
                blocked = blocked + 1 if not self._queue and self.budget.waiting else 0
                if blocked == 1:
                    gc.collect()  # batches in reference cycles the caller has dropped
                elif blocked > 1:
                    raise MemoryError(
                        f"the reader needs memory for the next batch, but its {self.budget.limit:,} bytes are held by "
                        f"batches the caller keeps ({self.budget.held:,} bytes): copy what you keep of a batch, or "
                        "raise the budget"
                    )
            stalled = time.perf_counter() - waited
            self.stats.stall_s += stalled
            self._recent[0] += stalled
            return self._take()

    def stop(self) -> None:
        """End the epoch early or late: stop the thread; the batches it read are released as they are freed."""
        self._consumed()
        self.budget.stop()
        self._thread.join()
        with self._ready:
            self._queue.clear()
            self._queue.append(_END)
