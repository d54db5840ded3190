"""One poll of everything a rank's progress engine waits on, and the two spins made of polls.

A poll takes in the frames that have arrived (``Endpoint.drain`` delivers the small ones where they land and
leaves the others to the engine), tests the pending requests once (handing the engine only those that completed),
and runs the channels' pollers. The engine spins on it for a short burst before it gives the event loop a turn, and
a task that awaits a value it knows is coming (an ask's reply) spins on it in its own stack. This module is the
reference; ``_wire.Poller`` is its compiled twin, which runs the same loops without a Python call per poll.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any


class Poller:
    """The polls of one engine: its ``endpoint``, the queues of frames waiting by source (``inbound``), where small
    messages go (``envelopes``) and are counted (``counts``), its pending requests and the messages whose parts it
    awaits (the lists themselves), its channels' ``pollers``, what takes in any other frame (``frames_found``), what
    matches the awaited parts (``match_parts``) and what follows the requests that completed (``pending_done``, given
    their indices)."""

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
        match_parts: Callable[[], bool],
        pending_done: Callable[[list[int]], None],
    ) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._endpoint, self._inbound, self._envelopes, self._counts = endpoint, inbound, envelopes, counts
        self._pending, self._unmatched, self._pollers = pending, unmatched, pollers
        self._frames_found, self._match_parts, self._pending_done = frames_found, match_parts, pending_done

    def poll(self) -> bool:
        """One poll of everything: whether anything happened. The pending requests are tested at once, and only
        those that completed go back to the engine (a poll with nothing done makes no call for them)."""
        found = self._endpoint.drain(self._inbound, self._envelopes, self._counts)
        progressed = found if type(found) is bool else self._frames_found(found)
        if self._unmatched:
            progressed |= self._match_parts()
        if self._pending:
            indices = testsome(self._MPI, self._pending)
            if indices:
                self._pending_done(indices)
                progressed = True
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


def testsome(MPI: ModuleType, pending: list) -> list[int] | None:
    """The indices of the requests of ``pending`` (each item's ``request``) that completed, in one ``Testsome``;
    None when every request is null."""
    return MPI.Request.Testsome([item.request for item in pending])
