"""The node watch against a real TCP peer standing in for the next host's first rank: a connection that ends while
the peer still listens is a warning and a new connection; a peer that no longer answers is a lost node."""

import asyncio
import logging
import socket

from mpiscale.runtime.node_watch import LostNode, NodeWatch


def _peer() -> socket.socket:
    """A first rank's listener on localhost (the next host's, and this rank's own)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    return listener


async def _until(condition, seconds: float = 5) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)


async def _watched_peer(caplog) -> list[LostNode]:
    loop = asyncio.get_running_loop()
    peer, lost = _peer(), []
    next_host = LostNode("node2", [2, 3])
    watch = NodeWatch(_peer(), following=(next_host, (["127.0.0.1"], peer.getsockname()[1])))

    async def on_lost(node: LostNode) -> None:
        lost.append(node)

    watch.start(on_lost)
    first, _ = await asyncio.wait_for(loop.sock_accept(peer), 5)
    first.close()  # the connection ends, but the peer still listens: a probe finds it alive
    again, _ = await asyncio.wait_for(loop.sock_accept(peer), 5)
    await _until(lambda: "node watch: the connection to node node2 ended" in caplog.text)
    assert lost == []
    peer.close()  # now it is gone: its connection ends and nothing answers the probe
    again.close()
    await _until(lambda: bool(lost))
    watch.close()
    return lost


def test_a_neighbour_that_answers_again_is_watched_anew_and_one_that_does_not_is_lost(caplog):
    caplog.set_level(logging.WARNING, logger="mpiscale.runtime.node_watch")
    lost = asyncio.run(asyncio.wait_for(_watched_peer(caplog), 20))
    assert lost == [LostNode("node2", [2, 3])]
    assert "ranks 2, 3" in lost[0].describe()


async def _parting(says_farewell: bool) -> tuple[list[LostNode], bytes]:
    """The next host (this test) ends its connection and stops listening, with or without a farewell first; then
    the watch itself says farewell on a second connection: (what it found lost, what the second peer read)."""
    loop = asyncio.get_running_loop()
    peer, other, lost = _peer(), _peer(), []

    async def on_lost(node: LostNode) -> None:
        lost.append(node)

    watch = NodeWatch(_peer(), following=(LostNode("node2", [2, 3]), (["127.0.0.1"], peer.getsockname()[1])))
    watch.start(on_lost)
    connection, _ = await asyncio.wait_for(loop.sock_accept(peer), 5)
    if says_farewell:
        await loop.sock_sendall(connection, b"F")
    peer.close()
    connection.close()
    await _until(lambda: bool(lost), 1.0)
    watch.close()
    told = NodeWatch(_peer(), following=(LostNode("node3", [4]), (["127.0.0.1"], other.getsockname()[1])))
    told.start(on_lost)
    second, _ = await asyncio.wait_for(loop.sock_accept(other), 5)
    await asyncio.sleep(0.05)  # its connection is held
    told.farewell()
    read = await asyncio.wait_for(loop.sock_recv(second, 1), 5)
    told.close()
    return lost, read


def test_a_neighbour_that_said_farewell_is_no_loss_and_the_watch_says_it_when_its_rank_exits():
    assert asyncio.run(asyncio.wait_for(_parting(says_farewell=False), 20))[0] == [LostNode("node2", [2, 3])]
    lost, read = asyncio.run(asyncio.wait_for(_parting(says_farewell=True), 20))
    assert lost == [] and read == b"F"


async def _gone_before_the_first_connection() -> list[LostNode]:
    """The next host's listener was up when the job began (its port is known) but is gone before the watch first
    connects: a node lost in the job's first moments."""
    gone = _peer()
    port = gone.getsockname()[1]
    gone.close()
    lost: list[LostNode] = []

    async def on_lost(node: LostNode) -> None:
        lost.append(node)

    watch = NodeWatch(_peer(), following=(LostNode("node2", [2, 3]), (["127.0.0.1"], port)))
    watch.start(on_lost)
    await asyncio.wait_for(watch.connected(), 5)
    await _until(lambda: bool(lost))
    watch.close()
    return lost


def test_a_neighbour_gone_before_the_first_connection_is_lost():
    """Before, a first connection that failed was left alone: the node went unnamed."""
    assert asyncio.run(asyncio.wait_for(_gone_before_the_first_connection(), 20)) == [LostNode("node2", [2, 3])]


async def _silent_at_the_start() -> list[LostNode]:
    """The next host answers nothing (as behind a firewall that drops): a listener whose queue of connections is
    full drops new ones unanswered, and the watch's connection times out."""
    full = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    queued = socket.create_connection(full.getsockname(), timeout=5)  # the one connection its queue holds
    lost: list[LostNode] = []

    async def on_lost(node: LostNode) -> None:
        lost.append(node)

    watch = NodeWatch(_peer(), following=(LostNode("node2", [2, 3]), (["127.0.0.1"], full.getsockname()[1])))
    watch.start(on_lost)
    await asyncio.wait_for(watch.connected(), 10)
    await asyncio.sleep(2.5)  # a probe of it would have ended by now (its 2-s timeout), and called it lost
    watch.close()
    queued.close()
    full.close()
    return lost


def test_a_neighbour_that_never_answered_is_not_watched_and_not_called_lost(caplog):
    """A first connection that nothing answers (a firewall between the nodes, say) tells no loss: a warning, and the
    job runs on, as before the first connection's failure counted."""
    caplog.set_level(logging.WARNING, logger="mpiscale.runtime.node_watch")
    assert asyncio.run(asyncio.wait_for(_silent_at_the_start(), 20)) == []
    assert "node node2 did not answer at the start" in caplog.text
