"""The partitioned memory store: records spread over the ranks by a hash of their id, one exchange per batch.

Every method is collective: every rank calls it in the same order, each with
its own part of the batch (possibly empty). A batch's records travel to their
owners in one ``alltoallv``; lookups come back in a second. Results that every
rank sees (aggregates, the top-k) are identical on every rank and, for the same
global workload, on any number of ranks: per-record updates are elementwise,
duplicate ids of a batch are combined in the order of their global position
(rank order, then position on the rank), sums are exact, and rankings break
ties by id.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ..kernels.memstore import combine_sorted, decay, default_parts, exact_total, iteration_pass, owners
from ..runtime import ActorSystem
from .partition import BASE_COLUMNS, Partition

INT64_LIMIT = 2**63 - 1
Checked = TypeVar("Checked")


@dataclass(frozen=True)
class Aggregate:
    """The global quality aggregate after an iteration (the same on every rank)."""

    count: int
    total: float
    mean: float
    maximum: float
    histogram: np.ndarray  # counts per bin of [low, high); values outside fall in the end bins
    edges: np.ndarray
    top_ids: np.ndarray  # the top-k ids by quality (descending), ties by smaller id
    top_quality: np.ndarray


class MemoryStore:
    """Records with float32 columns (strength, quality, touched, and ``extra``), partitioned over ``system``'s ranks."""

    def __init__(
        self,
        system: ActorSystem,
        extra: tuple[str, ...] = (),
        histogram_bins: int = 32,
        quality_range: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        clash = sorted(set(extra) & set(BASE_COLUMNS))
        if clash:
            raise ValueError(f"extra columns {clash} clash with the built-in columns {', '.join(BASE_COLUMNS)}")
        if histogram_bins < 1 or not quality_range[0] < quality_range[1]:
            raise ValueError(f"need bins >= 1 and low < high, got {histogram_bins} bins over {quality_range}")
        self.system = system
        self.partition = Partition(tuple(extra))
        self.bins, self.quality_range = histogram_bins, quality_range
        #: Seconds spent in the last calls, by phase (kernel work and exchanges), and bytes this rank sent so far.
        self.timings: dict[str, float] = {}
        self.bytes_sent = 0
        # The last aggregate and its k, valid until qualities change: only upsert and delete change them, and
        # both are collective, so every rank drops it at the same call.
        self._aggregate: tuple[int, Aggregate] | None = None

    @property
    def columns(self) -> tuple[str, ...]:
        return self.partition.names

    async def _route(self, ids: np.ndarray, *payloads: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Send each id (with its payload rows) to its owner.

        Returns (how many arrived from each rank; the arrays received, in source-rank order).
        """
        destination = owners(ids, self.system.size)
        order = np.argsort(destination, kind="stable")  # keeps each rank's batch order within a destination
        counts = np.bincount(destination, minlength=self.system.size)
        return await self._exchange(counts, *(array[order] for array in (ids, *payloads)))

    async def _exchange(self, counts: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Send ``counts[r]`` rows of every array to rank ``r`` (rows grouped by destination), in one ``alltoallv``.

        The arrays travel packed side by side, a record per row of bytes. Returns (rows that arrived from each
        rank; the arrays received, in source-rank order).
        """
        rows = len(arrays[0])
        flat = [np.ascontiguousarray(a).reshape(rows, int(np.prod(a.shape[1:]))) for a in arrays]
        widths = [a.shape[1] * a.dtype.itemsize for a in flat]
        packed = np.empty((rows, sum(widths)), np.uint8)
        offset = 0
        for array, width in zip(flat, widths):
            packed[:, offset : offset + width] = array.view(np.uint8).reshape(rows, width)
            offset += width
        received, sources = await self.system.world.alltoallv(packed, counts)
        self.bytes_sent += (rows - counts[self.system.rank]) * packed.shape[1]
        arrived, offset = [], 0
        for original, width in zip(arrays, widths):
            column = np.ascontiguousarray(received[:, offset : offset + width]).view(original.dtype)
            arrived.append(column if original.ndim > 1 else column[:, 0])
            offset += width
        return sources, arrived

    async def _checked(self, check: Callable[[], Checked]) -> Checked:
        """``check()`` on every rank; if it raised ValueError or TypeError on any, raise on every rank."""
        problem, result = None, None
        try:
            result = check()
        except (ValueError, TypeError) as error:
            problem = f"rank {self.system.rank}: {error}"
        await self._agree(problem)
        return result  # type: ignore[return-value]  # None only where _agree raised

    async def _agree(self, problem: str | None) -> None:
        """Raise ``problem`` (the lowest rank's) on every rank if any rank has one: before any state changes."""
        world = self.system.world
        flag = np.array([world.rank if problem else world.size], np.int64)
        await world.allreduce(flag, op="min", out=flag)
        if flag[0] < world.size:
            message = await world.bcast(problem, root=int(flag[0]))
            raise ValueError(f"memory store: {message}")

    async def _positions(self, count: int) -> np.ndarray:
        """Global positions of this rank's ``count`` batch entries (rank order, then order on the rank)."""
        counts = await self.system.world.allgather(np.array([count], np.int64))
        start = int(counts[: self.system.rank, 0].sum())
        return np.arange(start, start + count, dtype=np.int64)

    async def upsert(self, ids: np.ndarray, values: dict[str, np.ndarray]) -> int:
        """Insert or overwrite records (collective); of equal ids in a batch, the last by position wins.

        ``values`` holds every column of ``columns`` except ``touched`` (0 when
        new); returns the records added over all ranks.
        """
        given = [name for name in self.columns if name != "touched"]

        def check() -> tuple[np.ndarray, np.ndarray]:
            checked = _checked_ids(ids)
            missing = [name for name in given if name not in values]
            if missing:
                raise ValueError(f"upsert needs the columns {missing}")
            columns = [_finite(values[name], name, len(checked)) for name in given]
            return checked, np.column_stack(columns).astype(np.float32).reshape(len(checked), len(given))

        ids, table = await self._checked(check)
        positions = await self._positions(len(ids))
        _, (got_ids, got_positions, got_rows) = await self._route(ids, positions, table)
        order = np.lexsort((-got_positions, got_ids))  # per id, the last position first
        first = np.ones(len(order), bool)
        first[1:] = got_ids[order][1:] != got_ids[order][:-1]
        keep = order[first]
        rows = self.partition.rows_of(got_ids[keep])
        touched = np.zeros(len(rows), np.float32)  # new records: 0; stored ones keep theirs
        touched[rows >= 0] = self.partition.column("touched")[rows[rows >= 0]]
        named = {name: got_rows[keep, j] for j, name in enumerate(given)}
        added = self.partition.upsert(got_ids[keep], named | {"touched": touched})
        self._aggregate = None
        total = await self.system.world.allreduce(np.array([added], np.int64))
        return int(total[0])

    async def delete(self, ids: np.ndarray) -> int:
        """Remove records (collective); returns how many were removed over all ranks."""
        ids = await self._checked(lambda: _checked_ids(ids))
        _, (got_ids,) = await self._route(ids)
        removed = self.partition.delete(got_ids)
        self._aggregate = None
        total = await self.system.world.allreduce(np.array([removed], np.int64))
        return int(total[0])

    async def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, values: one row per id of every column) for this rank's ``ids`` (collective)."""
        ids = await self._checked(lambda: _checked_ids(ids))
        positions = np.arange(len(ids), dtype=np.int64)
        sources, (got_ids, got_positions) = await self._route(ids, positions)
        found, table = self.partition.read(got_ids)
        # back to the askers: the arrivals are grouped by source rank already
        _, (back_positions, back_found, back_table) = await self._exchange(sources, got_positions, found, table)
        values = np.empty_like(back_table)
        values[back_positions] = back_table
        present = np.empty(len(ids), bool)
        present[back_positions] = back_found
        return present, values

    async def reinforce(self, ids: np.ndarray, deltas: np.ndarray, iteration: int) -> None:
        """Add ``deltas`` to the records' strength (clamped to [0, 1]) and mark them touched (collective).

        Equal ids in a batch are combined by adding their deltas in the order
        of their global position. An id that is not stored, or a delta that is
        not finite, is an error on every rank, before anything changes.
        """
        began = time.perf_counter()

        def check() -> tuple[np.ndarray, np.ndarray]:
            checked = _checked_ids(ids)
            return checked, _finite(deltas, "deltas", len(checked))

        ids, deltas = await self._checked(check)
        positions = await self._positions(len(ids))
        _, (got_ids, got_positions, got_deltas) = await self._route(ids, positions, deltas)
        order = np.lexsort((got_positions, got_ids))
        unique, sums = combine_sorted(got_ids[order], got_deltas[order])
        rows = self.partition.rows_of(unique)
        unknown = unique[rows < 0]
        problem = f"reinforce: {len(unknown)} ids are not stored (for example {unknown[0]})" if len(unknown) else None
        await self._agree(problem)
        applying = time.perf_counter()
        self.partition.reinforce(rows, sums, iteration)
        self.timings |= {"reinforce_exchange_s": applying - began, "reinforce_apply_s": time.perf_counter() - applying}

    def decay(self, rate: float) -> None:
        """Decay every strength of this rank by ``rate`` (no exchange; ``iterate`` does it with the aggregates)."""
        decay(self.partition.column("strength"), np.float32(rate))

    async def iterate(self, rate: float, k: int = 100) -> Aggregate:
        """Decay every strength by ``rate`` and compute the global quality aggregate and top-k (collective).

        Decay changes no quality, so while no upsert or delete has run since the
        last call with the same ``k``, its aggregate is still exact: then only
        the decay runs, and nothing is exchanged.
        """
        began = time.perf_counter()
        if self._aggregate is not None and self._aggregate[0] == k:
            self.decay(rate)
            self.timings |= {"pass_s": time.perf_counter() - began, "aggregate_exchange_s": 0.0}
            return self._aggregate[1]
        low, high = self.quality_range
        part = self.partition
        parts = default_parts()
        count, maximum, histogram, exponents, heap_q, heap_id, kept = iteration_pass(
            part.column("strength"), part.column("quality"), part.ids, np.float32(rate), low, high, self.bins, k, parts
        )
        passed = time.perf_counter()
        sums = np.concatenate([[count], histogram.sum(axis=0), exponents.sum(axis=0)]).astype(np.int64)
        await self.system.world.allreduce(sums, out=sums)
        top = np.array([float(maximum.max(initial=-np.inf))])
        await self.system.world.allreduce(top, op="max", out=top)
        candidates_q = np.concatenate([heap_q[p, : kept[p]] for p in range(parts)])
        candidates_id = np.concatenate([heap_id[p, : kept[p]] for p in range(parts)])
        best_q, best_id = best_by_quality(candidates_q, candidates_id, k)
        every_q, every_id = await self._gather_candidates(best_q, best_id, k)
        top_q, top_id = best_by_quality(every_q, every_id, k)
        self.timings |= {"pass_s": passed - began, "aggregate_exchange_s": time.perf_counter() - passed}
        self.bytes_sent += (sums.nbytes + top.nbytes + k * 12) * (self.system.size > 1)
        total_count = int(sums[0])
        total = exact_total(sums[1 + self.bins :])
        aggregate = Aggregate(
            count=total_count,
            total=total,
            mean=total / total_count if total_count else float("nan"),
            maximum=float(top[0]) if total_count else float("nan"),
            histogram=sums[1 : 1 + self.bins],
            edges=np.linspace(low, high, self.bins + 1),
            top_ids=top_id,
            top_quality=top_q,
        )
        self._aggregate = (k, aggregate)
        return aggregate

    async def _gather_candidates(self, quality: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's best k (padded), stacked."""
        padded_q = np.full(k, -np.inf, np.float32)
        padded_id = np.full(k, INT64_LIMIT, np.int64)
        padded_q[: len(quality)], padded_id[: len(ids)] = quality, ids
        every_q = (await self.system.world.allgather(padded_q)).reshape(-1)
        every_id = (await self.system.world.allgather(padded_id)).reshape(-1)
        real = every_id != INT64_LIMIT
        return every_q[real], every_id[real]


def best_by_quality(quality: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (qualities, ids) by quality descending, then id ascending."""
    order = np.lexsort((ids, -quality.astype(np.float64)))[:k]
    return quality[order], ids[order]


def _checked_ids(ids: np.ndarray) -> np.ndarray:
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"ids must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"ids must be integers, got {array.dtype}")
    if array.size and array.dtype.kind == "u" and int(array.max()) > INT64_LIMIT:
        raise ValueError(f"ids must fit in int64: {int(array.max())} does not")
    return np.ascontiguousarray(array, dtype=np.int64)


def _finite(values: np.ndarray, name: str, count: int) -> np.ndarray:
    array = np.asarray(values, dtype=np.float32).reshape(-1)
    if len(array) != count:
        raise ValueError(f"{name}: {len(array)} values for {count} ids")
    bad = np.flatnonzero(~np.isfinite(array))
    if len(bad):
        raise ValueError(f"{name}: value {bad[0]} is {array[bad[0]]}; values must be finite")
    return array
