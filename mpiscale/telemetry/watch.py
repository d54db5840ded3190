"""``mpiscale watch``: a running job's state in the terminal, from its broker or its JSON-lines file.

The view keeps the latest record of each kind and the recent events, and
draws a few lines: the job and its state, a progress bar with the rate and
the ETA, the slowest rank and the metrics' spread, and the last events. In a
terminal it redraws in place; otherwise it prints the view when it changes.
It ends when the job's status says it has ended (``finished``, ``stopped``, ``failed``,
``lost``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import TextIO

from .schema import KINDS, problems
from .settings import TelemetrySettings
from .sinks import mqtt_client, topic

ENDED = ("finished", "stopped", "failed", "lost")


class View:
    """The job as its records tell it."""

    def __init__(self) -> None:
        self.latest: dict[str, dict] = {}
        self.events: deque[dict] = deque(maxlen=5)
        self.rejected = 0

    def take(self, payload: object) -> None:
        if problems(payload):
            self.rejected += 1
            return
        assert isinstance(payload, dict)
        self.latest[payload["kind"]] = payload
        if payload["kind"] == "event":
            self.events.append(payload)

    @property
    def ended(self) -> bool:
        return self.latest.get("status", {}).get("state") in ENDED

    def lines(self) -> list[str]:
        status = self.latest.get("status")
        if status is None:
            return ["waiting for the job's status..."]
        lines = [f"job {status['job']}: {status['command']} on {status['ranks']} ranks ({status['host']}), "
                 f"{status['state']}"]  # fmt: skip
        progress = self.latest.get("progress")
        if progress is not None:
            done = progress["step"] / progress["total"] if progress["total"] else 0.0
            bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
            eta = _clock(progress["eta_s"]) if progress["eta_s"] is not None else "?"
            lines.append(f"[{bar}] {progress['step']}/{progress['total']}  {progress['steps_per_s']:.1f} steps/s  "
                         f"{progress['items_per_s']:,.0f} items/s  ETA {eta}")  # fmt: skip
        metrics = self.latest.get("metrics")
        if metrics is not None:
            step = metrics["values"].get("step", {})
            lines.append(f"slowest rank {metrics['slowest_rank']} (step {step.get('min', 0):.0f}; fastest at "
                         f"{step.get('max', 0):.0f}), {metrics['ranks_reporting']} ranks reporting")  # fmt: skip
            for name, spread in sorted(metrics["values"].items()):
                if name != "step":
                    lines.append(f"  {name}: min {spread['min']:.4g} (rank {spread['min_rank']}), "
                                 f"mean {spread['mean']:.4g}, max {spread['max']:.4g}")  # fmt: skip
        beat = self.latest.get("heartbeat")
        if beat is not None:
            age = time.time() - beat["time"]
            lines.append(f"heartbeat {age:.1f} s ago; {beat['dropped']} records dropped by the publisher")
        for event in self.events:
            stamp = time.strftime("%H:%M:%S", time.localtime(event["time"]))
            lines.append(f"  {stamp} rank {event['rank']}: {event['event']} {event['detail']}")
        return lines


def _clock(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class Screen:
    """Draws a view: in place on a terminal, else a new block whenever it changes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.tty, self.shown = stream, stream.isatty(), 0
        self.last: list[str] = []

    def draw(self, view: View) -> None:
        lines = view.lines()
        if lines == self.last:
            return
        if self.tty and self.shown:
            self.stream.write(f"\x1b[{self.shown}F\x1b[J")
        self.stream.write("\n".join(lines) + "\n" + ("" if self.tty else "\n"))
        self.stream.flush()
        self.last, self.shown = lines, len(lines)


def watch_file(path: Path, follow: bool = True, stream: TextIO = sys.stdout, poll_s: float = 0.25) -> View:
    """Show the job of a telemetry file; with ``follow``, until its status says it ended."""
    view, screen = View(), Screen(stream)
    with open(path) as records:
        while True:
            start = records.tell()
            line = records.readline()
            if line.endswith("\n"):
                try:
                    view.take(json.loads(line))
                except ValueError:
                    view.rejected += 1
                continue
            screen.draw(view)
            if view.ended or not follow:
                return view
            records.seek(start)  # a line still being written is read again in full
            time.sleep(poll_s)


async def watch_broker(
    settings: TelemetrySettings, job: str, stream: TextIO = sys.stdout, timeout_s: float | None = None
) -> View:
    """Show a job from its broker's records (the retained status first) until its status says it ended."""
    view, screen = View(), Screen(stream)
    async with mqtt_client(settings) as client:
        for kind in KINDS:
            await client.subscribe(topic(job, kind), qos=1)
        async with asyncio.timeout(timeout_s):
            async for message in client.messages:
                try:
                    view.take(json.loads(bytes(message.payload)))
                except ValueError:
                    view.rejected += 1
                screen.draw(view)
                if view.ended:
                    break
    return view
