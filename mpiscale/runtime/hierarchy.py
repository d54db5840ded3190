"""The hierarchy of a world's communicators (world, node, node leaders) and its hierarchical allreduce, and
:class:`Group`, some ranks with collectives of their own."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from ..ranks import Comm, split_nodes
from . import wire
from .abandoned import CollectiveLog
from .collectives import Communicator, Reduction, described
from .config import RuntimeConfig
from .hierarchical import HierarchicalAllreduce, gate_row
from .mpi_arrays import apart, out_of_kind, out_of_size, reducible
from .pair_reduce import UFUNCS, delivered, direct_result, exchanged, room
from .progress import ProgressEngine
from .settling import reduce_pair, settle, settle_all


@dataclass(frozen=True)
class DirectCall:
    """What the event loop runs for a direct call (``reducer.direct_comm``) of one dtype, shape and operation,
    decided at its first call. Deciding it on every call took about 2.5 µs of Python, an eighth of a 64 KiB call
    between two ranks of a host (2026-12-04)."""

    comm: Comm
    mpi_op: Any
    op: str
    signature: str  # the arguments, as the check compares and a mismatch's report names them
    ufunc: np.ufunc | None  # between two ranks with checks on, the exchange's reduction (``pair_reduce``), else None
    pair: Any  # then its ``PairExchange`` (gate's check, swaps on ``comm``), else None
    row: np.ndarray  # what this rank sends in the gate's check


#: How many calls' decisions (:class:`DirectCall`) a hierarchy keeps: more than a program's distinct calls.
_KEPT_DIRECT_CALLS = 1024


@dataclass
class Hierarchy:
    """World, node-local and node-leader communicators, and the hierarchical allreduce."""

    world: Communicator
    node: Communicator
    leaders: Communicator | None  # None on ranks that do not lead their node
    node_index: int
    node_count: int
    node_leaders: tuple[int, ...]  # each rank's node's first rank (whom its telemetry reports go through)
    reducer: HierarchicalAllreduce
    #: The hierarchical allreduces this rank started, and those still pending.
    log: CollectiveLog
    engine: ProgressEngine  # counts the time a rank waits for a call's end (telemetry, the hang watch)
    pairs: dict[int, Any] = field(default_factory=dict)  # PairExchange of each direct communicator, by its id
    direct_calls: dict[tuple[np.dtype, tuple[int, ...], str], DirectCall | None] = field(default_factory=dict)

    async def allreduce(
        self, array: np.ndarray, op: str | Reduction = "sum", out: np.ndarray | None = None
    ) -> np.ndarray:
        """Reduce-scatter in each node, reduce each block across nodes, allgather in each node.

        Same result as ``world.allreduce`` up to floating-point summation order,
        and the same bits on every rank; every rank carries its share across
        nodes. float16 is summed in float32. ``op`` is "sum", "min", "max",
        "prod", or a ``Reduction``: a function of the contributions stacked in
        rank order (rows) returning one row, applied outside MPI (for element
        types MPI cannot add, such as 16-bit floats held as uint16). Several
        calls may be in flight.
        """
        data = self._checked(array, op, out)
        if isinstance(op, str):
            call = self._direct_call(data, op)
            if call is not None and self.reducer.claim_inline():  # nothing queued in the reducer's thread: runs here
                try:
                    return await self._inline_allreduce(call, data, out)
                finally:
                    self.reducer.release_inline()
        return await self.finish(self._start(data, op, out))

    def _direct_call(self, data: np.ndarray, op: str) -> DirectCall | None:
        """What the event loop runs for a call of ``data`` by ``op``, None where the reducer's thread runs it (see
        :class:`DirectCall`). Kept by dtype, shape and operation: nothing else decides it."""
        key = (data.dtype, data.shape, op)
        try:
            return self.direct_calls[key]
        except KeyError:
            pass
        mpi_op = self.world._op(op, data.dtype)
        comm = self.reducer.direct_comm(data, mpi_op)
        if comm is None:
            call = None
        else:
            ufunc = exchanged(comm.Get_size(), data.dtype, UFUNCS.get(op)) if self.reducer.check else None
            signature = described(data.dtype, data.shape, op)
            pair = self._pair_of(comm) if ufunc is not None else None
            call = DirectCall(comm, mpi_op, op, signature, ufunc, pair, gate_row(signature))
        if len(self.direct_calls) < _KEPT_DIRECT_CALLS:
            self.direct_calls[key] = call
        return call

    def _pair_of(self, comm: Comm) -> Any:
        """The ``PairExchange`` of two-rank calls on ``comm`` (checked on the reducer's gate): one a communicator."""
        pair = self.pairs.get(id(comm))
        if pair is None:
            pair = self.pairs[id(comm)] = wire.chosen()[0].PairExchange(self.world._MPI, self.reducer.gate, comm)
        return pair

    async def _inline_allreduce(self, call: DirectCall, data: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """A direct call on the event loop, not in the reducer's thread (the hand-offs to the thread and back cost
        about 0.1 ms): the same exchange first, then the reducer's non-blocking direct call on ``call.comm``, both
        settled as the world's collectives are; between two ranks with checks on, the gate's check and the swaps
        on ``call.comm`` (``reduce_pair``), in the caller's stack: the very messages the worker sends for it, should
        the other rank's worker run it. Nothing blocks the loop: a rank that died meanwhile is still reported."""
        number = self.log.begin("allreduce")
        what = f"allreduce on {self.log.name}"
        try:
            if call.ufunc is not None:  # (and so its ``pair``)
                theirs = self.reducer.kept_copies(room(data))
                result, in_out = direct_result(data, out, by_exchange=True)
                rows = await reduce_pair(self.engine, call.pair, call.row, call.ufunc, self.world.rank, data, result,
                                         theirs, what, self.world._spin_s)  # fmt: skip
                if rows is not None:
                    self.reducer.passed(rows, call.signature, self._named(number))
                return delivered(result, out, in_out)
            gate, digests, signature = self.reducer.post_gate(data, call.op)
            await settle(self.engine, gate, what, digests, self.world._spin_s)
            self.reducer.passed(digests, signature, self._named(number))
            steps, caller_result = self.reducer.start_direct(call.comm, data, call.mpi_op, out)
            for requests in steps:
                await settle_all(self.engine, requests, what, (data, out, steps), self.world._spin_s)
            return caller_result()
        finally:
            self.log.end(number)

    def _named(self, number: int) -> tuple[str, str]:
        """What and where the logged call ``number`` is, as a mismatch's report names it (read only then)."""
        return f"allreduce #{number} on {self.log.name}", self.log.site(number)

    async def finish(self, started: concurrent.futures.Future) -> np.ndarray:
        """The result of a call ``start_allreduce`` began; the time awaited counts as waiting in a collective (what
        telemetry reports and the hang watch reads)."""
        future = asyncio.wrap_future(started)
        self.engine.waits.count(future, f"allreduce on {self.log.name}")
        return await future

    def start_allreduce(
        self, array: np.ndarray, op: str | Reduction = "sum", out: np.ndarray | None = None
    ) -> concurrent.futures.Future:
        """Begin ``allreduce`` now, even from code that does not await or runs in another thread (a gradient hook:
        for GPU parameters autograd runs it in its device thread, which has no event loop); ``await finish(future)``
        later, on the loop.

        The reduction runs while the caller goes on; ``array`` must not change until the future is done.
        """
        return self._start(self._checked(array, op, out), op, out)

    def _checked(self, array: np.ndarray, op: str | Reduction, out: np.ndarray | None) -> np.ndarray:
        """``array`` made MPI-ready (and apart from an ``out`` that overlaps it), its call refused here, before any
        MPI call, where ``out`` cannot take the result or MPI cannot reduce the array by a named ``op`` (as the
        world's allreduce refuses them)."""
        data = self.world._array(array, "hierarchical allreduce")
        if out is not None:
            out_of_size(data, out, "hierarchical allreduce")
            out_of_kind(data, out, "hierarchical allreduce")
        if isinstance(op, str):
            reducible(data, "hierarchical allreduce", op)
        return apart(data, out)

    def _start(self, data: np.ndarray, op: str | Reduction, out: np.ndarray | None) -> concurrent.futures.Future:
        """``start_allreduce`` of ``data`` already made MPI-ready and checked (``allreduce`` has done both)."""
        number = self.log.begin("allreduce")
        call = self._named(number)
        if isinstance(op, str):
            future = self.reducer.start(data, self.world._op(op, data.dtype), op, out, call)
        else:
            future = self.reducer.start(data, op, getattr(op, "__name__", "a reduction function"), out, call)
        future.add_done_callback(lambda _: self.log.end(number))
        return future


def build_hierarchy(
    MPI: ModuleType, world_comm: Comm, engine: ProgressEngine, config: RuntimeConfig, name: str = "world"
) -> Hierarchy:
    """Create the communicators (collective over ``world_comm``; the runtime's at start-up, a :class:`Group`'s when
    it is made). ``name`` names its ``world`` communicator; the node communicators are named after it."""
    node_comm, index, count, node_leaders = split_nodes(world_comm, config.ranks_per_node)
    is_leader = node_comm.Get_rank() == 0
    leader_comm = world_comm.Split(0 if is_leader else MPI.UNDEFINED, world_comm.Get_rank())
    prefix = "" if name == "world" else f"{name}."
    leaders = Communicator(MPI, leader_comm, engine, config, f"{prefix}leaders") if is_leader else None
    world = Communicator(MPI, world_comm.Dup(), engine, config, name)
    return Hierarchy(
        reducer=HierarchicalAllreduce(MPI, node_comm, world_comm, index, config),
        world=world,
        node=Communicator(MPI, node_comm, engine, config, f"{prefix}node{index}"),
        leaders=leaders,
        node_index=index,
        node_count=count,
        node_leaders=node_leaders,
        log=CollectiveLog(f"{name} (hierarchical)", world.log.members),
        engine=engine,
    )


@dataclass
class Group:
    """Some of the world's ranks with collectives of their own (``ActorSystem.split``): the ``rank``, ``size``,
    ``world`` and ``hierarchy`` an ``ActorSystem`` offers, so what reduces over the whole job (``DataParallel``,
    the gradient compressions) reduces over a group alike."""

    name: str
    hierarchy: Hierarchy

    @property
    def world(self) -> Communicator:
        """Awaitable collectives over the group's ranks."""
        return self.hierarchy.world

    @property
    def rank(self) -> int:
        return self.hierarchy.world.rank

    @property
    def size(self) -> int:
        return self.hierarchy.world.size

    def logs(self) -> list[CollectiveLog]:
        """The collective logs of its communicators (for the watch on collectives some rank abandoned)."""
        h = self.hierarchy
        return [h.world.log, h.node.log, h.log] + ([h.leaders.log] if h.leaders else [])

    def free(self) -> None:
        """Stop the reducer's thread and free the communicators (at the runtime's end)."""
        h = self.hierarchy
        h.reducer.close()
        for comm in (h.world.comm, h.node.comm, h.leaders.comm if h.leaders else None):
            if comm is not None:
                comm.Free()
