"""ActorSystem: one per rank. Routes messages and answers asks, agrees, ends the job cleanly or aborts it.

The job's end is quiet: once ``main`` has returned everywhere, ``close`` waits
until no message is in flight anywhere (a two-wave message-count consensus on a
private communicator). An unhandled failure on any rank prints one report and
aborts the whole job. :mod:`.lifecycle` runs ``main`` on it and handles the
signals; :mod:`.diagnostics` words what a rank says about itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import numbers
import sys
import time
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any, TypeVar

from ..ranks import AGREED_REPORT_S, reported_by_another, reported_line
from . import wire
from .abandoned import AbandonedWatch, CollectiveLog
from .actor import Actor, ActorCell, ActorGroup, ActorRef, RestartPolicy, address
from .blocking import HeldAsks
from .channels import Channel, Deliver
from .collectives import Communicator
from .config import RuntimeConfig
from .consensus import agree_or_refuse, until_quiet
from .deadlines import AskDeadlines
from .diagnostics import failure_report, rank_diagnostics, refusal_report
from .dispatch import MESSAGE, REPLY, STATE, SYSTEM_ACTOR, PendingAsk
from .errors import Failure, JobRefused, MessageRefused, TransportError
from .hierarchy import Group, Hierarchy, build_hierarchy
from .lending import into
from .progress import ProgressEngine, completed
from .steering import Steering

log = logging.getLogger(__name__)

T = TypeVar("T")


class _SystemActor(Actor):
    """Built-in actor on every rank that spawns actors for other ranks."""

    def spawn(self, cls: type, args: tuple, kwargs: dict, name: str | None, restart: RestartPolicy | None) -> ActorRef:
        return self.system.spawn_local(cls, *args, name=name, restart=restart, **kwargs)

    def collective_state(self) -> dict[str, Any]:
        return self.system.collective_state()


class ActorSystem:
    """The runtime of one rank: actors, messaging, collectives, lifecycle."""

    def __init__(self, MPI: ModuleType, config: RuntimeConfig) -> None:
        self.MPI, self.config = MPI, config
        world = MPI.COMM_WORLD
        self.rank: int = world.Get_rank()
        self.size: int = world.Get_size()
        self.host: str = MPI.Get_processor_name()
        self._p2p, self._control = world.Dup(), world.Dup()
        self._cells: dict[str, ActorCell] = {}
        self._asks: dict[int, PendingAsk] = {}
        self._dispatch = wire.chosen()[0].Dispatch(self, self._cells, self._asks)
        self._deadlines = AskDeadlines(self._asks)
        self._engine = ProgressEngine(MPI, self._p2p, config, self._dispatch)
        self._ask_spin_s, self._value_spin_s = config.ask_spin_us * 1e-6, config.value_spin_us * 1e-6
        #: World, node-local and node-leader communicators (see ``Hierarchy``).
        self.hierarchy: Hierarchy = build_hierarchy(MPI, world, self._engine, config)
        self._groups = [Group("world", self.hierarchy)]  # the whole job's, then those ``split`` made
        #: Logs of collectives synchronous code makes (``blocking_barrier``), by name; the abandoned ones' watch.
        self.call_logs: dict[str, CollectiveLog] = {}
        self.abandoned_watch: AbandonedWatch | None = None
        self._channels: list[Channel] = []
        self._ask_ids, self._names = itertools.count(), itertools.count()
        #: The rank is shutting down: incoming asks are answered with ActorStopped, tells refused and counted.
        self.stopping = False
        self.refused_tells = 0
        self.failing = False  # this rank has reported a failure and is aborting the job
        self.main_state = "running"  # then how it left: "returned", "raised JobRefused" or "called sys.exit"
        self.exit_status = 0  # set when every rank refused the job (JobRefused)
        #: Stop and checkpoint requests, agreed by every rank at a steering job's step ends (SIGTERM feeds it).
        self.steering = Steering(MPI, world.Dup(), self._engine)
        #: The signal that asked this rank's job to stop after its current step (None: none did).
        self.stop_signal: int | None = None
        #: Each awaited as ``reporter(detail, rank)`` (a second at most) before the job ends for another rank's death.
        self.death_reporters: list[Callable[[str, int], Awaitable[None]]] = []
        self._at_end: list[Callable[[], Awaitable[None]]] = []
        #: What a rank does in the job (``"pipeline stage 1 of 4"``), named with it when it dies; a job fills it.
        self.roles: dict[int, str] = {}
        #: Ranks the job itself plans to kill (a rehearsed failure), with why: such a rank says so as it dies, so
        #: the rank that finds it gone names the plan in telemetry and prints no second line of its own.
        self.planned_deaths: dict[int, str] = {}
        #: Every rank's host, by rank (the lifecycle gathers them at start-up): reports name a sender's host.
        self.hosts: list[str] = []
        #: Called as this rank aborts the job after its report (the lifecycle tells its host's ranks: no second line).
        self.before_abort: list[Callable[[], None]] = []
        #: ``leave_last_words(module, spec)``: what the node watch says for this rank if a lost node finds the rank's
        #: Python held (``await module.speak(spec, detail, rank)``): telemetry's failure event. The lifecycle sets it.
        self.leave_last_words: Callable[[str, dict], None] = lambda module, spec: None

    def communicator(self, name: str) -> Communicator:
        """A new communicator over every rank, with its own numbering of collectives: for a layer's own collectives
        (telemetry's), kept apart from those a job's reports number on ``world`` (collective, blocking)."""
        return Communicator(self.MPI, self.world.comm.Dup(), self._engine, self.config, name)

    def split(self, color: int, name: str) -> Group:
        """Collective over every rank: the ranks that pass the same ``color`` form a :class:`Group` with
        collectives of its own (ranks in world order), named ``name`` in reports; e.g. the replicas of one pipeline
        stage, which average their gradients. Blocking, like :meth:`communicator`; freed when the runtime ends."""
        if not isinstance(color, int) or color < 0:
            raise ValueError(f"split takes a colour >= 0, got {color!r}")
        comm = self.world.comm.Split(color, self.rank)
        group = Group(name, build_hierarchy(self.MPI, comm, self._engine, self.config, name))
        comm.Free()  # the hierarchy holds duplicates of its own
        self._groups.append(group)
        return group

    async def channel(self, name: str, deliver: Deliver) -> Channel:
        """Collective (a barrier on ``world`` first: a rank that never comes is reported, not waited for): a
        :class:`Channel` for raw arrays, ``deliver(source, lane, key, array)`` called as each arrives."""
        await self.world.barrier()
        self._channels.append(Channel(self.MPI, self.world.comm.Dup(), self._engine, self.config, name, deliver))
        return self._channels[-1]

    def at_end(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``await hook()`` once ``main`` has returned on every rank and no message is in flight, before the
        actors stop: the place for a collective that must not meet a rank still in ``main`` (collective: every rank
        adds the same hooks in the same order)."""
        self._at_end.append(hook)

    # ----------------------------------------------------------- properties
    @property
    def world(self) -> Communicator:
        """Awaitable collectives over all ranks."""
        return self.hierarchy.world

    @property
    def node(self) -> Communicator:
        """Awaitable collectives over the ranks of this node."""
        return self.hierarchy.node

    @property
    def leaders(self) -> Communicator | None:
        """Collectives over one rank per node; None on ranks that do not lead a node."""
        return self.hierarchy.leaders

    @property
    def outbox(self) -> Any:
        """The progress engine's send queue (the compiled dispatch sends compact replies through it)."""
        return self._engine.outbox

    # -------------------------------------------------------------- spawning
    def spawn_local(
        self, cls: type, *args: Any, name: str | None = None, restart: RestartPolicy | None = None, **kwargs: Any
    ) -> ActorRef:
        """Create an actor on this rank and start its mailbox."""
        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise TypeError(f"spawn needs a subclass of mpiscale.Actor, got {cls!r}")
        if name is None:
            name = f"{cls.__name__}-{next(self._names)}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"actor names are non-empty strings, got {name!r}")
        if name in self._cells:
            raise ValueError(f"an actor named {name!r} already lives on rank {self.rank}")
        ref = ActorRef(self.rank, name)
        policy = restart if restart is not None else cls.restart_policy
        cell = ActorCell(self, ref, cls, args, kwargs, policy)
        self._cells[name] = cell
        cell.start()
        return ref

    async def spawn(self, cls: type, *args: Any, name: str | None = None, rank: int | None = None,
                    restart: RestartPolicy | None = None, **kwargs: Any) -> ActorRef:  # fmt: skip
        """Create an actor on ``rank`` (default: this rank). The class must be importable there."""
        if rank is None or rank == self.rank:
            return self.spawn_local(cls, *args, name=name, restart=restart, **kwargs)
        return await ActorRef(rank, SYSTEM_ACTOR).ask("spawn", cls, args, kwargs, name, restart)

    async def spawn_group(self, cls: type, *args: Any, name: str, restart: RestartPolicy | None = None,
                          over: Communicator | None = None, **kwargs: Any) -> ActorGroup:  # fmt: skip
        """Collective: every rank spawns one ``cls`` named ``name``; returns when all exist.

        ``over``: the communicator over every rank whose barrier waits for them (default ``world``; a layer's own,
        from :meth:`communicator`, keeps the job's numbering of world's collectives as it is)."""
        self.spawn_local(cls, *args, name=name, restart=restart, **kwargs)
        await (over or self.world).barrier()
        return ActorGroup(name, self.size)

    # ------------------------------------------------------------- messaging
    @property
    def origin(self) -> str:
        """Where a failure on this rank happened, as its reports name it: "rank R on host H"."""
        return f"rank {self.rank} on host {self.host}"

    def _post(self, rank: int, envelope: tuple, track: bool = True, answers: int = -1) -> asyncio.Future | None:
        """Send an envelope (to this rank's own actors without MPI); a future for its buffers when ``track``."""
        if rank == self.rank:
            self._dispatch.envelope(rank, envelope)
            return completed(0) if track else None
        return self._engine.send(rank, envelope, track, answers)

    async def ask(
        self, ref: ActorRef, method: str, args: tuple, kwargs: dict, timeout: float | None, reply_into: Any = None
    ) -> Any:
        """Send an ask and await the reply; see :meth:`ActorRef.ask`."""
        ref, method = address(ref, method, self.size)
        if timeout is not None and not (isinstance(timeout, numbers.Real) and timeout >= 0):
            kind = ValueError if isinstance(timeout, numbers.Real) else TypeError
            raise kind(f"ask({method!r}) to {ref}: timeout must be >= 0 seconds or None, got {timeout!r}")
        ask_id = next(self._ask_ids)
        loan = None  # of the buffer for the reply, while the ask is out (see lending.py)
        if reply_into is not None:
            over = self.config.inline_bytes if ref.rank != self.rank else None
            loan = self._engine.receiving.lending.lend(ask_id, ref.rank, reply_into, f"ask({method!r}) to {ref}", over)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if timeout is None:
            self._asks[ask_id] = PendingAsk(future, ref, method, time.monotonic())
        else:  # failed by the one timer of the asks' deadlines (asyncio.wait_for would add a task to every ask)
            deadline = loop.time() + timeout
            self._asks[ask_id] = PendingAsk(future, ref, method, time.monotonic(), timeout, deadline)
            self._deadlines.add(loop, deadline)
        try:
            self._post(ref.rank, (MESSAGE, ref.name, method, args, kwargs, ask_id), track=False)
            if ref.rank != self.rank and self._ask_spin_s:
                self._engine.poll_until(future, self._ask_spin_s)  # a fast reply then needs no task switch
            value, failed = await future
        finally:
            self._asks.pop(ask_id, None)
            if loan is not None and (held := self._engine.receiving.lending.end(loan)) is not None:
                await asyncio.shield(held)  # a timed-out ask: its reply's parts still coming into the buffer
        if failed:
            value.raise_here()
        return value if reply_into is None else into(reply_into, value, bool(loan and loan.repaid), ref, method)

    def tell(self, ref: ActorRef, method: str, args: tuple, kwargs: dict) -> asyncio.Future:
        """Send a one-way message; see :meth:`ActorRef.tell`."""
        ref, method = address(ref, method, self.size)
        envelope = (MESSAGE, ref.name, method, args, kwargs, -1)
        if ref.rank != self.rank and (queued := self._engine.post(ref.rank, envelope)) is not None:
            return queued  # small: copied now, sent at the turn's end
        sent = self._post(ref.rank, envelope)
        assert sent is not None  # tracked
        return sent

    def reply(self, reply_to: tuple[int, int], value: Any) -> None:
        """Answer an ask with a value or a :class:`Failure`."""
        rank, ask_id = reply_to
        failed = isinstance(value, Failure)
        if failed and rank != self.rank:
            value = value.picklable()
        try:
            self._post(rank, (REPLY, ask_id, value, failed), track=False, answers=ask_id)
        except Exception as error:  # the result could not be pickled
            if failed:
                raise
            failure = Failure.capture(error, f"{self.origin}, sending a reply").picklable()
            self._post(rank, (REPLY, ask_id, failure, True), track=False)

    # ------------------------------------------------------------- lifecycle
    async def agree(
        self, error: BaseException | None, what: str = "the checks", timeout: float | None = None, status: int = 2
    ) -> None:
        """Collective: if ``error`` is set on any rank, raise :class:`JobRefused` on every rank.

        The message is the lowest failing rank's. For checks every rank makes
        before a job starts (input, settings, checkpoints), so that bad input
        ends the job with one message and a clean exit. A rank that never
        arrives (it failed elsewhere, or waits in another collective) cannot
        hang the others: after ``timeout`` seconds (the shutdown timeout by
        default) the job fails as for any unhandled error. ``status`` is the
        exit status of the failing rank whose message is shown: 2 for bad input
        or settings, 1 for a failure of the run.
        """
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        await agree_or_refuse(self._engine, self._control, error, what, timeout, status)

    def _locally_idle(self) -> bool:
        return not self._asks and all(cell.idle for cell in self._cells.values())

    async def _until_quiet(self) -> None:
        """Return when every rank is idle and every sent message was delivered."""
        await until_quiet(self.MPI, self._engine, self._control, self._locally_idle, self.config.shutdown_timeout_s)

    async def _stop_actors(self) -> None:
        for cell in self._cells.values():
            try:
                await cell.instance.on_stop()
            except Exception:
                log.exception("on_stop of actor %s failed", cell.ref)
            if cell.task is not None:
                cell.task.cancel()
        await asyncio.gather(*(c.task for c in self._cells.values() if c.task), return_exceptions=True)

    async def _drain_engine(self, deadline: float) -> bool:
        while not self._engine.idle and time.monotonic() < deadline:
            await asyncio.sleep(1e-3)
        return self._engine.idle

    def _free(self) -> None:
        for channel in self._channels:
            channel.close()
        for group in self._groups:
            group.free()
        for comm in (self._control, self._p2p, self.steering.comm):
            comm.Free()

    def fail(self, error: BaseException, context: str, status: int = 1) -> None:
        """Print one failure report for this rank and abort the whole job with ``status``."""
        if self.failing:
            return
        reporter = reported_by_another(error, self.rank, self.size)
        if reporter is not None:
            # Every rank raised it alike: the reporter's report, and its abort, end the job. This rank gives them
            # time, then ends with one line (the reporter may have caught it and gone on).
            self.failing = True
            sys.stdout.flush()
            time.sleep(AGREED_REPORT_S)
            self.abort(reported_line(self.rank, error, reporter) + "\n", status)
            return
        if isinstance(error, MessageRefused):
            source = error.source
            sender_host = self.hosts[source] if 0 <= source < len(self.hosts) else "unknown"
            self.abort(refusal_report(self.rank, self.size, self.host, sender_host, error), status)
            return
        self.abort(failure_report(self.rank, self.size, self.host, context, error), status)

    def start(self) -> tuple[asyncio.Task, asyncio.Task | None]:
        """The progress engine's task, the system actor, and the watch for abandoned collectives (None: off)."""
        loop = asyncio.get_running_loop()
        engine_task = loop.create_task(self._engine.run(), name="mpiscale progress engine")
        engine_task.add_done_callback(self._engine_finished)
        self.spawn_local(_SystemActor, name=SYSTEM_ACTOR)
        if self.config.collective_check_s <= 0 or self.size == 1:
            return engine_task, None
        held = HeldAsks(self._asks, self._ask_ids, self._post, self._engine, SYSTEM_ACTOR, STATE)
        checker = AbandonedWatch(self.rank, self.host, self._collective_logs, self.fail, self._ask_collective_state,
                                 held.ask, held.answer, self.config.collective_check_s)  # fmt: skip
        self.abandoned_watch = checker
        return engine_task, loop.create_task(checker.run(), name="mpiscale abandoned-collective watch")

    async def close(self, refused: JobRefused | None, engine_task: asyncio.Task, watch: asyncio.Task | None) -> None:
        """The end of a job whose ``main`` returned (or refused it): every rank quiet, the hooks of ``at_end`` run
        (not after a refusal), the actors stopped, the engine drained and stopped, the communicators freed."""
        if watch is not None:
            watch.cancel()
        if refused is None:
            try:
                await self._until_quiet()
            except MessageRefused as unfinished:  # a frame whose parts no rank sent: no end would ever come
                self.fail(unfinished, "the job ended with a message from another rank unfinished")
            except TransportError as unbalanced:  # a message no rank sent, delivered: no end would ever come
                self.fail(SystemExit(str(unbalanced)), "the job's end")  # (as a SystemExit: its text, no traceback)
            for hook in self._at_end:
                try:
                    await hook()
                except Exception as error:  # the others may wait in the hook's collective: end them all
                    self.fail(error, "a hook run at the job's end failed")
        else:  # every rank should be here; if one is not, fail rather than wait for it
            try:
                await asyncio.wait_for(self._until_quiet(), self.config.shutdown_timeout_s)
            except TimeoutError:
                self.fail(refused, "main refused the job, but not every rank did")
        await self._stop_actors()
        await self._drain_engine(time.monotonic() + self.config.shutdown_timeout_s)
        self._engine.stop()
        await engine_task
        self._free()

    async def drain(self, deadline: float) -> bool:
        """A shutdown's drain until ``deadline``: queued asks answered with ActorStopped, running handlers given
        their time, the messages in flight sent; whether everything drained."""
        for cell in self._cells.values():
            cell.fail_pending()
        while any(cell.current for cell in self._cells.values()) and time.monotonic() < deadline:
            await asyncio.sleep(1e-3)
        return await self._drain_engine(deadline)

    def abort(self, last_words: str, status: int) -> None:
        """Write this rank's ``last_words`` to stderr (after what it printed) and abort every rank with ``status``."""
        self.failing = True
        sys.stdout.flush()
        sys.stderr.write(last_words)
        sys.stderr.flush()
        for hook in self.before_abort:
            hook()
        self.MPI.COMM_WORLD.Abort(status)

    def _collective_logs(self) -> list[CollectiveLog]:
        return [log for group in self._groups for log in group.logs()] + list(self.call_logs.values())

    def collective_state(self) -> dict[str, Any]:
        """Where ``main`` is and the collectives this rank started (what another rank asks when one waits long)."""
        logs = {log.name: log.state() for log in self._collective_logs()}
        return {"main": self.main_state, "host": self.host, "logs": logs}

    async def _ask_collective_state(self, rank: int, timeout: float) -> dict[str, Any]:
        return await self.ask(ActorRef(rank, SYSTEM_ACTOR), STATE, (), {}, timeout)

    def waiting_in(self) -> tuple[str, float] | None:
        """What this rank waits on longest now (a collective, a value owed it), and for how long (None: nothing)."""
        return self._engine.waits.oldest()

    def expect(self, future: asyncio.Future, what: str | Callable[[], str]) -> None:
        """``future`` awaits a value another rank owes this one (``what``, or what it returns once the wait is named):
        count the wait (telemetry reports it, the hang watch names it), polling MPI for it in the caller's stack for
        up to ``value_spin_us`` first."""
        began = time.monotonic()
        self._engine.poll_until(future, self._value_spin_s)
        self._engine.waits.count(future, what, began)

    @property
    def collective_wait_s(self) -> float:
        """Seconds this rank has spent waiting on others so far (how much of its time others cost it)."""
        return self._engine.waits.total_s

    def traffic(self) -> dict[str, float]:
        """This rank's actor messaging so far: messages and bytes sent and received, messages waiting in mailboxes."""
        engine = self._engine
        return {
            "messages_sent": engine.messages_sent,
            "messages_received": engine.messages_received,
            "bytes_sent": engine.bytes_sent,
            "bytes_received": engine.bytes_received,
            "bytes_received_in_place": engine.receiving.lending.bytes_in_place,
            "mailbox_depth": sum(len(cell.mailbox) for cell in self._cells.values()),
        }

    def diagnostics(self) -> str:
        """What this rank is doing: pending MPI requests and asks, mailboxes, task stacks."""
        engine = self._engine
        where = f"rank {self.rank} of {self.size} on {self.host}"
        traffic = (engine.messages_sent, engine.messages_received)
        return rank_diagnostics(where, self.stopping, traffic, engine.describe(), self._asks, self._cells.values())

    def dump_diagnostics(self) -> None:
        """Write :meth:`diagnostics` to stderr (also done on SIGUSR1)."""
        sys.stderr.write(self.diagnostics())
        sys.stderr.flush()

    def _engine_finished(self, task: asyncio.Task) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self.fail(error, "the progress engine failed while handling MPI traffic")
