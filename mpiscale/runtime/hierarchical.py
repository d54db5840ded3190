"""Hierarchical allreduce of large buffers: reduce-scatter in the node, reduce across nodes, allgather in the node.

Every rank of a node carries a share across nodes (as Horovod's hierarchical
mode does), not only a leader. The buffer is cut into ``L`` blocks, ``L`` the
most ranks any node has; block ``b`` belongs to the node-local rank ``b % m``
of a node of ``m`` ranks, so nodes of different sizes work together. Per call:

1. a reduce-scatter in the node: each rank gets the node's sum of its blocks.
   For sums, products, maxima and minima each rank sends every other local
   rank its copy of that rank's blocks, and reduces the copies of its own in
   local-rank order with numpy (Open MPI's ``Reduce_scatter`` took 2.1-2.5x as
   long: 64 MiB, 2 ranks on a node, shared memory, 2026-11-27); other
   operations use ``Reduce_scatter``;
2. per block, across its owners (one per node): between two nodes the owners
   reduce their partial sums by the exchange of :mod:`.pair_reduce` (whole, or
   a half each from 512 KiB), in node order; over more
   nodes it is ``Reduce`` then ``Bcast`` rooted on the first node. One
   reduction order, so every rank ends with the very same bits;
3. each rank sends its reduced blocks to the other local ranks, which put the
   buffer back together.

The stages' messages are point-to-point and non-blocking, polled for a moment
(yielding the core) and then with short sleeps: a rank waiting for data leaves
its core to the ranks and the kernel's TCP work it waits for. Open MPI's
blocking calls busy-poll instead, and with more ranks than cores (the local
cluster of ``hpc/cluster``) the 32 MiB swap between two hosts took 3-4x as
long as a blocking ``Allreduce``/``Sendrecv`` (2026-11-27).

On one node, and for buffers under ``hierarchical_min_bytes`` (the stages'
extra hand-offs cost more than they save there), it is MPI's own
``Allreduce``, in place when the result goes back into the buffer, and in
pieces of at most ``allreduce_piece_bytes``: past 16 MiB Open MPI's
shared-memory Allreduce switches to an algorithm a third as fast, so a 50 MB
gradient bucket took 18 ms whole and 6.4 ms in pieces of 8 MiB. float16 is
summed in float32 (MPI has no half-precision sum).
A reduction given as a Python function (``op=f``, ``f(stacked) -> row``, the
contributions stacked in rank order) is applied outside MPI, at any size:
stage 1 gives each rank every copy of its blocks, ``f`` reduces them, the
owners gather each other's partial results across nodes and ``f`` again
combines them in node order, and stage 3 puts the buffer together. That is
how 16-bit gradients are summed with only 16 bits on the wire
(``mpiscale.kernels.halves``): MPI has no such sum, and MPI's user-defined
operations call Python inside MPI, holding the GIL (a training step with them
ran 4x slower).

The calls run in one worker thread per rank, on communicators of their own,
while the event loop goes on. An awaited call that is one direct call (between
two ranks, the exchange of :mod:`.pair_reduce` at any size; else MPI's
``Iallreduce`` of at most ``INLINE_ALLREDUCE_BYTES``) runs on the event loop
when the worker has no call queued (the hand-offs to the thread and back cost
about 0.1 ms, 30 times a 4 KiB Allreduce): its exchange, then the direct call,
both settled as the world's collectives are, never blocking the loop. The
worker runs a direct call the same way, and calls begun meanwhile wait for the
loop's, so every rank's calls meet in the same order whichever thread runs
them. Open MPI's non-blocking collectives advance only while the caller polls
(a third to a half of the blocking ones' bandwidth here), so where a stage is a
collective it is a blocking one. The worker takes calls in the order they were
made, the same on every rank, so several may be in flight.

A blocking collective busy-polls until its last rank arrives. A rank that starts
a gradient bucket during backward would spin a core for as long as the slowest
rank computes, and with a core per rank that spinning takes the core from the
compute threads (whose slowness it waits for). So the worker first waits,
mostly asleep, in a non-blocking barrier until every rank has reached the call,
and only then starts the stages, which all ranks now run together.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np

from ..ranks import Comm, block_rows, by_ranks, world_ranks
from .collectives import described
from .config import RuntimeConfig
from .errors import CollectiveMismatch, signature_digest
from .mpi_arrays import WIDER
from .pair_reduce import delivered, direct_result, exchanged, room, rounds, ufuncs_by_handle

_GATE_SPIN_S = 200e-6  # how long the barrier before a call is polled without sleeping (ranks that arrive together)
_GATE_SLEEP_S = 2e-3  # the longest sleep between its polls, as the engine's: a long wait wakes 500 times a second
_MOVE_SPIN_S = 2e-3  # how long the stages' messages are polled without sleeping (a small buffer arrives by then)
_MOVE_SLEEP_S = 100e-6  # the longest sleep between those polls: the transfer stalls at most this long
#: An awaited call of at most this many bytes runs on the event loop (non-blocking, its requests settled there) when
#: the worker is idle; larger ones run in the worker.
INLINE_ALLREDUCE_BYTES = 1 << 20
_STAGE_TAG = 7  # the stages' point-to-point messages, on communicators of their own


@functools.lru_cache(maxsize=1024)
def gate_row(signature: str) -> np.ndarray:
    """What a rank sends in a call's gate with checks on: the digest of its arguments (kept, read-only)."""
    row = np.array([signature_digest(signature)], np.int64)
    row.flags.writeable = False  # (MPI only reads it)
    return row


