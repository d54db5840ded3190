"""Replies received into a buffer the asker lends: ``ask(..., reply_into=buffer)``.

Every rank asks the next one. A large reply lands in the buffer (the array sent, here), a small one and a local one
are copied in; messages of the same size from the same rank that are not the reply (a tell sent just before it,
another ask's reply) never stay in a lent buffer, and a reply that comes after its ask timed out never lands in a
buffer given back. Refusals: a reply of another shape or dtype, and a buffer that cannot take one.
"""

import asyncio

import numpy as np

import mpiscale
from mpiscale import AskTimeout

N = 1 << 19  # float64: 4 MiB, received apart from its frame (over the compact and inline limits)


class Server(mpiscale.Actor):
    def __init__(self):
        self.kept: list[np.ndarray] = []

    def doubled(self, values: np.ndarray) -> np.ndarray:
        return values * 2

    def same(self, values: np.ndarray) -> np.ndarray:
        return values

    async def slow(self, seconds: float, fill: float) -> np.ndarray:
        await asyncio.sleep(seconds)
        return np.full(N, fill)

    def first_a_tell(self, keeper, fill: float) -> np.ndarray:
        keeper.tell("keep", np.full(N, -fill))  # the same size, from the same rank, just before the reply
        return np.full(N, fill)

    def keep(self, values: np.ndarray) -> None:
        self.kept.append(values)

    def kept_sums(self) -> list[float]:
        return [float(values.sum()) for values in self.kept]

    def shaped(self, shape: tuple, dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype)

    def fails(self) -> np.ndarray:
        raise KeyError("no such vector")


async def main(system):
    rank, size = system.rank, system.size
    servers = await system.spawn_group(Server, name="reply-into-server")
    other = await system.spawn_group(Server, name="reply-into-other")
    peer, me = servers[(rank + 1) % size], servers[rank]

    # The array sent is the buffer of its reply: received there, returned as itself.
    buffer = np.arange(N, dtype=np.float64)
    for round_ in range(3):
        got = await peer.ask("doubled", buffer, reply_into=buffer)
        assert got is buffer and buffer[7] == 7 * 2 ** (round_ + 1), (round_, buffer[:8])
    in_place = system.traffic()["bytes_received_in_place"]
    assert in_place == 3 * buffer.nbytes, f"{in_place} bytes of 3 replies of {buffer.nbytes} received in place"

    # A tell of the reply's size from the asked rank comes first: it keeps its own values, the buffer the reply's.
    keeper = servers[rank]
    for fill in (3.0, 4.0):
        got = await peer.ask("first_a_tell", keeper, fill, reply_into=buffer)
        assert got is buffer and (buffer == fill).all()
    await system.world.barrier()
    assert await keeper.ask("kept_sums") == [-3.0 * N, -4.0 * N], await keeper.ask("kept_sums")
    assert system.traffic()["bytes_received_in_place"] == 5 * buffer.nbytes, system.traffic()

    # Two asks out at once, answered in the other order: each buffer holds its own reply.
    first, second = np.zeros(N), np.zeros(N)
    late = asyncio.ensure_future(peer.ask("slow", 0.2, 1.0, reply_into=first))
    await asyncio.sleep(0.01)
    assert await other[(rank + 1) % size].ask("slow", 0.0, 2.0, reply_into=second) is second
    assert await late is first and (first == 1.0).all() and (second == 2.0).all()
    assert system.traffic()["bytes_received_in_place"] == 7 * buffer.nbytes, system.traffic()

    # Dates and durations (numpy exports no buffer of them) and the other byte order travel and land in place too.
    for kind in ("datetime64[s]", "timedelta64[ms]", ">f8"):
        sent, lent = np.arange(N).astype(kind), np.zeros(N).astype(kind)
        assert await peer.ask("same", sent, reply_into=lent) is lent and (lent == sent).all(), kind
    assert system.traffic()["bytes_received_in_place"] == 10 * buffer.nbytes, system.traffic()

    # Small and local replies are copied in.
    small = np.zeros(8)
    assert await peer.ask("doubled", np.ones(8), reply_into=small) is small and (small == 2).all()
    assert await me.ask("doubled", np.ones(N), reply_into=buffer) is buffer and (buffer == 2).all()

    # A reply after its ask timed out does not land in the buffer given back.
    buffer[:] = 5.0
    try:
        await peer.ask("slow", 0.3, 9.0, reply_into=buffer, timeout=0.05)
    except AskTimeout:
        pass
    else:
        raise AssertionError("the slow ask did not time out")
    await asyncio.sleep(0.6)  # the late reply came meanwhile
    assert (buffer == 5.0).all(), buffer[:4]

    # Refusals, and a remote error: one clear exception each, and the next ask is whole.
    for shape, dtype, expected in (((N // 2,), "float64", "float64(262144,)"), ((N,), "float32", "float32(524288,)")):
        try:
            await peer.ask("shaped", shape, dtype, reply_into=buffer)
        except ValueError as error:
            assert f"the reply is {expected}, the buffer given as reply_into float64(524288,)" in str(error), error
        else:
            raise AssertionError(f"a reply {shape} {dtype} went into a float64 buffer of {N}")
    for wrong in (buffer[::2], np.zeros(4).view(np.float64).reshape(2, 2).T, [0.0] * 4):
        try:
            await peer.ask("doubled", np.ones(4), reply_into=wrong)
        except TypeError as error:
            assert "reply_into must be a writable, C-contiguous numpy array" in str(error), error
        else:
            raise AssertionError(f"{type(wrong)} taken as reply_into")
    try:
        await peer.ask("fails", reply_into=buffer)
    except KeyError as error:
        assert "no such vector" in str(error)
    else:
        raise AssertionError("the remote error was lost")
    assert await peer.ask("doubled", np.ones(N), reply_into=buffer) is buffer and (buffer == 2).all()

    await system.world.barrier()
    if rank == 0:
        print(f"reply_into ok on {size} ranks")


mpiscale.run(main)
