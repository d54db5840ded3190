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
from .collectives import Communicator, Reduction, described, out_of_size
from .config import RuntimeConfig
from .hierarchical import HierarchicalAllreduce, gate_row
from .pair_reduce import UFUNCS, direct_result, exchanged, room
from .progress import ProgressEngine
from .settling import reduce_pair, settle, settle_all


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
        if isinstance(op, str):
            mpi_op = self.world._op(op)
            comm = self.reducer.direct_comm(array, mpi_op)
            if comm is not None and self.reducer.claim_inline():  # nothing queued in the reducer's thread: runs here
                try:
                    return await self._inline_allreduce(comm, array, op, mpi_op, out)
                finally:
                    self.reducer.release_inline()
        return await self.finish(self.start_allreduce(array, op, out))

    async def _inline_allreduce(
        self, comm: Comm, array: np.ndarray, op: str, mpi_op: object, out: np.ndarray | None
    ) -> np.ndarray:
        """A direct call (``reducer.direct_comm``) on the event loop, not in the reducer's thread (the hand-offs to
        the thread and back cost about 0.1 ms): the same exchange first, then the reducer's non-blocking direct call
        on ``comm``, both settled as the world's collectives are. Nothing blocks the loop: a rank that died meanwhile
        is still reported."""
        data = self.world._array(array, "hierarchical allreduce")
        if out is not None:  # refused before any MPI call, as the world's allreduce refuses it
            out_of_size(data, out, "hierarchical allreduce")
        number, call = self._begin()
        what = f"allreduce on {self.log.name}"
        try:
            ufunc = exchanged(comm.Get_size(), data.dtype, UFUNCS.get(op))
            if ufunc is not None and self.reducer.check:
                return await self._pair_allreduce(comm, ufunc, data, op, out, call)
            gate, digests, signature = self.reducer.post_gate(data, op)
            await settle(self.engine, gate, what, digests, self.world._spin_s)
            self.reducer.passed(digests, signature, call)
            steps, result = self.reducer.start_direct(comm, data, mpi_op, out)
            for requests in steps:
                await settle_all(self.engine, requests, what, (data, out, steps), self.world._spin_s)
            return result()
        finally:
            self.log.end(number)

    async def _pair_allreduce(
        self, comm: Comm, ufunc: np.ufunc, data: np.ndarray, op: str, out: np.ndarray | None, call: tuple[str, str]
    ) -> np.ndarray:
        """A checked call between two ranks: the gate's check, then the swaps on ``comm`` (``reduce_pair``), in the
        caller's stack (the very messages the worker sends for it, should the other rank's worker run it)."""
        pair = self.pairs.get(id(comm))
        if pair is None:
            pair = self.pairs[id(comm)] = wire.chosen()[0].PairExchange(self.world._MPI, self.reducer.gate, comm)
        signature = described(data.dtype, data.shape, op)
        row = gate_row(signature)  # as the worker's gate sends it
        theirs = self.reducer.kept_copies(room(data))
        result, caller_result = direct_result(data, out, by_exchange=True)
        what = f"allreduce on {self.log.name}"
        rows = await reduce_pair(self.engine, pair, row, ufunc, self.world.rank, data, result, theirs, what,
                                 self.world._spin_s)  # fmt: skip
        if rows is not None:
            self.reducer.passed(rows, signature, call)
        return caller_result()

    def _begin(self) -> tuple[int, tuple[str, str]]:
        """A call entered in the log: its number, and what and where it is (named in a mismatch's report)."""
        number = self.log.begin("allreduce")
        assert self.log.last is not None  # set by begin
        return number, (f"allreduce #{number} on {self.log.name}", self.log.last[2])

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
        data = self.world._array(array, "hierarchical allreduce")
        number, call = self._begin()
        if isinstance(op, str):
            future = self.reducer.start(data, self.world._op(op), op, out, call)
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
