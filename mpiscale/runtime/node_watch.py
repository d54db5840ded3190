"""Whole nodes of a multi-host job, watched over TCP: which node was lost, within seconds.

When a node goes down, or every process on it is killed, nothing tells the
ranks on the other nodes: their MPI calls that need it wait, srun learns of it
only when Slurm's controller declares the node dead (SlurmdTimeout: minutes on
most sites), and a rank can see only the processes of its own host
(:mod:`mpiscale.runtime.peers`). So the first rank of each host keeps a TCP
connection to the first rank of the next host, in a ring. A connection that
ends while this rank's ``main`` still runs may mean the other end died: its
process went (the kernel closes its socket at once) or its host went silent
(TCP keepalive gives up within about ten seconds). After a short grace, in
which an abort begun elsewhere usually signals this process too, the rank asks
the other's listener again: if it answers, the other is alive and is watched
on the new connection; if it does not, the job ends with one report naming the
host that was lost. A first rank that exits on purpose says farewell (one
byte) before its connections end: that end is no loss. Jobs on a single host
watch nothing. The ring runs in a process of its own beside the rank
(:mod:`.node_sentry`): a rank's Python can be held while a node is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_KEEPALIVE = {"TCP_KEEPIDLE": 4, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3}  # a silent host: lost within ~10 s
_CONNECT_TIMEOUT_S = 2.0  # a neighbour's listener that does not answer within this is lost
# A launcher that ends the job (an abort elsewhere, a cancel) signals this process before the other end's goes: a
# short wait lets the signal, not the closed connection, speak. mpirun, for its part, kills its ranks soon after a
# node's daemon is lost: the report must come before.
GRACE_S = 0.05
FAREWELL = b"F"  # the one byte a first rank that exits on purpose sends its neighbours


@dataclass(frozen=True)
class LostNode:
    """A host of the job whose first rank's connection ended without warning."""

    host: str
    ranks: list[int]

    def describe(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        return (
            f"node {self.host} (ranks {ranks}) was lost while the job ran: its connection to this rank's node ended "
            "with no word from it (the node went down, or every process on it was killed); the job cannot go on"
        )


def listening_socket() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    listener.setblocking(False)
    return listener


def own_addresses(host: str) -> list[str]:
    """This host's IPv4 addresses by its name, loopback left out (none: the host is not watched)."""
    try:
        return [a for a in socket.gethostbyname_ex(host)[2] if not a.startswith("127.")]
    except OSError:
        return []


def _keep_alive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE.items():
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing stands
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


Address = tuple[list[str], int]  # a first rank's listener: its host's addresses, its port


class NodeWatch:
    """One host's part of the ring, watched for the host's first rank (in its node sentry's process)."""

    def __init__(self, listener: socket.socket | None, following: tuple[LostNode, Address] | None = None,
                 preceding: tuple[LostNode, Address] | None = None) -> None:  # fmt: skip
        self._listener = listener
        self._following, self._preceding = following, preceding  # the next and previous hosts, and their listeners
        self._tasks: list[asyncio.Task] = []
        self._over = False
        self._watched: dict[socket.socket, LostNode] = {}  # the neighbours' connections held now
        self._open: set[socket.socket] = set()  # every connection held now (the neighbours', and probes)
        self._parting: set[socket.socket] = set()  # those whose other end said farewell
        self._ending: LostNode | None = None  # a neighbour whose connection ended, being asked again
        self._connected = asyncio.Event()  # the next host was connected to, or found lost (or there is none)

    def start(self, on_lost: Callable[[LostNode], Awaitable[None]]) -> None:
        """Accept connections (the previous host's), connect to the next host; ``on_lost`` when one ends early."""
        if self._listener is None or self._following is None:
            self._connected.set()
        if self._listener is None:
            return
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._accept(on_lost), name="node watch: accept"))
        if self._following is not None:
            self._tasks.append(loop.create_task(self._watch(self._following, on_lost), name="node watch: next"))

    async def connected(self) -> None:
        """Once the next host is watched: connected to, found lost (its listener was up before the job began, so a
        first connection its host refuses is a loss too), or left unwatched (nothing answered)."""
        await self._connected.wait()

    def ended(self) -> LostNode | None:
        """A neighbour whose connection has ended by now, looked at without waiting (a SIGTERM that comes as a node
        is lost is the launcher ending the job for it: the loss, not a stop, is what to report); None: none."""
        if self._ending is not None:
            return self._ending
        for connection, neighbour in list(self._watched.items()):
            if connection in self._parting:
                continue
            try:
                if connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return neighbour
            except BlockingIOError:
                continue
            except OSError:
                return neighbour
        return None

    @property
    def over(self) -> bool:
        """This rank's end began (quiet, farewell or closed): no connection's end is a loss now."""
        return self._over

    def quiet(self) -> None:
        """This rank's ``main`` ended, or a stop began: a connection that ends from now on is the job's end, not a
        loss (safe in a signal handler). The connections stay open: ranks elsewhere may still run their ``main``."""
        self._over = True

    def farewell(self) -> None:
        """This host's first rank exits on purpose (a drain, a report's abort): the neighbours are told, so that the
        end of its connections is no loss to them, even where their rank is held and cannot take a stop."""
        self._over = True
        for connection in list(self._open):
            with contextlib.suppress(OSError):
                connection.send(FAREWELL)

    def close(self) -> None:
        """Close the connections, once every rank has ended (a rank that closes them earlier looks lost)."""
        self._over = True
        for task in self._tasks:
            task.cancel()
        if self._listener is not None:
            self._listener.close()

    async def _accept(self, on_lost: Callable[[LostNode], Awaitable[None]]) -> None:
        """Hold each connection made to this rank: the previous host's, and its probes after an early end."""
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        first = True
        while True:
            connection, _ = await loop.sock_accept(self._listener)
            _keep_alive(connection)
            if first and self._preceding is not None:  # the previous host's own connection: watched
                self._tasks.append(loop.create_task(self._until_lost(connection, self._preceding, on_lost)))
            else:  # a probe after an early end: held, so that the prober sees this rank alive
                self._tasks.append(loop.create_task(self._hold(connection), name="node watch: probe"))
            first = False

    async def _watch(self, neighbour: tuple[LostNode, Address], on_lost: Callable[[LostNode], Awaitable[None]]) -> None:
        connection, refused = await _connect(neighbour[1])
        self._connected.set()
        if connection is None and not refused:  # no word from its host at all: no loss can be told from that
            log.warning("node watch: node %s did not answer at the start (no route to it, or a firewall between the "
                        "nodes): it is not watched", neighbour[0].host)  # fmt: skip
            return
        await self._until_lost(connection, neighbour, on_lost)

    async def _hold(self, connection: socket.socket) -> bool:
        """Keep a connection open until it ends (a farewell is all that is ever sent on it): whether the other end
        said farewell first."""
        self._open.add(connection)
        said = False
        try:
            while data := await asyncio.get_running_loop().sock_recv(connection, 16):
                if FAREWELL in data:
                    said = True
                    self._parting.add(connection)
        except OSError:
            pass
        finally:
            self._open.discard(connection)
            self._parting.discard(connection)
            connection.close()
        return said

    async def _until_lost(self, connection: socket.socket | None, neighbour: tuple[LostNode, Address],
                          on_lost: Callable[[LostNode], Awaitable[None]]) -> None:  # fmt: skip
        """Wait for ``connection`` to end (None: none was made); then, while the job still runs, ask the neighbour's
        listener again: a neighbour that answers is alive (watched on the new connection), one that does not is
        lost."""
        while True:
            if connection is not None:
                self._watched[connection] = neighbour[0]
                farewell = await self._hold(connection)
                del self._watched[connection]
                if self._over or farewell:
                    return
            self._ending = neighbour[0]
            await asyncio.sleep(GRACE_S)
            if self._over:
                return
            answer, _ = await _connect(neighbour[1])
            if answer is None:
                if not self._over:
                    await on_lost(neighbour[0])
                return
            self._ending = None
            if connection is not None:
                log.warning("node watch: the connection to node %s ended, but its first rank answers again: it is "
                            "watched on a new connection", neighbour[0].host)  # fmt: skip
            connection = answer


async def _connect(address: Address) -> tuple[socket.socket | None, bool]:
    """A connection to a first rank's listener (None if none of its addresses answers), and whether one refused it:
    its host is up and nothing listens there (the rank's processes are gone)."""
    loop = asyncio.get_running_loop()
    addresses, port = address
    refused = False
    for host_address in addresses:
        connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        connection.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(connection, (host_address, port)), _CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as error:
            refused |= isinstance(error, ConnectionRefusedError)
            connection.close()
            continue
        _keep_alive(connection)
        return connection, False
    return None, refused