class HierarchicalAllreduce:
    """The three-stage allreduce over one world's nodes (built collectively, once)."""

    def __init__(self, MPI: ModuleType, node: Comm, world: Comm, node_index: int, config: RuntimeConfig) -> None:
        self._MPI, self.check, self._min_bytes = MPI, config.check_collectives, config.hierarchical_min_bytes
        self._piece_bytes = config.allreduce_piece_bytes
        self._node, self._world = node.Dup(), world.Dup()
        self.gate = world.Dup()  # the barrier before each call, apart from the calls' own traffic
        self._members = world_ranks(world)  # (a mismatch every rank raises names them so; the first reports it)
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
        self._ufuncs = ufuncs_by_handle(MPI)
        self._order = threading.Lock()  # guards the three below: which thread runs the next call
        self._queued = 0  # calls given to the worker and not finished
        self._inline_busy = False  # while the event loop runs a call itself
        self._worker_waits = False  # the worker waits for that call's end (a threading.Event's set and clear cost
        self._inline_done = threading.Condition(self._order)  # 1.5 µs of a 9 µs call: notified only then)

    def start(self, array: np.ndarray, op: Any, op_name: str, out: np.ndarray | None, call: tuple[str, str]) -> Future:
        """Begin a call now, in call order, from any thread (a gradient hook runs in autograd's device thread, which
        has no event loop); the future's result is ``out``, or a new array. ``call``: what the call is and where it
        was made (``allreduce #3 on world (hierarchical)``, a file and line), named in a mismatch's report."""
        with self._order:
            self._queued += 1
        return self._worker.submit(self._run_queued, array, op, op_name, out, call)

    def claim_inline(self) -> bool:
        """Whether the caller may run the next call itself, on the event loop (:meth:`post_gate`, :meth:`passed`, a
        non-blocking Allreduce on :meth:`direct_comm`, then :meth:`release_inline`): only when no call is queued or
        running in the worker, and calls begun meanwhile wait for it. Every rank's calls then still meet on the same
        communicators in the same order, whichever thread runs them."""
        with self._order:
            if self._queued or self._inline_busy:
                return False
            self._inline_busy = True
            return True

    def release_inline(self) -> None:
        with self._order:
            self._inline_busy = False
            if self._worker_waits:
                self._inline_done.notify()

    def _run_queued(self, array: np.ndarray, op: Any, op_name: str, out: np.ndarray | None,
                    call: tuple[str, str]) -> np.ndarray:  # fmt: skip
        try:
            with self._order:  # a call the loop runs itself, begun before this one
                self._worker_waits = True
                self._inline_done.wait_for(lambda: not self._inline_busy)
                self._worker_waits = False
            return self._run(array, op, op_name, out, call)
        finally:
            with self._order:
                self._queued -= 1

    def close(self) -> None:
        """Stop the worker once its calls are done."""
        self._worker.shutdown(wait=True)

    def _run(
        self, array: np.ndarray, op: Any, op_name: str, out: np.ndarray | None, call: tuple[str, str]
    ) -> np.ndarray:
        gate, digests, signature = self.post_gate(array, op_name)
        self._until_done([gate], _GATE_SPIN_S, _GATE_SLEEP_S)
        self.passed(digests, signature, call)
        comm = self.direct_comm(array, op) if isinstance(op, self._MPI.Op) else None
        if comm is not None:  # as the event loop runs such a call on other ranks
            steps, result = self.start_direct(comm, array, op, out)
            for requests in steps:
                self._until_done(requests, _MOVE_SPIN_S, _MOVE_SLEEP_S)
            return result()
        return self.reduce_now(array, op, out)

    def start_direct(
        self, comm: Comm, data: np.ndarray, op: Any, out: np.ndarray | None
    ) -> tuple[Iterator[list], Callable[[], np.ndarray]]:
        """A call on ``comm`` (its :meth:`direct_comm`) in one piece, non-blocking: (its rounds, each the requests to
        wait for before the next; what returns the caller's result after the last: ``out`` filled, else a new array
        shaped as ``data``). Between two ranks it is the exchange of :mod:`.pair_reduce`, else MPI's
        ``Iallreduce``. The event loop and the worker run such a call alike (a blocking collective would not match a
        non-blocking one on another rank)."""
        ufunc = exchanged(comm.Get_size(), data.dtype, self._ufunc(op))
        result, in_out = direct_result(data, out, by_exchange=ufunc is not None)
        caller_result = functools.partial(delivered, result, out, in_out)
        if ufunc is None:
            sent = self._MPI.IN_PLACE if np.may_share_memory(result, data) else data  # (``out`` is ``data``)
            return iter([[comm.Iallreduce(sent, result, op)]]), caller_result
        theirs = self.kept_copies(room(data))  # the worker and the loop never run calls at once: one buffer
        return rounds(comm, ufunc, data, result, theirs), caller_result

    def post_gate(self, array: np.ndarray, op_name: str) -> tuple[Any, np.ndarray | None, str]:
        """Start the exchange that waits until every rank has reached this call (so a rank ahead of the others
        leaves its core to compute threads meanwhile); with checks on it carries a digest of the call's arguments.
        Returns (its request, where the digests arrive (None without checks), the arguments as text)."""
        signature = described(array.dtype, array.shape, op_name)
        if not self.check:
            return self.gate.Ibarrier(), None, signature
        digests = np.empty(self.gate.Get_size(), np.int64)
        return self.gate.Iallgather(gate_row(signature), digests), digests, signature

    def passed(self, digests: np.ndarray | None, signature: str, call: tuple[str, str]) -> None:
        """After the exchange: a mismatch of the ranks' arguments is one :class:`CollectiveMismatch` naming every
        rank's arguments and call site (raised on every rank; the lowest one reports it)."""
        if digests is not None and len(set(digests.tolist())) > 1:
            calls = self.gate.allgather(f"allreduce({signature}) at {call[1]}")
            error = CollectiveMismatch(f"{call[0]}: the ranks passed different arguments (shape, dtype, op), where all "
                                       f"must pass the same: {by_ranks(calls, self._members)}")  # fmt: skip
            error.reporter = self._members[0]
            raise error

    def direct_comm(self, array: np.ndarray, op: Any) -> Comm | None:
        """The communicator on which a call of ``array`` by MPI operation ``op`` is one non-blocking call
        (:meth:`start_direct`), which the event loop may run: no widening, and :data:`INLINE_ALLREDUCE_BYTES` at
        most, or any size where it is the two-rank exchange; None: the worker runs it."""
        if not isinstance(array, np.ndarray) or array.dtype in WIDER:  # (not an array: refused on the way)
            return None
        nbytes = array.nbytes
        comm = self._node if self.nodes == 1 else self._world if nbytes < self._min_bytes else None
        if comm is None or nbytes <= INLINE_ALLREDUCE_BYTES or exchanged(comm.Get_size(), array.dtype, self._ufunc(op)):
            return comm
        return None

    def reduce_now(self, array: np.ndarray, op: Any, out: np.ndarray | None) -> np.ndarray:
        """The reduction itself, once every rank has passed the exchange (blocking: all ranks run it together)."""
        if not isinstance(op, self._MPI.Op):  # a reduction function, applied outside MPI
            flat = np.ascontiguousarray(array).reshape(-1)
            total = np.empty_like(flat)
            self._combine_stages(flat, total, op)
            result = total.reshape(array.shape)
            if out is None:
                return result
            np.copyto(out, result)
            return out
        wide = WIDER.get(array.dtype, array.dtype)
        flat = np.ascontiguousarray(array, dtype=wide).reshape(-1)
        if out is not None and out.dtype == wide and out.flags.c_contiguous:
            self._reduce(flat, out.reshape(-1), op)  # straight into the caller's buffer (in place if it is the array)
            return out
        total = np.empty_like(flat)
        self._reduce(flat, total, op)
        result = total.reshape(array.shape).astype(array.dtype, copy=False)
        if out is None:
            return result
        np.copyto(out, result)
        return out

    def _until_done(self, requests: list, spin_s: float, longest_sleep_s: float) -> None:
        """Return once ``requests`` are complete: polled for ``spin_s``, then with sleeps of a quarter of the wait so
        far, 20 µs to ``longest_sleep_s`` (Open MPI moves data only while polled; a wait grows a quarter at most)."""
        started = time.perf_counter()
        while not self._MPI.Request.Testall(requests):
            waited = time.perf_counter() - started
            if waited > spin_s:
                time.sleep(min(max(waited / 4, 20e-6), longest_sleep_s))
            else:
                os.sched_yield()

    def _reduce(self, flat: np.ndarray, total: np.ndarray, op: Any) -> None:
        if self.nodes == 1:
            self._allreduce(self._node, flat, total, op)
        elif flat.nbytes < self._min_bytes:
            self._allreduce(self._world, flat, total, op)
        else:
            if np.shares_memory(flat, total):
                flat = flat.copy()  # the stages read every rank's copy after writing their own share
            self._three_stages(flat, total, op)

    def _allreduce(self, comm: Comm, flat: np.ndarray, total: np.ndarray, op: Any) -> None:
        """MPI's own Allreduce of ``flat`` into ``total`` (in place where they are one buffer), in pieces."""
        in_place = np.shares_memory(flat, total)
        step = max(1, self._piece_bytes // flat.itemsize) if self._piece_bytes else max(1, flat.size)
        for start in range(0, max(flat.size, 1), step):
            piece = total[start : start + step]
            comm.Allreduce(self._MPI.IN_PLACE if in_place else flat[start : start + step], piece, op)

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

    def _move(self, comm: Comm, sends: list[tuple[np.ndarray, int]], receives: list[tuple[np.ndarray, int]]) -> None:
        """Point-to-point messages (buffer, rank) sent and received on ``comm``, polled with sleeps until done."""
        requests = [comm.Irecv(buffer, rank, _STAGE_TAG) for buffer, rank in receives]
        requests += [comm.Isend(buffer, rank, _STAGE_TAG) for buffer, rank in sends]
        self._until_done(requests, _MOVE_SPIN_S, _MOVE_SLEEP_S)

    def _swap(self, pair: Comm, piece: np.ndarray, theirs: np.ndarray) -> None:
        """``piece`` sent to the other rank of a two-rank communicator, and its piece received into ``theirs``."""
        partner = 1 - pair.Get_rank()
        self._move(pair, [(piece, partner)], [(theirs, partner)])

    def _others_copies(self, grouped: np.ndarray, counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(every local rank's copy of this rank's blocks, one row each in local-rank order, this rank's own row
        left unset; where each local rank's blocks start in ``grouped``), this rank's copies of theirs sent."""
        me, ranks = self.local_rank, self.local_size
        nbytes = ranks * counts[me] * grouped.dtype.itemsize
        copies = self.kept_copies(nbytes).view(grouped.dtype).reshape(ranks, counts[me])
        starts = _bounds(counts)
        others = [r for r in range(ranks) if r != me]
        sends = [(grouped[starts[r] : starts[r + 1]], r) for r in others]
        self._move(self._node, sends, [(copies[r], r) for r in others])
        return copies, starts

    def kept_copies(self, nbytes: int) -> np.ndarray:
        if self._copies_buffer.nbytes < nbytes:
            self._copies_buffer = np.empty(nbytes, np.uint8)
        return self._copies_buffer[:nbytes]

    def _every_copy(self, grouped: np.ndarray, counts: list[int]) -> np.ndarray:
        """Every local rank's copy of this rank's blocks, one row each in local-rank order."""
        copies, starts = self._others_copies(grouped, counts)
        copies[self.local_rank] = grouped[starts[self.local_rank] : starts[self.local_rank + 1]]
        return copies

    def _node_reduce_scatter(
        self, grouped: np.ndarray, mine: np.ndarray, counts: list[int], op: Any, ufunc: np.ufunc | None
    ) -> None:
        """This rank's blocks reduced over its node into ``mine`` (see the module's docstring, stage 1); ``ufunc``
        is numpy's twin of ``op``, if it has one."""
        if ufunc is None:
            self._node.Reduce_scatter(grouped, mine, counts, op)
            return
        copies, starts = self._others_copies(grouped, counts)
        me = self.local_rank
        rows = [grouped[starts[me] : starts[me + 1]] if r == me else copies[r] for r in range(self.local_size)]
        _fold(ufunc, rows, mine)

    def _ufunc(self, op: Any) -> np.ufunc | None:
        return self._ufuncs.get(op.py2f()) if isinstance(op, self._MPI.Op) else None

    def _layout(self, count: int) -> tuple[list[int], np.ndarray, list[int]]:
        """(elements per block, block starts, elements per local rank) of a buffer of ``count``."""
        sizes = block_rows(count, self.blocks)
        starts = _bounds(sizes)
        counts = [sum(sizes[b] for b in range(self.blocks) if b % self.local_size == r) for r in range(self.local_size)]
        return sizes, starts, counts

    def _grouped(self, flat: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The buffer with each local rank's blocks side by side, in local-rank order."""
        if self._in_order:
            return flat
        return np.concatenate([flat[starts[b] : starts[b + 1]] for b in self._by_owner])

    def _gather_blocks(self, mine: np.ndarray, total: np.ndarray, starts: np.ndarray, counts: list[int]) -> None:
        """Every local rank's blocks gathered in the node and put back in buffer order."""
        gathered = total if self._in_order else np.empty_like(total)
        at = _bounds(counts)
        others = [r for r in range(self.local_size) if r != self.local_rank]
        own = gathered[at[self.local_rank] : at[self.local_rank + 1]]
        if not np.may_share_memory(own, mine):
            own[...] = mine
        self._move(self._node, [(mine, r) for r in others], [(gathered[at[r] : at[r + 1]], r) for r in others])
        if not self._in_order:
            offset = 0
            for block in self._by_owner:
                size = starts[block + 1] - starts[block]
                total[starts[block] : starts[block + 1]] = gathered[offset : offset + size]
                offset += size

    def _three_stages(self, flat: np.ndarray, total: np.ndarray, op: Any) -> None:
        sizes, starts, counts = self._layout(flat.size)
        if self._in_order:  # this rank's blocks are reduced where they end up: no copy of them in the last stage
            at = _bounds(counts)
            mine = total[at[self.local_rank] : at[self.local_rank + 1]]
        else:
            mine = self._scratch(counts[self.local_rank], flat.dtype)
        ufunc = self._ufunc(op)
        self._node_reduce_scatter(self._grouped(flat, starts), mine, counts, op, ufunc)
        offset, cross_comms = 0, self._cross_comms()
        for block in self.owned:
            piece, cross = mine[offset : offset + sizes[block]], cross_comms[block]
            if cross.Get_size() == 2 and ufunc is not None:  # exchanged, and reduced in node order on both nodes
                for requests in rounds(cross, ufunc, piece, piece, self.kept_copies(room(piece))):
                    self._until_done(requests, _MOVE_SPIN_S, _MOVE_SLEEP_S)
            elif cross.Get_size() == 2:  # a + b == b + a bit for bit: both ends of an allreduce agree
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
                if cross.Get_size() == 2:
                    self._swap(cross, piece, partials[1 - cross.Get_rank()])
                    partials[cross.Get_rank()] = piece
                else:
                    cross.Allgather(piece, partials)
                piece[...] = combine(partials)  # node order, the same on every node
                offset += sizes[block]
        self._gather_blocks(mine, total, starts, counts)


def _fold(ufunc: np.ufunc, rows: list[np.ndarray], out: np.ndarray) -> None:
    """``out`` = the rows reduced by ``ufunc`` in order, first to last (the bits of ``ufunc.reduce`` on them
    stacked, without stacking them)."""
    if len(rows) == 1:
        np.copyto(out, rows[0])
        return
    ufunc(rows[0], rows[1], out=out)
    for row in rows[2:]:
        ufunc(out, row, out=out)


def _bounds(sizes: list[int]) -> np.ndarray:
    """Where consecutive pieces of ``sizes`` start, and where the last one ends (``len(sizes) + 1`` offsets)."""
    return np.concatenate([[0], np.cumsum(sizes)]).astype(int)
