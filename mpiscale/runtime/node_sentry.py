"""The node watch in a process of its own beside each host's first rank, and the rank's link to it.

A rank's Python can be held for as long as the job lives: a thread blocked in
a parallel HDF5 call (h5py keeps the GIL through the MPI collective inside it,
the background checkpoint's file open for one) waits for the ranks of a node
that is gone, and no other thread of the rank runs, its event loop included.
A node watch on that loop saw nothing until the launcher killed the rank. So
the first rank of each host starts a small process, the sentry, that holds its
part of the ring (:mod:`.node_watch`) and tells the rank when a node is lost;
the rank says its one line as it takes the message, and only then answers
(telemetry's failure event follows). A rank that has not answered within
``HANDLED_S`` is held: the sentry prints the line in its place, leaves the
rank's last words (telemetry's failure event, see ``leave_last_words``), tells
the host's death watch that the ends that follow are said for, and kills the
rank, so that the launcher ends the job at once.

The sentry ignores the launcher's signals (they are the rank's to handle) and
ends when its link to the rank does: at the rank's end, or its death.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ..ranks import Comm
from .death_watch import DeathWatch
from .node_watch import Address, LostNode, NodeWatch, listening_socket, own_addresses

log = logging.getLogger(__name__)

HANDLED_S = 0.25  # a rank that has not taken a lost node's report within this is held: the sentry speaks for it
_LAST_WORDS_S = 1.0  # the longest the sentry waits for the rank's last words before it kills the rank
_ASKED_S = 0.5  # the longest a rank waits for the sentry's answer to "has a connection ended?"
_WATCHING_S = 30.0  # the longest a rank's main waits for its sentry to watch the next host
Neighbour = tuple[LostNode, Address]


def _send(link: socket.socket, message: dict) -> None:
    """One message on the link, whole (safe in a signal handler: a few bytes on a local socket)."""
    with contextlib.suppress(OSError):
        link.sendall(json.dumps(message).encode() + b"\n")


def _neighbour(value: list | None) -> Neighbour | None:
    if value is None:
        return None
    host, ranks, addresses, port = value
    return LostNode(host, ranks), (addresses, port)


class NodeSentry:
    """The rank's side: the sentry's process and the link to it (none on a single host, or on other ranks)."""

    def __init__(self, process: subprocess.Popen | None = None, link: socket.socket | None = None) -> None:
        self._process, self._link = process, link
        self._quiet = False
        self._buffer = b""
        self._on_lost: Callable[[LostNode], None] | None = None
        self._answer: list[LostNode | None] = []  # the sentry's answer to ``ended``
        self._watching = False  # the sentry watches the next host (or found it lost)

    @classmethod
    def gather(cls, world: Comm, hosts: list[str], death_watch: str | None = None) -> NodeSentry:
        """Collective over ``world`` at start-up, given every rank's host: each host's first rank listens, learns
        its neighbours' listeners, and starts its sentry (nothing, and no communication, on a single host), which
        tells the host's ``death_watch`` (its address) when it kills a held rank."""
        first_of = {h: hosts.index(h) for h in dict.fromkeys(hosts)}
        if len(first_of) == 1:
            return cls()
        rank = world.Get_rank()
        host = hosts[rank]
        leads = first_of[host] == rank
        listener = listening_socket() if leads else None
        addresses = own_addresses(host) if leads else []
        port = listener.getsockname()[1] if listener is not None else 0
        everyone = world.allgather((addresses, port))
        if listener is None or not addresses:
            if listener is not None:
                listener.close()
            return cls()
        ring = list(first_of)  # hosts in the order of their first rank
        neighbours = [ring[(ring.index(host) + 1) % len(ring)], ring[ring.index(host) - 1]]
        following, preceding = [
            [h, [r for r, where in enumerate(hosts) if where == h], *everyone[first_of[h]]] for h in neighbours
        ]
        return cls.spawn(listener, rank, following, preceding, death_watch)

    @classmethod
    def spawn(
        cls, listener: socket.socket, rank: int, following: list | None, preceding: list | None, death_watch: str | None
    ) -> NodeSentry:
        """Start the sentry of ``rank`` on ``listener`` with its neighbours (``[host, ranks, addresses, port]``:
        watched where it has addresses) and its host's ``death_watch``."""
        ours, theirs = socket.socketpair()
        # -c, not -m: the package imports this module first, and runpy warns of that on the rank's stderr
        start = f"import sys; from {__name__} import main; main(sys.argv)"
        command = [sys.executable, "-c", start, str(listener.fileno()), str(theirs.fileno())]
        # its stdout is not the rank's (a launcher reads that to its end); its stderr is: the line it may print
        fds = (listener.fileno(), theirs.fileno())
        process = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        listener.close()
        theirs.close()
        watched = [n if n is not None and n[2] else None for n in (following, preceding)]
        _send(ours, {"rank": rank, "following": watched[0], "preceding": watched[1], "death_watch": death_watch})
        ours.setblocking(False)
        return cls(process, ours)

    def start(self, on_lost: Callable[[LostNode], None]) -> None:
        """``on_lost`` on this rank's loop when the sentry finds a neighbour lost: it says the line before it returns
        (only then is the sentry told the rank has spoken)."""
        if self._link is None:
            return
        self._on_lost = on_lost
        # main begins once the next host is watched: a node lost in the job's first moments is named too (the
        # sentry's process starts in a fraction of a second, seconds on a loaded host)
        self._read_until(lambda: self._watching, _WATCHING_S)
        if not self._watching and self._link is not None:  # (a sentry that ended has been warned of)
            log.warning("node watch: not watching after %g s; a node lost now may go unnamed", _WATCHING_S)
        if self._link is not None:
            asyncio.get_running_loop().add_reader(self._link.fileno(), self._read)

    def leave_last_words(self, module: str, spec: dict) -> None:
        """What the sentry says for this rank if it must speak in its place: ``await module.speak(spec, detail,
        rank)``, ``rank`` the lost node's first (the module is imported at once, ready)."""
        if self._link is not None:
            _send(self._link, {"last_words": [module, spec]})

    def ended(self) -> LostNode | None:
        """A neighbour whose connection has ended by now, asked of the sentry (half a second at most: a SIGTERM
        that comes as a node is lost is the launcher ending the job for it, and the loss is what to report)."""
        if self._link is None:
            return None
        self._answer.clear()
        _send(self._link, {"ended": True})
        self._read_until(lambda: bool(self._answer), _ASKED_S)
        return self._answer[0] if self._answer else None

    def quiet(self) -> None:
        """This rank's ``main`` ended, or a stop began: a connection that ends from now on is the job's end, not a
        loss (safe in a signal handler). The connections stay open: ranks elsewhere may still run their ``main``."""
        if self._link is not None and not self._quiet:
            self._quiet = True
            _send(self._link, {"quiet": True})

    def farewell(self) -> None:
        """This rank exits on purpose (a drain, a report's abort): the neighbours take the end of its connections for
        no loss, even where their rank is held (safe in a signal handler). It also quiets the sentry's watch."""
        if self._link is not None:
            self._quiet = True
            _send(self._link, {"farewell": True})

    def close(self) -> None:
        """End the sentry and its connections, once every rank has ended (a rank that closes them earlier looks
        lost)."""
        self.farewell()
        if self._link is None:
            return
        with contextlib.suppress(RuntimeError):  # no loop runs any more
            asyncio.get_running_loop().remove_reader(self._link.fileno())
        self._link.close()
        self._link = None
        assert self._process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(1.0)

    def _read_until(self, done: Callable[[], bool], seconds: float) -> None:
        """Take the sentry's messages, blocking, until ``done()``, for ``seconds`` at most (less if it ends)."""
        deadline = time.monotonic() + seconds
        while not done() and self._link is not None and (left := deadline - time.monotonic()) > 0:
            if select.select([self._link], [], [], left)[0]:
                self._read()

    def _read(self) -> None:
        assert self._link is not None
        try:
            data = self._link.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the sentry is gone: nothing watches now
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_reader(self._link.fileno())
            if not self._quiet and not self._answer:
                log.warning("node watch: its process (pid %s) ended while the job ran; a lost node is no longer "
                            "named", self._process.pid if self._process else "?")  # fmt: skip
            self._answer.append(None)
            self._link.close()
            self._link = None
            return
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "watching" in message:
                self._watching = True
            elif "ended" in message:
                self._answer.append(None if message["ended"] is None else LostNode(*message["ended"]))
            elif "lost" in message:
                if not self._quiet and self._on_lost is not None:
                    self._on_lost(LostNode(*message["lost"]))  # says the line before it returns
                _send(self._link, {"handled": True})  # the rank has spoken: the sentry need not


