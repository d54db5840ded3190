"""Arrays between ranks without pickle, received into buffers posted ahead.

A :class:`Channel` carries numpy arrays point to point (a pipeline stage's
activations and gradients, a compiled graph's edge values) on a communicator
of its own. A message is a fixed header (its lane, a key of three integers,
the dtype and shape) and then the array's bytes as they lie in memory. An
array of at most ``INLINE_BYTES`` travels in its header's message, one MPI
message in all, and is copied out of it on arrival (a copy of 4 KiB costs less
than a second message).

Each (peer, lane) has a capacity: the size of the first larger array sent on
it. An array that fits travels on the lane's *fit* tag, whose receive the receiver
posted ahead into a buffer of that capacity, so it lands in place: nothing is
unpickled, copied again or rebuilt, and the receiver is handed a view of the
buffer. A bigger array, and a lane's first, travels on the lane's *over* tag
and is received, once its header has arrived, into memory of its own size.
Both ends decide fit or over by the same rule from the same history, so
nothing is negotiated per message and shapes may vary from one to the next.

A buffer is posted again only when nothing outside the channel refers to it
(a view handed out keeps it, and its reference count says so); otherwise a
new one is made. An array handed out therefore stays valid as long as it is
held, however far the sender runs ahead.

Headers from every source arrive on one tag, through a ring of receives posted
for any source; MPI keeps each sender's order per tag, so the arrays of a
(peer, lane) arrive in the order they were sent. The progress engine polls the
channel every turn, and an arrived array goes to ``deliver(source, lane, key,
array)`` at once, whether or not anything awaits it yet. A header that is not
one of this channel's (damaged, another program's, a shape that disagrees with
its size or its message's, an object dtype) is a :class:`TransportError`, which
ends the job. The MPI calls of a send are the message path's (``wire``): the
compiled ones where they are built.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from ..ranks import Comm, chunks
from . import wire
from .config import RuntimeConfig
from .errors import TransportError
from .progress import ProgressEngine

#: ``deliver(source, lane, key, array)``: an array arrived (``array`` may be a view of a buffer posted ahead).
Deliver = Callable[[int, int, tuple[int, int, int], np.ndarray], None]

_MAGIC = 0x6D70_6973_6368_616E  # "mpischan"
_HEADER_WORDS = 16  # magic, lane, mode, bytes, key (3), dtype, ndim, shape (up to 7)
_OVER, _FIT, _INLINE = 0, 1, 2  # how an array's bytes travel: on the over tag, the fit tag, or after its header
#: Arrays of at most this many bytes travel in their header's message (one message; the receiver copies them out).
INLINE_BYTES = 4096
_MAX_DIMS = 7
_SHAPE = 9  # the word where the shape begins
_HEADER_TAG = 0
_RING = 8  # header receives posted ahead for any source
_KEPT_BUFFERS = 4  # buffers a (peer, lane) keeps for reuse; more in use at once are made and let go
#: The dtypes a channel carries (plain numbers, in either byte order), by a code the header holds, and back.
_DTYPES = {i: np.dtype(order + char) for i, (char, order) in enumerate(
    (char, order) for char in "?bBhHiIlLqQefdFD" for order in "<>")}  # fmt: skip
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


def _data_tags(lane: int) -> tuple[int, int]:
    """The (fit, over) tags of ``lane``."""
    return 2 * lane + 1, 2 * lane + 2


@dataclass(eq=False)
class _Lane:
    """One (peer, lane) seen from this rank: what was sent on it, or what is posted to receive on it."""

    source: int  # the peer (the destination of a lane sent on)
    lane: int
    tags: tuple[int, int]  # its (fit, over) data tags
    capacity: int | None = None  # the first array's bytes (None: nothing yet, or too big to post ahead)
    buffers: list[np.ndarray] = field(default_factory=list)  # buffers of ``capacity`` bytes, for reuse
    posted: np.ndarray | None = None  # the buffer of the fit receive posted ahead
    what: str = ""  # a send's description (for diagnostics)
    request: Any = None
    arrivals: deque[_Arrival] = field(default_factory=deque)  # announced by their headers, not yet delivered
    fits: deque[_Arrival] = field(default_factory=deque)  # those of them whose data the fit receives bring


@dataclass(eq=False)
class _Arrival:
    """An array whose header arrived: where its bytes are once they are all here."""

    key: tuple[int, int, int]
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    memory: np.ndarray | None = None


class Channel:
    """Raw arrays to and from any rank of ``comm`` (a communicator of the channel's own; see the module notes)."""

    def __init__(self, MPI: ModuleType, comm: Comm, engine: ProgressEngine, config: RuntimeConfig, name: str,
                 deliver: Deliver) -> None:  # fmt: skip
        self._MPI, self.comm, self._engine, self.name = MPI, comm, engine, name
        self._deliver = deliver
        self._chunk_bytes = config.chunk_bytes
        self._inline_bytes = min(INLINE_BYTES, config.chunk_bytes)
        tag_ub = comm.Get_attr(MPI.TAG_UB)
        assert isinstance(tag_ub, int), tag_ub  # MPI sets it on every communicator
        self.lanes = (tag_ub - 2) // 2  # lanes 0 .. lanes-1 have tags
        self._sending: dict[tuple[int, int], _Lane] = {}
        self._receiving: dict[tuple[int, int], _Lane] = {}
        self._slots = np.zeros((_RING, 8 * _HEADER_WORDS + INLINE_BYTES), np.uint8)  # headers posted ahead
        self._ring: deque[tuple[int, Any]] = deque()
        self._status = MPI.Status()
        self._endpoint = wire.chosen()[0].Endpoint(MPI, comm)
        self._over: list[tuple[Any, Callable[[], None]]] = []  # receives of over data, and what follows each
        self._fitting: dict[_Lane, None] = {}  # lanes awaiting fit data (a dict: ordered, as a set is not)
        for slot in range(_RING):
            self._post_header(slot)
        engine.pollers.append(self.poll)
        self.closed = False

    # ---------------------------------------------------------------- sending
    def send(self, dest: int, lane: int, key: tuple[int, int, int], array: np.ndarray) -> None:
        """Send ``array`` (C-contiguous, of plain numbers) to rank ``dest`` on ``lane`` with ``key``; it is kept
        alive until MPI is done with it, and must not be changed before then."""
        state = self._sending.get((dest, lane))
        if state is None:
            state = self._sending[(dest, lane)] = self._sending_lane(dest, lane)
        code = _CODES.get(array.dtype) if isinstance(array, np.ndarray) else None
        if code is None or array.ndim > _MAX_DIMS or not array.flags.c_contiguous or self.closed:
            self._refuse(array)
        nbytes = array.nbytes
        if nbytes <= self._inline_bytes:
            mode = _INLINE
        else:
            capacity = state.capacity
            mode = _FIT if capacity is not None and nbytes <= capacity else _OVER
            if capacity is None and nbytes <= self._chunk_bytes:
                state.capacity = nbytes  # the same rule the receiver applies to the header
        engine, tag = self._engine, state.tags[0 if mode == _FIT else 1]
        fields = (_MAGIC, lane, mode, nbytes, *key, code)
        if nbytes <= self._chunk_bytes:  # (the compiled path's calls, or the reference's)
            for request in self._endpoint.send_array(dest, _HEADER_TAG, tag, fields, array, mode == _INLINE):
                engine.track(request, state.what, None)
        else:
            comm, MPI = self.comm, self._MPI
            header = wire.channel_header(fields, array)  # (never inline: too big)
            engine.track(comm.Isend([header, MPI.BYTE], dest, _HEADER_TAG), state.what, header)
            for piece in chunks(memoryview(array).cast("B"), self._chunk_bytes):
                engine.track(comm.Isend([piece, MPI.BYTE], dest, tag), state.what, array)
        engine.count_sent(1, nbytes + 8 * (_SHAPE + array.ndim))
        engine.kick()

    def _sending_lane(self, dest: int, lane: int) -> _Lane:
        if not (isinstance(lane, int) and 0 <= lane < self.lanes):
            raise ValueError(f"channel {self.name!r}: lane {lane!r} is outside 0..{self.lanes - 1}")
        return _Lane(dest, lane, _data_tags(lane), what=f"channel {self.name!r} lane {lane} to rank {dest}")

    def _refuse(self, array: object) -> None:
        """Say why ``array`` cannot be sent."""
        if self.closed:
            raise RuntimeError(f"channel {self.name!r} is closed")
        if isinstance(array, np.ndarray) and array.dtype in _CODES and array.ndim <= _MAX_DIMS:
            raise ValueError(f"channel {self.name!r} sends C-contiguous arrays (np.ascontiguousarray makes one)")
        what = f"{array.dtype} array of {array.ndim} dims" if isinstance(array, np.ndarray) else type(array).__name__
        raise TypeError(f"channel {self.name!r} sends numpy arrays of plain numbers (bool, integers, floats, "
                        f"complex) and at most {_MAX_DIMS} dims, got a {what}")  # fmt: skip

    # -------------------------------------------------------------- receiving
    def _post_header(self, slot: int) -> None:
        request = self.comm.Irecv([self._slots[slot], self._MPI.BYTE], self._MPI.ANY_SOURCE, _HEADER_TAG)
        self._ring.append((slot, request))

    def poll(self) -> bool:
        """Take the headers that arrived (in the order they matched) and the data that arrived; deliver each lane's
        arrays in order as they complete. Whether anything happened."""
        progressed = False
        status = self._status
        ring = self._ring
        while ring[0][1].Test(status):
            slot, _ = ring.popleft()
            self._header_arrived(status.Get_source(), self._slots[slot], status.Get_count(self._MPI.BYTE))
            self._post_header(slot)
            progressed = True
        for state in list(self._fitting) if self._fitting else ():
            while state.fits and state.request.Test():
                self._fit_arrived(state)
                progressed = True
            if not state.fits:
                del self._fitting[state]
        if self._over:
            done = set(self._MPI.Request.Testsome([request for request, _ in self._over]) or ())
            if done:
                finished = [self._over[i][1] for i in done]
                self._over = [entry for i, entry in enumerate(self._over) if i not in done]
                for then in finished:
                    then()
                progressed = True
        return progressed

    def _header_arrived(self, source: int, slot: np.ndarray, count: int) -> None:
        """A header (and an inline array's bytes after it) arrived in ``slot``, ``count`` bytes."""
        lane, mode, nbytes, dtype, shape, key = self._read(source, slot[: 8 * _HEADER_WORDS].view(np.int64), count)
        state = self._receiving.get((source, lane))
        if state is None:
            state = self._receiving[(source, lane)] = _Lane(source, lane, _data_tags(lane))
        arrival = _Arrival(key, nbytes, dtype, shape)
        state.arrivals.append(arrival)
        if mode == _INLINE:
            start = 8 * (_SHAPE + len(shape))
            arrival.memory = slot[start : start + nbytes].copy()  # (the slot takes the next header)
            self._deliver_ready(state)
            return
        if mode == _FIT:
            if state.capacity is None or nbytes > state.capacity:
                posted = "no buffer (nothing came on it before)" if state.capacity is None else \
                    f"a buffer of {state.capacity} bytes"  # fmt: skip
                raise TransportError(f"channel {self.name!r}: rank {source} sent {nbytes} bytes on lane {lane} as "
                                     f"fitting the lane's buffer, and it has {posted}")  # fmt: skip
            state.fits.append(arrival)
            self._fitting[state] = None
            return
        memory = np.empty(nbytes, np.uint8)
        pieces = list(chunks(memoryview(memory), self._chunk_bytes))
        left = [len(pieces)]

        def piece_arrived() -> None:
            left[0] -= 1
            if left[0] == 0:
                arrival.memory = memory
                self._deliver_ready(state)

        for piece in pieces:
            self._over.append((self.comm.Irecv([piece, self._MPI.BYTE], source, state.tags[1]), piece_arrived))
        if state.capacity is None and nbytes <= self._chunk_bytes:  # the sender's rule: the lane's capacity is
            state.capacity = nbytes  # known now, so its first fit receive is posted ahead
            self._post_fit(state)

    def _read(self, source: int, header: np.ndarray, count: int) -> tuple:
        """A header's fields, checked against each other and the ``count`` bytes its message held: (lane, mode,
        bytes, dtype, shape, key)."""
        magic, lane, mode, nbytes, k0, k1, k2, code, ndim, *dims = header.tolist()
        dtype = _DTYPES.get(code)
        shape = tuple(dims[:ndim]) if 0 <= ndim <= _MAX_DIMS else ()
        expected = 8 * (_SHAPE + len(shape)) + (nbytes if mode == _INLINE else 0)
        problem = None
        if magic != _MAGIC or count < 8 * _SHAPE:
            problem = "is not one of its headers"
        elif not (0 <= lane < self.lanes and mode in (_OVER, _FIT, _INLINE) and 0 <= ndim <= _MAX_DIMS
                  and 0 <= nbytes and (mode != _INLINE or nbytes <= INLINE_BYTES)):  # fmt: skip
            problem = f"has lane {lane}, mode {mode}, {ndim} dims, {nbytes} bytes"
        elif dtype is None:
            problem = f"names no dtype of plain numbers (code {code})"
        elif min(shape, default=0) < 0 or math.prod(shape) * dtype.itemsize != nbytes:
            problem = f"gives shape {shape} of {dtype} for {nbytes} bytes"
        elif count != expected:
            problem = f"came in a message of {count} bytes, not {expected}"
        if problem is not None:
            raise TransportError(f"channel {self.name!r}: a header from rank {source} {problem}: damaged, or not "
                                 "from this program")  # fmt: skip
        return lane, mode, nbytes, dtype, shape, (k0, k1, k2)

    def _post_fit(self, state: _Lane) -> None:
        """Post the fit receive of a lane ahead, into a buffer nothing else holds."""
        assert state.capacity is not None
        buffer = _unheld(state.buffers)
        if buffer is None:
            buffer = np.empty(state.capacity, np.uint8)
            if len(state.buffers) < _KEPT_BUFFERS:
                state.buffers.append(buffer)
        state.posted = buffer
        state.request = self.comm.Irecv([buffer, self._MPI.BYTE], state.source, state.tags[0])

    def _fit_arrived(self, state: _Lane) -> None:
        arrival = state.fits.popleft()
        arrival.memory = state.posted
        state.posted = state.request = None
        self._post_fit(state)
        self._deliver_ready(state)

    def _deliver_ready(self, state: _Lane) -> None:
        """Deliver the lane's arrays that are complete, up to the first that is not (the order they were sent)."""
        arrivals, engine = state.arrivals, self._engine
        while arrivals and arrivals[0].memory is not None:
            arrival = arrivals.popleft()
            engine.messages_received += 1
            engine.bytes_received += arrival.nbytes + 8 * (_SHAPE + len(arrival.shape))  # as the sender counts
            memory = arrival.memory
            assert memory is not None  # (the loop's condition)
            array = memory[: arrival.nbytes].view(arrival.dtype).reshape(arrival.shape)
            arrival.memory = None
            self._deliver(state.source, state.lane, arrival.key, array)

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Cancel the receives posted ahead (at the job's end, when every sent array has arrived) and free the
        communicator."""
        if self.closed:
            return
        self.closed = True
        self._engine.pollers.remove(self.poll)
        requests = [request for _, request in self._ring]
        requests += [state.request for state in self._receiving.values() if state.request is not None]
        for request in requests:
            request.Cancel()
        self._MPI.Request.Waitall(requests)
        self.comm.Free()


def _unheld(buffers: list[np.ndarray]) -> np.ndarray | None:
    """The first of ``buffers`` that nothing but the list refers to (no view of it handed out is alive)."""
    for i in range(len(buffers)):
        if sys.getrefcount(buffers[i]) == 2:  # the list's reference and the argument's
            return buffers[i]
    return None
