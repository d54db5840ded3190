"""Messages on their way in: frames whose parts are still coming, delivered in the order each source sent them.

A frame that carries its message whole is delivered at once (the compiled ``drain`` delivers most of them before
this module sees them). Any other frame waits in its source's queue: its bytes may still be coming, and its parts
(the buffers of a large message) are received only once each one's MPI message is matched with its size checked
(a piece sent longer than its receive would overrun it: Open MPI 4.1's single-copy path writes past a truncated
receive's buffer). A reply's one array goes into the buffer its asker lent for it where one fits
(:mod:`.lending`). A source's messages are delivered in the order it sent them, whatever order their parts finish in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any, Protocol

from ..ranks import Comm, chunks
from . import transport
from .errors import MessageRefused, TransportError
from .lending import Lending, Loan


class Envelopes(Protocol):
    """Where arrived messages go (``dispatch.Dispatch``, or its compiled twin): one, or several from one source."""

    held: bool  # a blocking call holds the event loop while it polls: only STATE questions run where they land

    def envelope(self, source: int, envelope: Any) -> None: ...

    def envelopes(self, source: int, envelopes: list) -> None: ...


class Counts(Protocol):
    """The engine's traffic counters this side adds to."""

    messages_received: int
    bytes_received: int


#: ``watch(request, on_done, what, due)``: the engine tests ``request`` with the others, and calls ``on_done``.
Watch = Callable[[Any, Callable[[], None], str, float], None]


@dataclass
class Inbound:
    """A message from one source being received: its frame, then its parts."""

    source: int
    frame: memoryview
    parts: list = field(default_factory=list)
    missing: int = -1  # part receives still outstanding; -1 until the frame arrived
    header: transport.FrameHeader | None = None
    unmatched: deque = field(default_factory=deque)  # pieces of its parts whose MPI message has not arrived yet
    due: float = 0.0  # the time.monotonic() by which its parts should have moved
    loan: Loan | None = None  # the asker's buffer its one array is received into


