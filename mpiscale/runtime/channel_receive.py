"""A channel's receiving end (see :mod:`.channels`): headers through a ring posted ahead, data into buffers
posted ahead or of its own size, each lane's arrays delivered in the order they were sent.

This is the reference; ``_wire.ChannelReceiver`` is its compiled twin, which takes the common arrivals in C (an
inline array, or one whose data has filled its lane's buffer, with nothing of its lane before it; an array that fits
its lane's buffer, queued until its data lands) and hands the rest to the reference it holds, so the rare cases and
every refusal have one implementation.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from ..ranks import Comm, chunks
from .channel_format import (
    DTYPES,
    FIT,
    HEADER_TAG,
    HEADER_WORDS,
    INLINE,
    INLINE_BYTES,
    MAGIC,
    MAX_DIMS,
    OVER,
    SHAPE,
    Arrival,
    Lane,
    data_tags,
    header_bytes,
)
from .errors import TransportError

#: ``deliver(source, lane, key, array)``: an array arrived (``array`` may be a view of a buffer posted ahead).
Deliver = Callable[[int, int, tuple[int, int, int], np.ndarray], None]

RING = 8  # header receives posted ahead for any source
KEPT_BUFFERS = 4  # buffers a (peer, lane) keeps for reuse; more in use at once are made and let go


class Counts(Protocol):
    """What a receiver counts of the arrays it delivers (the progress engine: its traffic)."""

    messages_received: int
    bytes_received: int


class Receiver:
    """The receiving end of a channel on ``comm``: ``poll`` takes what arrived and delivers it."""

    def __init__(self, MPI: ModuleType, comm: Comm, counts: Counts, name: str, lanes: int, chunk_bytes: int,
                 deliver: Deliver) -> None:  # fmt: skip
        self.MPI, self.comm, self.counts, self.name, self.lanes = MPI, comm, counts, name, lanes
        self.chunk_bytes, self.deliver = chunk_bytes, deliver
        self.receiving: dict[tuple[int, int], Lane] = {}
        self.slots = np.zeros((RING, 8 * HEADER_WORDS + INLINE_BYTES), np.uint8)  # headers posted ahead
        self.ring: deque[tuple[int, Any]] = deque()
        self._status = MPI.Status()
        self.over: list[tuple[Any, Callable[[], None]]] = []  # receives of over data, and what follows each
        self.fitting: dict[Lane, None] = {}  # lanes awaiting fit data (a dict: ordered, as a set is not)
        for slot in range(RING):
            self.post_header(slot)

    def post_header(self, slot: int) -> None:
        request = self.comm.Irecv([self.slots[slot], self.MPI.BYTE], self.MPI.ANY_SOURCE, HEADER_TAG)
        self.ring.append((slot, request))

    def poll(self) -> bool:
        """Take the headers that arrived (in the order they matched) and the data that arrived; deliver each lane's
        arrays in order as they complete. Whether anything happened."""
        progressed = False
        status = self._status
        ring = self.ring
        while ring[0][1].Test(status):
            slot, _ = ring.popleft()
            self.header_arrived(status.Get_source(), self.slots[slot], status.Get_count(self.MPI.BYTE))
            self.post_header(slot)
            progressed = True
        for state in list(self.fitting) if self.fitting else ():
            while state.fits and state.request.Test():
                self._fit_arrived(state)
                progressed = True
            if not state.fits:
                del self.fitting[state]
        if self.over:
            progressed |= self.poll_over()
        return progressed

    def poll_over(self) -> bool:
        """Run what follows each receive of over data that completed; whether any did."""
        done = set(self.MPI.Request.Testsome([request for request, _ in self.over]) or ())
        if not done:
            return False
        finished = [self.over[i][1] for i in done]
        self.over = [entry for i, entry in enumerate(self.over) if i not in done]
        for then in finished:
            then()
        return True

    def header_arrived(self, source: int, slot: np.ndarray, count: int) -> None:
        """A header (and an inline array's bytes after it) arrived in ``slot``, ``count`` bytes."""
        lane, mode, nbytes, dtype, shape, key = self._read(source, slot[: 8 * HEADER_WORDS].view(np.int64), count)
        state = self.receiving.get((source, lane))
        if state is None:
            state = self.receiving[(source, lane)] = Lane(source, lane, data_tags(lane))
        arrival = Arrival(key, nbytes, dtype, shape)
        state.arrivals.append(arrival)
        if mode == INLINE:
            start = header_bytes(len(shape))
            arrival.memory = slot[start : start + nbytes].copy()  # (the slot takes the next header)
            self.deliver_ready(state)
            return
        if mode == FIT:
            if state.capacity is None or nbytes > state.capacity:
                posted = "no buffer (nothing came on it before)" if state.capacity is None else \
                    f"a buffer of {state.capacity} bytes"  # fmt: skip
                raise TransportError(f"channel {self.name!r}: rank {source} sent {nbytes} bytes on lane {lane} as "
                                     f"fitting the lane's buffer, and it has {posted}")  # fmt: skip
            state.fits.append(arrival)
            self.fitting[state] = None
            return
        memory = np.empty(nbytes, np.uint8)
        pieces = list(chunks(memoryview(memory), self.chunk_bytes))
        left = [len(pieces)]

        def piece_arrived() -> None:
            left[0] -= 1
            if left[0] == 0:
                arrival.memory = memory
                self.deliver_ready(state)

        for piece in pieces:
            self.over.append((self.comm.Irecv([piece, self.MPI.BYTE], source, state.tags[1]), piece_arrived))
        if state.capacity is None and nbytes <= self.chunk_bytes:  # the sender's rule: the lane's capacity is
            state.capacity = nbytes  # known now, so its first fit receive is posted ahead
            self.post_fit(state)

    def _read(self, source: int, header: np.ndarray, count: int) -> tuple:
        """A header's fields, checked against each other and the ``count`` bytes its message held: (lane, mode,
        bytes, dtype, shape, key)."""
        magic, lane, mode, nbytes, k0, k1, k2, code, ndim, *dims = header.tolist()
        dtype = DTYPES.get(code)
        shape = tuple(dims[:ndim]) if 0 <= ndim <= MAX_DIMS else ()
        expected = header_bytes(len(shape)) + (nbytes if mode == INLINE else 0)
        problem = None
        if magic != MAGIC or count < 8 * SHAPE:
            problem = "is not one of its headers"
        elif not (0 <= lane < self.lanes and mode in (OVER, FIT, INLINE) and 0 <= ndim <= MAX_DIMS
                  and 0 <= nbytes and (mode != INLINE or nbytes <= INLINE_BYTES)):  # fmt: skip
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

    def post_fit(self, state: Lane) -> None:
        """Post the fit receive of a lane ahead, into a buffer nothing else holds."""
        assert state.capacity is not None
        buffer = _unheld(state.buffers)
        if buffer is None:
            buffer = np.empty(state.capacity, np.uint8)
            if len(state.buffers) < KEPT_BUFFERS:
                state.buffers.append(buffer)
        state.posted = buffer
        state.request = self.comm.Irecv([buffer, self.MPI.BYTE], state.source, state.tags[0])

    def _fit_arrived(self, state: Lane) -> None:
        arrival = state.fits.popleft()
        arrival.memory = state.posted
        state.posted = state.request = None
        self.post_fit(state)
        self.deliver_ready(state)

    def deliver_ready(self, state: Lane) -> None:
        """Deliver the lane's arrays that are complete, up to the first that is not (the order they were sent)."""
        arrivals, counts = state.arrivals, self.counts
        while arrivals and arrivals[0].memory is not None:
            arrival = arrivals.popleft()
            counts.messages_received += 1
            counts.bytes_received += arrival.nbytes + header_bytes(len(arrival.shape))  # as the sender counts
            memory = arrival.memory
            assert memory is not None  # (the loop's condition)
            array = memory[: arrival.nbytes].view(arrival.dtype).reshape(arrival.shape)
            arrival.memory = None
            self.deliver(state.source, state.lane, arrival.key, array)

    def cancel(self) -> None:
        """Cancel the receives posted ahead (at the job's end, when every sent array has arrived)."""
        requests = [request for _, request in self.ring]
        requests += [state.request for state in self.receiving.values() if state.request is not None]
        for request in requests:
            request.Cancel()
        self.MPI.Request.Waitall(requests)


def _unheld(buffers: list[np.ndarray]) -> np.ndarray | None:
    """The first of ``buffers`` that nothing but the list refers to (no view of it handed out is alive)."""
    for i in range(len(buffers)):
        if sys.getrefcount(buffers[i]) == 2:  # the list's reference and the argument's
            return buffers[i]
    return None
