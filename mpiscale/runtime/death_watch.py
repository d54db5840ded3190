"""A small process per host that names a rank of the host the moment it dies unannounced.

A rank killed by a signal (the out-of-memory killer, a segfault, ``kill -9``)
prints nothing. mpirun then sends the other ranks SIGTERM a second later and
SIGKILL a second after that; a surviving rank that does not run in that second
(its Python held by a thread in a parallel HDF5 call that waits for the dead
rank, or a loaded node) is killed before it can name the dead rank, and the job
ends with no word of which rank died. So the host's first rank starts this
watch, a process of its own outside any rank's interpreter: it waits on every
local rank's process (a pidfd each), and when one ends without having said
that it ends on purpose, it prints the one line naming it at once, a second
before the launcher even signals the others.

A rank says so in a datagram (safe in a signal handler, queued before the
process can end): ``done`` once its exit is no death to report (its ``main``
ended, a stop began, it drains or exits), ``over`` once the job ends for a
reason already said (a rank's report and abort, a lost node; the teardown's
deaths follow). It also tells its role and a planned death (a rehearsal, which
the dying rank announces itself). The watch names one death, once, then stays
silent; it ends when every rank it watches has. It ignores the launcher's
signals, which are the ranks' to take.

The job cannot go on after such a death: a rank of the host ends it once its
launcher's SIGTERM comes, and says ``over`` as it does. A rank that has neither
said so nor ended ``HELD_S`` after the death is held (that parallel HDF5 call
keeps its Python from running, and srun kills it only ``KillWait`` later, 30 s
by default) or was never told (``srun`` without ``--kill-on-bad-exit``): the
watch names it and kills it, so that the launcher ends the job.

Run as a script (``python -I -S death_watch.py ...``): standard library only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # run as a script, it imports nothing of the package
    from ..ranks import Comm

_POLL_S = 0.2  # how often the watch looks at its ranks where the kernel has no pidfds
HELD_S = 5.0  # a rank of the host that neither ends nor ends the job within this of a death is held: it is killed
#: What a rank that died unannounced did, as far as another process can tell (its exit status is its parent's).
ENDED = "ended while the job ran (killed by a signal, or failed: the job's output says which); the job cannot go on"


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet collected by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the signal's answer stands
    return state not in ("Z", "X")


class DeathWatch:
    """A rank's side: the address of its host's watch (none where no watch runs), and what it tells the watch."""

    def __init__(self, rank: int, address: str | None = None, pid: int | None = None) -> None:
        self.rank, self._address, self._pid = rank, address, pid
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if address else None

    @classmethod
    def gather(cls, world: Comm, placement: list[tuple[str, int]], rank: int) -> DeathWatch:
        """Collective over ``world`` at start-up, given every rank's (host, pid): each host's first rank starts the
        watch of its host's ranks that it can see, and every rank learns its host's watch."""
        host = placement[rank][0]
        local = {r: pid for r, (where, pid) in enumerate(placement) if where == host}
        mine = None
        if min(local) == rank:
            watched = {r: pid for r, pid in local.items() if r == rank or alive(pid)}
            mine = spawn_watch(watched, host) if len(watched) > 1 else None
        ours = world.allgather(None if mine is None else mine[:2])[min(local)]
        return cls(rank, *ours) if ours is not None else cls(rank)

    @property
    def address(self) -> str | None:
        return self._address

    @property
    def active(self) -> bool:
        """Whether a watch speaks for this host's dead ranks (its process still runs: it outlives its ranks)."""
        return self._pid is not None and alive(self._pid)

    def done(self) -> None:
        """This rank's exit from now on is no death to report (safe in a signal handler)."""
        self._tell({"done": self.rank})

    def over(self) -> None:
        """The job ends for a reason already said: the deaths that follow are its teardown (safe in a signal
        handler)."""
        self._tell({"over": self.rank})

    def role(self, rank: int, text: str) -> None:
        if rank == self.rank:
            self._tell({"role": [rank, text]})

    def planned(self, rank: int, why: str) -> None:
        if rank == self.rank:
            self._tell({"planned": [rank, why]})

    def close(self) -> None:
        """This rank's part ends (the watch itself ends once all its ranks have)."""
        self.done()
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _tell(self, message: dict) -> None:
        if self._socket is not None and self._address is not None:
            with contextlib.suppress(OSError):
                self._socket.sendto(json.dumps(message).encode(), socket.MSG_DONTWAIT, self._address)


class Noted(dict):
    """A dict that passes each entry set to ``on_set(key, value)``: a job fills ``system.roles`` and
    ``system.planned_deaths`` as plain dicts, and the death watch hears of them."""

    def __init__(self, on_set: Callable[[Any, Any], None]) -> None:
        super().__init__()
        self._on_set = on_set

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._on_set(key, value)

    def update(self, *args: Any, **entries: Any) -> None:
        for key, value in dict(*args, **entries).items():
            self[key] = value


