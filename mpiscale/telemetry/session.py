"""A job's telemetry: every rank reports, node leaders combine, rank 0 publishes (one connection per job).

Each rank keeps its latest numbers (``update``: the step, items done, and
any metrics) and, every ``interval_s``, tells them to its node's first rank,
which forwards its node's reports to rank 0 in one message: a tree over
nodes, so rank 0 gets one message per node and interval however many ranks
there are. Rank 0 publishes the job's progress, the metrics' minimum, mean
and maximum over ranks with the rank furthest behind, a heartbeat, and the
events ranks send (``event``). Everything rides on the event loop; nothing
waits for the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..kernels.devices import gpu_memory_mib
from ..runtime import Actor, ActorGroup, ActorSystem, Communicator, Orders
from ..words import counted
from . import last_words
from .aggregate import by_node, pace, spread
from .beat import BusyBeat
from .control import Rejected, parse, set_log_level
from .prometheus import PrometheusEndpoint, open_endpoint
from .schema import record
from .settings import TelemetrySettings, job_id, restart_count
from .sinks import FileSink, MqttSink, lost_status
from .token import issue, token_path
from .watchdog import Watchdog, WatchdogSettings

log = logging.getLogger(__name__)
COLLECTOR = "mpiscale-telemetry"
REJECTIONS_SHOWN = 10  # rejected control messages answered one by one per interval; the rest are counted
_sessions = itertools.count()


class Collector(Actor):
    """Receives reports (on a node's first rank, and on rank 0) and events (on rank 0) for this rank's session."""

    def __init__(self, session: Telemetry) -> None:
        self.session = session

    def report(self, reports: list[dict]) -> None:
        for one in reports:
            self.session.reports[one["rank"]] = one

    def event(self, payload: dict) -> None:
        self.session.emit(payload)

    def dump(self) -> None:
        """Write this rank's diagnostics to stderr (the hang detector and the ``dump`` command ask every rank)."""
        self.session.system.dump_diagnostics()

    def log_level(self, level: str) -> None:
        set_log_level(level)


class Telemetry:
    """One per rank; build with ``await Telemetry.start(system, command, out)`` (collective)."""

    def __init__(
        self, system: ActorSystem, settings: TelemetrySettings, job: str, command: str, comm: Communicator
    ) -> None:
        self.system, self.settings, self.job, self.command = system, settings, job, command
        self._comm = comm  # the session's start and end, apart from the job's collectives
        self.step, self.total, self.items = 0, 0, 0.0
        self.phase_s: dict[str, float] = {}  # seconds spent in each of the job's phases so far
        self.stopped_after = ""  # where the job stopped on request ("iteration 12"); empty if it ran to its end
        self.group: ActorGroup | None = None
        self.sink: MqttSink | FileSink | None = None
        self.endpoint: PrometheusEndpoint | None = None  # rank 0, when MPISCALE_PROMETHEUS_PORT is set
        self.watchdog: Watchdog | None = None
        self.reports: dict[int, dict] = {}  # rank -> its latest report: its node's on a node's first rank, all on 0
        self._commands: dict[str, str] = {}  # rank 0: id -> command, for checkpoints and stops not yet obeyed
        self._rejected = 0  # rank 0: control messages rejected in this interval
        self._token: str | None = None  # rank 0 with a broker: what commands must carry (None: all are refused)
        self._task: asyncio.Task | None = None
        self._busy_beat: BusyBeat | None = None  # rank 0: heartbeats while its loop is held
        self._accepted = False  # the job's checks passed (``accept``)
        self._leader = 0
        self._progress: list[tuple[float, int, float]] = []  # (time, step, items) of recent reports
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._out: str | None = None  # the job's output, beside which a telemetry file lies
        self._spoke_for_rank_0 = False  # this rank reported rank 0's death in its place

    @classmethod
    async def start(cls, system: ActorSystem, command: str, out: str | None) -> Telemetry:
        """Start reporting (collective). Rank 0 connects to the broker, or opens ``OUT.telemetry.jsonl``.

        Checkpoint and stop commands go to the runtime's steering while a job steers (``system.steering.active``)
        and are rejected otherwise.
        """
        problem = None
        try:
            settings, watching = TelemetrySettings.from_env(), WatchdogSettings.from_env()
        except ValueError as error:  # the same environment on every rank: one line, the job refused
            problem = ValueError(f"mpiscale {command}: {error}")
        await system.agree(problem, "the telemetry settings")  # raises on every rank where settings were refused
        comm = system.communicator("telemetry")  # the job's own collectives on world keep their numbers
        agreed = await comm.bcast((job_id(), settings.enabled) if system.rank == 0 else None, 0)
        assert isinstance(agreed, tuple)
        job, enabled = agreed
        session = cls(system, settings, str(job), command, comm)
        if not enabled:  # rank 0's choice: every rank must take part in the session's collectives, or none
            return session
        name = f"{COLLECTOR}-{next(_sessions)}"  # every rank starts the same sessions in the same order
        session.group = await system.spawn_group(Collector, session, name=name, over=comm)
        session._leader = system.hierarchy.node_leaders[system.rank]  # the node's first rank (the watchdog's too)
        if system.rank == 0:
            session._open_sink(out)
            restarts = restart_count()
            previous = session.sink.previous_failure() if restarts and isinstance(session.sink, FileSink) else None
            if previous is not None:
                print(f"mpiscale: restart {restarts} of this job: its previous run failed: {previous}", file=sys.stderr,
                      flush=True)  # fmt: skip
            if settings.prometheus_port is not None:
                session.endpoint = open_endpoint(session.job, settings.prometheus_port, settings.prometheus_addr)
            session.watchdog = Watchdog(watching, settings.interval_s, system.hierarchy.node_leaders)
            session._busy_beat = BusyBeat(settings.interval_s, session._beat_while_busy)
            session.emit(record("status", session.job, state="running", command=command, ranks=system.size,
                                host=socket.gethostname()), retain=True)  # fmt: skip
            session.event("started", f"{command} on {counted(system.size, 'rank')}")
            if restarts:
                after = f", after: {previous}" if previous else ""
                session.event("restarted", f"run {restarts + 1} of the job (restart {restarts}){after}")
        session._out = out
        system.death_reporters.append(session.died)  # (on the others: where rank 0 is the one that died)
        said = last_words.spec(session.job, command, system.size, system.rank, session._file_path(out))
        system.leave_last_words(last_words.__name__, said)  # a held rank's node watch says it in its place
        session._task = asyncio.get_running_loop().create_task(session._tick(), name="mpiscale-telemetry")
        session._task.add_done_callback(session._tick_ended)
        return session

    def _open_sink(self, out: str | None) -> None:
        host = socket.gethostname()
        if self.settings.broker is not None:
            lost = lost_status(self.job, self.command, self.system.size, host)
            try:
                self._token = issue(self.job)
                kept = f"; control token in {token_path(self.job)}"
            except OSError as error:
                kept = f"; no control: the token cannot be written ({error})"
            self.sink = MqttSink(self.settings, self.job, lost, on_control=self.on_control)
            where = f"mqtt://{self.settings.broker_shown}/mpiscale/{self.job}/{kept}"
        else:  # opened once the job's input is accepted: a refused job writes nothing
            self.sink = FileSink(self._file_path(out))
            return
        print(f"telemetry: job {self.job} -> {where}", flush=True)

    def accept(self) -> None:
        """The job's input and settings passed its checks: its records from now on, and those held, are written."""
        sink = self.sink
        if isinstance(sink, FileSink) and sink.accept() and not self._accepted:
            print(f"telemetry: job {self.job} -> {sink.path}", flush=True)
        self._accepted = True

    def refused(self) -> None:
        """The job was refused before its checks passed: a telemetry file keeps nothing of it."""
        if isinstance(self.sink, FileSink) and not self._accepted:
            self.sink.discard()

    # ------------------------------------------------------------- every rank
    def update(self, step: int, total: int, items: float = 0.0, phases: dict[str, float] | None = None) -> None:
        """This rank's progress: step ``step`` of ``total`` done, ``items`` more processed, seconds in ``phases``."""
        self.step, self.total = step, total
        self.items += items
        for phase, seconds in (phases or {}).items():
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds

    def event(self, name: str, detail: str = "") -> None:
        """An event of this rank, published by rank 0 (from any thread: a background checkpoint writer's, say)."""
        if self.group is None:
            return
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.event, name, detail)
            return
        payload = record("event", self.job, event=name, rank=self.system.rank, detail=detail)
        if self.system.rank == 0:
            self.emit(payload)
        else:
            self.group[0].tell("event", payload)

    def obeyed(self, orders: Orders, where: str, checkpointed: bool) -> None:
        """The job acted on ``orders`` after ``where`` ("iteration 12"): rank 0 answers the commands behind them."""
        if orders.stop:
            self.stopped_after = where
        if self.system.rank != 0:
            return
        for id in orders.ids:
            command = self._commands.pop(id, "")
            if command == "checkpoint" and not checkpointed:
                self._answer("rejected", id, "this job keeps no checkpoints: start it with a checkpoint directory")
            elif command == "checkpoint":
                self._answer("completed", id, f"checkpoint of {where} saved")
            elif command == "stop":
                saved = "after its checkpoint" if checkpointed else "without a checkpoint (the job keeps none)"
                self._answer("completed", id, f"stopped after {where}, {saved}")

    # ------------------------------------------------------------------ rank 0: control
    def on_control(self, raw: bytes) -> None:
        """A message on the job's control topic: rejected with the reason, or acknowledged and obeyed."""
        try:
            command = parse(raw, self._token)
        except Rejected as error:
            self._rejected += 1
            if self._rejected <= REJECTIONS_SHOWN:  # a flood costs a few events per interval, then one count
                self._answer("rejected", error.id, str(error))
            return
        assert self.group is not None
        steering = self.system.steering
        if not steering.active and command.command in ("checkpoint", "stop"):
            self._answer("rejected", command.id, f"{self.command} keeps no checkpoints and has no steps to stop "
                         "after; end it with scancel or Ctrl-C")  # fmt: skip
            return
        self._answer("acknowledged", command.id, command.command + (f" {command.level}" if command.level else ""))
        if command.command == "dump":
            self.group.tell_all("dump")
            self._answer("completed", command.id, f"every rank of {self.system.size} writes its diagnostics to stderr")
        elif command.command == "log-level":
            assert command.level is not None
            self.group.tell_all("log_level", command.level)
            self._answer("completed", command.id, f"log level {command.level} on every rank")
        else:
            self._commands[command.id] = command.command
            steering.request(command.command, command.id)

    def _answer(self, event: str, id: str | None, detail: str) -> None:
        self.emit(record("event", self.job, event=event, rank=0, detail=detail, id=id))

    def _report(self) -> dict:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        waited = self.system.collective_wait_s
        return {
            "rank": self.system.rank, "step": self.step, "total": self.total, "items": self.items,
            "time": time.time(), "waiting_in": self.system.waiting_in(), "wait_s": waited,
            "host": socket.gethostname(), "pid": os.getpid(), "via": self._leader,
            "metrics": self.system.traffic() | self._machine(usage, waited),
        }  # fmt: skip

    def _machine(self, usage, waited: float) -> dict[str, float]:
        numbers = {"rss_mib": usage.ru_maxrss / 1024, "collective_wait_s": waited}
        numbers |= {f"time_{phase}_s": seconds for phase, seconds in self.phase_s.items()}
        gpu = gpu_memory_mib()
        return numbers if gpu is None else numbers | {"gpu_memory_mib": gpu}

    async def _tick(self) -> None:
        assert self.group is not None
        while True:  # the first report at once: a rank stuck before its first interval is still seen
            mine = self._report()
            if self.system.rank == 0:
                self.reports[0] = mine
                self._publish(self.reports)
                if self._rejected > REJECTIONS_SHOWN:
                    self._answer("rejected", None, f"{self._rejected - REJECTIONS_SHOWN} more control messages "
                                 f"rejected in {self.settings.interval_s:g} s")  # fmt: skip
                self._rejected = 0
                await self._watch()
            elif self._leader == self.system.rank:
                node, self.reports = [mine, *self.reports.values()], {}
                self.group[0].tell("report", node)
            else:
                self.group[self._leader].tell("report", [mine])
            await asyncio.sleep(self.settings.interval_s)

    def _tick_ended(self, task: asyncio.Task) -> None:
        """The reports' task ends only when cancelled: an error in it (a defect of ours) would leave the job without
        its reports and its hang watch, unsaid, so it ends the job with its traceback instead."""
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self.system.fail(error, "telemetry (its reports and hang watch)")

    # ------------------------------------------------------------------ rank 0
    def emit(self, payload: dict, retain: bool = False) -> None:
        if self.sink is not None:
            self.sink.publish(payload, retain)
        if self.endpoint is not None:
            self.endpoint.take(payload)

    def _publish(self, reports: dict[int, dict]) -> None:
        now = time.time()
        step = min(report["step"] for report in reports.values())
        total = max(report["total"] for report in reports.values())
        items = sum(report["items"] for report in reports.values())
        self._progress = [*self._progress[-9:], (now, step, items)]
        steps_per_s, items_per_s, eta = pace(self._progress, total)
        self.emit(record("progress", self.job, step=step, total=total, steps_per_s=steps_per_s, eta_s=eta,
                         items_per_s=items_per_s))  # fmt: skip
        values = spread(reports)
        slowest = values["step"]["min_rank"]
        self.emit(record("metrics", self.job, ranks_reporting=len(reports), slowest_rank=slowest, values=values,
                         nodes=by_node(reports)))  # fmt: skip
        self.emit(self._heartbeat(reports, now))
        if self._busy_beat is not None:
            self._busy_beat.mark()

    def _heartbeat(self, reports: dict[int, dict], now: float) -> dict:
        """The heartbeat record: how many ranks report, and the age of the oldest report."""
        oldest = now - min(report["time"] for report in reports.values())
        dropped = self.sink.dropped if self.sink is not None else 0
        return record("heartbeat", self.job, ranks_reporting=len(reports), oldest_report_s=oldest, dropped=dropped,
                      interval_s=self.settings.interval_s)  # fmt: skip

    def _beat_while_busy(self) -> None:
        """From the busy beat's thread: the loop is held, so its reports stand as they are (a copy, read once)."""
        try:
            reports = dict(self.reports)
        except RuntimeError:  # the loop changed them just now: it is not busy, and beats itself
            return
        sink = self.sink
        if reports and sink is not None:
            sink.publish(self._heartbeat(reports, time.time()))

    async def _watch(self) -> None:
        """Report what the watchdog finds; on a hang, every rank's diagnostics, and the end if so configured."""
        assert self.watchdog is not None and self.group is not None
        for finding in self.watchdog.look(self.reports, time.time()):
            print(f"mpiscale: telemetry: {finding.kind}: {finding.detail}", file=sys.stderr, flush=True)
            self.emit(record("event", self.job, event=finding.kind, rank=finding.rank, detail=finding.detail))
            if finding.kind != "hang":
                continue
            self.group.tell_all("dump")
            stuck = self.reports[finding.rank]
            if stuck.get("host") == socket.gethostname():  # its event loop may be stuck: faulthandler answers
                with contextlib.suppress(OSError):
                    os.kill(stuck["pid"], signal.SIGUSR1)
            if self.watchdog.settings.action == "abort":
                await asyncio.sleep(1.0)  # the dumps and the event go out first
                await self._end("failed")
                self.system.fail(RuntimeError(f"hang detected: {finding.detail}"), "the hang detector (telemetry)")

    async def close(self) -> None:
        """The job finished (collective): rank 0 publishes the last numbers and status, then closes its sink."""
        if self._task is not None:
            self._task.cancel()
        if self.group is None:
            return
        final = np.array([self.step, self.total, self.items], np.float64)
        every = await self._comm.allgather(final)  # the last numbers, not the last interval's
        if self.system.rank == 0:
            self.reports[0] = self._report()
            for rank, (step, total, items) in enumerate(every):
                report = self.reports.setdefault(rank, {"rank": rank, "metrics": {}, "time": time.time()})
                report.update(step=int(step), total=int(total), items=float(items))
            self._publish(self.reports)
            for id, command in self._commands.items():  # arrived after the last agreement
                self._answer("rejected", id, f"the job finished before it could {command}")
            if self.stopped_after:
                self.event("finished", f"{self.command} stopped after {self.stopped_after}, its state saved")
            else:
                self.event("finished", self.command)  # (watch shows "finished dictlearn")
            await self._end("stopped" if self.stopped_after else "finished")

    async def fail(self, detail: str, rank: int = 0) -> None:
        """The job is failing on this rank (not collective), or ``rank`` died: rank 0 says so, and closes its sink."""
        if self._task is not None:
            self._task.cancel()
        if self.group is not None and self.sink is not None:  # rank 0's, or one speaking in its place
            self.emit(record("event", self.job, event="failure", rank=rank, detail=detail))
            await self._end("failed")

    async def died(self, detail: str, rank: int) -> None:
        """``rank`` died (the runtime's death reporter): as :meth:`fail`, and when rank 0 is the one that died (its
        node lost), the rank that found it says so in its place."""
        if self.system.rank != 0 and rank == 0 and self.group is not None and not self._spoke_for_rank_0:
            self._spoke_for_rank_0 = True  # once (a node found lost by both of its connections)
            file = self._file_path(self._out)
            self.sink = last_words.sink_in_rank_0s_place(self.settings, self.job, self.command, self.system.size, file)
        await self.fail(detail, rank)

    def _file_path(self, out: str | None) -> Path:
        """The telemetry file beside the job's output (or named after its command)."""
        return Path(f"{out or self.command}.telemetry.jsonl")

    async def _end(self, state: str) -> None:
        if self.died in self.system.death_reporters:
            self.system.death_reporters.remove(self.died)
        self.emit(record("status", self.job, state=state, command=self.command, ranks=self.system.size,
                         host=socket.gethostname()), retain=True)  # fmt: skip
        if self._busy_beat is not None:
            self._busy_beat.stop()
        sink, self.sink = self.sink, None  # late reports and events are dropped
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            await asyncio.to_thread(endpoint.close)  # waits for the server's poll (half a second at most)
        if sink is not None:
            await sink.close()


_current: Telemetry | None = None


def current() -> Telemetry | None:
    """The running job's telemetry on this rank (None outside a job)."""
    return _current


def set_current(session: Telemetry | None) -> None:
    global _current
    _current = session
