"""The deadlines of timed asks, kept by one timer set for the earliest.

A timer per ask (``loop.call_later`` when it is sent, ``cancel`` when its reply
comes) cost 1.6 µs of a 15 µs ask here, and left a cancelled entry in the
loop's heap each time. Here an ask only writes its deadline into its
:class:`~.dispatch.PendingAsk`; one timer waits for the earliest deadline
still pending, and when it fires fails what is due and waits for the next.
An answered ask leaves the table (the dispatch pops it), so nothing is to be
cancelled, and asks that share a timeout (a client's 30 s) never move the
timer.
"""

from __future__ import annotations

import asyncio
import math

from .dispatch import PendingAsk
from .errors import AskTimeout


class AskDeadlines:
    """One timer for the timed asks of ``asks`` (pending asks by id)."""

    def __init__(self, asks: dict[int, PendingAsk]) -> None:
        self._asks = asks
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf  # when the timer fires

    def add(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """An ask sent now times out at ``deadline`` (``loop.time()``'s clock) unless answered first."""
        if deadline < self._at:
            if self._timer is not None:
                self._timer.cancel()
            self._at = deadline
            self._timer = loop.call_at(deadline, self._due, loop)

    def _due(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fail the asks whose deadline has come; wait for the earliest of the others."""
        self._timer, self._at = None, math.inf
        now, nearest = loop.time(), math.inf
        for pending in list(self._asks.values()):
            if pending.deadline is None or pending.future.done():
                continue
            if pending.deadline <= now:
                pending.future.set_exception(AskTimeout(f"no reply from actor {pending.ref} to {pending.method!r} "
                                                        f"within {pending.timeout:g}s"))  # fmt: skip
            else:
                nearest = min(nearest, pending.deadline)
        if nearest < math.inf:
            self.add(loop, nearest)
