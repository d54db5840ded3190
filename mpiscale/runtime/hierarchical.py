"""Hierarchical allreduce of large buffers: reduce-scatter in the node, reduce across nodes, allgather in the node.

Every rank of a node carries a share across nodes (as Horovod's hierarchical
mode does), not only a leader. The buffer is cut into ``L`` blocks, ``L`` the
most ranks any node has; block ``b`` belongs to the node-local rank ``b % m``
of a node of ``m`` ranks, so nodes of different sizes work together. Per call:

1. a reduce-scatter in the node: each rank gets the node's sum of its blocks.
   For sums, products, maxima and minima it is an ``Alltoallv`` that hands
   each rank every copy of its blocks, reduced in local-rank order with numpy:
   Open MPI's ``Reduce_scatter`` took 2.1-2.5x as long (64 MiB, 2 ranks on a
   node, shared memory, 2026-11-27); other operations use ``Reduce_scatter``;
2. per block, ``Reduce`` then ``Bcast`` over the block's owners (one per node),
   rooted on the first node: one reduction order, so every rank ends with the
   very same bits (an ``Allreduce`` between two nodes, where ``a + b == b + a``);
3. ``Allgatherv`` in the node puts the blocks back together.

On one node it is MPI's own ``Allreduce``. float16 is summed in float32 (MPI
has no half-precision sum). A reduction given as a Python function (``op=f``,
``f(stacked) -> row``, the contributions stacked in rank order) is applied
outside MPI: an ``Alltoallv`` in the node gives each rank every copy of its
blocks, ``f`` reduces them, an ``Allgather`` across nodes and ``f`` again
combine the nodes in node order, and the node allgathers the result. That is
how 16-bit gradients are summed with only 16 bits on the wire
(``mpiscale.kernels.halves``): MPI has no such sum, and MPI's user-defined
operations call Python inside MPI, holding the GIL (a training step with them
ran 4x slower).

The calls run in one worker thread per rank, with MPI's blocking collectives
on communicators of their own. Open MPI's non-blocking collectives advance only
while the caller polls, and measured at a third to a half of the blocking ones'
bandwidth here; in a thread, the blocking ones run at full speed while the
event loop goes on. The worker takes calls in the order they were made, the
same on every rank (as all collectives require), so several may be in flight.

A blocking collective busy-polls until its last rank arrives. A rank that starts
a gradient bucket during backward would spin a core for as long as the slowest
rank computes, and with a core per rank that spinning takes the core from the
compute threads (whose slowness it waits for). So the worker first waits,
mostly asleep, in a non-blocking barrier until every rank has reached the call,
and only then enters the blocking collectives, which all ranks now run together.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np

from ..ranks import Comm, block_rows
from .errors import check_signatures, signature_digest

_WIDER = {np.dtype(np.float16): np.dtype(np.float32)}
_GATE_SPIN_S = 20e-6  # how long the barrier before a call is polled without sleeping (ranks that arrive together)
_GATE_SLEEP_S = 500e-6  # the longest sleep between its polls: a call starts at most this late


class HierarchicalAllreduce:
    """The three-stage allreduce over one world's nodes (built collectively, once)."""

    def __init__(self, MPI: ModuleType, node: Comm, world: Comm, node_index: int, check: bool) -> None:
        self._MPI, self._check = MPI, check
        self._node, self._world = node.Dup(), world.Dup()
        self._gate = world.Dup()  # the barrier before each call, apart from the calls' own traffic
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self.blocks = world.allreduce(self.local_size, op=MPI.MAX)
        self.nodes = world.allreduce(1 if self.local_rank == 0 else 0)
        self.owned = [b for b in range(self.blocks) if b % self.local_size == self.local_rank]
        self._by_owner = [
            b for rank in range(self.local_size) for b in range(self.blocks) if b % self.local_size == rank
        ]
        self._in_order = self._by_owner == list(range(self.blocks))  # one block per local rank: no regrouping
        self._node_index = node_index
        self._cross: dict[int, Any] | None = None  # split at the first call across nodes (none on one node)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mpiscale-allreduce")
        self._buffer = np.empty(0, np.uint8)  # this rank's share, kept between calls: fresh pages cost page faults
        self._copies_buffer = np.empty(0, np.uint8)  # every local rank's copy of this rank's share, kept as well
        self._ufuncs = [(MPI.SUM, np.add), (MPI.PROD, np.multiply), (MPI.MAX, np.maximum), (MPI.MIN, np.minimum)]

    def start(self, array: np.ndarray, op: Any, op_name: str, out: np.ndarray | None) -> asyncio.Future:
        """Begin a call now, in call order; await the result (``out``, or a new array)."""
        return asyncio.wrap_future(self._worker.submit(self._run, array, op, op_name, out))

    def close(self) -> None:
        """Stop the worker once its calls are done."""
        self._worker.shutdown(wait=True)

    def _run(self, array: np.ndarray, op: Any, op_name: str, out: np.ndarray | None) -> np.ndarray:
        self._until_all_arrived()
        if self._check:
            self._agree_on(f"{array.dtype}{array.shape} {op_name}")
        if not isinstance(op, self._MPI.Op):  # a reduction function, applied outside MPI
            flat = np.ascontiguousarray(array).reshape(-1)
            total = np.empty_like(flat)
            self._combine_stages(flat, total, op)
            result = total.reshape(array.shape)
            if out is None:
                return result
            np.copyto(out, result)
            return out
        wide = _WIDER.get(array.dtype, array.dtype)
        flat = np.ascontiguousarray(array, dtype=wide).reshape(-1)
        if out is not None and out.dtype == wide and out.flags.c_contiguous and out is not array:
            self._reduce(flat, out.reshape(-1), op)  # straight into the caller's buffer
            return out
        total = np.empty_like(flat)
        self._reduce(flat, total, op)
        result = total.reshape(array.shape).astype(array.dtype, copy=False)
        if out is None:
            return result
        np.copyto(out, result)
        return out

    def _until_all_arrived(self) -> None:
        """Return once every rank has reached this call: polled a few microseconds, then with sleeps doubling
        to ``_GATE_SLEEP_S``, so that a rank ahead of the others leaves its core to compute threads."""
        request, pause = self._gate.Ibarrier(), _GATE_SPIN_S
        started = time.perf_counter()
        while not request.Test():
            if time.perf_counter() - started > _GATE_SPIN_S:
                time.sleep(pause)
                pause = min(2 * pause, _GATE_SLEEP_S)

    def _reduce(self, flat: np.ndarray, total: np.ndarray, op: Any) -> None:
        if self.nodes == 1:
            self._node.Allreduce(flat, total, op)
        else:
            self._three_stages(flat, total, op)

    def _cross_comms(self) -> dict[int, Any]:
        """Per owned block, the communicator of its owners: one rank per node, node 0's first (collective)."""
        if self._cross is None:
            self._cross = {}
            for block in range(self.blocks):
                owner = block % self.local_size == self.local_rank
                split = self._world.Split(block if owner else self._MPI.UNDEFINED, self._node_index)
                if owner:
                    self._cross[block] = split
        return self._cross

    def _scratch(self, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` elements of ``dtype`` in the kept buffer (the worker runs one call at a time)."""
        nbytes = count * dtype.itemsize
        if self._buffer.nbytes < nbytes:
            self._buffer = np.empty(nbytes, np.uint8)
        return self._buffer[:nbytes].view(dtype)

    def _every_copy(self, grouped: np.ndarray, counts: list[int]) -> np.ndarray:
        """Every local rank's copy of this rank's blocks, one row each in local-rank order (``Alltoallv``)."""
        count, ranks = counts[self.local_rank], self.local_size
        nbytes = ranks * count * grouped.dtype.itemsize
        if self._copies_buffer.nbytes < nbytes:
            self._copies_buffer = np.empty(nbytes, np.uint8)
        copies = self._copies_buffer[:nbytes].view(grouped.dtype).reshape(ranks, count)
        send_displacements = np.concatenate([[0], np.cumsum(counts)])[:-1].astype(int).tolist()
        receive = ([count] * ranks, [r * count for r in range(ranks)])
        self._node.Alltoallv([grouped, (counts, send_displacements)], [copies, receive])
        return copies

    def _node_reduce_scatter(self, grouped: np.ndarray, mine: np.ndarray, counts: list[int], op: Any) -> None:
        """This rank's blocks reduced over its node into ``mine`` (see the module's docstring, stage 1)."""
        ufunc = next((f for known, f in self._ufuncs if op == known), None)
        if ufunc is None:
            self._node.Reduce_scatter(grouped, mine, counts, op)
        else:
            ufunc.reduce(self._every_copy(grouped, counts), axis=0, out=mine)

    def _agree_on(self, signature: str) -> None:
        every = self._world.allgather(signature_digest(signature))
        check_signatures(every, "hierarchical allreduce", self._world.Get_rank(), signature)

    def _layout(self, count: int) -> tuple[list[int], np.ndarray, list[int]]:
        """(elements per block, block starts, elements per local rank) of a buffer of ``count``."""
        sizes = block_rows(count, self.blocks)
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        counts = [sum(sizes[b] for b in range(self.blocks) if b % self.local_size == r) for r in range(self.local_size)]
        return sizes, starts, counts

    def _grouped(self, flat: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The buffer with each local rank's blocks side by side, in local-rank order."""
        if self._in_order:
            return flat
        return np.concatenate([flat[starts[b] : starts[b + 1]] for b in self._by_owner])

    def _gather_blocks(self, mine: np.ndarray, total: np.ndarray, starts: np.ndarray, counts: list[int]) -> None:
        """Allgather every local rank's blocks in the node and put them back in buffer order."""
        gathered = total if self._in_order else np.empty_like(total)
        displacements = np.concatenate([[0], np.cumsum(counts)])[:-1].astype(int).tolist()
        self._node.Allgatherv(mine, [gathered, (counts, displacements)])
        if not self._in_order:
            offset = 0
            for block in self._by_owner:
                size = starts[block + 1] - starts[block]
                total[starts[block] : starts[block + 1]] = gathered[offset : offset + size]
                offset += size

    def _three_stages(self, flat: np.ndarray, total: np.ndarray, op: Any) -> None:
        sizes, starts, counts = self._layout(flat.size)
        mine = self._scratch(counts[self.local_rank], flat.dtype)
        self._node_reduce_scatter(self._grouped(flat, starts), mine, counts, op)
        offset, cross_comms = 0, self._cross_comms()
        for block in self.owned:
            piece, cross = mine[offset : offset + sizes[block]], cross_comms[block]
            if cross.Get_size() == 2:  # a + b == b + a bit for bit: both ends of an allreduce agree
                cross.Allreduce(self._MPI.IN_PLACE, piece, op)
            elif cross.Get_rank() == 0:
                cross.Reduce(self._MPI.IN_PLACE, piece, op, 0)
                cross.Bcast(piece, 0)
            else:
                cross.Reduce(piece, None, op, 0)
                cross.Bcast(piece, 0)
            offset += sizes[block]
        self._gather_blocks(mine, total, starts, counts)

    def _combine_stages(self, flat: np.ndarray, total: np.ndarray, combine: Callable) -> None:
        """The stages with ``combine(stacked) -> row`` applied outside MPI (see the module's docstring)."""
        sizes, starts, counts = self._layout(flat.size)
        mine = np.ascontiguousarray(combine(self._every_copy(self._grouped(flat, starts), counts)), dtype=flat.dtype)
        if self.nodes > 1:
            offset, cross_comms = 0, self._cross_comms()
            for block in self.owned:
                piece, cross = mine[offset : offset + sizes[block]], cross_comms[block]
                partials = np.empty((cross.Get_size(), piece.size), flat.dtype)
                cross.Allgather(piece, partials)
                piece[...] = combine(partials)  # node order, the same on every node
                offset += sizes[block]
        self._gather_blocks(mine, total, starts, counts)
