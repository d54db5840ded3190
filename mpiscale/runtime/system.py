"""ActorSystem: one per rank. Routes messages, runs ``main``, ends the job cleanly.

``run(main)`` is called by every rank. It returns once ``main`` has returned on
every rank and no message is in flight anywhere (checked with a two-wave
message-count consensus on a private communicator). An unhandled failure on
any rank prints one report and aborts the whole job; SIGTERM/SIGINT drains and
exits non-zero; SIGUSR1 prints diagnostics. SIGUSR2 is taken as SIGTERM: mpirun
passes it on to the ranks as it is, while it follows its own SIGTERM with a
SIGKILL a second later, so the launcher turns a SIGTERM into SIGUSR2 to give a
job the time to stop after its step.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import itertools
import logging
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from .. import early_stop
from .abandoned import AbandonedWatch, CollectiveLog
from .actor import Actor, ActorCell, ActorGroup, ActorRef, Message, RestartPolicy, set_current_system
from .collectives import Communicator, Group, Hierarchy, build_hierarchy
from .config import RuntimeConfig, load_mpi
from .errors import ActorNotFound, ActorStopped, AskTimeout, Failure, JobRefused
from .eventloop import new_event_loop
from .peers import LocalPeers
from .progress import ProgressEngine, completed
from .steering import Steering

log = logging.getLogger(__name__)

T = TypeVar("T")
SYSTEM_ACTOR = "mpiscale.system"
_FINALIZE_GRACE_S = 3  # seconds MPI_Finalize may take after a signal before the process ends anyway
# One cancel reaches a rank several times at once: Slurm signals every process of the job (the rank, and mpirun or
# srun, which pass a SIGTERM on), and the launcher turns its own into SIGUSR2. Repeats this close count as one.
_SAME_STOP_S = 2.0
_STEERING_BEGINS_S = 5.0  # a stop that came while the rank started waits this long for the job to begin steering
_AGREED_REPORT_S = 3.0  # a failure every rank raised alike: how long the others wait for the reporter's abort
_MESSAGE, _REPLY = 0, 1


def _expire(future: asyncio.Future, ref: ActorRef, method: str, timeout: float) -> None:
    if not future.done():
        future.set_exception(AskTimeout(f"no reply from actor {ref} to {method!r} within {timeout:g}s"))


@dataclass
class _PendingAsk:
    future: asyncio.Future
    ref: ActorRef
    method: str
    started: float


class _SystemActor(Actor):
    """Built-in actor on every rank that spawns actors for other ranks."""

    def spawn(self, cls: type, args: tuple, kwargs: dict, name: str | None, restart: RestartPolicy | None) -> ActorRef:
        return self.system.spawn_local(cls, *args, name=name, restart=restart, **kwargs)

    def collective_state(self) -> dict[str, Any]:
        return self.system.collective_state()


class ActorSystem:
    """The runtime of one rank: actors, messaging, collectives, lifecycle."""

    def __init__(self, MPI: ModuleType, config: RuntimeConfig) -> None:
        self._MPI = MPI
        self.config = config
        world = MPI.COMM_WORLD
        self.rank: int = world.Get_rank()
        self.size: int = world.Get_size()
        self.host: str = MPI.Get_processor_name()
        self._p2p = world.Dup()
        self._control = world.Dup()
        self._engine = ProgressEngine(MPI, self._p2p, config, self._on_envelope)
        self._ask_spin_s = config.ask_spin_us * 1e-6
        #: World, node-local and node-leader communicators (see ``Hierarchy``).
        self.hierarchy: Hierarchy = build_hierarchy(MPI, world, self._engine, config)
        self._groups = [Group("world", self.hierarchy)]  # the whole job's, then those ``split`` made
        self._cells: dict[str, ActorCell] = {}
        self._asks: dict[int, _PendingAsk] = {}
        self._ask_ids = itertools.count()
        self._names = itertools.count()
        self._stopping = False
        self._failing = False
        self._dropped = 0
        self._main_task: asyncio.Task | None = None
        self._main_state = "running"  # then how it left: "returned", "raised JobRefused" or "called sys.exit"
        self.exit_status = 0  # set when every rank refused the job (JobRefused)
        #: Stop and checkpoint requests, agreed by every rank at a steering job's step ends (SIGTERM feeds it).
        self.steering = Steering(MPI, world.Dup(), self._engine)
        #: The signal that asked this rank's job to stop after its current step (None: none did).
        self.stop_signal: int | None = None
        self._stop_asked_at = -math.inf  # monotonic time of the first SIGTERM (or SIGUSR2) received
        self._stop_noted = False  # a SIGTERM's stop request was made at once, before the loop took the signal
        self._local_peers = LocalPeers.gather(world, self.host)
        #: Called as ``await reporter(detail, rank)`` (a second at most each) before the job ends because another
        #: rank died: telemetry names it there.
        self.death_reporters: list[Callable[[str, int], Awaitable[None]]] = []
        self._at_end: list[Callable[[], Awaitable[None]]] = []
        #: What a rank does in the job (``"pipeline stage 1 of 4"``), named with it when it dies; a job fills it.
        self.roles: dict[int, str] = {}

    def communicator(self, name: str) -> Communicator:
        """A new communicator over every rank, with its own numbering of collectives: for a layer's own collectives
        (telemetry's), kept apart from those a job's reports number on ``world`` (collective, blocking)."""
        return Communicator(self._MPI, self.world.comm.Dup(), self._engine, self.config, name)

    def split(self, color: int, name: str) -> Group:
        """Collective over every rank: the ranks that pass the same ``color`` form a :class:`Group` with
        collectives of its own (ranks in world order), named ``name`` in reports; e.g. the replicas of one pipeline
        stage, which average their gradients. Blocking, like :meth:`communicator`; freed when the runtime ends."""
        if not isinstance(color, int) or color < 0:
            raise ValueError(f"split takes a colour >= 0, got {color!r}")
        comm = self.world.comm.Split(color, self.rank)
        group = Group(name, build_hierarchy(self._MPI, comm, self._engine, self.config, name))
        comm.Free()  # the hierarchy holds duplicates of its own
        self._groups.append(group)
        return group

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

    async def spawn(
        self,
        cls: type,
        *args: Any,
        name: str | None = None,
        rank: int | None = None,
        restart: RestartPolicy | None = None,
        **kwargs: Any,
    ) -> ActorRef:
        """Create an actor on ``rank`` (default: this rank). The class must be importable there."""
        if rank is None or rank == self.rank:
            return self.spawn_local(cls, *args, name=name, restart=restart, **kwargs)
        return await ActorRef(rank, SYSTEM_ACTOR).ask("spawn", cls, args, kwargs, name, restart)

    async def spawn_group(
        self,
        cls: type,
        *args: Any,
        name: str,
        restart: RestartPolicy | None = None,
        over: Communicator | None = None,
        **kwargs: Any,
    ) -> ActorGroup:
        """Collective: every rank spawns one ``cls`` named ``name``; returns when all exist.

        ``over``: the communicator over every rank whose barrier waits for them (default ``world``; a layer's own,
        from :meth:`communicator`, keeps the job's numbering of world's collectives as it is)."""
        self.spawn_local(cls, *args, name=name, restart=restart, **kwargs)
        await (over or self.world).barrier()
        return ActorGroup(name, self.size)

    # ------------------------------------------------------------- messaging
    @property
    def _origin(self) -> str:
        return f"rank {self.rank} on host {self.host}"

    def _check_rank(self, ref: ActorRef) -> None:
        if not 0 <= ref.rank < self.size:
            raise ValueError(f"{ref}: rank {ref.rank} is outside this job of {self.size} ranks")

    def _post(self, rank: int, envelope: tuple, track: bool = True) -> asyncio.Future | None:
        """Send an envelope (to this rank's own actors without MPI); a future for its buffers when ``track``."""
        if rank == self.rank:
            self._on_envelope(rank, envelope)
            return completed(0) if track else None
        return self._engine.send(rank, envelope, track)

    async def ask(self, ref: ActorRef, method: str, args: tuple, kwargs: dict, timeout: float | None) -> Any:
        """Send an ask and await the reply; see :meth:`ActorRef.ask`."""
        self._check_rank(ref)
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"ask({method!r}) to {ref}: timeout must be >= 0 seconds or None, got {timeout!r}")
        ask_id = next(self._ask_ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._asks[ask_id] = _PendingAsk(future, ref, method, time.monotonic())
        # a timer that fails the future (asyncio.wait_for would add a task and tens of µs to every ask)
        timer = None if timeout is None else loop.call_later(timeout, _expire, future, ref, method, timeout)
        try:
            self._post(ref.rank, (_MESSAGE, ref.name, method, args, kwargs, ask_id), track=False)
            if ref.rank != self.rank and self._ask_spin_s:
                self._engine.poll_until(future, self._ask_spin_s)  # a fast reply then needs no task switch
            value, failed = await future
        finally:
            self._asks.pop(ask_id, None)
            if timer is not None:
                timer.cancel()
        if failed:
            value.raise_here()
        return value

    def tell(self, ref: ActorRef, method: str, args: tuple, kwargs: dict) -> asyncio.Future:
        """Send a one-way message; see :meth:`ActorRef.tell`."""
        self._check_rank(ref)
        envelope = (_MESSAGE, ref.name, method, args, kwargs, -1)
        if ref.rank != self.rank and self._engine.post(ref.rank, envelope):  # small: copied now, sent at turn's end
            return completed(0)
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
            self._post(rank, (_REPLY, ask_id, value, failed), track=False)
        except Exception as error:  # the result could not be pickled
            if failed:
                raise
            failure = Failure.capture(error, f"{self._origin}, sending a reply").picklable()
            self._post(rank, (_REPLY, ask_id, failure, True), track=False)

    def _on_envelope(self, source: int, envelope: tuple) -> None:
        if envelope[0] == _REPLY:
            _, ask_id, value, failed = envelope
            pending = self._asks.pop(ask_id, None)
            if pending is not None and not pending.future.done():
                pending.future.set_result((value, failed))
            return
        _, name, method, args, kwargs, ask_id = envelope
        reply_to = (source, ask_id) if ask_id >= 0 else None
        cell = self._cells.get(name)
        if self._stopping:
            if reply_to is not None:
                error = ActorStopped(f"rank {self.rank} is shutting down; {name!r} did not handle {method!r}")
                self.reply(reply_to, Failure.capture(error, self._origin))
            else:
                self._dropped += 1
            return
        if cell is None:
            missing = ActorNotFound(f"no actor {name!r} on rank {self.rank} (message {method!r} from rank {source})")
            if reply_to is not None:
                self.reply(reply_to, Failure.capture(missing, self._origin))
            else:
                self.fail(missing, "a tell was addressed to an actor that does not exist")
            return
        message = Message(method, args, kwargs, reply_to, source)
        if source == self.rank:
            cell.post(message)  # a local send returns before its handler runs, as a remote one does
        else:
            cell.deliver(message)

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
        message = b"" if error is None else str(error).encode()
        lengths = np.empty((self.size, 2), dtype=np.int64)  # per rank: message length (-1: no error), status
        mine = np.array([len(message) if error is not None else -1, status], dtype=np.int64)
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        try:
            await asyncio.wait_for(
                self._engine.wait(self._control.Iallgather(mine, lengths), f"agreement on {what}"), timeout
            )
            failed = np.flatnonzero(lengths[:, 0] >= 0)
            if not len(failed):
                return
            root = int(failed[0])
            text = np.empty(lengths[root, 0], np.uint8)
            if root == self.rank:
                text[:] = np.frombuffer(message, np.uint8)
            await asyncio.wait_for(self._engine.wait(self._control.Ibcast(text, root), f"message of {what}"), timeout)
        except TimeoutError:
            if error is not None:
                raise error from None
            raise RuntimeError(
                f"rank {self.rank}: other ranks did not reach the agreement on {what} within {timeout:g}s"
            ) from None
        raise JobRefused(text.tobytes().decode(errors="replace"), int(lengths[root, 1]))

    def _locally_idle(self) -> bool:
        return not self._asks and all(cell.idle for cell in self._cells.values())

    async def _until_locally_idle(self) -> None:
        delay = 0.0
        while not self._locally_idle():
            await asyncio.sleep(delay)
            delay = min(delay * 2 or 1e-4, 5e-3)

    async def _until_quiet(self) -> None:
        """Return when every rank is idle and every sent message was delivered."""
        MPI = self._MPI
        previous = None
        while True:
            await self._until_locally_idle()
            counts = np.array([self._engine.messages_sent, self._engine.messages_received], dtype=np.int64)
            await self._engine.wait(self._control.Iallreduce(MPI.IN_PLACE, counts, MPI.SUM), "termination vote")
            current = (int(counts[0]), int(counts[1]))
            if current[0] == current[1] and current == previous:
                return
            previous = current

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
        for group in self._groups:
            group.free()
        for comm in (self._control, self._p2p, self.steering.comm):
            comm.Free()

    def fail(self, error: BaseException, context: str, status: int = 1) -> None:
        """Print one failure report for this rank and abort the whole job with ``status``."""
        if self._failing:
            return
        reporter = getattr(error, "reporter", None)
        if reporter is not None and reporter != self.rank and 0 <= reporter < self.size:
            # Every rank raised it alike: the reporter's report, and its abort, end the job. This rank gives them
            # time, then ends with one line (the reporter may have caught it and gone on).
            self._failing = True
            sys.stdout.flush()
            time.sleep(_AGREED_REPORT_S)
            self._abort(f"mpiscale: rank {self.rank}: {type(error).__name__}: {str(error)[:200]} (the report is rank "
                        f"{reporter}'s)\n", status)  # fmt: skip
            return
        if isinstance(error, SystemExit):  # a deliberate exit: its message is the report
            text = f"{error.code}\n"
        else:
            text = "".join(traceback.format_exception(error))
        bar = "=" * 72
        report = (
            f"\n{bar}\nmpiscale: job failed on rank {self.rank} of {self.size} "
            f"(host {self.host}, pid {os.getpid()})\n{context}\n\n{text}{bar}\n"
            f"mpiscale: aborting all {self.size} ranks\n"
        )
        self._abort(report, status)

    def _abort(self, last_words: str, status: int) -> None:
        """Write this rank's ``last_words`` to stderr (after what it printed) and abort every rank with ``status``."""
        self._failing = True
        sys.stdout.flush()
        sys.stderr.write(last_words)
        sys.stderr.flush()
        self._MPI.COMM_WORLD.Abort(status)

    def _collective_logs(self) -> list[CollectiveLog]:
        return [log for group in self._groups for log in group.logs()]

    def collective_state(self) -> dict[str, Any]:
        """Where ``main`` is and the collectives this rank started (what another rank asks when one waits long)."""
        logs = {log.name: log.state() for log in self._collective_logs()}
        return {"main": self._main_state, "host": self.host, "logs": logs}

    async def _ask_collective_state(self, rank: int, timeout: float) -> dict[str, Any]:
        return await self.ask(ActorRef(rank, SYSTEM_ACTOR), "collective_state", (), {}, timeout)

    def waiting_in(self) -> tuple[str, float] | None:
        """The collective this rank has waited in longest right now, and for how many seconds (None: none)."""
        return self._engine.waiting_in()

    def count_wait(self, future: asyncio.Future, what: str) -> None:
        """Count the time until ``future`` is done as time waiting on other ranks, as a collective's is: telemetry
        reports it and the hang watch takes ``what`` for where this rank waits (a message another rank owes it)."""
        self._engine.count_wait(future, what)

    @property
    def collective_wait_s(self) -> float:
        """Seconds this rank has spent waiting in collectives so far (how much of its time others cost it)."""
        return self._engine.collective_wait_s

    def traffic(self) -> dict[str, float]:
        """This rank's actor messaging so far: messages and bytes sent and received, messages waiting in mailboxes."""
        engine = self._engine
        return {
            "messages_sent": engine.messages_sent,
            "messages_received": engine.messages_received,
            "bytes_sent": engine.bytes_sent,
            "bytes_received": engine.bytes_received,
            "mailbox_depth": sum(len(cell.mailbox) for cell in self._cells.values()),
        }

    def diagnostics(self) -> str:
        """What this rank is doing: pending MPI requests and asks, mailboxes, task stacks."""
        now = time.monotonic()
        engine = self._engine
        lines = [
            f"==== mpiscale diagnostics: rank {self.rank} of {self.size} on {self.host} (pid {os.getpid()}) ====",
            f"state: {'stopping' if self._stopping else 'running'}; messages sent {engine.messages_sent}, "
            f"received {engine.messages_received}",
            "pending MPI requests:",
        ]
        lines += [f"  {line}" for line in engine.describe()] or ["  none"]
        lines.append("pending asks:")
        lines += [
            f"  ask #{i} to {p.ref} {p.method!r}: waiting {now - p.started:.3f}s" for i, p in self._asks.items()
        ] or ["  none"]
        lines.append("actors:")
        lines += [f"  {cell.describe()}" for cell in self._cells.values()]
        lines.append("asyncio tasks:")
        for task in asyncio.all_tasks():
            stream = io.StringIO()
            task.print_stack(file=stream)
            lines.append("  " + stream.getvalue().rstrip().replace("\n", "\n  "))
        return "\n".join(lines) + "\n"

    def dump_diagnostics(self) -> None:
        """Write :meth:`diagnostics` to stderr (also done on SIGUSR1)."""
        sys.stderr.write(self.diagnostics())
        sys.stderr.flush()

    def _on_terminate(self) -> None:
        """SIGTERM or SIGUSR2 from outside; a repeat within ``_SAME_STOP_S`` of the first is the same request."""
        now = time.monotonic()
        if now - self._stop_asked_at < _SAME_STOP_S:
            return
        if self._stop_asked_at == -math.inf:
            self._stop_asked_at = now
            dead = self._local_peers.gone()
            if dead:  # the launcher ends a job whose rank died: no step can end, no stop can be agreed
                asyncio.get_running_loop().create_task(self._peers_died(dead), name="a rank died")
                return
        self._on_signal(signal.SIGTERM)

    async def _peers_died(self, dead: dict[int, int]) -> None:
        named = ", ".join(f"rank {rank} (pid {pid}{', ' + self.roles[rank] if rank in self.roles else ''})"
                          for rank, pid in sorted(dead.items()))  # fmt: skip
        detail = (
            f"{named} on host {self.host} ended while the job ran (killed by a signal, such as the "
            "out-of-memory killer's, or failed: the job's output says which); the job cannot go on"
        )
        for reporter in self.death_reporters:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reporter(detail, min(dead)), 1.0)
        if not self._failing:  # one line, not a second report: a rank that failed has printed its own
            self._abort(f"mpiscale: rank {self.rank}: a SIGTERM came, and {detail}\n", 1)

    def _stop_at_start(self) -> None:
        """A stop signal came while this rank started (``mpiscale.early_stop``): a job that begins to steer soon stops
        before its first step; one that does not drains, as for any stop of a job without steps."""
        self.stop_signal, self._stop_asked_at = signal.SIGTERM, time.monotonic()
        sys.stderr.write(f"mpiscale: rank {self.rank}: SIGTERM received while starting: stopping before the first "
                         "step\n")  # fmt: skip
        self.steering.stop_when_begun()
        loop = asyncio.get_running_loop()
        loop.call_later(_STEERING_BEGINS_S, self._drain_unless_steering)
        loop.call_later(self.config.stop_grace_s, self._stop_overdue, signal.SIGTERM)

    def _drain_unless_steering(self) -> None:
        if self.steering.cancel_stop_when_begun() and not self._stopping:
            self._on_signal(signal.SIGTERM)  # no step to stop after: drain

    def _note_stop(self, signum: int, frame: object) -> None:
        """SIGTERM's Python-level handler: a steering job's stop request, noted between two bytecodes of a step."""
        if self.steering.active and self.stop_signal is None and not self._stopping:
            self.steering.request("stop")
            self._stop_noted = True

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        noted, self._stop_noted = self._stop_noted, False
        steering = self.steering.active or noted  # noted: the job may have stopped on it before the loop came round
        if signum == signal.SIGTERM and steering and self.stop_signal is None and not self._stopping:
            # A steering job stops after its step, its state saved; the process then exits with 128+SIGTERM as for
            # a drain. If it has not returned within stop_grace_s, or a second SIGTERM comes, the rank drains.
            self.stop_signal = signum
            grace = self.config.stop_grace_s
            sys.stderr.write(f"mpiscale: rank {self.rank}: {name} received, stopping after the current step with a "
                             f"checkpoint (within {grace:g} s; a second {name} drains at once)\n")  # fmt: skip
            if self.steering.active:
                self.steering.request("stop")
                asyncio.get_running_loop().call_later(grace, self._stop_overdue, signum)
            return
        if self._stopping:
            sys.stderr.write(f"mpiscale: rank {self.rank}: second {name}, exiting now\n")
            os._exit(128 + signum)
        self._stopping = True
        sys.stderr.write(f"mpiscale: rank {self.rank}: {name} received, draining and shutting down\n")
        if self._main_task is not None:
            self._main_task.cancel()
        asyncio.get_running_loop().create_task(self._shutdown(128 + signum), name="shutdown")

    def _stop_overdue(self, signum: int) -> None:
        if self._stopping or self._main_task is None or self._main_task.done():
            return
        sys.stderr.write(f"mpiscale: rank {self.rank}: the job did not stop within {self.config.stop_grace_s:g} s\n")
        self.steering.active = False  # the drain's turn: no second wait for a step's end
        self._on_signal(signum)

    async def _shutdown(self, code: int) -> None:
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        for cell in self._cells.values():
            cell.fail_pending()
        while any(cell.current for cell in self._cells.values()) and time.monotonic() < deadline:
            await asyncio.sleep(1e-3)
        drained = await self._drain_engine(deadline)
        sys.stderr.write(
            f"mpiscale: rank {self.rank}: shutdown {'drained' if drained else 'timed out'}; "
            f"{self._dropped} incoming tells refused; exit status {code}\n"
        )
        _finalize_and_exit(self._MPI, code)

    async def _run_main(self, main: Callable[[ActorSystem], Awaitable[T]]) -> T:
        loop = asyncio.get_running_loop()
        engine_task = loop.create_task(self._engine.run(), name="mpiscale progress engine")
        engine_task.add_done_callback(self._engine_finished)
        signals = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
        loop.add_signal_handler(signal.SIGINT, self._on_signal, signal.SIGINT)
        for signum in (signal.SIGTERM, signal.SIGUSR2):
            loop.add_signal_handler(signum, self._on_terminate)
            # the loop calls _on_terminate once it runs again; a step that computes without awaiting notes the
            # request now, so the agreement at its end carries it (asyncio's wakeup of the loop stays in place)
            signal.signal(signum, self._note_stop)
        loop.add_signal_handler(signal.SIGUSR1, self.dump_diagnostics)
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
        self.spawn_local(_SystemActor, name=SYSTEM_ACTOR)
        watch = None
        if self.config.collective_check_s > 0 and self.size > 1:
            checker = AbandonedWatch(self.rank, self.host, self._collective_logs, self._ask_collective_state, self.fail,
                                     self.config.collective_check_s)  # fmt: skip
            watch = loop.create_task(checker.run(), name="mpiscale abandoned-collective watch")
        try:
            self._main_task = loop.create_task(_exit_as_exception(main(self)), name="main")
            if early_stop.take() is not None:
                self._stop_at_start()
            refused: JobRefused | None = None
            try:
                result = await self._main_task
                self._main_state = "returned"
            except JobRefused as refusal:
                self._main_state = "raised JobRefused"
                refused, result, self.exit_status = refusal, None, refusal.status
                if self.rank == 0:
                    sys.stdout.flush()
                    sys.stderr.write(f"{refusal}\n")
                    sys.stderr.flush()
            except asyncio.CancelledError:
                await asyncio.Event().wait()  # the shutdown task exits the process
            except _MainExit as exit_request:
                self._main_state = "called sys.exit"
                code = exit_request.exit.code
                if code not in (0, None):
                    self.fail(exit_request.exit, "main exited", code if isinstance(code, int) else 1)
                result = None
            except Exception as error:
                self.fail(error, "main raised an exception")
            if watch is not None:
                watch.cancel()
            if refused is None:
                await self._until_quiet()
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
            return result
        finally:
            faulthandler.unregister(signal.SIGUSR1)
            for signum in signals:
                loop.remove_signal_handler(signum)

    def _engine_finished(self, task: asyncio.Task) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self.fail(error, "the progress engine failed while handling MPI traffic")


class _MainExit(Exception):
    """Carries a SystemExit out of ``main``: asyncio would re-raise it out of the loop."""

    def __init__(self, exit_request: SystemExit) -> None:
        super().__init__(exit_request.code)
        self.exit = exit_request


async def _exit_as_exception(coroutine: Awaitable[T]) -> T:
    try:
        return await coroutine
    except SystemExit as exit_request:
        raise _MainExit(exit_request) from None


def _finalize_and_exit(MPI, code: int) -> None:
    """Finalize MPI, but let the kernel end the process if a departed peer makes that hang.

    The watchdog is SIGALRM with its default action, not a Python timer: a
    blocked ``MPI_Finalize`` may hold the interpreter, so no Python code could run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(_FINALIZE_GRACE_S)
    try:
        MPI.Finalize()
    finally:
        os._exit(code)


def _setup_logging(rank: int) -> None:
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    verbose = os.environ.get("MPISCALE_LOG_ALL_RANKS", "0") not in ("", "0")
    # INFO for mpiscale's own loggers only: numba.cuda's driver logs every allocation at INFO
    root.setLevel(logging.WARNING)
    logging.getLogger("mpiscale").setLevel(logging.INFO if rank == 0 or verbose else logging.WARNING)


def run(main: Callable[[ActorSystem], Awaitable[T]], *, config: RuntimeConfig | None = None) -> T:
    """Start this rank's ActorSystem and run ``await main(system)`` on it.

    Every rank calls ``run``. It returns ``main``'s result on this rank once
    ``main`` has returned on all ranks and no message is in flight. If every
    rank raised :class:`JobRefused`, it prints the message once and raises
    ``SystemExit`` with its status after a clean shutdown; after a SIGTERM the
    job stopped on (see :mod:`mpiscale.runtime.steering`), ``SystemExit(143)``.
    """
    config = config or RuntimeConfig.from_env()
    MPI = load_mpi(config)
    system = ActorSystem(MPI, config)
    _setup_logging(system.rank)
    set_current_system(system)
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            result = runner.run(system._run_main(main))
    finally:
        set_current_system(None)
    status = system.exit_status or (128 + system.stop_signal if system.stop_signal is not None else 0)
    if status:
        raise SystemExit(status)  # a job stopped by SIGTERM says so, also when it saved its state first
    return result
