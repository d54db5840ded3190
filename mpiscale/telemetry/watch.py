"""``mpiscale watch``: a running job's state in the terminal, from its broker or its JSON-lines file.

The view keeps the latest record of each kind and the recent events, and
draws a few lines: the job and its state, a progress bar with the rate and
the ETA, the slowest rank and the metrics' spread, and the last events. In a
terminal it redraws in place; otherwise it prints the view when it changes.
It ends when the job's status says it has ended (``finished``, ``stopped``, ``failed``), or
when the job has said nothing for many heartbeat intervals (it died without a final
status, or its rank 0 is blocked). ``lost`` (the job's broker connection dropped, also
when the broker itself went down) does not end it: the job may come back. From a broker
it redraws every second, so a heartbeat that stops shows, and it reconnects when its own
connection drops.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TextIO

from ..words import counted
from .schema import KINDS, problems
from .settings import TelemetrySettings
from .sinks import mqtt_client, topic

ENDED = ("finished", "stopped", "failed")
STALE_INTERVALS = 5  # a heartbeat this many intervals late is shown as missing
GONE_INTERVALS = 30  # and this many: the job is taken for dead
#: ... but never sooner than this: a job of short intervals (0.2 s) on a loaded machine was silent 8 s at its end
GONE_AFTER_S = 15.0
_UNKNOWN_INTERVAL_S = 2.0  # telemetry's default interval, for records that do not say theirs
_REDRAW_S = 1.0


class View:
    """The job as its records tell it."""

    def __init__(self) -> None:
        self.latest: dict[str, dict] = {}
        self.events: deque[dict] = deque(maxlen=5)
        self.rejected = 0
        self._beats: deque[float] = deque(maxlen=5)  # the times of the latest heartbeats
        self._declared_s: float | None = None  # the interval the job's heartbeats say it reports at

    def take_raw(self, raw: str | bytes) -> None:
        """Take one record as it came (a JSON line, an MQTT payload); what is not JSON counts as rejected."""
        try:
            self.take(json.loads(raw))
        except ValueError:
            self.rejected += 1

    def take(self, payload: object) -> None:
        if problems(payload):
            self.rejected += 1
            return
        assert isinstance(payload, dict)
        self.latest[payload["kind"]] = payload
        if payload["kind"] == "event":
            self.events.append(payload)
        elif payload["kind"] == "heartbeat":
            self._beats.append(payload["time"])
            self._declared_s = payload.get("interval_s", self._declared_s)

    @property
    def holds_no_record(self) -> bool:
        """Lines came and none was a record: not a telemetry file."""
        return bool(self.rejected) and not self.latest

    @property
    def ended(self) -> bool:
        return self.latest.get("status", {}).get("state") in ENDED

    @property
    def interval_s(self) -> float:
        """The job's heartbeat interval: the longest recent gap, never shorter than the interval the job declares.

        Beats can come together (the busy-loop thread's and the loop's own, a
        queue flushed), so the gaps alone can say 0.01 s for a job that reports
        every 2 s; a loaded job can beat slower than it declares.
        """
        beats = list(self._beats)
        gaps = [later - earlier for earlier, later in zip(beats, beats[1:]) if later > earlier]
        floor = self._declared_s if self._declared_s is not None else 0.0
        if not gaps and self._declared_s is None:
            return _UNKNOWN_INTERVAL_S
        return max([floor, *gaps])

    def silent_s(self, now: float) -> float | None:
        """Seconds since the job's last heartbeat (or status, before any); None before any record or after its end."""
        if self.ended:
            return None
        last = self._beats[-1] if self._beats else self.latest.get("status", {}).get("time")
        return None if last is None else max(0.0, now - last)

    def gone(self, now: float) -> bool:
        """Whether the job has said nothing for so long that it is taken for dead."""
        silent = self.silent_s(now)
        return silent is not None and silent > max(GONE_INTERVALS * self.interval_s, GONE_AFTER_S)

    def _node_lines(self, nodes: list[dict], as_of: float, ago: str) -> list[str]:
        """One line per node of a job on several (stalest first): its ranks, its step, how fresh its reports were at
        ``as_of`` (now, or the job's end); a node silent for many intervals is named as hung or gone."""
        if len(nodes) < 2:
            return []
        lines = []
        for node in nodes:
            age = max(0.0, as_of - node["report_time"])
            if age <= STALE_INTERVALS * self.interval_s:
                fresh = f"reported {age:.1f} s {ago}"
            elif self.ended:
                fresh = f"SILENT for {age:.0f} s {ago}: its ranks were hung, or the node was gone"
            else:
                fresh = f"SILENT for {age:.0f} s: its ranks are hung, or the node is gone"
            lines.append(f"  node {node['host']} (ranks {_spans(node['ranks'])}): step {node['step']}, {fresh}")
        return lines

    def lines(self) -> list[str]:
        now = time.time()
        status = self.latest.get("status")
        if status is None:
            return ["waiting for the job's status..."]
        lines = [f"job {status['job']}: {status['command']} on {counted(status['ranks'], 'rank')} ({status['host']}), "
                 f"{status['state']}"]  # fmt: skip
        # ages are measured to the job's end once it has ended: its file read hours later shows how fresh each report
        # was then, not hours of silence
        as_of, ago = (status["time"], "before the job ended") if self.ended else (now, "ago")
        progress = self.latest.get("progress")
        if progress is not None and not progress["total"]:  # the report at the start, before the job's first step
            lines.append("no step reported yet")
        elif progress is not None:
            done = progress["step"] / progress["total"]
            bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
            eta = _clock(progress["eta_s"]) if progress["eta_s"] is not None else "?"
            lines.append(f"[{bar}] {progress['step']}/{progress['total']}  {progress['steps_per_s']:.1f} steps/s  "
                         f"{progress['items_per_s']:,.0f} items/s  ETA {eta}")  # fmt: skip
        metrics = self.latest.get("metrics")
        if metrics is not None:
            step = metrics["values"].get("step", {})
            lines.append(f"slowest rank {metrics['slowest_rank']} (step {step.get('min', 0):.0f}; fastest at "
                         f"{step.get('max', 0):.0f}), {metrics['ranks_reporting']} of {status['ranks']} ranks "
                         "reporting")  # fmt: skip
            for name, spread in sorted(metrics["values"].items()):
                if name != "step":
                    lines.append(f"  {name}: min {spread['min']:.4g} (rank {spread['min_rank']}), "
                                 f"mean {spread['mean']:.4g}, max {spread['max']:.4g}")  # fmt: skip
            lines += self._node_lines(metrics.get("nodes", []), as_of, ago)
        beat = self.latest.get("heartbeat")
        if beat is not None:
            age = max(0.0, as_of - beat["time"])
            lines.append(f"heartbeat {age:.1f} s {ago}; {beat['dropped']} records dropped by the publisher")
        silent = self.silent_s(now)
        if silent is not None and silent > STALE_INTERVALS * self.interval_s:
            lines.append(f"NO HEARTBEAT for {silent:.0f} s (one every {self.interval_s:.1f} s): the job is stalled, "
                         "or it died without a final status")  # fmt: skip
        if status["state"] == "lost":
            lines.append("the job's connection to the broker dropped; watching for it to come back")
        for event in self.events:
            stamp = time.strftime("%H:%M:%S", time.localtime(event["time"]))
            lines.append(f"  {stamp} rank {event['rank']}: {event['event']} {event['detail']}")
        return lines


