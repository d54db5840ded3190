"""Raw arrays over a channel: every rank sends to every other on two lanes, shapes and dtypes varying, arrays
bigger than a lane's capacity and empty ones among them; each receiver checks every value and the order of each
(sender, lane), that arrays which fit landed in the buffers posted ahead (reused once let go), and that an
array it keeps is never written over however far the senders run ahead. The tests run it with tiny chunks too.
``damaged KIND``: rank 0 sends rank 1 a header that is not one, which must end the job; ``only-rank-0``: rank 0
opens a channel the others never open, which must end the job with the abandoned-collective report."""

import asyncio
import sys

import numpy as np

import mpiscale
from mpiscale.runtime.channel_format import CODES as _CODES
from mpiscale.runtime.channel_format import MAGIC as _MAGIC

ROUNDS = 60
DTYPES = (np.float32, np.float64, np.int16, np.complex64, np.uint8)


def _array(sender: int, lane: int, round_: int) -> np.ndarray:
    """What ``sender`` sends on ``lane`` in ``round_``: mostly 400 rows or fewer; every 7th round 900 rows (over the
    lane's capacity), every 11th none; on lane 1 the dtype changes each round (1-byte ones travel inline)."""
    rows = 900 if round_ % 7 == 3 else 0 if round_ % 11 == 5 else 400 - round_ % 5
    dtype = DTYPES[round_ % len(DTYPES)] if lane == 1 else np.float32
    shape = (rows, 3) if lane == 0 else (2, rows, 2)
    return (np.arange(np.prod(shape)).reshape(shape) % 100 + sender * 1000 + round_).astype(dtype)


async def main(system: mpiscale.ActorSystem) -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "damaged":
        await _damaged(system, sys.argv[2])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "only-rank-0":
        await system.world.barrier()
        if system.rank == 0:
            await system.channel("test.alone", lambda *arrived: None)  # the others never open it: a report
        return
    arrived: dict[tuple[int, int], list] = {}
    everything = asyncio.get_running_loop().create_future()
    expected = 2 * ROUNDS * (system.size - 1)
    count = [0]

    def deliver(source: int, lane: int, key: tuple[int, int, int], array: np.ndarray) -> None:
        arrived.setdefault((source, lane), []).append((key, array))
        count[0] += 1
        if count[0] == expected:
            everything.set_result(None)

    channel = await system.channel("test.channel", deliver)
    for round_ in range(ROUNDS):
        for dest in range(system.size):
            if dest != system.rank:
                for lane in (0, 1):
                    channel.send(dest, lane, (round_, lane, -round_), _array(system.rank, lane, round_))
        await asyncio.sleep(0)
    await asyncio.wait_for(everything, 60)
    in_place = 0
    for (source, lane), values in sorted(arrived.items()):
        assert [key for key, _ in values] == [(r, lane, -r) for r in range(ROUNDS)], (source, lane)
        for round_, (_, array) in enumerate(values):
            want = _array(source, lane, round_)
            assert array.dtype == want.dtype and array.shape == want.shape, (source, lane, round_, array.dtype)
            assert np.array_equal(array, want), (source, lane, round_)
            in_place += array.base is not None and array.base.nbytes > array.nbytes  # a view of a bigger buffer
    if system.config.chunk_bytes >= 400 * 3 * 4:  # (else every array is too big to be posted ahead)
        assert in_place > 0, "no array landed in a buffer posted ahead"
    buffers = await _reused(system)
    for name, bad in _bad_sends():
        try:
            channel.send((system.rank + 1) % system.size, 0, (0, 0, 0), bad)
        except (TypeError, ValueError) as error:
            assert "channel 'test.channel'" in str(error), error
        else:
            raise AssertionError(f"{name} was sent")
    peer = (system.rank + 1) % system.size
    for name, dest, lane, key in [("a key of two", peer, 0, (1, 2)), ("a float in a key", peer, 0, (1.5, 0, 0)),
                                  ("a key past 64 bits", peer, 0, (2**64, 0, 0)), ("a key of text", peer, 0, "abc"),
                                  ("a new lane's key of one", peer, 3, (1,)), ("no rank", system.size, 0, (0, 0, 0)),
                                  ("a float lane", peer, 0.5, (0, 0, 0))]:  # fmt: skip
        try:  # each once went out as a header the receiver could not read, and ended the job there
            channel.send(dest, lane, key, np.ones(3))
        except (TypeError, ValueError) as error:
            assert "channel 'test.channel'" in str(error), error
        else:
            raise AssertionError(f"{name} was sent")
    print(
        f"rank {system.rank}: channel ok, {in_place} of {len(arrived) * ROUNDS} arrays in place; the last "
        f"{ROUNDS // 2} of a stream let go of took {buffers} buffers",
        flush=True,
    )


