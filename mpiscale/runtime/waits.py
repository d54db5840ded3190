"""How long a rank has waited on the others, and on what it waits now.

Every wait the runtime knows is for something another rank owes: a
collective's completion, a pipeline stage's next activation, a graph value.
Telemetry reports the total (``collective_wait_s``) and the hang watch and the
diagnostics name the oldest wait still open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class WaitClock:
    """The seconds spent in waits that ended, and the waits still open (what each is for, and since when)."""

    def __init__(self) -> None:
        self._ended_s = 0.0
        self._open: dict[int, tuple[str | Callable[[], str], float]] = {}

    def count(self, future: asyncio.Future, what: str | Callable[[], str], began: float | None = None) -> None:
        """Count the time until ``future`` is done (from ``began``, a ``time.monotonic()``, or now) as a wait for
        ``what`` (or what it returns: made only for a wait still open, which a pipeline's spin mostly ends first)."""
        key, started = id(future), time.monotonic() if began is None else began
        if future.done():  # (no callback to queue: a task that spins for its value checks the ready queue)
            self._ended_s += time.monotonic() - started
            return
        self._open[key] = (what, started)

        def done(_: asyncio.Future) -> None:
            if self._open.pop(key, None) is not None:
                self._ended_s += time.monotonic() - started

        future.add_done_callback(done)

    @property
    def total_s(self) -> float:
        """Seconds waited so far, the open waits included (a rank in a collective that never ends shows it
        growing)."""
        now = time.monotonic()
        return self._ended_s + sum(now - started for _, started in self._open.values())

    def oldest(self) -> tuple[str, float] | None:
        """(what, seconds) of the oldest open wait, or None."""
        if not self._open:
            return None
        what, started = min(self._open.values(), key=lambda entry: entry[1])
        return (what if isinstance(what, str) else what()), time.monotonic() - started


def ends_in_place(test: Callable[[], bool], seconds: float) -> bool:
    """Whether ``test()`` comes true within ``seconds``, tested in the caller's stack (at least once)."""
    clock = time.perf_counter
    end = clock() + seconds
    while not test():
        if clock() > end:
            return False
    return True
