"""How one rank's job runs from start to exit: ``run``, ``main`` as a task, the signals, the shutdown, MPI finalized.

Signals: SIGTERM (or SIGUSR2) asks a steering job to stop after its current
step with its state saved, and any other job to drain; a second one drains at
once. SIGINT drains. SIGUSR1 writes the rank's diagnostics. A SIGTERM that
finds a rank of this host gone (the launcher ends a job whose rank died) ends
the job; the host's death watch (:mod:`.death_watch`) has named that rank the
moment it died.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .. import early_stop, run_dir
from ..errors import MpiscaleError
from ..srun_tasks import launch_refused
from .actor import set_current_system
from .config import RuntimeConfig, load_mpi
from .death_watch import ENDED, DeathWatch, Noted
from .errors import JobRefused, MainNotAsync
from .eventloop import new_event_loop
from .node_sentry import NodeSentry
from .node_watch import LostNode
from .peers import LocalPeers
from .system import ActorSystem
from .wire import message_path

T = TypeVar("T")
_FINALIZE_GRACE_S = 3  # seconds MPI_Finalize may take after a signal before the process ends anyway
# One cancel reaches a rank several times at once: Slurm signals every process of the job (the rank, and mpirun or
# srun, which pass a SIGTERM on), and the launcher turns its own into SIGUSR2. Repeats this close count as one.
_SAME_STOP_S = early_stop.SAME_STOP_S
#: Sent by a rank that printed its report and aborts the job to the other ranks of its host, before the launcher's
#: SIGTERM reaches them (a real-time signal: nothing else in a job sends it, and it queues in order of sending).
REPORTED_SIGNAL = signal.SIGRTMIN + 3
_STEERING_BEGINS_S = 5.0  # a stop that came while the rank started waits this long for the job to begin steering


class Lifecycle:
    """One rank's run of ``main`` on its ActorSystem, and what signals do to it."""

    def __init__(self, system: ActorSystem) -> None:
        self.system = system
        self.main_task: asyncio.Task | None = None
        self.stop_asked_at = -math.inf  # monotonic time of the first SIGTERM (or SIGUSR2) received
        self.stop_noted = False  # a SIGTERM's stop request was made at once, before the loop took the signal
        world = system.world.comm
        placement = world.allgather((system.host, os.getpid()))  # every rank's, once, for both watches
        self.local_peers = LocalPeers.of(placement, system.rank)
        system.hosts = [host for host, _ in placement]
        self.death_watch = DeathWatch.gather(world, placement, system.rank)
        self.node_watch = NodeSentry.gather(world, system.hosts, self.death_watch.address)
        system.roles = Noted(self.death_watch.role)
        system.planned_deaths = Noted(self.death_watch.planned)
        system.leave_last_words = self.node_watch.leave_last_words
        self.peer_reported = False  # a rank of this host printed a report and aborts the job (REPORTED_SIGNAL)
        # the death watch hears first that the deaths which follow are the abort's: the signal to the host's other
        # ranks ends one still starting, or past its run (its default action), and the watch would name that death
        system.before_abort.extend((self.death_watch.over, self.tell_peers_reported, self.node_watch.farewell))
        signal.signal(REPORTED_SIGNAL, signal.SIG_IGN)  # until the loop takes it (its default action ends a process)

    async def run_main(self, main: Callable[[ActorSystem], Awaitable[T]]) -> T | None:
        """``main`` on this rank, then the quiet end every rank agrees on; signals handled meanwhile."""
        system = self.system
        loop = asyncio.get_running_loop()
        signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, REPORTED_SIGNAL)
        loop.add_signal_handler(signal.SIGINT, self.on_signal, signal.SIGINT)
        for signum in (signal.SIGTERM, signal.SIGUSR2):
            loop.add_signal_handler(signum, self.on_terminate)
            # the loop calls on_terminate once it runs again; a step that computes without awaiting notes the
            # request now, so the agreement at its end carries it (asyncio's wakeup of the loop stays in place)
            signal.signal(signum, self.note_stop)
        loop.add_signal_handler(signal.SIGUSR1, system.dump_diagnostics)
        loop.add_signal_handler(REPORTED_SIGNAL, self.on_peer_reported)
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
        engine_task, watch = system.start()
        self.node_watch.start(self.node_lost)
        try:
            self.main_task = loop.create_task(_exit_as_exception(main, system), name="main")
            self.main_task.add_done_callback(lambda _: self.quiet())
            if early_stop.take() is not None:
                self.stop_at_start()
            refused: JobRefused | None = None
            result = None
            try:
                result = await self.main_task
                system.main_state = "returned"
            except JobRefused as refusal:
                system.main_state = "raised JobRefused"
                refused, system.exit_status = refusal, refusal.status
                if system.rank == 0:
                    sys.stdout.flush()
                    sys.stderr.write(f"{refusal}\n")
                    sys.stderr.flush()
            except asyncio.CancelledError:
                await asyncio.Event().wait()  # the shutdown task exits the process
            except _MainExit as exit_request:
                system.main_state = "called sys.exit"
                code = exit_request.exit.code
                if code not in (0, None):
                    system.fail(exit_request.exit, "main exited", code if isinstance(code, int) else 1)
            except Exception as error:
                system.fail(error, "main raised an exception")
            # what main printed leaves before the ranks' last agreement: once one rank exits with a non-zero
            # status the launcher tears the others' pipes down, and a flush at their exit would then fail
            sys.stdout.flush()
            await system.close(refused, engine_task, watch)
            return result
        finally:
            self.node_watch.close()
            self.death_watch.close()
            faulthandler.unregister(signal.SIGUSR1)
            for handled in signals:
                loop.remove_signal_handler(handled)
            signal.signal(REPORTED_SIGNAL, signal.SIG_IGN)

    def quiet(self) -> None:
        """``main`` ended, or a stop began: the ranks' ends from now on are no loss (safe in a signal handler)."""
        self.node_watch.quiet()
        self.death_watch.done()

    def on_terminate(self) -> None:
        """SIGTERM or SIGUSR2 from outside; a repeat within ``_SAME_STOP_S`` of the first is the same request."""
        now = time.monotonic()
        if now - self.stop_asked_at < _SAME_STOP_S:
            return
        if self.peer_reported:  # a rank of this host reported a failure and aborts the job: not a stop to announce
            self.stop_asked_at = now
            asyncio.get_running_loop().create_task(self.peer_failed(), name="a rank of this host failed")
            return
        lost = self.node_watch.ended()
        if lost is not None:  # the launcher ends the job because a node was lost: that is what to report
            self.stop_asked_at = now
            self.node_lost(lost)
            return
        if self.stop_asked_at == -math.inf:
            self.stop_asked_at = now
            dead = self.local_peers.gone()
            if dead:  # the launcher ends a job whose rank died: no step can end, no stop can be agreed
                asyncio.get_running_loop().create_task(self.peers_died(dead), name="a rank died")
                return
        self.on_signal(signal.SIGTERM)

    def tell_peers_reported(self) -> None:
        """This rank printed its report and now aborts the job: its host's other ranks are told (the launcher's
        SIGTERM comes after), so that none takes its death for a signal's and adds a line of its own."""
        for pid in self.local_peers.pids.values():
            with contextlib.suppress(OSError):
                os.kill(pid, REPORTED_SIGNAL)

    def on_peer_reported(self) -> None:
        self.peer_reported = True

    async def peer_failed(self) -> None:
        """A rank of this host printed its report and aborts the job: telemetry hears of it (the rank, once its
        process is gone: half a second at most), this rank adds no line."""
        dead: dict[int, int] = {}
        for _ in range(50):
            if dead := self.local_peers.gone():
                break
            await asyncio.sleep(0.01)
        rank = min(dead or self.local_peers.pids or [0])
        if rank == 0:  # rank 0 reported, to its telemetry too: nothing to add there
            if not self.system.failing:
                self.system.abort("", 1)
            return
        await self._end_for_death("", f"rank {rank} failed and reported it; the job cannot go on", rank)

    async def peers_died(self, dead: dict[int, int]) -> None:
        system = self.system
        if self.peer_reported:  # the rank that died printed why; telemetry still hears of it
            await self.peer_failed()
            return
        named = ", ".join(f"rank {rank} (pid {pid}{', ' + system.roles[rank] if rank in system.roles else ''})"
                          for rank, pid in sorted(dead.items()))  # fmt: skip
        # the host's death watch named it as it died (this rank may not run again before the launcher's SIGKILL)
        said = self.death_watch.active
        planned = {system.planned_deaths.get(rank) for rank in dead}
        if None not in planned:  # every dead rank died as planned, and said so itself
            detail = f"{named} on host {system.host} ended as planned ({'; '.join(sorted(planned))})"  # type: ignore[arg-type]
            await self._end_for_death("", f"{detail}; the job cannot go on", min(dead))
            return
        detail = f"{named} on host {system.host} {ENDED}"
        await self._end_for_death("" if said else f"a SIGTERM came, and {detail}", detail, min(dead))

    def node_lost(self, lost: LostNode) -> None:
        """The node watch found a host of the job gone: the line at once, in this turn of the loop (a rank held next,
        in a parallel HDF5 call, has said it; its sentry speaks only for a rank that has not), then telemetry hears of
        it and the job ends."""
        detail = lost.describe()
        ending = self._say(detail)
        rank = min(lost.ranks, default=0)
        asyncio.get_running_loop().create_task(self._tell_and_end(detail, rank, ending), name="a node was lost")

    async def _end_for_death(self, report: str, detail: str, rank: int) -> None:
        """One line, ``report`` (none when empty: the dead rank said why itself), then telemetry hears that ``rank``
        died, then every rank ends."""
        await self._tell_and_end(detail, rank, self._say(report))

    def _say(self, report: str) -> bool:
        """This rank's one line for a death, before anything else (the launcher kills the ranks a second after it
        learns of the death itself), unless it has reported a failure already: whether this rank ends the job."""
        system = self.system
        if system.failing:  # one line, not a second report: a rank that failed has printed its own
            return False
        system.failing = True
        self.death_watch.over()
        if report:
            sys.stdout.flush()
            sys.stderr.write(f"mpiscale: rank {system.rank}: {report}\n")
            sys.stderr.flush()
        return True

    async def _tell_and_end(self, detail: str, rank: int, ending: bool) -> None:
        system = self.system
        for reporter in system.death_reporters:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reporter(detail, rank), 1.0)
        if ending:
            system.abort("", 1)

    def stop_at_start(self) -> None:
        """A stop signal came while this rank started (``mpiscale.early_stop``): a job that begins to steer soon stops
        before its first step; one that does not drains, as for any stop of a job without steps."""
        system = self.system
        system.stop_signal, self.stop_asked_at = signal.SIGTERM, time.monotonic()
        sys.stderr.write(f"mpiscale: rank {system.rank}: SIGTERM received while starting: stopping before the first "
                         "step\n")  # fmt: skip
        system.steering.stop_when_begun()
        loop = asyncio.get_running_loop()
        loop.call_later(_STEERING_BEGINS_S, self.drain_unless_steering)
        loop.call_later(system.config.stop_grace_s, self.stop_overdue, signal.SIGTERM)

    def drain_unless_steering(self) -> None:
        if self.system.steering.cancel_stop_when_begun() and not self.system.stopping:
            self.on_signal(signal.SIGTERM)  # no step to stop after: drain

    def note_stop(self, signum: int, frame: object) -> None:
        """SIGTERM's Python-level handler: a steering job's stop request, noted between two bytecodes of a step."""
        system = self.system
        self.quiet()  # a signal from the launcher comes first: the connections that close next are no loss
        if system.steering.active and system.stop_signal is None and not system.stopping:
            system.steering.request("stop")
            self.stop_noted = True

    def on_signal(self, signum: int) -> None:
        system = self.system
        name = signal.Signals(signum).name
        noted, self.stop_noted = self.stop_noted, False
        steering = system.steering.active or noted  # noted: the job may have stopped on it before the loop came round
        if signum == signal.SIGTERM and steering and system.stop_signal is None and not system.stopping:
            # A steering job stops after its step, its state saved; the process then exits with 128+SIGTERM as for
            # a drain. If it has not returned within stop_grace_s, or a second SIGTERM comes, the rank drains.
            system.stop_signal = signum
            grace = system.config.stop_grace_s
            sys.stderr.write(f"mpiscale: rank {system.rank}: {name} received, stopping after the current step with "
                             f"a checkpoint (within {grace:g} s; a second {name} drains at once)\n")  # fmt: skip
            if system.steering.active:
                system.steering.request("stop")
                asyncio.get_running_loop().call_later(grace, self.stop_overdue, signum)
            return
        self.quiet()  # the ranks end now: connections that close are no loss
        if system.stopping:
            sys.stderr.write(f"mpiscale: rank {system.rank}: second {name}, exiting now\n")
            self.node_watch.farewell()
            os._exit(128 + signum)
        system.stopping = True
        sys.stderr.write(f"mpiscale: rank {system.rank}: {name} received, draining and shutting down\n")
        if self.main_task is not None:
            self.main_task.cancel()
        asyncio.get_running_loop().create_task(self.shutdown(128 + signum), name="shutdown")

    def stop_overdue(self, signum: int) -> None:
        system = self.system
        if system.stopping or self.main_task is None or self.main_task.done():
            return
        sys.stderr.write(
            f"mpiscale: rank {system.rank}: the job did not stop within {system.config.stop_grace_s:g} s\n"
        )
        system.steering.active = False  # the drain's turn: no second wait for a step's end
        self.on_signal(signum)

    async def shutdown(self, code: int) -> None:
        system = self.system
        drained = await system.drain(time.monotonic() + system.config.shutdown_timeout_s)
        self.node_watch.farewell()  # this rank exits now, whatever the others do: its neighbours lose nothing
        self.death_watch.done()
        sys.stderr.write(
            f"mpiscale: rank {system.rank}: shutdown {'drained' if drained else 'timed out'}; "
            f"{system.refused_tells} incoming tells refused; exit status {code}\n"
        )
        _finalize_and_exit(system.MPI, code)


