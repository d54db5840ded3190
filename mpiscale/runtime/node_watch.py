"""Whole nodes of a multi-host job, watched over TCP: which node was lost, within seconds.

When a node goes down, or every process on it is killed, nothing tells the
ranks on the other nodes: their MPI calls that need it wait, srun learns of it
only when Slurm's controller declares the node dead (SlurmdTimeout: minutes on
most sites), and a rank can see only the processes of its own host
(:mod:`mpiscale.runtime.peers`). So the first rank of each host keeps a TCP
connection to the first rank of the next host, in a ring. A connection that
ends while both jobs' ``main`` still run means the other end died: its process
went (the kernel closes its socket at once) or its host went silent (TCP
keepalive gives up within about ten seconds). After a short grace, in which an
abort begun elsewhere usually ends this process too, the job ends with one
report naming the host that was lost. Jobs on a single host watch nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..ranks import Comm

_KEEPALIVE = {"TCP_KEEPIDLE": 4, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3}  # a silent host: lost within ~10 s
_CONNECT_TIMEOUT_S = 5.0
# A launcher that ends the job (an abort elsewhere, a cancel) signals this process before the other end's goes: a
# short wait lets the signal, not the closed connection, speak. mpirun, for its part, kills its ranks soon after a
# node's daemon is lost: the report must come before.
GRACE_S = 0.05


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


def _listening_socket() -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    listener.setblocking(False)
    return listener


def _own_addresses(host: str) -> list[str]:
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


class NodeWatch:
    """One rank's part of the ring; only the first rank of each host takes part (every method but ``gather`` is
    for this rank alone)."""

    def __init__(self, listener: socket.socket | None, target: tuple[list[str], int] | None,
                 following: LostNode | None = None, preceding: LostNode | None = None) -> None:  # fmt: skip
        self._listener = listener
        self._target = target  # the next host's first rank: (its addresses, its port)
        self._following, self._preceding = following, preceding  # what is lost when a connection ends
        self._tasks: list[asyncio.Task] = []
        self._over = False

    @classmethod
    def gather(cls, world: Comm, host: str) -> NodeWatch:
        """Collective over ``world`` at start-up: each host's first rank listens, and learns the next host's."""
        rank = world.Get_rank()
        hosts = world.allgather(host)
        first_of = {h: hosts.index(h) for h in dict.fromkeys(hosts)}
        leads = first_of[host] == rank and len(first_of) > 1
        listener = _listening_socket() if leads else None
        addresses = _own_addresses(host) if leads else []
        port = listener.getsockname()[1] if listener is not None else 0
        everyone = world.allgather((addresses, port))
        if not leads or not addresses:
            if listener is not None:
                listener.close()
            return cls(None, None)
        ring = list(first_of)  # hosts in the order of their first rank
        following = ring[(ring.index(host) + 1) % len(ring)]
        preceding = ring[ring.index(host) - 1]
        node_of = {h: LostNode(h, [r for r, where in enumerate(hosts) if where == h]) for h in (following, preceding)}
        target = everyone[first_of[following]]
        return cls(listener, target if target[0] else None, node_of[following], node_of[preceding])

    def start(self, on_lost: Callable[[LostNode], Awaitable[None]]) -> None:
        """Connect to the next host and accept the previous one's connection; ``on_lost`` when one ends early."""
        if self._listener is None:
            return
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._accept(on_lost), name="node watch: accept"))
        if self._target is not None:
            self._tasks.append(loop.create_task(self._connect(on_lost), name="node watch: connect"))

    def quiet(self) -> None:
        """From now on a connection that ends is the job's end, not a loss (safe in a signal handler)."""
        self._over = True

    def end(self) -> None:
        """This rank's ``main`` ended, or a stop began: connections that end from now on are the job's end."""
        self._over = True
        for task in self._tasks:
            task.cancel()
        if self._listener is not None:
            self._listener.close()

    async def _accept(self, on_lost: Callable[[LostNode], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        connection, _ = await loop.sock_accept(self._listener)
        _keep_alive(connection)
        await self._hold(connection, self._preceding, on_lost)

    async def _connect(self, on_lost: Callable[[LostNode], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        assert self._target is not None
        addresses, port = self._target
        for address in addresses:
            connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            connection.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(connection, (address, port)), _CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                connection.close()
                continue
            _keep_alive(connection)
            await self._hold(connection, self._following, on_lost)
            return

    async def _hold(self, connection: socket.socket, node: LostNode | None,
                    on_lost: Callable[[LostNode], Awaitable[None]]) -> None:  # fmt: skip
        """Wait for the connection to end (nothing is ever sent on it); report its host if the job still runs."""
        loop = asyncio.get_running_loop()
        try:
            with contextlib.suppress(OSError):
                await loop.sock_recv(connection, 1)
        finally:
            connection.close()
        if self._over:
            return
        await asyncio.sleep(GRACE_S)
        if not self._over and node is not None:
            await on_lost(node)
