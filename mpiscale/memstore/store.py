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

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from ..io import CheckpointError
from ..jobs import choose_numba_device
from ..kernels.memstore import exact_total, group_by_owner, owners
from ..runtime import ActorSystem
from .durability import Durability, DurableLog, Replica
from .inputs import INT64_LIMIT, checked_ids, finite, per_rank, record_table
from .journal import Op
from .partition import BASE_COLUMNS, DEVICE_THRESHOLD, TOUCHED_TYPE, Partition
from .recovery import Recovered

Checked = TypeVar("Checked")


_EXACT_ITERATIONS = 2**53  # the largest iteration a float64 (lookups, the journal) holds with its neighbours


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
    """Records with float32 columns (strength, quality, touched, and ``extra``), partitioned over ``system``'s ranks.

    With ``durable``, every change is logged, and ``commit`` makes the changes
    since the last one durable on two nodes before it returns; ``checkpoint``
    bounds the logs, and ``recover`` (called first) rebuilds the store after a
    failure, on any number of ranks.
    """

    def __init__(
        self,
        system: ActorSystem,
        extra: tuple[str, ...] = (),
        histogram_bins: int = 32,
        quality_range: tuple[float, float] = (0.0, 1.0),
        durable: Durability | None = None,
        device: str = "cpu",
        device_threshold: int = DEVICE_THRESHOLD,
    ) -> None:
        clash = sorted(set(extra) & set(BASE_COLUMNS))
        if clash:
            raise ValueError(f"extra columns {clash} clash with the built-in columns {', '.join(BASE_COLUMNS)}")
        if histogram_bins < 1 or not quality_range[0] < quality_range[1]:
            raise ValueError(f"need bins >= 1 and low < high, got {histogram_bins} bins over {quality_range}")
        self.system = system
        #: ``cuda`` when partitions of at least ``device_threshold`` records iterate on the GPU (``auto``: if any).
        # one rank per GPU, by the GPUs' identity (mpiscale.gpus); agreed by every rank
        self.device = choose_numba_device(device, system.world.comm).split(":")[0]
        self.partition = Partition(tuple(extra), self.device, device_threshold)
        self.bins, self.quality_range = histogram_bins, quality_range
        #: Seconds spent in the last calls, by phase (kernel work and exchanges), and bytes this rank sent so far.
        self.timings: dict[str, float] = {}
        self.bytes_sent = 0
        # The last aggregate and its k, valid until qualities change: only upsert and delete change them, and
        # both are collective, so every rank drops it at the same call.
        self._aggregate: tuple[int, Aggregate] | None = None
        #: The logs, commits and checkpoints of a durable store (None: the store keeps nothing on disk).
        self.durable: DurableLog | None = None
        if durable is not None:
            self.durable = DurableLog(
                system, durable, Replica(self.columns, self._replay, self._snapshot, self._records)
            )

    @property
    def columns(self) -> tuple[str, ...]:
        return self.partition.names

    async def _route(self, ids: np.ndarray, *payloads: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Send each id (with its payload rows) to its owner.

        Returns (how many arrived from each rank; the arrays received, in source-rank order).
        """
        if self.system.size == 1:  # a world of one: every record is here already, nothing to sort
            return await self._exchange(np.array([len(ids)], np.int64), ids, *payloads)
        # the order keeps each rank's batch order within a destination
        order, counts = group_by_owner(owners(ids, self.system.size), self.system.size)
        return await self._exchange(counts, *(array[order] for array in (ids, *payloads)))

    async def _exchange(self, counts: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Send ``counts[r]`` rows of every array to rank ``r`` (rows grouped by destination), in one ``alltoallv``.

        The arrays travel packed side by side, a record per row of bytes. Returns (rows that arrived from each
        rank; the arrays received, in source-rank order).
        """
        if self.system.size == 1:
            return counts, list(arrays)
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
            problem = str(error)
        await self._agree(problem)
        return result  # type: ignore[return-value]  # None only where _agree raised

    async def _agree(self, problem: str | None, kind: type[Exception] = ValueError) -> None:
        """Raise on every rank, naming the ranks and their problems, if any rank has one: before any state changes."""
        await self.system.world.agree(problem, "memory store", kind)

    async def upsert(self, ids: np.ndarray, values: dict[str, np.ndarray]) -> int:
        """Insert or overwrite records (collective); of equal ids in a batch, the last by position wins.

        ``values`` holds every column of ``columns`` except ``touched`` (0 when
        new); returns the records added over all ranks.
        """
        self._ready_to_change()
        given = [name for name in self.columns if name != "touched"]

        def check() -> tuple[np.ndarray, np.ndarray]:
            checked = checked_ids(ids)
            missing = [name for name in given if name not in values]
            unknown = sorted(set(values) - set(given))
            if missing or unknown:
                raise ValueError(
                    f"upsert takes the columns {', '.join(given)}"
                    + (f"; missing {', '.join(missing)}" if missing else "")
                    + (f"; not columns of this store: {', '.join(unknown)}" if unknown else "")
                    + ("; touched is kept by the store" if "touched" in unknown else "")
                )
            columns = [finite(values[name], name, len(checked)) for name in given]
            strength = columns[0]
            outside = np.flatnonzero((strength < 0) | (strength > 1))
            if len(outside):
                raise ValueError(f"strength: value {outside[0]} is {strength[outside[0]]}; strengths are in [0, 1]")
            return checked, np.column_stack(columns).astype(np.float32).reshape(len(checked), len(given))

        ids, table = await self._checked(check)
        _, (got_ids, got_rows) = await self._route(ids, table)
        # arrivals are in global position order (source ranks in order, each in its batch order)
        order = np.lexsort((-np.arange(len(got_ids)), got_ids))  # per id, the last position first
        first = np.ones(len(order), bool)
        first[1:] = got_ids[order][1:] != got_ids[order][:-1]
        keep = order[first]
        rows = self.partition.rows_of(got_ids[keep])
        touched = np.zeros(len(rows), TOUCHED_TYPE)  # new records: 0; stored ones keep theirs
        touched[rows >= 0] = self.partition.column("touched")[rows[rows >= 0]]
        named = {name: got_rows[keep, j] for j, name in enumerate(given)} | {"touched": touched}
        added = self.partition.upsert(got_ids[keep], named)
        self._log(Op("upsert", got_ids[keep], record_table([named[name] for name in self.columns])))
        self._aggregate = None
        total = await self.system.world.allreduce(np.array([added], np.int64))
        return int(total[0])

    async def delete(self, ids: np.ndarray) -> int:
        """Remove records (collective); returns how many were removed over all ranks."""
        self._ready_to_change()
        ids = await self._checked(lambda: checked_ids(ids))
        _, (got_ids,) = await self._route(ids)
        removed = self.partition.delete(got_ids)
        self._log(Op("delete", got_ids))
        self._aggregate = None
        total = await self.system.world.allreduce(np.array([removed], np.int64))
        return int(total[0])

    async def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, values: one row per id of every column) for this rank's ``ids`` (collective)."""
        ids = await self._checked(lambda: checked_ids(ids))
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
        self._ready_to_change()
        began = time.perf_counter()

        def check() -> tuple[np.ndarray, np.ndarray]:
            exact = isinstance(iteration, (int, np.integer)) and not isinstance(iteration, bool)
            if not (exact and 0 <= iteration <= _EXACT_ITERATIONS):
                raise ValueError(f"reinforce: the iteration must be an integer from 0 to 2^53 (lookups and the "
                                 f"journal hold it as a float64, exact up to there), got {iteration!r}")  # fmt: skip
            checked = checked_ids(ids)
            return checked, finite(deltas, "deltas", len(checked))

        ids, deltas = await self._checked(check)
        _, (got_ids, got_deltas) = await self._route(ids, deltas)
        rows = self.partition.rows_of(got_ids)
        unknown = np.unique(got_ids[rows < 0])
        problem = f"reinforce: {len(unknown)} ids are not stored (for example {unknown[0]})" if len(unknown) else None
        await self._agree(problem)
        applying = time.perf_counter()
        rows, sums = self.partition.combine(rows, got_deltas)  # arrivals are in global position order
        self.partition.reinforce(rows, sums, iteration)
        self._log(Op("reinforce", self.partition.ids[rows], sums, float(iteration)))
        self.timings |= {"reinforce_exchange_s": applying - began, "reinforce_apply_s": time.perf_counter() - applying}

    async def decay(self, rate: float) -> None:
        """Decay every strength by ``rate`` (collective: one check that every rank gives the same rate in [0, 1])."""
        await self._agreed_settings("decay", rate, 0)
        self._decay(rate)

    def _decay(self, rate: float) -> None:
        self.partition.decay(rate)
        self._log(Op("decay", scalar=float(np.float32(rate))))

    async def iterate(self, rate: float, k: int = 100) -> Aggregate:
        """Decay every strength by ``rate`` and compute the global quality aggregate and top-k (collective).

        ``rate`` (in [0, 1]) and ``k`` (>= 0) must be the same on every rank;
        one small exchange checks them before anything changes. Decay changes
        no quality, so while no upsert or delete has run since the last call
        with the same ``k``, its aggregate is still exact: then only the decay
        runs, and nothing else is exchanged.
        """
        began = time.perf_counter()
        k = await self._agreed_settings("iterate", rate, k)
        if self._aggregate is not None and self._aggregate[0] == k:
            self._decay(rate)
            self.timings |= {"pass_s": time.perf_counter() - began, "aggregate_exchange_s": 0.0}
            return self._aggregate[1]
        low, high = self.quality_range
        mine = self.partition.iteration_pass(rate, low, high, self.bins, min(k, self.partition.size))
        self._log(Op("decay", scalar=float(np.float32(rate))))
        passed = time.perf_counter()
        sums = np.concatenate([[mine.count], mine.histogram, mine.exponents]).astype(np.int64)
        await self.system.world.allreduce(sums, out=sums)
        top = np.array([mine.maximum])
        await self.system.world.allreduce(top, op="max", out=top)
        total_count = int(sums[0])
        k_kept = min(k, total_count)  # a k beyond the store's size pads nothing it cannot fill
        best_q, best_id = best_by_quality(mine.candidates_quality, mine.candidates_ids, k_kept)
        every_q, every_id = await self._gather_candidates(best_q, best_id, k_kept)
        top_q, top_id = best_by_quality(every_q, every_id, k)
        self.timings |= {"pass_s": passed - began, "aggregate_exchange_s": time.perf_counter() - passed}
        self.bytes_sent += (sums.nbytes + top.nbytes + k_kept * 12) * (self.system.size > 1)
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

    async def _agreed_settings(self, what: str, rate: float, k: int) -> int:
        """``k`` once every rank gave the same ``rate`` in [0, 1] and integer ``k`` >= 0; else ValueError on every rank.

        Checked before anything changes: a NaN rate would make every strength NaN for good, and a rate that differs
        between ranks would make the logged decay disagree with what some ranks applied.
        """
        self._ready_to_change()
        try:
            mine = np.array([float(rate), float(operator.index(k))])
        except (TypeError, ValueError, OverflowError):
            mine = np.array([np.nan, np.nan])
        every = (await self.system.world.allgather(mine)).reshape(-1, 2)
        rates, ks = every[:, 0], every[:, 1]
        problems = []
        if not (np.isfinite(rates).all() and (rates >= 0).all() and (rates <= 1).all()):
            problems.append(f"the rate must be a number in [0, 1]; got {per_rank(rates)}")
        elif (rates != rates[0]).any():
            problems.append(f"every rank must give the same rate; got {per_rank(rates)}")
        if not (np.isfinite(ks).all() and (ks >= 0).all()):
            problems.append(f"k must be an integer >= 0; got {per_rank(ks)}")
        elif (ks != ks[0]).any():
            problems.append(f"every rank must give the same k; got {per_rank(ks)}")
        if problems:
            raise ValueError(f"{what}: " + "; ".join(problems))
        return int(ks[0])

    def _ready_to_change(self) -> None:
        """Refuse a change to a durable store before ``recover()`` (the same on every rank), before it is applied."""
        if self.durable is not None:
            self.durable.check_ready()

    # ------------------------------------------------------------ durability (see durability.py)
    def _log(self, op: Op) -> None:
        """Keep an applied change for the next commit's record (durable stores only)."""
        if self.durable is not None:
            self.durable.log(op)

    def _durable(self, what: str) -> DurableLog:
        if self.durable is None:
            raise RuntimeError(f"{what}() needs a store made with durable=Durability(...)")
        return self.durable

    async def recover(self, meta: dict | None = None, accept_rollback: bool = False) -> Recovered | None:
        """Rebuild the store from its checkpoints and logs, or start them (collective; durable stores, first call).

        ``meta`` (JSON) names the job: logs and checkpoints of another job are
        refused with a CheckpointError before anything is written. Committed
        data is never dropped silently: logs that are gone or damaged, or a
        missing ``journal.json``, are refused naming what would be lost, unless
        ``accept_rollback``. Returns None when there was nothing to recover.
        """
        return await self._durable("recover").recover(meta, accept_rollback)

    @property
    def commits(self) -> int:
        """Commits made so far (recovered ones included; 0 for a store that keeps nothing on disk)."""
        return self.durable.commits if self.durable is not None else 0

    @property
    def logged_bytes(self) -> int:
        """Bytes this rank wrote to its log and to the partner copies it keeps, so far."""
        return self.durable.logged_bytes if self.durable is not None else 0

    @property
    def local_directory(self) -> Path | None:
        """This rank's node-local directory of a durable store with ``local_dir`` (after ``recover``), else None."""
        return self.durable.local_directory if self.durable is not None else None

    async def commit(self, notes: dict[str, np.ndarray] | None = None) -> int:
        """Make the changes since the last commit durable on this node and the partner's (collective).

        ``notes`` are small arrays (the same on every rank) kept with the
        commit and given back by ``recover`` for the commits it replays: an
        iteration's results, say. Returns the commit's number.
        """
        began = time.perf_counter()
        number = await self._durable("commit").commit(notes)
        self.timings |= {"commit_s": time.perf_counter() - began}
        return number

    async def checkpoint(self, replicated: dict[str, np.ndarray] | None = None, meta: dict | None = None) -> None:
        """Checkpoint the store as of the last commit, with the caller's own arrays and metadata (collective).

        The save runs in the background; the logs before the previous
        checkpoint are deleted.
        """
        await self._durable("checkpoint").checkpoint(replicated, meta)

    def _snapshot(self) -> dict[str, np.ndarray]:
        return {"ids": self.partition.ids} | {name: self.partition.column(name) for name in self.columns}

    def _records(self) -> int:
        return self.partition.size

    async def _replay(self, kind: str, scalar: float, ops: list[Op]) -> None:
        """``Replica.apply``: one logged operation again; ``ops`` are the parts of it this rank read (collective)."""
        if kind == "decay":
            self.partition.decay(scalar)
            return
        ids = np.concatenate([op.ids for op in ops if op.ids is not None] or [np.empty(0, np.int64)])
        width = len(self.columns) if kind == "upsert" else 1
        values = [op.values.reshape(len(op.ids), width) for op in ops if op.values is not None and op.ids is not None]
        table = np.concatenate(values or [np.empty((0, width), np.float64)]).astype(np.float64)
        if kind == "upsert":  # whole records, ids unique over all ranks
            _, (got_ids, got_table) = await self._route(ids, table)
            self.partition.upsert(got_ids, {name: got_table[:, j] for j, name in enumerate(self.columns)})
        elif kind == "delete":
            _, (got_ids,) = await self._route(ids)
            self.partition.delete(got_ids)
        else:
            _, (got_ids, got_sums) = await self._route(ids, table[:, 0])
            rows = self.partition.rows_of(got_ids)
            missing = got_ids[rows < 0]
            problem = f"a logged reinforcement names {len(missing)} ids not stored (e.g. {missing[:1]})"
            await self._agree(problem if len(missing) else None, CheckpointError)
            self.partition.reinforce(rows, got_sums, int(scalar))
        self._aggregate = None

    def close(self) -> None:
        """Close the logs and wait for the last checkpoint (collective for durable stores)."""
        if self.durable is not None:
            self.durable.close()

    async def _gather_candidates(self, quality: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's best k (padded), stacked."""
        padded_q = np.full(k, -np.inf, np.float32)
        padded_id = np.full(k, INT64_LIMIT, np.int64)
        padded_q[: len(quality)], padded_id[: len(ids)] = quality, ids
        every_q = (await self.system.world.allgather(padded_q)).reshape(-1)
        every_id = (await self.system.world.allgather(padded_id)).reshape(-1)
        real = every_q != -np.inf  # stored qualities are finite; any id, 2**63 - 1 too, may be real
        return every_q[real], every_id[real]


def best_by_quality(quality: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (qualities, ids) by quality descending, then id ascending."""
    order = np.lexsort((ids, -quality.astype(np.float64)))[:k]
    return quality[order], ids[order]