class _MainExit(MpiscaleError):
    """Carries a SystemExit out of ``main``: asyncio would re-raise it out of the loop."""

    def __init__(self, exit_request: SystemExit) -> None:
        super().__init__(exit_request.code)
        self.exit = exit_request


async def _exit_as_exception(main: Callable[[ActorSystem], Awaitable[T]], system: ActorSystem) -> T:
    try:
        return await MainNotAsync.started(main, system)
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
    run_dir.note("status", str(code))
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
    Tasks that cannot form one MPI job (srun without an MPI plugin) end before
    MPI starts, with one line from rank 0 and ``SystemExit(2)``.
    """
    refused = launch_refused()  # (tasks that cannot form one job: said once, before MPI starts)
    if refused is not None:
        raise SystemExit(refused)
    config = config or RuntimeConfig.from_env()
    MPI = load_mpi(config)
    system = ActorSystem(MPI, config)
    lifecycle = Lifecycle(system)
    _setup_logging(system.rank)
    path, as_asked = message_path()
    if system.rank == 0 and not as_asked:
        logging.getLogger(__name__).warning("the message path is %s", path)
    set_current_system(system)
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            result = runner.run(lifecycle.run_main(main))
    finally:
        set_current_system(None)
    status = system.exit_status or (128 + system.stop_signal if system.stop_signal is not None else 0)
    run_dir.note("status", str(status))
    if status:
        raise SystemExit(status)  # a job stopped by SIGTERM says so, also when it saved its state first
    return result  # type: ignore[return-value]  # None only where main refused, and then status is set