def _spans(ranks: list[int]) -> str:
    """Ranks as runs: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _clock(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


_AGE = re.compile(r"(reported|SILENT for) [0-9.]+ s")


def _without_age(lines: list[str]) -> list[str]:
    """The lines without the ages that change every second (the heartbeat's, each node's report's)."""
    return [_AGE.sub(r"\1", line) for line in lines if not line.startswith("heartbeat ")]


class Screen:
    """Draws a view: in place on a terminal, else a new block whenever it changes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.tty, self.shown = stream, stream.isatty(), 0
        self.last: list[str] = []

    def draw(self, view: View) -> None:
        lines = view.lines()
        if lines == self.last or (not self.tty and _without_age(lines) == _without_age(self.last)):
            return  # a log gets a new block when something but the heartbeat's age changed
        if self.tty and self.shown:
            self.stream.write(f"\x1b[{self.shown}F\x1b[J")
        self.stream.write("\n".join(lines) + "\n" + ("" if self.tty else "\n"))
        self.stream.flush()
        # the rows drawn, to go back up by: a line wider than the terminal wraps onto more than one (a failure's or a
        # hang's event line), and counting it as one would leave the view's top on screen at every redraw
        columns = shutil.get_terminal_size().columns
        self.last, self.shown = lines, sum(max(1, -(-len(line) // columns)) for line in lines)


def watch_file(path: Path, follow: bool = True, stream: TextIO = sys.stdout, poll_s: float = 0.25) -> View:
    """Show the job of a telemetry file; with ``follow``, until its status says it ended."""
    view, screen = View(), Screen(stream)
    with open(path, errors="replace") as records:  # bytes that are not UTF-8 make a line that is no record
        while True:
            start = records.tell()
            line = records.readline()
            if line.endswith("\n"):
                view.take_raw(line)
                continue
            if view.holds_no_record:  # not a telemetry file: nothing to wait for
                return view
            screen.draw(view)
            if view.ended or not follow or view.gone(time.time()):
                return view
            records.seek(start)  # a line still being written is read again in full
            time.sleep(poll_s)


async def watch_broker(
    settings: TelemetrySettings, job: str, stream: TextIO = sys.stdout, timeout_s: float | None = None
) -> View:
    """Show a job from its broker's records (the retained status first) until it ended or is gone.

    A connection that drops once the job was seen is made again (the retained
    status brings the view up to date); a broker never reached raises.
    """
    import aiomqtt  # imported when used: a job without a broker never loads it

    view, screen = View(), Screen(stream)
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                async for idle in _records(settings, job, view):
                    screen.draw(view)
                    # silence is judged only when no record waits: a watch that was itself held (suspended, or its
                    # output blocked) has the job's queued records to read before it may call the job gone
                    if view.ended or (idle and view.gone(time.time())):
                        return view
            except (aiomqtt.MqttError, OSError) as error:
                if not view.latest:
                    raise
                sys.stderr.write(f"mpiscale watch: lost the broker ({error}); connecting again\n")
                await asyncio.sleep(_REDRAW_S)


async def _records(settings: TelemetrySettings, job: str, view: View) -> AsyncIterator[bool]:
    """Feed the job's records into ``view``; yields False after each, and True every second when none comes (False
    when the wait took far longer: the watch itself was held, and the records queued meanwhile come next)."""
    async with mqtt_client(settings) as client:
        for kind in KINDS:
            await client.subscribe(topic(job, kind), qos=1)
        messages = aiter(client.messages)
        while True:
            began = time.monotonic()
            try:
                message = await asyncio.wait_for(anext(messages), _REDRAW_S)
            except TimeoutError:
                yield time.monotonic() - began < 2 * _REDRAW_S
                continue
            view.take_raw(bytes(message.payload))
            yield False
