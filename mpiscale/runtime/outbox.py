"""The per-destination send queue of small messages, flushed as one batch frame at the end of a loop turn.

Small one-way messages (:meth:`Outbox.post`) to the same rank within one turn of the event loop leave together, as
one batch frame, at the end of that turn; the first of a turn leaves at once, so a lone message never waits (not
even for a long computation after it in the same turn), and a stream of them costs one MPI message per batch. A
turn lasts at most :data:`TURN_S` for this purpose: one loop pass may run several tasks that each compute for
milliseconds (batches in flight through a compiled graph), and a message one of them sends after its computation
leaves at once instead of waiting for the others' to end. Any other send to that rank sends the batch first
(:meth:`Outbox.send_queued`), so each receiver sees a sender's messages in the order they were made; the sequence
numbers of a destination's frames (:meth:`Outbox.next_seq`) are kept here for the same reason.

This is the reference; the compiled message path has a twin (``_wire.Outbox``) that writes the same frames.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

TURN_S = 250e-6  # a message posted this long after the turn's first one begins a new turn
BATCH_MAX_MESSAGES = 4096  # a batch leaves at once when it holds this many messages or inline_bytes

Track = Callable[[Any, str, object], None]  # (pending request, what it is, what it must keep alive)


class Outbox:
    """Small messages queued per destination rank, sent through ``endpoint`` as frames that ``frames`` (the
    message path's functions) writes; ``track`` keeps a send that has not left yet, ``kick`` notes activity;
    ``turn_s``: the longest turn."""

    def __init__(self, endpoint: Any, frames: Any, inline_bytes: int, track: Track, kick: Callable[[], None],
                 turn_s: float = TURN_S) -> None:  # fmt: skip
        self._endpoint = endpoint
        self._turn_s = turn_s
        self._frames = frames
        self._inline_bytes = inline_bytes
        self._track = track
        self._kick = kick
        #: The compact bodies queued per destination, sent at the turn's end.
        self.queued: dict[int, list[bytes]] = {}
        self._queued_bytes: dict[int, int] = {}
        self._seq: dict[int, int] = {}
        self._flush_scheduled = False
        self._done: asyncio.Future | None = None  # the done future of every queued message
        self._sent_this_turn: set[int] = set()  # ranks a small message went to at once in this loop turn
        self._turn_began = 0.0  # when the turn's first small message left
        #: Messages queued here so far, and the bytes of the frames sent (the engine adds them to its counts).
        self.messages = 0
        self.bytes = 0

    def post(self, dest: int, obj: object) -> asyncio.Future | None:
        """Queue a small message of plain values (``transport.compact_body``) for rank ``dest``, to leave with the
        others queued for it at the end of this loop turn; its arrays are copied now, and the future returned is
        done (one future, shared by every queued message: a new one per tell cost a tenth of its time). None,
        queuing nothing, when it is the first to ``dest`` this turn or does not qualify: the caller sends it."""
        now = time.perf_counter()
        if self._sent_this_turn and now - self._turn_began > self._turn_s:
            self.flush()  # a long turn (computations of several tasks in one loop pass): a new turn begins here
        if dest not in self._sent_this_turn:
            if not self._sent_this_turn:
                self._turn_began = now
            self._sent_this_turn.add(dest)
            if not self._flush_scheduled:  # the flush also ends the turn's record
                self._flush_scheduled = True
                asyncio.get_running_loop().call_soon(self.flush)
            return None
        body = self._frames.compact_body(obj, self._inline_bytes)
        if body is None:
            return None
        queued = self.queued.get(dest)
        if queued is None:
            queued = self.queued[dest] = []
            self._queued_bytes[dest] = 0
        queued.append(body)
        self._queued_bytes[dest] += len(body)
        self.messages += 1
        if len(queued) >= BATCH_MAX_MESSAGES or self._queued_bytes[dest] >= self._inline_bytes:
            self._send_batch(dest)
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
            self._done.set_result(0)
        return self._done

    def flush(self) -> None:
        """Send every queued batch now; the loop turn ends here for :meth:`post`."""
        self._flush_scheduled = False
        self._sent_this_turn.clear()
        for dest in list(self.queued):
            self._send_batch(dest)

    def send(self, dest: int, obj: object) -> int:
        """Send ``obj`` to ``dest`` at once, as a compact frame of its own after what is queued for it: the size of
        its compact bytes; -1, sending nothing, when it does not travel compact (the caller pickles it)."""
        body = self._frames.compact_body(obj, self._inline_bytes)
        if body is None:
            return -1
        self.send_queued(dest)
        self.messages += 1
        self._send(dest, self._frames.encode_compact(body, self.next_seq(dest)), 1)
        return len(body)

    def send_queued(self, dest: int) -> None:
        """Send what is queued for ``dest`` now (before another message to it)."""
        if dest in self.queued:
            self._send_batch(dest)

    def next_seq(self, dest: int) -> int:
        """The sequence number of the next frame to ``dest``."""
        seq = self._seq.get(dest, 0)
        self._seq[dest] = seq + 1
        return seq

    def _send_batch(self, dest: int) -> None:
        bodies = self.queued.pop(dest)
        del self._queued_bytes[dest]
        if len(bodies) == 1:  # a lone message travels as any compact one
            self._send(dest, self._frames.encode_compact(bodies[0], self.next_seq(dest)), 1)
        else:
            self._send(dest, self._frames.encode_batch(bodies, self.next_seq(dest)), len(bodies))

    def _send(self, dest: int, frame: bytes, count: int) -> None:
        """Start sending ``frame`` (``count`` messages) to ``dest``; a send still pending keeps its frame."""
        self.bytes += len(frame)
        request = self._endpoint.send(dest, frame)
        if request is not None:
            self._track(request, f"{count} small messages to rank {dest} ({len(frame)} bytes)", frame)
        else:
            self._kick()