class Receiving:
    """The messages each source has begun to send this rank, received and delivered in its order."""

    def __init__(
        self, MPI: ModuleType, comm: Comm, frames: Any, deliver: Envelopes, counts: Counts, watch: Watch,
        due: Callable[[int], float], pool: transport.BufferPool, chunk_bytes: int,
    ) -> None:  # fmt: skip
        self._MPI, self._comm, self._frames, self._counts = MPI, comm, frames, counts
        self._deliver, self._deliver_all = deliver.envelope, deliver.envelopes
        self._watch, self._due, self._pool, self._chunk_bytes = watch, due, pool, chunk_bytes
        tag_ub = comm.Get_attr(MPI.TAG_UB)
        assert isinstance(tag_ub, int), tag_ub  # MPI sets it on every communicator
        self._tag_ub = tag_ub
        self._probe_status = MPI.Status()
        self._memory_bytes = transport.host_memory_bytes()
        #: Each source's messages not yet delivered, in the order it sent them.
        self.queues: dict[int, deque[Inbound]] = {}
        #: Messages whose parts are expected, some of whose pieces' MPI messages have not been matched yet.
        self.unmatched: list[Inbound] = []
        #: Buffers askers lent for their replies.
        self.lending = Lending()

    @property
    def busy(self) -> bool:
        """Whether any source's message is partly received."""
        return any(self.queues.values())

    def frame_found(self, source: int, frame: memoryview, request: Any) -> None:
        """A frame that ``drain`` left: its parts apart, its bytes still coming (``request``), a pickled message,
        or one behind others of its source."""
        arrived = request is None  # eager data is already here
        queue = self.queues.get(source)
        header = None
        if arrived and not queue:  # nothing from source is before it
            header = transport.decode_frame(frame)
            if header.inline_parts is not None:  # a small message: delivered at once, never queued
                self._counts.bytes_received += len(frame)
                self._deliver_inline(source, header)
                return
        inbound = Inbound(source, frame)
        if queue is None:
            queue = self.queues[source] = deque()
        queue.append(inbound)
        if arrived:
            self._frame_arrived(inbound, header)
        else:
            self._watch(request, partial(self._frame_arrived, inbound), f"frame from rank {source}", 0.0)

    def match_parts(self) -> bool:
        """Receive each awaited piece of a message's parts whose MPI message has come, its size checked first:
        whether any came."""
        MPI, comm, status = self._MPI, self._comm, self._probe_status
        matched = False
        for inbound in self.unmatched:
            header = inbound.header
            assert header is not None
            tag = transport.data_tag(header.seq, self._tag_ub)
            what = f"message parts from rank {inbound.source} (seq {header.seq}, {sum(header.sizes)} bytes)"
            while inbound.unmatched and (message := comm.Improbe(inbound.source, tag, status)) is not None:
                piece = inbound.unmatched[0]
                size = status.Get_count(MPI.BYTE)
                if size != len(piece):
                    raise MessageRefused(inbound.source, f"a piece of its message seq {header.seq}'s parts came with "
                                         f"{size} bytes where {len(piece)} were declared")  # fmt: skip
                inbound.unmatched.popleft()
                request = message.Irecv([piece, MPI.BYTE])
                self._watch(request, partial(self._part_arrived, inbound), what, inbound.due)
                matched = True
        if matched:
            self.unmatched[:] = [inbound for inbound in self.unmatched if inbound.unmatched]
        return matched

    def unfinished_refusal(self) -> MessageRefused | None:
        """When the job ends with every sent message delivered and still messages whose parts never began to
        arrive: the refusal of the first (no rank will send its parts: its frame was none of theirs), else None."""
        if not self.unmatched:
            return None
        inbound = self.unmatched[0]
        assert inbound.header is not None
        declared = sum(inbound.header.sizes)
        missing = sum(len(piece) for piece in inbound.unmatched)
        return MessageRefused(inbound.source, f"its message seq {inbound.header.seq} declared {declared} bytes of "
                              f"parts, {missing} of which never came: the job ended without them (a frame no rank "
                              "sent as one of its messages: damaged, or from another program)")  # fmt: skip

    # ------------------------------------------------------------ internals
    def _frame_arrived(self, inbound: Inbound, header: transport.FrameHeader | None = None) -> None:
        """Its frame is here (``header``: already decoded): deliver it, or receive its parts as they come."""
        try:
            header = inbound.header = header or transport.decode_frame(inbound.frame)
            self._counts.bytes_received += len(inbound.frame) + (
                sum(header.sizes) if header.inline_parts is None else 0
            )
            if header.inline_parts is not None:
                inbound.missing = 0
                self._deliver_ready(inbound.source)
                return
            declared = sum(header.sizes)
            if declared > self._memory_bytes:  # refused before any of it is mapped
                raise TransportError(f"its message seq {header.seq} declares {declared} bytes of parts, more than "
                                     f"this host's memory ({self._memory_bytes} bytes)")  # fmt: skip
            if header.answers >= 0:  # a reply: its asker may have lent a buffer for it
                inbound.loan = self.lending.claim(inbound.source, header.answers, header.sizes)
            if inbound.loan is not None:
                inbound.parts = [transport.allocate(header.sizes[0]), inbound.loan.memory]
            else:
                inbound.parts = [transport.allocate(size, self._pool) for size in header.sizes]
        except Exception as error:
            raise MessageRefused.of(inbound.source, error) from error
        inbound.unmatched.extend(p for part in inbound.parts for p in chunks(part, self._chunk_bytes))
        inbound.missing = len(inbound.unmatched)
        inbound.due = self._due(declared)
        self.unmatched.append(inbound)
        self.match_parts()

    def _part_arrived(self, inbound: Inbound) -> None:
        inbound.missing -= 1
        if inbound.missing == 0:
            try:
                self._deliver_ready(inbound.source)
            except Exception as error:
                raise MessageRefused.of(inbound.source, error) from error

    def _deliver_ready(self, source: int) -> None:
        queue = self.queues[source]
        while queue and queue[0].missing == 0:
            inbound = queue.popleft()
            header = inbound.header
            assert header is not None  # set when its frame arrived
            if header.inline_parts is not None:
                self._deliver_inline(source, header)
                continue
            envelope = self._frames.load(header, inbound.parts)
            if inbound.loan is not None and not self.lending.repaid(inbound.loan, envelope):
                # not the reply the buffer was lent for: the message gets memory of its own, the buffer back
                envelope = self._frames.load(header, [transport.copied(part) for part in inbound.parts])
            self._counts.messages_received += 1
            self._deliver(source, envelope)

    def _deliver_inline(self, source: int, header: transport.FrameHeader) -> None:
        """Deliver the message, or the batch of messages, that a frame carries inline."""
        assert header.inline_parts is not None
        if header.batch:
            messages = self._frames.load_batch(header)
            self._counts.messages_received += len(messages)
            self._deliver_all(source, messages)
        else:
            self._counts.messages_received += 1
            self._deliver(source, self._frames.load(header, header.inline_parts))
