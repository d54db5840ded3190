"""Awaitable collectives on non-blocking MPI, so actors keep serving while they run.

All ranks of a communicator must start its collectives in the same order, as in
MPI. Each :class:`Communicator` wraps its own duplicate of the MPI communicator,
so collectives never match the runtime's point-to-point traffic.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Concatenate, NoReturn, ParamSpec, TypeVar

import numpy as np

from ..ranks import COUNT_LIMIT, Comm, block_rows, by_ranks, chunks, problem_text, raise_agreed, world_ranks
from . import transport, wire
from .abandoned import CollectiveLog
from .config import RuntimeConfig
from .errors import CollectiveMismatch, signature_digest
from .mpi_arrays import apart, narrowed, out_for_mpi, reducible, widened, words, words_each
from .nan_ops import nan_keeping
from .pair_reduce import UFUNCS, exchanged, mpi_ops, room
from .progress import ProgressEngine
from .settling import reduce_pair, settle


@functools.lru_cache(maxsize=1024)
def described(dtype: np.dtype, shape: tuple[int, ...], rest: str) -> str:
    """A collective's arguments as its check compares and its report names them: ``float32(1024,) sum`` (kept: numpy
    takes microseconds to name a dtype, longer than a small collective)."""
    return f"{dtype}{shape} {rest}" if rest else f"{dtype}{shape}"


def part_offsets(counts: np.ndarray) -> np.ndarray:
    """Where each rank's part starts."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


P = ParamSpec("P")
R = TypeVar("R")


def _collective(
    method: Callable[Concatenate[Communicator, P], Awaitable[R]],
) -> Callable[Concatenate[Communicator, P], Awaitable[R]]:
    """Record the call in the communicator's log while it runs (how an abandoned collective is found), and run the
    communicator's calls one at a time, in the order they were made.

    A call's MPI operations are posted in steps (its check, then its data, in as many steps as it needs), each after
    an await. Two calls in flight at once could interleave their steps in one order on one rank and in another on
    a rank that came late, and MPI would match one call's data with the other's: two allgathers started together on
    two ranks, one of them 5 ms late, ended in MPI_ERR_TRUNCATE (2026-11-29). Calls made together still overlap
    with everything else the loop runs, and with other communicators' calls."""
    operation = method.__name__

    @functools.wraps(method)
    async def logged(self: Communicator, *args: P.args, **kwargs: P.kwargs) -> R:
        number, posted = self.log.begin(operation), self._posted
        try:
            await self._one_at_a_time.acquire()  # FIFO: the calls start in call order, the same on every rank
            try:
                return await method(self, *args, **kwargs)
            finally:
                self._one_at_a_time.release()
        except BaseException:
            if self._posted == posted:  # refused before any MPI call: the other ranks need not match it
                self.log.cancel(number)
            raise
        finally:
            self.log.end(number)

    return logged


#: How many calls' rows (:meth:`Communicator._row`) a communicator keeps: more than a program's distinct calls.
_KEPT_ROWS = 1024

#: A reduction applied outside MPI: the contributions stacked in rank order (rows) -> the reduced row.
Reduction = Callable[[np.ndarray], np.ndarray]