def spawn_watch(watched: dict[int, int], host: str) -> tuple[str, int, subprocess.Popen] | None:
    """Start the watch of ``watched`` (rank -> pid) with its datagram socket bound first, so that no rank's word
    is lost before it runs: (its address, its pid, its process), or None where it cannot start."""
    inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = f"\0mpiscale-death-watch-{os.getpid()}-{os.urandom(6).hex()}"  # Linux's abstract names: no file
    try:
        inbox.bind(address)
        command = [sys.executable, "-I", "-S", __file__, str(inbox.fileno()), host, json.dumps(watched)]
        # its stdout is not the rank's (a launcher reads that to its end); its stderr is: the line it prints
        process = subprocess.Popen(command, pass_fds=(inbox.fileno(),), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL)  # fmt: skip
    except OSError:
        return None
    finally:
        inbox.close()
    return address, process.pid, process


class _Watch:
    """The watch's side, in its own process."""

    def __init__(self, inbox: socket.socket, host: str, watched: dict[int, int]) -> None:
        self.inbox, self.host, self.watched = inbox, host, watched
        self.done: set[int] = set()
        self.roles: dict[int, str] = {}
        self.planned: dict[int, str] = {}
        self.silent = False
        self.taken: set[int] = set()  # the ranks that said ``over``: they end the job themselves
        self.held_at: float | None = None  # the monotonic time from which a rank still running is held
        self.pidfds: dict[int, int] = {}  # fd -> rank
        for rank, pid in watched.items():
            with contextlib.suppress(OSError, AttributeError):  # no pidfds (old kernel): the watch polls
                self.pidfds[os.pidfd_open(pid)] = rank

    def run(self) -> None:
        poller = select.poll()
        poller.register(self.inbox, select.POLLIN)
        for fd in self.pidfds:
            poller.register(fd, select.POLLIN)
        every_rank_has_a_pidfd = len(self.pidfds) == len(self.watched)
        while self.watched:
            wait_s = None if every_rank_has_a_pidfd else _POLL_S
            if self.held_at is not None:
                wait_s = max(0.0, min(wait_s or math.inf, self.held_at - time.monotonic()))
            poller.poll(None if wait_s is None else math.ceil(wait_s * 1000))
            self.take_messages()  # first: a rank's word was queued before its process could end
            gone = {rank: pid for rank, pid in self.watched.items() if not alive(pid)}
            for rank in gone:
                del self.watched[rank]
            for fd in [fd for fd, rank in self.pidfds.items() if rank in gone]:
                poller.unregister(fd)
                del self.pidfds[fd]
                os.close(fd)
            unannounced = {rank: pid for rank, pid in gone.items() if rank not in self.done}
            if unannounced and not self.silent:
                self.silent = True  # one death named; what follows is the job's teardown
                self.say(unannounced)
                self.held_at = time.monotonic() + HELD_S
            if self.held_at is not None and time.monotonic() >= self.held_at:
                self.held_at = None
                self.end_held()

    def take_messages(self) -> None:
        while True:
            try:
                message = json.loads(self.inbox.recv(1 << 16, socket.MSG_DONTWAIT))
            except (BlockingIOError, InterruptedError):
                return
            except (OSError, ValueError):
                continue
            if "done" in message:
                self.done.add(message["done"])
            elif "over" in message:
                self.silent = True
                self.taken.add(message["over"])
            elif "role" in message:
                self.roles[message["role"][0]] = message["role"][1]
            elif "planned" in message:
                self.planned[message["planned"][0]] = message["planned"][1]

    def say(self, dead: dict[int, int]) -> None:
        """The line for ranks that died unannounced, unless each died as planned (and said so itself)."""
        if all(rank in self.planned for rank in dead):
            return
        named = ", ".join(f"rank {rank} (pid {pid}{', ' + self.roles[rank] if rank in self.roles else ''})"
                          for rank, pid in sorted(dead.items()))  # fmt: skip
        with contextlib.suppress(OSError):
            os.write(2, f"mpiscale: {named} on host {self.host} {ENDED}\n".encode())

    def end_held(self) -> None:
        """``HELD_S`` after a death: kill the ranks still running, naming those that never took it."""
        running = {rank: pid for rank, pid in self.watched.items() if alive(pid)}
        held = {rank: pid for rank, pid in running.items() if rank not in self.taken}
        if held:
            named = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in sorted(held.items()))
            with contextlib.suppress(OSError):
                os.write(2, f"mpiscale: {named} on host {self.host} still ran {HELD_S:g} s after that death, held "
                         "(native code such as a parallel HDF5 call that waits for the dead rank keeps its Python "
                         "from running) or never told to end by its launcher: killed\n".encode())  # fmt: skip
        for pid in running.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> None:
    """The watch's process: ``argv`` ends with its socket's file descriptor, its host and the ranks' pids."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # the launcher's signals are the ranks' to take
    inbox = socket.socket(fileno=int(argv[-3]))
    watched = {int(rank): pid for rank, pid in json.loads(argv[-1]).items()}
    _Watch(inbox, argv[-2], watched).run()


if __name__ == "__main__":
    main(sys.argv)