async def _reused(system: mpiscale.ActorSystem) -> int:
    """Arrays let go of as they arrive: their buffers are posted again, so a few serve a long stream. Counted over a
    second stream, once the lane's capacity is known: in the first, the lane's first array is received apart, and
    until its data is in, the fitting arrays behind it wait for it, each in a buffer of its own (under load, dozens).
    """
    seen: list[int] = []
    sums: list[float] = []
    loop = asyncio.get_running_loop()
    done = [loop.create_future(), loop.create_future()]

    def deliver(source: int, lane: int, key: tuple[int, int, int], array: np.ndarray) -> None:
        seen.append(id(array.base))  # the buffer (alive while posted, so its id is not reused meanwhile)
        sums.append(float(array.sum()))
        if len(sums) % ROUNDS == 0:
            done[len(sums) // ROUNDS - 1].set_result(None)

    channel = await system.channel("test.reused", deliver)
    source, dest = (system.rank - 1) % system.size, (system.rank + 1) % system.size
    for stream in range(2):
        for round_ in range(ROUNDS):
            channel.send(dest, 3, (round_, 0, 0), np.full(1000, stream * ROUNDS + round_, np.float64))
            await asyncio.sleep(0)
        await asyncio.wait_for(done[stream], 60)
        await system.world.barrier()
    assert sums == [1000.0 * r for r in range(2 * ROUNDS)], sums
    posted_ahead = system.config.chunk_bytes >= 8000
    buffers = len(set(seen[ROUNDS:]))
    assert buffers <= 4 or not posted_ahead, f"{buffers} buffers for a stream of {ROUNDS} arrays from rank {source}"
    return buffers


async def _damaged(system: mpiscale.ActorSystem, kind: str) -> None:
    """Rank 0 sends rank 1 a header of the ``kind`` named: the receiving rank must end the job with its report."""
    channel = await system.channel("test.damaged", lambda *arrived: None)
    float64 = _CODES[np.dtype("<f8")]
    good = np.array([_MAGIC, 0, 0, 24, 1, 2, 3, float64, 1, 3], np.int64)  # lane 0, 3 float64s, "over"
    header = {
        "noise": np.frombuffer(bytes(range(80)), np.int64),
        "fit-without-capacity": _with(good, 2, 1),
        "shape-disagrees": _with(good, 9, 4),
        "object-dtype": _with(good, 7, 10_000),
        "inline-without-its-bytes": _with(good, 2, 2),
    }[kind]
    if system.rank == 0:
        channel.comm.Send(header, 1, 0)  # the header tag, as a stray program's message would
    await asyncio.sleep(10)  # rank 1 ends the job long before this
    raise AssertionError(f"a {kind} header was taken")


def _with(header: np.ndarray, word: int, value: int) -> np.ndarray:
    changed = header.copy()
    changed[word] = value
    return changed


def _bad_sends():
    yield "an object array", np.array([object()] * 3)
    yield "a list", [1, 2, 3]
    yield "a strided view", np.zeros((4, 4))[:, ::2]
    yield "8 dimensions", np.zeros((1,) * 8)


if __name__ == "__main__":
    mpiscale.run(main)