class Communicator:
    """Awaitable collectives over one MPI communicator."""

    def __init__(self, MPI: ModuleType, comm: Comm, engine: ProgressEngine, config: RuntimeConfig, name: str) -> None:
        self._MPI = MPI
        self.comm = comm
        self._engine = engine
        self._config = config
        self.name = name
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self._ops = mpi_ops(MPI)
        #: The collectives this rank started here, and those still pending.
        self.log = CollectiveLog(name, world_ranks(comm))
        self._posted = 0  # MPI requests started, to tell a refused call from one that reached MPI
        self._spin_s = config.value_spin_us * 1e-6
        self._one_at_a_time = asyncio.Lock()  # see _collective
        self._spare: np.ndarray | None = None  # the receive buffer of two-rank allreduces, kept: its largest call's
        self._pair = wire.chosen()[0].PairExchange(MPI, comm, comm) if self.size == 2 else None
        self._rows: dict[str, np.ndarray] = {}  # see _row

    def __repr__(self) -> str:
        return f"Communicator({self.name!r}, rank {self.rank} of {self.size})"

    @property
    def world_ranks(self) -> tuple[int, ...]:
        """The world rank of each member, in this communicator's rank order."""
        return self.log.members

    async def _wait(self, request, what: str, keep: object = None) -> None:
        self._posted += 1
        await settle(self._engine, request, f"{what} on {self.name}", keep, self._spin_s)

    def _op(self, op: str, dtype: np.dtype | None = None):
        """MPI's operation ``op``; for floating-point ``dtype`` min and max that keep NaNs, as numpy's do (see
        ``nan_ops``)."""
        try:
            found = self._ops[op]
        except KeyError:
            raise ValueError(f"unknown reduction {op!r}; use one of {', '.join(self._ops)}") from None
        if dtype is not None and dtype.kind == "f" and op in ("min", "max"):
            return nan_keeping(self._MPI, op)
        return found

    @staticmethod
    def _array(array: np.ndarray, what: str) -> np.ndarray:
        """``array`` as MPI takes it: C-contiguous, in the machine's byte order (the same values), its shape kept."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{what} takes a numpy array, got {type(array).__name__}")
        if array.dtype.hasobject:
            raise TypeError(
                f"{what} cannot take object arrays: MPI would move their pointers (bcast takes any picklable object)"
            )
        if array.size > COUNT_LIMIT:
            raise ValueError(f"{what}: {array.size} elements exceed MPI's count limit {COUNT_LIMIT}; split the array")
        if not array.dtype.isnative:  # (mpi4py refuses it)
            return array.astype(array.dtype.newbyteorder("="), order="C")
        return array if array.flags.c_contiguous else np.ascontiguousarray(array)  # (which makes a 0-d array 1-d)

    def _root(self, root: object, what: str) -> int:
        """``root`` where it names a rank of this communicator, else refused before any MPI call (MPI_ERR_ROOT came
        after the check; a negative root indexed the ranks from the end)."""
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ValueError(f"{what}: root must be a rank of {self.name}, 0 to {self.size - 1}, got {root!r}")
        return int(root)

    async def _check(self, what: str, signature: str) -> None:
        """Fail identically on every rank if the ranks are not in the same collective with matching arguments (when
        ``check_collectives`` is on; a collective that needs the exchange anyway calls ``_exchange`` itself)."""
        if self._config.check_collectives and self.size > 1:
            await self._exchange(what, signature)

    async def _exchange(self, what: str, signature: str, mine: int = 0) -> np.ndarray:
        """Every rank's integer ``mine``, gathered in the exchange that begins every collective (and so is a
        barrier); with ``check_collectives`` on it carries a digest of the collective's name and arguments too.

        Whatever two ranks called, their first MPI calls are this same
        allgather, so they match: a mismatch is found here, and every rank's
        call is gathered into one ``CollectiveMismatch`` report, never bytes of
        one collective read as another's. A collective that needs one number
        from every rank anyway (a message's length) gets it in the same round.
        """
        check = self._config.check_collectives
        called = f"{what}({signature})"
        sent = self._row(called, mine)
        every = np.empty((self.size, len(sent)), np.int64)
        await self._wait(self.comm.Iallgather(sent, every), f"{what} check" if check else what, keep=sent)
        digests = every[:, 0].tolist()  # (compared in Python: numpy's compare costs µs)
        if check and digests.count(digests[0]) != self.size:
            await self._mismatched(what, called)
        return every[:, -1]

    async def _mismatched(self, what: str, called: str) -> NoReturn:
        """Raise the one report of a check whose digests differ, naming every rank's call (every rank of the check
        finds the difference, and gathers the calls with the others)."""
        site = f" at {self.log.last[2]}" if self.log.last else ""
        calls = await self._texts(f"{called}{site}", f"the calls behind a mismatched {what}")
        error = CollectiveMismatch(
            f"collective #{self.log.started} on {self.name}: the ranks called different collectives, or passed "
            "different arguments (shape, dtype, op, root), where all must call the same: "
            f"{by_ranks(calls, self.world_ranks)}"
        )
        error.reporter = self.world_ranks[0]  # every rank raises it: one report, the lowest rank's
        raise error

    def _row(self, called: str, mine: int) -> np.ndarray:
        """This rank's row of a collective's first exchange: the digest of ``called`` (the call and its arguments)
        with checks on, then ``mine``. The row of a call that adds no number of its own is kept, read-only (MPI only
        reads it), so a loop of the same call builds it once."""
        row = self._rows.get(called) if mine == 0 else None
        if row is None:
            row = np.array([signature_digest(called), mine] if self._config.check_collectives else [mine], np.int64)
            if mine == 0 and len(self._rows) < _KEPT_ROWS:
                row.flags.writeable = False
                self._rows[called] = row
        return row

    async def _texts(self, text: str | None, what: str, lengths: np.ndarray | None = None) -> list[str | None]:
        """Every rank's ``text`` (None stays None), in rank order; ``lengths``: their lengths in bytes (-1 for None),
        when already gathered."""
        mine = np.frombuffer((text or "").encode(), np.uint8)
        if lengths is None:
            lengths = np.empty(self.size, np.int64)
            length = np.array([len(mine) if text is not None else -1], np.int64)
            await self._wait(self.comm.Iallgather(length, lengths), what, keep=length)
        if (lengths < 0).all():
            return [None] * self.size
        sizes = np.maximum(lengths, 0)
        every = np.empty(int(sizes.sum()), np.uint8)
        offsets = part_offsets(sizes)
        await self._wait(self.comm.Iallgatherv(mine, [every, (sizes, offsets)]), what, keep=mine)
        return [
            every[offset : offset + size].tobytes().decode(errors="replace") if length >= 0 else None
            for offset, size, length in zip(offsets, sizes, lengths)
        ]

    @_collective
    async def agree(self, problem: BaseException | str | None, what: str, kind: type[Exception] = RuntimeError) -> None:
        """All ranks go on, or all raise ``kind`` naming every failing rank and its message (collective).

        The awaitable twin of ``mpiscale.ranks.agree``: the ranks keep serving
        messages while they agree. For checks that must pass on every rank
        before any state changes (a batch's ids on one rank, say).
        """
        text = problem_text(problem)
        lengths = await self._exchange("agree", "", len(text.encode()) if text is not None else -1)
        messages = await self._texts(text, f"agreement on {what}", lengths)
        try:
            raise_agreed(messages, problem, what, kind, lambda: self.world_ranks)
        except kind as agreed:
            agreed.reporter = self.world_ranks[0]  # type: ignore[attr-defined]  # every rank raises it: one report
            raise

    @_collective
    async def barrier(self) -> None:
        """Wait until every rank has reached the barrier (the checked exchange that begins every collective is one)."""
        if self._config.check_collectives:
            await self._exchange("barrier", "")
        else:
            await self._wait(self.comm.Ibarrier(), "barrier")

    @_collective
    async def allreduce(self, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray:
        """Element-wise reduction over all ranks; ``out=array`` reduces in place. The result has the array's shape
        (0-d included) and dtype, in the machine's byte order."""
        data = self._array(array, "allreduce")
        reducible(data, "allreduce", op)
        self._op(op)  # (an unknown one refused here, before any MPI call)
        out_for_mpi(data, out, "allreduce")
        data = apart(data, out)
        signature = described(data.dtype, data.shape, str(op))
        if (sent := widened(data)) is not data:  # float16, reduced in float32
            return narrowed(await self._allreduce(sent, op, None, signature), data.dtype, out)
        return await self._allreduce(data, op, out, signature)  # (``out`` is ``data`` only as the caller's array)

    def _allreduce(self, data: np.ndarray, op: str, out: np.ndarray | None, signature: str) -> Awaitable[np.ndarray]:
        """The allreduce of MPI-ready ``data`` into ``out`` (``data`` itself: in place) or a new array: between two
        ranks swapped and reduced, checked on the way (see pair_reduce), else MPI's own. (The awaitable of the one
        or the other, not a coroutine awaiting it: a coroutine's frame costs a small call 0.2 µs.)"""
        ufunc = exchanged(self.size, data.dtype, UFUNCS.get(op))
        if ufunc is not None:
            return self._pair_allreduce(ufunc, data, out, signature)
        return self._mpi_allreduce(data, op, out, signature)

    async def _mpi_allreduce(self, data: np.ndarray, op: str, out: np.ndarray | None, signature: str) -> np.ndarray:
        await self._check("allreduce", signature)
        mpi_op = self._op(op, data.dtype)
        if out is data:
            await self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, data, mpi_op), "allreduce")
            return data
        result = np.empty_like(data) if out is None else out
        await self._wait(self.comm.Iallreduce(data, result, mpi_op), "allreduce", keep=data)
        return result

    def _take_spare(self, nbytes: int) -> np.ndarray:
        """The kept receive buffer of two-rank allreduces, at least ``nbytes``; the caller puts it back once its
        call has ended (never after a failed wait: MPI may still write into it)."""
        theirs, self._spare = self._spare, None
        return theirs if theirs is not None and theirs.nbytes >= nbytes else np.empty(nbytes, np.uint8)

    async def _pair_allreduce(
        self, ufunc: np.ufunc, data: np.ndarray, out: np.ndarray | None, signature: str
    ) -> np.ndarray:
        """The two-rank allreduce by exchange (``reduce_pair``: its check and its swaps), into ``out`` (``data``
        itself when in place) or a new array."""
        theirs = self._take_spare(room(data))
        result = np.empty_like(data) if out is None else out.reshape(data.shape)
        called = f"allreduce({signature})"
        row = self._row(called, 0) if self._config.check_collectives else None
        self._posted += 1
        what = f"allreduce on {self.name}"
        if await reduce_pair(self._engine, self._pair, row, ufunc, self.rank, data, result, theirs, what,
                             self._spin_s) is not None:  # fmt: skip
            await self._mismatched("allreduce", called)
        self._spare = theirs  # kept for the next call: fresh pages cost page faults
        return result if out is None else out

    @_collective
    async def reduce(
        self, array: np.ndarray, op: str = "sum", root: int = 0, out: np.ndarray | None = None
    ) -> np.ndarray | None:
        """Reduce onto ``root``; returns the result there and None elsewhere; ``out=array`` reduces in place."""
        root = self._root(root, "reduce")
        data = self._array(array, "reduce")
        reducible(data, "reduce", op)
        mpi_op = self._op(op, data.dtype)  # (an unknown one refused here, before any MPI call)
        out_for_mpi(data, out, "reduce")
        data = apart(data, out)
        await self._check("reduce", described(data.dtype, data.shape, f"{op} root={root}"))
        sent = widened(data)  # float16 in float32
        narrow = sent is not data
        if self.rank != root:
            await self._wait(self.comm.Ireduce(sent, None, mpi_op, root), "reduce", keep=sent)
            return None
        if narrow or out is data:  # in place: float16's float32 copy, or the caller's array
            await self._wait(self.comm.Ireduce(self._MPI.IN_PLACE, sent, mpi_op, root), "reduce")
            return narrowed(sent, data.dtype, out) if narrow else data
        result = np.empty_like(data) if out is None else out
        await self._wait(self.comm.Ireduce(data, result, mpi_op, root), "reduce", keep=data)
        return result

    @_collective
    async def bcast_array(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Broadcast ``root``'s array into ``array`` on every rank (same shape everywhere)."""
        root = self._root(root, "bcast_array")
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise TypeError("bcast_array needs a C-contiguous numpy array on every rank")
        if self.rank != root and not array.flags.writeable:  # (mpi4py refuses it after the check, the root's sent)
            rank = self.world_ranks[self.rank]  # (the job's rank, as every line of the job names it)
            raise TypeError(f"bcast_array: rank {rank} receives into its array, which is read-only")
        await self._check("bcast_array", described(array.dtype, array.shape, f"root={root}"))
        await self._wait(self.comm.Ibcast(words(array), root), "bcast")
        return array

    @_collective
    async def bcast(self, obj: object = None, root: int = 0) -> object:
        """Broadcast any picklable object (arrays travel without pickling their data)."""
        MPI = self._MPI
        root = self._root(root, "bcast")
        length = 0
        if self.rank == root:
            encoded = transport.encode(obj, 0, self._config.inline_bytes)
            frame = memoryview(encoded.frame)
            length = frame.nbytes
        lengths = await self._exchange("bcast", f"root={root}", length)  # the root's frame length, to every rank
        if self.rank != root:
            frame = transport.allocate(int(lengths[root]))
        await self._wait(self.comm.Ibcast([frame, MPI.BYTE], root), "bcast")
        header = transport.decode_frame(frame)
        if header.inline_parts is not None:
            return obj if self.rank == root else transport.load(header, header.inline_parts)
        parts = encoded.parts if self.rank == root else [transport.allocate(n) for n in header.sizes]
        for part in parts:
            for piece in chunks(part, self._config.chunk_bytes):
                await self._wait(self.comm.Ibcast([piece, MPI.BYTE], root), "bcast")
        return obj if self.rank == root else transport.load(header, parts)

    @_collective
    async def allgather(self, array: np.ndarray) -> np.ndarray:
        """Stack every rank's array (same shape and dtype): result shape (size, *shape)."""
        data = self._array(array, "allgather")
        await self._check("allgather", described(data.dtype, data.shape, ""))
        result = np.empty((self.size, *data.shape), dtype=data.dtype)
        await self._wait(self.comm.Iallgather(words(data), words(result)), "allgather", keep=data)
        return result

    @_collective
    async def gather(self, array: np.ndarray, root: int = 0) -> np.ndarray | None:
        """Stack every rank's array on ``root``; None elsewhere."""
        root = self._root(root, "gather")
        data = self._array(array, "gather")
        await self._check("gather", described(data.dtype, data.shape, f"root={root}"))
        result = np.empty((self.size, *data.shape), dtype=data.dtype) if self.rank == root else None
        await self._wait(self.comm.Igather(words(data), None if result is None else words(result), root), "gather",
                         keep=data)  # fmt: skip
        return result

    @_collective
    async def alltoallv(self, rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Send ``counts[r]`` rows of ``rows`` (grouped by destination, in rank order) to each rank ``r``.

        Returns (the rows received, stacked in source-rank order; how many came
        from each rank). Row shapes and dtypes must agree; counts may differ.
        """
        data = self._array(rows, "alltoallv")
        if data.ndim == 0:
            raise ValueError("alltoallv sends rows: it needs an array with at least one dimension")
        sent = np.asarray(counts)
        if sent.shape != (self.size,) or sent.dtype.kind not in "iu" or (sent < 0).any() or sent.sum() != len(data):
            raise ValueError(f"alltoallv: {self.size} counts, whole numbers from 0, summing to the {len(data)} rows "
                             f"are needed, got {counts}")  # fmt: skip
        await self._check("alltoallv", described(data.dtype, data.shape[1:], ""))
        sent = np.ascontiguousarray(sent, dtype=np.int64)
        received_counts = np.empty(self.size, np.int64)
        await self._wait(self.comm.Ialltoall(sent, received_counts), "alltoallv counts", keep=sent)
        row = int(np.prod(data.shape[1:], dtype=np.int64)) * words_each(data.dtype)
        result = np.empty((int(received_counts.sum()), *data.shape[1:]), dtype=data.dtype)
        send = [words(data), (sent * row, part_offsets(sent) * row)]
        receive = [words(result), (received_counts * row, part_offsets(received_counts) * row)]
        await self._wait(self.comm.Ialltoallv(send, receive), "alltoallv", keep=data)
        return result, received_counts

    @_collective
    async def reduce_scatter(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce over ranks, then give each rank its block of rows (as ``np.array_split``)."""
        data = self._array(array, "reduce_scatter")
        reducible(data, "reduce_scatter", op)
        mpi_op = self._op(op, data.dtype)  # (an unknown one refused here, before any MPI call)
        if data.ndim == 0:
            raise ValueError("reduce_scatter needs an array with at least one dimension")
        await self._check("reduce_scatter", described(data.dtype, data.shape, str(op)))
        rows = block_rows(data.shape[0], self.size)
        row_elements = int(np.prod(data.shape[1:], dtype=np.int64))
        counts = [r * row_elements for r in rows]
        sent = widened(data)  # float16 in float32
        result = np.empty((rows[self.rank], *data.shape[1:]), dtype=sent.dtype)
        request = self.comm.Ireduce_scatter(sent, result, counts, mpi_op)
        await self._wait(request, "reduce_scatter", keep=sent)
        return result if sent is data else narrowed(result, data.dtype, None)