class _Sentry:
    """The sentry's side, in its own process: the ring's part, and the rank's stand-in when the rank is held."""

    def __init__(self, listener: socket.socket, link: socket.socket) -> None:
        self.listener, self.link = listener, link
        self.rank = 0
        self.rank_pid = os.getppid()
        self.watch: NodeWatch | None = None
        self.handled = asyncio.Event()
        self.reported = False
        self.last_words: tuple[object, dict] | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.death_watch = DeathWatch(0)

    async def serve(self) -> None:
        reader, self.writer = await asyncio.open_unix_connection(sock=self.link)
        setup = json.loads(await reader.readline() or b"{}")
        if not setup:
            return
        self.rank = setup["rank"]
        self.death_watch = DeathWatch(self.rank, setup["death_watch"])
        self.watch = NodeWatch(self.listener, _neighbour(setup["following"]), _neighbour(setup["preceding"]))
        self.watch.start(self.lost)
        await self.watch.connected()
        self.writer.write(b'{"watching": true}\n')
        try:
            while line := await reader.readline():
                self.take(json.loads(line))
        finally:
            self.watch.close()  # the rank is gone, or ended: nothing to say for it now

    def take(self, message: dict) -> None:
        """One message from the rank."""
        assert self.watch is not None and self.writer is not None
        if "quiet" in message:
            self.watch.quiet()
        elif "farewell" in message:
            self.watch.farewell()
        elif "handled" in message:
            self.handled.set()
        elif "ended" in message:
            lost = self.watch.ended()
            answer = None if lost is None else [lost.host, lost.ranks]
            self.writer.write(json.dumps({"ended": answer}).encode() + b"\n")
        elif "last_words" in message:
            module, spec = message["last_words"]
            self.last_words = importlib.import_module(module), spec

    async def lost(self, node: LostNode) -> None:
        """A neighbour is lost: the rank reports it; if it does not take the report, the sentry speaks for it."""
        assert self.watch is not None
        if self.reported or self.watch.over:
            return
        self.reported = True
        assert self.writer is not None
        self.writer.write(json.dumps({"lost": [node.host, node.ranks]}).encode() + b"\n")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.handled.wait(), HANDLED_S)
        if self.handled.is_set() or self.watch.over:
            return
        detail = node.describe()
        line = f"mpiscale: rank {self.rank}: {detail} (said by its node watch: the rank was held)\n"
        # in a thread: a stderr whose reader is gone with the lost node (srun on the batch host) blocks a write,
        # and the failure event must still be written
        saying = threading.Thread(target=os.write, args=(2, line.encode()), daemon=True, name="the line")
        saying.start()
        if self.last_words is not None:
            module, spec = self.last_words
            with contextlib.suppress(Exception):
                await asyncio.wait_for(module.speak(spec, detail, min(node.ranks, default=0)), _LAST_WORDS_S)  # type: ignore[attr-defined]
        saying.join(_LAST_WORDS_S)
        self.death_watch.over()  # the rank's end, and the job's, are said for
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.rank_pid, signal.SIGKILL)  # the launcher ends the job: this rank cannot


def main(argv: list[str]) -> None:
    """The sentry's process: ``argv`` ends with the listener's and the link's file descriptors."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # the launcher's signals are the rank's to take
    listener, link = socket.socket(fileno=int(argv[-2])), socket.socket(fileno=int(argv[-1]))
    listener.setblocking(False)
    link.setblocking(False)
    asyncio.run(_Sentry(listener, link).serve())
