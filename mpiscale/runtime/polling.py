"""One poll of everything a rank's progress engine waits on, and the two spins made of polls.

A poll takes in the frames that have arrived (``Endpoint.drain`` delivers the small ones where they land and
leaves the others to the engine), tests the pending requests once, and runs the channels' pollers. The engine
spins on it for a short burst before it gives the event loop a turn, and a task that awaits a value it knows is
coming (an ask's reply) spins on it in its own stack. This module is the reference; ``_wire.Poller`` is its
compiled twin, which runs the same loops without a Python call per poll.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any


class Poller:
    """The polls of one engine: its ``endpoint``, the queues of frames waiting by source (``inbound``), where small
    messages go (``envelopes``) and are counted (``counts``), its pending requests and the messages whose parts it
    awaits (the lists themselves, both handled by ``test_pending``), its channels' ``pollers``, and what takes in
    any other frame (``frames_found``)."""

    def __init__(
        self,
        endpoint: Any,
        inbound: dict,
        envelopes: Any,
        counts: Any,
        pending: list,
        unmatched: list,
        pollers: list[Callable[[], bool]],
        frames_found: Callable[[tuple], bool],
        test_pending: Callable[[], bool],
    ) -> None:
        self._endpoint, self._inbound, self._envelopes, self._counts = endpoint, inbound, envelopes, counts
        self._pending, self._unmatched, self._pollers = pending, unmatched, pollers
        self._frames_found, self._test_pending = frames_found, test_pending

    def poll(self) -> bool:
        """One poll of everything: whether anything happened."""
        found = self._endpoint.drain(self._inbound, self._envelopes, self._counts)
        progressed = found if type(found) is bool else self._frames_found(found)
        if self._pending or self._unmatched:
            progressed |= self._test_pending()
        for poll in self._pollers:
            progressed |= poll()
        return progressed

    def burst(self, seconds: float) -> bool:
        """Poll until something happens or ``seconds`` have passed: whether something did."""
        clock = time.monotonic
        end = clock() + seconds
        while not self.poll():
            if clock() > end:
                return False
        return True

    def until(self, future: asyncio.Future, seconds: float, burst: float) -> bool:
        """Poll until ``future`` is done or ``seconds`` have passed, yielding the core (``sched_yield``) after each
        ``burst`` seconds of empty polls: whether anything happened."""
        clock = time.monotonic
        now = clock()
        end, next_yield = now + seconds, now + burst
        progressed = False
        while not future.done():
            if self.poll():
                progressed = True
                continue
            now = clock()
            if now > end:
                break
            if now > next_yield:
                os.sched_yield()
                next_yield = clock() + burst
        return progressed
