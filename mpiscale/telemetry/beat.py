"""Rank 0's heartbeat while its event loop is busy: a thread that says the job is alive when the loop cannot.

The loop publishes the job's heartbeat with its progress every interval. A
step that holds the loop for longer (Numba compiling the kernels on a first
run, a long kernel, a slow file system) would leave a watcher with no
heartbeat, and it would call the job lost. This thread publishes one whenever
the loop has not for one and a half intervals; the reports' age in it still
shows how long the ranks have said nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BusyBeat:
    """Calls ``beat()`` from a thread when ``mark()`` has not been called for ``1.5 * interval_s``."""

    def __init__(self, interval_s: float, beat: Callable[[], None]) -> None:
        self.interval_s, self._beat = interval_s, beat
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpiscale-telemetry-beat", daemon=True)
        self._thread.start()

    def mark(self) -> None:
        """The loop has just published a heartbeat."""
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s / 2):
            if time.monotonic() - self._last >= 1.5 * self.interval_s:
                self._beat()
                self.mark()
