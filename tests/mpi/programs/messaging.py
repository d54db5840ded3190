"""Ordering, nested payloads, chunked large messages, remote spawn, refs in messages."""

import asyncio
import os
import sys
import time

import numpy as np
import torch

import mpiscale
from mpiscale import Actor, ActorRef
from mpiscale.runtime import wire


class Recorder(Actor):
    """Records the sequence numbers it receives from each sender."""

    def __init__(self):
        self.seen: dict[int, list[int]] = {}
        self.notes: dict[int, list[int]] = {}

    def record(self, sender: int, seq: int, payload=None):
        if payload is not None and payload.dtype == np.uint8:  # a compact frame about the 4 KiB eager limit
            assert payload.shape == (3950 + seq % 150,) and (payload == seq % 251).all(), payload.shape
        elif payload is not None:
            assert payload.shape == (seq % 7 * 5000,), payload.shape
            assert (payload == seq).all()
        self.seen.setdefault(sender, []).append(seq)

    def sequences(self):
        return self.seen

    def note(self, sender: int, seq: int, values: np.ndarray):
        assert values.flags.writeable and (values == seq).all(), (seq, values)
        notes = self.notes.setdefault(sender, [])
        assert seq == len(notes), f"note {seq} from rank {sender} after {len(notes)}"
        notes.append(seq)

    def stamp(self):
        self.stamped_at = time.monotonic()

    def stamped(self) -> float:
        return self.stamped_at

    def notes_from(self, sender: int) -> int:
        return len(self.notes.get(sender, []))


class Tally(Actor):
    """Counts the tells it gets, by sender."""

    def __init__(self):
        self.senders: list[int] = []

    def add(self, sender: int):
        self.senders.append(sender)

    def received(self):
        return sorted(self.senders)


class Echo(Actor):
    async def echo(self, value):
        return value


class Mixed(Actor):
    """Handlers of every kind: one that suspends (its actor's task runs it), plain ones and one that awaits nothing
    (run at once where they arrive when the actor is idle), a plain one that returns a coroutine."""

    def __init__(self):
        self.log = []

    async def pause(self, seconds: float):
        await asyncio.sleep(seconds)
        self.log.append("paused")

    def add(self, value: int):
        self.log.append(value)

    async def snapshot(self) -> list:
        return list(self.log)

    def deferred(self, value: int):
        return self._later(value)

    async def _later(self, value: int) -> int:
        await asyncio.sleep(0.01)
        self.log.append(("later", value))
        return value * 2


class Relay(Actor):
    """Forwards to the actor it is given (a reference travelling in a message)."""

    async def relay(self, target: ActorRef, value):
        return await target.ask("echo", value)


def payload(rank: int) -> dict:
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4) + rank)
    return {
        "ints": np.arange(10, dtype=np.int32) * rank,
        "nested": [(np.ones((2, 3), dtype=np.float32), {"deep": [np.array(3.5), np.zeros(0)]})],
        "fortran": fortran,
        "strided": np.arange(40.0)[::3],
        "bool": np.array([True, False, True]),
        "complex": np.array([1 + 2j, 3 - 4j]),
        "structured": np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
        "big": np.random.default_rng(rank).random((300, 400)),  # above the inline limit
        "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank,
        "bf16": torch.ones(4, dtype=torch.bfloat16) * 2,
        "param": torch.nn.Parameter(torch.zeros(3)),
        "text": "héllo",
        "none": None,
    }


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return (
            type(b) is np.ndarray
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b)
            and b.flags.writeable
        )
    if isinstance(a, torch.Tensor):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
            and a.requires_grad == b.requires_grad
        )
    return a == b


