"""The asyncio event loop the runtime runs on.

asyncio's epoll selector rounds every timeout *up* to whole milliseconds, so a
50 µs back-off sleep of the progress engine would last 1 ms and two ranks that
poll each other would settle into millisecond round trips. This selector sleeps
sub-millisecond timeouts precisely; I/O readiness is still checked before and
after such a short sleep.
"""

from __future__ import annotations

import asyncio
import selectors
import time


class PreciseSelector(selectors.DefaultSelector):
    """A selector whose sub-millisecond timeouts are honoured, not rounded up to 1 ms."""

    def select(self, timeout: float | None = None):
        if timeout is not None and 0 < timeout < 1e-3:
            ready = super().select(0)
            if ready:
                return ready
            time.sleep(timeout)
            timeout = 0
        return super().select(timeout)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A selector event loop with precise short sleeps."""
    return asyncio.SelectorEventLoop(PreciseSelector())
