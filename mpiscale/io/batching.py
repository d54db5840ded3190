"""How an epoch's samples are cut into batches, and how much memory a reader may hold: pure functions of the data.

Four strategies, all over the same epoch order (``epoch_order``: a function of
seed and epoch only, the same at every world size):

- ``sequential``: global batches of BATCH_SIZE samples; each rank takes its
  block of a batch (as ``np.array_split``).
- ``round-robin``: the same global batches, their samples dealt across the
  ranks one by one (rank r takes samples r, r+P, ...), which evens out the
  ranks' bytes when sizes drift along the order.
- ``memory``: each batch is bounded by BATCH_BYTES of *padded* size (samples
  x the longest sample, as a padded tensor takes), so no batch is ever larger
  than the budget. Samples are grouped by size within pools of the order
  (POOL samples: sorted by size, cut greedily, the batches then shuffled), as
  token-budget batching does, which cuts the padding. A step is one batch per
  rank; the batches are the same at every world size, only how many make a
  step changes with it.
- ``adaptive``: as ``memory``, but the batch size and the read-ahead are
  chosen within one budget (MEMORY_BYTES) from the measured read and consume
  times; the pools are dealt to the ranks, each cutting its own. The samples
  of an epoch stay the same, the cut of batches depends on timings.

A batch's sample ids are ascending (reads then run over consecutive samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..ranks import block_rows, rank_rows
from .reader import epoch_order
from .sample_random import SampleRandom

STRATEGIES = ("sequential", "round-robin", "memory", "adaptive")
BATCH_STREAM = 253  # SampleRandom stream reserved for the order of the batches of a pool
POOL = 8192  # samples grouped by size at once, at least
BATCHES_PER_POOL = 64
MiB = 1 << 20
ARRAY_HEADER_BYTES = 112  # a small numpy array's own object beside its data (sys.getsizeof of a view)


@dataclass(frozen=True)
class Batching:
    """A batching strategy and its sizes (see the module docstring); checked when made."""

    strategy: str = "sequential"
    batch_size: int = 64  # sequential, round-robin: samples per global batch
    batch_bytes: int = 32 * MiB  # memory: padded bytes per batch
    batch_tokens: int = 0  # memory: padded length units per batch instead (samples x the longest), if not 0
    prefetch_bytes: int = 0  # bytes of batches read ahead (0: two batches' worth)
    memory_bytes: int = 256 * MiB  # adaptive: all the reader holds
    pool: int = POOL
    drop_last: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"batching must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        for name in ("batch_size", "batch_bytes", "memory_bytes", "pool"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        problems += [f"{name} must be 0 or more, got {getattr(self, name)}"
                     for name in ("batch_tokens", "prefetch_bytes") if getattr(self, name) < 0]  # fmt: skip
        if problems:
            raise ValueError("batching: " + "; ".join(problems))

    @property
    def by_bytes(self) -> bool:
        """Batches bounded by bytes (memory, adaptive), not by a count."""
        return self.strategy in ("memory", "adaptive")

    def bound(self, sizes: SampleSizes) -> tuple[SampleSizes, int, str]:
        """(what a batch's cost counts, its limit, the setting's name) of byte-bounded batching: bytes, or tokens
        with BATCH_TOKENS; adaptive batching's initial limit is half its budget."""
        if self.strategy == "adaptive":
            return sizes, self.memory_bytes // 2, "memory_bytes / 2"
        if self.batch_tokens:
            return sizes.in_tokens(), self.batch_tokens, "batch_tokens"
        return sizes, self.batch_bytes, "batch_bytes"

    def batch_limit_bytes(self, sizes: SampleSizes) -> int:
        """The most bytes one memory batch reads (its padded bytes bound them)."""
        if self.batch_tokens:
            return self.batch_tokens * (int(sizes.units.sum()) + sizes.fixed)
        return self.batch_bytes