async def main(system):
    rank, size = system.rank, system.size
    recorders = await system.spawn_group(Recorder, name="recorder")
    echoes = await system.spawn_group(Echo, name="echo")
    tallies = await system.spawn_group(Tally, name="tally")
    relays = await system.spawn_group(Relay, name="relay")

    # Ordering: every rank sends numbered tells to every recorder, mixing small
    # (inline) and large (separate parts) messages, which complete at different speeds,
    # and compact frames of either side of the shared-memory eager limit (4 KiB).
    count = 300
    for seq in range(count):
        for target in recorders:
            large = np.full(seq % 7 * 5000, seq, dtype=np.int64) if seq % 3 == 0 else None
            if seq % 3 == 1:
                large = np.full(3950 + seq % 150, seq % 251, dtype=np.uint8)
            target.tell("record", rank, seq, large)
    await system.world.barrier()
    await asyncio.sleep(0)
    seen = await recorders[rank].ask("sequences")
    while sum(map(len, seen.values())) < count * size:
        await asyncio.sleep(0.01)
        seen = await recorders[rank].ask("sequences")
    assert sorted(seen) == list(range(size)), seen.keys()
    for sender, seqs in seen.items():
        assert seqs == list(range(count)), f"rank {rank}: messages from {sender} out of order"

    # Asks leave at once, each a frame of its own: compact frames either side of the 4 KiB eager limit, many in
    # flight from every rank to every rank, come back whole and in place.
    sizes = [n for n in range(3950, 4100, 3) for _ in range(size)]
    asked = [echoes[i % size].ask("echo", np.full(n, n % 251, np.uint8)) for i, n in enumerate(sizes)]
    echoed = await asyncio.gather(*asked)
    assert all(value.shape == (n,) and (value == n % 251).all() for value, n in zip(echoed, sizes))

    # A burst of small tells in one loop turn leaves in batches (several, past the batch limits), in order, each
    # with the values its arrays held when it was told (a tell whose future is done has copied them, as batched
    # ones do); an ask after them sees them all.
    burst, mutable = 2_000, np.zeros(3)
    target = recorders[(rank + 1) % size]
    for seq in range(burst):
        mutable[:] = seq
        if not target.tell("note", rank, seq, mutable).done():  # sent without a copy: the buffer is in flight
            mutable = mutable.copy()
    mutable[:] = -1
    assert await target.ask("notes_from", rank) == burst
    await system.world.barrier()

    # A lone small tell leaves at once: a long computation after it in the same loop turn does not hold it back.
    if rank == 0:
        told = time.monotonic()
        recorders[1].tell("stamp")
        time.sleep(0.5)  # the sender's loop is blocked; CLOCK_MONOTONIC is shared by the processes of a host
        arrived = await recorders[1].ask("stamped")
        assert arrived - told < 0.25, f"a lone tell arrived {arrived - told:.3f} s after it was told"
    await system.world.barrier()

    # Handlers run at once where they arrive, or in the actor's task, still one at a time and in the order sent.
    mixed = await system.spawn_group(Mixed, name="mixed")
    target = mixed[(rank + 1) % size]  # each rank's member hears from one rank
    target.tell("pause", 0.05)
    for value in range(50):
        target.tell("add", value)
    assert await target.ask("deferred", 7) == 14
    log = await target.ask("snapshot")
    assert log == ["paused", *range(50), ("later", 7)], log

    # Payloads round-trip unchanged through another rank, at any nesting depth.
    other = echoes[(rank + 1) % size]
    sent = payload(rank)
    assert same(sent, await other.ask("echo", sent)), "payload changed in transit"
    # ... and through a third rank, with a reference travelling in the message.
    third = echoes[(rank + 2) % size]
    assert same(sent, await relays[(rank + 1) % size].ask("relay", third, sent))

    # tell's future resolves once the buffers may be reused: the byte count sent.
    big = np.ones(100_000)
    assert await recorders[(rank + 1) % size].tell("sequences") >= 0
    assert await echoes[(rank + 1) % size].tell("echo", big) >= big.nbytes

    # Same-rank messages never touch MPI: the very same object arrives, unserialized.
    assert await echoes[rank].ask("echo", sent) is sent

    # Whole groups: ask_all answers in rank order; tell_all reaches every member.
    assert await echoes.ask_all("echo", rank) == [rank] * size
    tallies.tell_all("add", rank)
    deadline = time.monotonic() + 30
    while (got := await tallies[rank].ask("received")) != list(range(size)):
        assert time.monotonic() < deadline, f"tell_all: rank {rank}'s member heard from {got}, not every rank"
        await asyncio.sleep(0.01)
    assert len(echoes) == size and [ref.rank for ref in echoes] == list(range(size))

    # Remote spawn: rank 0 places an actor on the last rank; everyone uses it.
    if rank == 0:
        ref = await system.spawn(Echo, name="spawned", rank=size - 1)
        assert ref == ActorRef(size - 1, "spawned")
    await system.world.barrier()
    assert await ActorRef(size - 1, "spawned").ask("echo", rank) == rank

    # The message path each rank ran ("mixed": odd ranks on the pure-Python reference, even ones compiled).
    paths = await system.world.allgather(np.frombuffer(wire.chosen()[1].split()[0].ljust(12).encode(), np.uint8))
    if rank == 0:
        names = [bytes(row).decode().strip() for row in paths.reshape(size, 12)]
        print(f"messaging ok on {size} ranks ({sys.argv[1:]}), paths {','.join(names)}")


if "mixed" in sys.argv[1:]:  # read once the runtime starts
    os.environ[wire.PURE_ENV] = str(int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) % 2)
mpiscale.run(main)
