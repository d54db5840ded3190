"""A periodic progress line for long iterative jobs: the step, the numbers that matter, the rate and the ETA."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .. import telemetry


def duration(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLine:
    """Prints at most every ``every`` seconds (and at the end); ``every=None`` prints nothing (other ranks).

    ``unit`` names what the rate counts ("signals", "samples"); ``step_name``
    what a step is called ("iteration", "step").
    """

    def __init__(
        self,
        total: int,
        start: int,
        every: float | None,
        unit: str,
        step_name: str = "iteration",
        stream: TextIO | None = None,
    ) -> None:
        self.total, self.start, self.every = total, start, every
        self.unit, self.step_name = unit, step_name
        self.stream = stream or sys.stdout
        self.began = self.last = time.monotonic()
        self.items = 0.0
        self.line = ""
        # The rate and the ETA leave out the first step: it holds start-up work (Numba compiles its kernels, the
        # first batch is read), which would make the first ETA hours long.
        self._rate_since: tuple[float, int, float] | None = None  # (time, step, items) at the first step's end

    def update(self, done: int, text: str, items: float, phases: dict[str, float] | None = None) -> None:
        """Record step ``done`` (1-based) with its ``text`` (the metrics), ``items`` processed and the seconds it
        spent in each of the job's ``phases``; print if due.

        Every rank calls it: it feeds the job's telemetry, and rank 0 prints.
        """
        session = telemetry.current()
        if session is not None:
            session.update(done, self.total, items, phases)
        if self.every is None:
            return
        self.items += items
        now = time.monotonic()
        if self._rate_since is None:
            self._rate_since = (now, done, self.items)
            rate = "measuring"
        else:
            since, first, counted = self._rate_since
            elapsed = max(now - since, 1e-9)
            per_step = elapsed / max(done - first, 1)
            rate = (
                f"{(self.items - counted) / elapsed:,.0f} {self.unit}/s  ETA {duration(per_step * (self.total - done))}"
            )
        self.line = f"{self.step_name} {done}/{self.total}  {text}  {rate}"
        if self.every and now - self.last >= self.every:
            self.last = now
            print(self.line, file=self.stream, flush=True)

    def finish(self) -> None:
        """Print the last line (if any step ran)."""
        if self.every is not None and self.line:
            print(
                self.line.rsplit("  ETA", 1)[0].removesuffix("  measuring")
                + f"  done in {duration(time.monotonic() - self.began)}",
                file=self.stream,
                flush=True,
            )