@dataclass(frozen=True)
class SampleSizes:
    """What each sample takes: its length in every ragged array, and the bytes of one unit of each array."""

    lengths: np.ndarray  # (samples, ragged arrays) int64
    units: np.ndarray  # (ragged arrays,) bytes per unit of length
    fixed: int  # bytes per sample of the fixed-row arrays

    @property
    def samples(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes this index holds: the lengths and each sample's bytes."""
        return self.lengths.nbytes + self.units.nbytes + self.packed.nbytes

    @cached_property
    def packed(self) -> np.ndarray:
        """Each sample's bytes as read."""
        return self.lengths @ self.units + self.fixed

    def in_tokens(self) -> SampleSizes:
        """The same samples counted in length units (tokens) instead of bytes."""
        return SampleSizes(self.lengths, np.ones(len(self.units), dtype=np.int64), 0)

    def padded(self, ids: np.ndarray) -> int:
        """Bytes of the batch ``ids`` padded to its longest sample in every array."""
        if not len(ids):
            return 0
        return int(len(ids) * (self.lengths[ids].max(axis=0) @ self.units + self.fixed))


def pool_batches(sizes: SampleSizes, pool: np.ndarray, limit: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The samples of ``pool`` grouped by size into batches of at most ``limit`` padded bytes, in a shuffled order."""
    key = sizes.packed[pool]
    if len(sizes.units) <= 1:  # sorted by size, each sample is its batch's longest so far: a cut of the sizes alone
        batches = [np.sort(pool[cut]) for cut in length_batches(key, limit)]
    else:
        grouped = pool[np.argsort(key, kind="stable")]  # ties keep the shuffled order
        batches, start = [], 0
        longest = np.zeros(len(sizes.units), dtype=np.int64)
        for at, sample in enumerate(grouped.tolist()):
            wider = np.maximum(longest, sizes.lengths[sample])
            if at > start and (at - start + 1) * (wider @ sizes.units + sizes.fixed) > limit:
                batches.append(np.sort(grouped[start:at]))
                start, wider = at, sizes.lengths[sample]
            longest = wider
        if start < len(grouped):
            batches.append(np.sort(grouped[start:]))
    firsts = np.array([batch[0] for batch in batches], dtype=np.int64)
    shuffled = np.argsort(SampleRandom(seed).uniform(epoch, firsts, 1, stream=BATCH_STREAM)[:, 0], kind="stable")
    return [batches[i] for i in shuffled]


def length_batches(lengths: np.ndarray, tokens: int) -> list[np.ndarray]:
    """Positions of ``lengths`` grouped by length into batches of at most ``tokens`` padded tokens (the count times
    the longest; a longer sample is a batch alone), each batch's positions ascending, the shortest batches first."""
    order = np.argsort(lengths, kind="stable")
    batches, first = [], 0
    for at, longest in enumerate(np.asarray(lengths)[order].tolist()):  # ascending: each is its batch's longest
        if at > first and (at - first + 1) * longest > tokens:
            batches.append(np.sort(order[first:at]))
            first = at
    if first < len(order):
        batches.append(np.sort(order[first:]))
    return batches


def pool_samples(sizes: SampleSizes, batching: Batching) -> int:
    """Samples grouped by size at once: POOL, or more where batches are large, so a pool makes at least
    BATCHES_PER_POOL batches (a pool of few batches pads each over a wide range of sizes)."""
    if not batching.by_bytes or not sizes.samples:
        return batching.pool
    cost, limit, _ = batching.bound(sizes)
    per_batch = limit / max(1.0, float(cost.packed.mean()))
    return max(batching.pool, int(BATCHES_PER_POOL * per_batch))


def check_budget(sizes: SampleSizes, batching: Batching, what: str) -> None:
    """Refuse a byte or token budget that cannot hold the largest sample (as a batch of one)."""
    if not batching.by_bytes or not sizes.samples:
        return
    cost, limit, name = batching.bound(sizes)
    single = cost.packed  # a batch of one pads nothing
    largest = int(np.argmax(single))
    if single[largest] > limit:
        need = int(single[largest]) * (2 if batching.strategy == "adaptive" else 1)
        unit = "tokens" if name == "batch_tokens" else "bytes"
        raise ValueError(
            f"{what}: sample {largest} takes {int(single[largest]):,} {unit}, more than {name} ({limit:,}): a batch "
            f"must hold at least one sample; raise {name.split()[0]} to at least {need:,}"
        )


class EpochBatches:
    """The batches of one epoch for one rank of ``size``: a pure function of the data, seed, epoch and batching.

    ``steps`` is the number of global steps (the same on every rank);
    ``batch(step)`` is this rank's sample ids of that step (ascending; empty
    when a step has fewer batches than ranks). Adaptive batching cuts its
    pools as it goes (``pools`` and ``cut``), so it has no steps up front.
    """

    def __init__(
        self, sizes: SampleSizes, batching: Batching, epoch: int, seed: int, shuffle: bool, window: int | None,
        size: int = 1, rank: int = 0,
    ) -> None:  # fmt: skip
        self.sizes, self.batching, self.epoch, self.seed = sizes, batching, epoch, seed
        self.size, self.rank = size, rank
        self.order = epoch_order(sizes.samples, epoch, seed, shuffle, window)
        strategy = batching.strategy
        self._batches: list[np.ndarray] = []
        self.pool = pool_samples(sizes, batching)
        if strategy == "memory":
            cost, limit, _ = batching.bound(sizes)
            for start in range(0, len(self.order), self.pool):
                pool = self.order[start : start + self.pool]
                self._batches += pool_batches(cost, pool, limit, seed, epoch)
            whole, rest = divmod(len(self._batches), size)
            self.steps = whole + (1 if rest and not batching.drop_last else 0)
        elif strategy == "adaptive":
            self.steps = 0
        else:
            whole, rest = divmod(sizes.samples, batching.batch_size)
            self.steps = whole + (1 if rest and not batching.drop_last else 0)

    def batch(self, step: int) -> np.ndarray:
        """This rank's ids of global step ``step``."""
        strategy = self.batching.strategy
        if strategy == "memory":
            index = step * self.size + self.rank
            return self._batches[index] if index < len(self._batches) else np.empty(0, dtype=np.int64)
        count = self.batching.batch_size
        rows = self.order[step * count : (step + 1) * count]
        if strategy == "round-robin":
            return np.sort(rows[self.rank :: self.size])
        start, stop = rank_rows(len(rows), self.size, self.rank)
        return np.sort(rows[start:stop])

    def step_samples(self, step: int) -> int:
        """Samples of global step ``step`` over all ranks (the divisor of a step's mean loss)."""
        if self.batching.strategy == "memory":
            return sum(len(b) for b in self._batches[step * self.size : (step + 1) * self.size])
        count = self.batching.batch_size
        return len(self.order[step * count : (step + 1) * count])

    def smallest(self) -> int:
        """The fewest samples any rank's batch of a step holds."""
        if self.batching.strategy == "memory":
            return min((len(batch) for batch in self._batches[: self.steps * self.size]), default=0)
        return self.batching.batch_size // self.size if self.steps else 0

    def pools(self) -> list[np.ndarray]:
        """Adaptive batching: this rank's pools of the order (dealt round-robin)."""
        pool = self.pool
        return [self.order[s : s + pool] for s in range(self.rank * pool, len(self.order), self.size * pool)]

    def cut(self, pool: np.ndarray, limit: int) -> list[np.ndarray]:
        """Adaptive batching: one pool cut into batches of at most ``limit`` padded bytes."""
        return pool_batches(self.sizes, pool, limit, self.seed, self.epoch)

    def largest(self) -> int:
        """Packed bytes of this rank's largest batch (count strategies: what read-ahead must hold at least)."""
        packed = self.sizes.packed
        return max((int(packed[self.batch(step)].sum()) for step in range(self.steps)), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes this plan holds: the epoch's order and its batches (each an array, with numpy's own header)."""
        return self.order.nbytes + sum(batch.nbytes + ARRAY_HEADER_BYTES for batch in self._batches)

    def largest_of_any_rank(self) -> int:
        """Packed bytes of the largest batch any rank gets this epoch (count strategies), in one pass over the
        order: the full global batches as rows, each rank's share of a row summed at once."""
        count, size = self.batching.batch_size, self.size
        ordered = self.sizes.packed[self.order]
        whole = min(self.steps, len(ordered) // count)
        sums = np.zeros((whole, 1), np.int64)
        if whole:
            full = ordered[: whole * count].reshape(whole, count)
            if self.batching.strategy == "round-robin":
                sums = np.stack([full[:, rank::size].sum(axis=1) for rank in range(size)], axis=1)
            else:
                edges = np.concatenate([[0], np.cumsum(block_rows(count, size))])
                running = np.concatenate([np.zeros((whole, 1), np.int64), np.cumsum(full, axis=1)], axis=1)
                sums = running[:, edges[1:]] - running[:, edges[:-1]]
        last = 0
        if self.steps > whole:  # a partial last batch (kept when drop_last is off)
            rows = ordered[whole * count :]
            if self.batching.strategy == "round-robin":
                last = max(int(rows[rank::size].sum()) for rank in range(size))
            else:
                last = max(int(rows[lo:hi].sum()) for lo, hi in (rank_rows(len(rows), size, r) for r in range(size)))
        return max(int(sums.max(initial=0)), last)
