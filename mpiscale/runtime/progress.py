"""The progress engine: turns MPI requests into asyncio awaitables.

One engine per rank runs as an asyncio task. Each turn it

1. matches newly arrived frames with ``Improbe`` and posts their receives,
2. tests every pending request with one ``Testsome`` call and runs the
   completion callbacks (resolving futures, posting part receives),
3. hands completed inbound messages to the runtime, in the order each source
   sent them.

Small one-way messages (``post``) to the same rank within one turn of the
event loop leave together, as one batch frame, at the end of that turn (the
engine's :mod:`outbox <.outbox>`); any other send to that rank sends the batch
first, so each receiver sees a sender's messages in the order they were made.

Polling trades latency against CPU: right after any activity (or a local send)
the engine polls continuously for ``spin_us``, yielding the core to other
processes with ``sched_yield`` each turn (so oversubscribed ranks stay fast);
after that it sleeps a quarter of the time it has been quiet, up to
``max_sleep_us``. An idle rank therefore costs a few hundred short wake-ups per
second, not a core, and the latency a sleep adds stays proportional to the
quiet time before it. Quiet time is what the engine itself spent polling and
sleeping in vain since the last activity: time the loop spent in other work (a
handler's or ``main``'s computation) does not count, so a rank that computes
for a millisecond and then awaits a message polls for it at once rather than
sleeping a quarter of that millisecond. While a large message's parts are on
their way to or from the rank, it polls on without sleeping until they are
overdue (the spin window plus their bytes at 1 GB/s): a 16 MiB transfer takes
milliseconds, and a sleep of a quarter of that would be added to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..ranks import Comm, chunks
from . import transport, wire
from .config import RuntimeConfig
from .errors import MessageRefused
from .inbound import Envelopes, Receiving
from .waits import WaitClock

_BURST_S = 20e-6  # longest tight-polling burst before yielding to the event loop
_SLEEP_FRACTION = 0.25  # an idle rank sleeps at most this fraction of its quiet time so far
_MIN_SLEEP_S = 20e-6
#: A message's parts in flight are due within the spin window plus their bytes at this rate (bytes/s); until then the
#: engine polls for them without sleeping. Memory and fabrics move bytes 5-50x faster, so a transfer rarely outlasts
#: its allowance, and one stalled on a busy peer spins no longer than that allowance before the rank sleeps.
_TRANSFER_BYTES_PER_S = 1e9


@dataclass
class _Pending:
    """One MPI request and what to do when it completes."""

    request: object
    on_done: Callable[[], None]
    what: str
    started: float = field(default_factory=time.monotonic)
    keep: object = None  # buffers that must stay alive until completion
    due: float = 0.0  # for a message's parts: the time.monotonic() by which they should have moved (else 0)


class ProgressEngine:
    """Drives all non-blocking MPI traffic of one rank from the asyncio loop."""

    def __init__(self, MPI: ModuleType, comm: Comm, config: RuntimeConfig, deliver: Envelopes) -> None:
        self._MPI = MPI
        self._comm = comm
        self._config = config
        self._envelopes = deliver  # where arrived messages go
        tag_ub = comm.Get_attr(MPI.TAG_UB)
        assert isinstance(tag_ub, int), tag_ub  # MPI sets it on every communicator
        self._tag_ub = tag_ub
        self._pending: list[_Pending] = []
        self._quiet_s = 0.0  # seconds of the engine's own vain polling and sleeping since the last activity
        self._sleeper: asyncio.Future | None = None
        self._frames = wire.chosen()[0]  # the compiled message path, or its pure-Python reference
        #: The messages on their way in (``unfinished``: frames whose parts have not even begun to arrive).
        self.receiving = Receiving(MPI, comm, self._frames, deliver, self, self._watch, self._due,
                                   transport.BufferPool(config.pool_bytes), config.chunk_bytes)  # fmt: skip
        self._endpoint = self._frames.Endpoint(MPI, comm)
        #: Small one-way messages queued per destination (``post``), sent as one frame at the loop turn's end.
        self.outbox = self._frames.Outbox(self._endpoint, self._frames, config.inline_bytes, self.track, self.kick)
        self.post = self.outbox.post
        self._stopped = False
        self._yielded = False  # the engine waits for its next turn in the loop's ready queue (spinning, or woken)
        self._turn_at = time.monotonic()  # when the engine's task last ran
        self._longest_turn_s = config.max_sleep_us * 1e-6
        self._wake_timer: asyncio.TimerHandle | None = None  # the engine's sleep's end, while it sleeps
        self._messages_sent = 0  # and the outbox's
        self._bytes_sent = 0
        self.messages_received = 0
        self.bytes_received = 0
        #: The waits on other ranks: requests awaited through ``wait`` (the collectives), values expected.
        self.waits = WaitClock()
        #: Called on every poll (channels' receives posted ahead); each says whether anything happened.
        self.pollers: list[Callable[[], bool]] = []
        receiving = self.receiving
        self._poller = self._frames.Poller(self._endpoint, receiving.queues, deliver, self, self._pending,
                                           receiving.unmatched, self.pollers, self._frames_found,
                                           receiving.match_parts, self.pending_done)  # fmt: skip

    # ------------------------------------------------------------------ API
    @property
    def messages_sent(self) -> int:
        """Messages sent so far: actor messages, queued or not, and channels' arrays (collectives not counted)."""
        return self._messages_sent + self.outbox.messages

    @property
    def bytes_sent(self) -> int:
        """Bytes of the messages sent so far: frames and parts (collectives not counted)."""
        return self._bytes_sent + self.outbox.bytes

    def count_sent(self, messages: int, nbytes: int) -> None:
        """Count messages sent on another path (a channel's arrays) in this rank's traffic."""
        self._messages_sent += messages
        self._bytes_sent += nbytes

    def send(self, dest: int, obj: object, track: bool = True, answers: int = -1) -> asyncio.Future | None:
        """Send ``obj`` to rank ``dest``, after what :meth:`post` queued for it; the future resolves when the
        buffers are reusable (None without ``track``: the runtime's own asks and replies need none). ``answers``:
        the ask whose reply ``obj`` is."""
        nbytes = self.outbox.send(dest, obj)  # a small message of plain values: its compact frame, sent at once
        if nbytes >= 0:
            return completed(nbytes) if track else None  # (its values were copied into the frame)
        self.outbox.send_queued(dest)
        seq = self.outbox.next_seq(dest)
        encoded = transport.encode_pickled(obj, seq, self._config.inline_bytes, answers)
        MPI, comm = self._MPI, self._comm
        self._messages_sent += 1
        self._bytes_sent += len(encoded.frame) + (encoded.nbytes if encoded.parts else 0)  # inline parts: in the frame
        frame_request = self._endpoint.send(dest, encoded.frame)
        if not encoded.parts and frame_request is None:  # small message, already on its way
            self.kick()
            return completed(encoded.nbytes) if track else None
        done = asyncio.get_running_loop().create_future() if track else None
        requests = [] if frame_request is None else [frame_request]
        if encoded.parts:
            tag = transport.data_tag(seq, self._tag_ub)
            for part in encoded.parts:
                for piece in chunks(part, self._config.chunk_bytes):
                    requests.append(comm.Isend([piece, MPI.BYTE], dest, tag))
        remaining = [len(requests)]

        def one_done() -> None:
            remaining[0] -= 1
            if remaining[0] == 0 and done is not None and not done.done():
                done.set_result(encoded.nbytes)

        what = f"send to rank {dest} (seq {seq}, {encoded.nbytes} bytes)"
        due = self._due(encoded.nbytes) if encoded.parts else 0.0
        for request in requests:
            self._pending.append(_Pending(request, one_done, what, keep=encoded, due=due))
        self.kick()
        return done

    def poll_until(self, future: asyncio.Future, seconds: float) -> None:
        """Poll MPI in the caller's stack until ``future`` is done or ``seconds`` have passed, yielding the core
        (``sched_yield``) after each ``_BURST_S`` of empty polls, as the engine's own spin does (a yield after every
        empty poll put a system call between a reply's arrival and its poll). Only while no other callback is ready
        to run in the event loop: a task that spins must not hold up the others (``asyncio.gather`` of several asks
        sends them all first)."""
        if self.others_ready():
            return
        if self._poller.until(future, seconds, _BURST_S):
            self._quiet_s = 0.0

    def poll_held(self, future: asyncio.Future, seconds: float) -> None:
        """Poll MPI in the caller's stack until ``future`` is done or ``seconds`` have passed, for a caller that holds
        the event loop (a blocking call in ``main``: nothing else runs meanwhile), sleeping a millisecond after each
        empty burst of polls rather than spinning a core. A message that lands meanwhile waits for the loop, as any
        message to a rank whose ``main`` is busy does: its handler, one that could run where it lands, ran inside the
        blocking call (main's state changed under it, as asyncio never lets a handler do). Another rank's question
        about this rank's collective calls (``dispatch.STATE``) is still answered at once."""
        end = time.monotonic() + seconds
        with self._held():
            while not future.done() and time.monotonic() < end:
                if not self._poller.burst(_BURST_S):
                    time.sleep(1e-3)

    def answer_held(self) -> None:
        """One poll in the stack of a caller that holds the event loop, as ``poll_held`` polls: what has landed is
        taken in, and of the messages only the other ranks' questions about this rank's collectives are answered
        (a rank waiting long in a blocking call answers them as it waits, so that two such ranks find each other)."""
        with self._held():
            self._poller.poll()

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The dispatch told that a caller holding the event loop polls (``dispatch.Dispatch.held``), meanwhile."""
        self._envelopes.held = True
        try:
            yield
        finally:
            self._envelopes.held = False

    def others_ready(self) -> bool:
        """Whether another task or callback is ready to run in the event loop: a caller that would poll or test in
        its own stack must then await instead, and let them run (a loop of calls that all end at once in the
        caller's stack would otherwise never give the loop a turn: telemetry, served asks, the user's other tasks).
        True where the loop's run queue cannot be read. Once the engine has gone without a turn for longer than it
        sleeps at most, also where a timer other than the engine's own wake-up has fallen due or a file the loop
        watches is ready (telemetry's reports, deadlines, a signal, a socket): neither is in the run queue until a
        turn of the loop puts it there. (The time alone sent every collective after a job's millisecond of compute
        through the loop: dictlearn's statistics cost 20-26% more a call, 0.05-0.13 ms.)"""
        loop = asyncio.get_running_loop()
        ready = getattr(loop, "_ready", None)  # asyncio's run queue (a deque)
        # (the one ready callback of a yielded or woken engine is its next turn, which a caller's poll stands for)
        if ready is None or ready and not (self._yielded and len(ready) == 1):
            return True
        return time.monotonic() > self._turn_at + self._longest_turn_s and self._loop_has_work(loop)

    def _loop_has_work(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a timer other than the engine's wake-up is due, or a file the loop watches is ready (asyncio's
        selector, level-triggered: asking leaves the events to the loop); True where either cannot be read."""
        scheduled, selector = getattr(loop, "_scheduled", None), getattr(loop, "_selector", None)
        if scheduled is None or selector is None:
            return True
        now = loop.time()
        if any(timer.when() <= now and timer is not self._wake_timer and not timer.cancelled() for timer in scheduled):
            return True
        return bool(selector.select(0))

    def wait(self, request: Any, what: str, keep: object = None, spin_s: float = 0.0) -> asyncio.Future:
        """An awaitable for one MPI request (collectives use this), polled for in the caller's stack for up to
        ``spin_s`` first (``poll_until``); its waiting time is counted. The count begins after the spin: a wait
        still open gets a done callback, and one queued by a wait that ended in the spin would make the next
        caller's ``others_ready`` true (the second swap of a 4 MiB allreduce then went through the event loop: 0.78x
        its messages' floor, against 1.0x with no callback queued)."""
        began = time.monotonic()
        future = asyncio.get_running_loop().create_future()

        def resolve() -> None:
            if not future.done():
                future.set_result(None)

        self._pending.append(_Pending(request, resolve, what, keep=keep))
        self.kick()
        if spin_s:
            self.poll_until(future, spin_s)
        self.waits.count(future, what, began)
        return future

    def track(self, request: Any, what: str, keep: object) -> None:
        """Keep ``keep`` alive until ``request`` (a send) completes; the engine is not idle until then."""
        self._pending.append(_Pending(request, _nothing, what, keep=keep))
        self.kick()

    def kick(self) -> None:
        """Note local activity: poll continuously again for the spin window."""
        self._quiet_s = 0.0
        if self._sleeper is not None:
            self._wake()

    @property
    def idle(self) -> bool:
        """True when nothing is queued to send, no request is pending and no inbound message is partial."""
        return not self.outbox.queued and not self._pending and not self.receiving.busy

    @property
    def unfinished(self) -> int:
        """Messages whose frame came and some of whose parts have not even begun to arrive."""
        return len(self.receiving.unmatched)

    def describe(self) -> list[str]:
        """One line per pending request, oldest first, then per queued batch (for diagnostics)."""
        now = time.monotonic()
        queued = [f"{len(bodies)} small messages queued for rank {dest}" for dest, bodies in self.outbox.queued.items()]
        return [f"{p.what}: pending {now - p.started:.3f}s" for p in self._pending] + queued

    def stop(self) -> None:
        self._stopped = True
        self.kick()

    async def run(self) -> None:
        """Poll until :meth:`stop`; an exception in a callback ends the task with it."""
        loop = asyncio.get_running_loop()
        spin = self._config.spin_us * 1e-6
        max_sleep = self._config.max_sleep_us * 1e-6
        clock, poller = time.monotonic, self._poller
        while not self._stopped:
            self._turn_at = clock()
            if self._quiet_s < spin or self._transferring():
                # Spinning: poll in a tight loop for a short burst before giving
                # the event loop back; other ready tasks wait at most one burst.
                began = clock()
                if poller.burst(_BURST_S):
                    self._quiet_s = 0.0
                else:
                    os.sched_yield()
                    self._quiet_s += clock() - began
                await self._yield()
                continue
            if poller.poll():
                self._quiet_s = 0.0
                await self._yield()
                continue
            # Sleep a fraction of the time already spent quiet: the latency this
            # adds stays proportional, so two ranks waiting on each other cannot
            # ratchet each other up to the longest sleep.
            delay = min(max(self._quiet_s * _SLEEP_FRACTION, _MIN_SLEEP_S), max_sleep)
            self._quiet_s += delay
            self._sleeper = loop.create_future()
            handle = self._wake_timer = loop.call_later(delay, self._wake)
            await self._sleeper
            handle.cancel()
            self._sleeper = None
            self._yielded = False

    # ------------------------------------------------------------ internals
    def _due(self, nbytes: int) -> float:
        """When parts of ``nbytes`` posted now should have moved: the spin window plus their time at a slow rate."""
        return time.monotonic() + self._config.spin_us * 1e-6 + nbytes / _TRANSFER_BYTES_PER_S

    def _transferring(self) -> bool:
        """Whether a message's parts are on their way to or from this rank and not overdue: polling on for them,
        not sleeping a quarter of the time they took so far, saves a large message up to that quarter."""
        now = time.monotonic()
        unmatched = self.receiving.unmatched
        return any(now < item.due for item in self._pending) or any(now < item.due for item in unmatched)

    def _wake(self) -> None:
        """End the engine's sleep: its next turn is then in the loop's ready queue, as when it yields."""
        sleeper = self._sleeper
        if sleeper is not None and not sleeper.done():
            sleeper.set_result(None)
            self._yielded = True

    async def _yield(self) -> None:
        """Let the other ready tasks run once; meanwhile an asker may poll in the engine's place."""
        self._yielded = True
        try:
            await asyncio.sleep(0)
        finally:
            self._yielded = False

    def _frames_found(self, found: tuple) -> bool:
        """Take in ``found``, a frame that ``drain`` left, then every frame that arrives after it; True."""
        drain, queues, deliver = self._endpoint.drain, self.receiving.queues, self._envelopes
        frame_found = self.receiving.frame_found
        while type(found) is not bool:
            try:
                frame_found(*found)
            except Exception as error:
                raise MessageRefused.of(found[0], error) from error
            found = drain(queues, deliver, self)
        return True

    def pending_done(self, indices: list[int]) -> None:
        """Drop the pending requests at ``indices`` (which completed) and run what follows each."""
        pending = self._pending
        done = [pending[i] for i in indices]
        keep = set(indices)
        pending[:] = [p for i, p in enumerate(pending) if i not in keep]  # (the poller holds the list)
        for item in done:
            item.on_done()

    def _watch(self, request: Any, on_done: Callable[[], None], what: str, due: float) -> None:
        """Test ``request`` with the others, and call ``on_done`` once it completes."""
        self._pending.append(_Pending(request, on_done, what, due=due))


def _nothing() -> None:
    """A completed batch send needs no action: its frame was kept alive until then."""


def completed(result: object) -> asyncio.Future:
    """A future that is already done, with ``result``."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(result)
    return future
