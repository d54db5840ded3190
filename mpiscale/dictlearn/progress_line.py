"""A periodic progress line for long iterative jobs: iteration, the metrics that matter, rate and ETA."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLine:
    """Prints at most every ``every`` seconds (and at the end); ``every=None`` prints nothing (other ranks)."""

    def __init__(self, total: int, start: int, every: float | None, stream: TextIO | None = None) -> None:
        self.total, self.start, self.every = total, start, every
        self.stream = stream or sys.stdout
        self.began = self.last = time.monotonic()
        self.signals = 0.0
        self.line = ""

    def update(self, done: int, metrics: dict, signals: float) -> None:
        """Record iteration ``done`` (1-based) and print if a line is due."""
        if self.every is None:
            return
        self.signals += signals
        now = time.monotonic()
        elapsed = max(now - self.began, 1e-9)
        per_iteration = elapsed / max(done - self.start, 1)
        self.line = (
            f"iteration {done}/{self.total}  objective {metrics['objective']:.4e}  "
            f"error {metrics['error']:.4f}  non-zeros {metrics['sparsity']:.2f}  "
            f"{self.signals / elapsed:,.0f} signals/s  ETA {_duration(per_iteration * (self.total - done))}"
        )
        if self.every and now - self.last >= self.every:
            self.last = now
            print(self.line, file=self.stream, flush=True)

    def finish(self) -> None:
        """Print the last line (if any iteration ran)."""
        if self.every is not None and self.line:
            print(
                self.line.rsplit("  ETA", 1)[0] + f"  done in {_duration(time.monotonic() - self.began)}",
                file=self.stream,
                flush=True,
            )
