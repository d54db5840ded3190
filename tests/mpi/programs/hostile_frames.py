"""A peer that sends damaged or foreign frames with raw mpi4py on the runtime's own communicator and frame tag.

The last rank attacks rank 0, where an actor takes whatever envelope reaches it. ``SCENARIO`` is one named damage,
or ``fuzz-SEED``: random damage (bit flips, cuts, bytes replaced or added) to real frames of every kind, sent one
after another, each followed by an ask that says whether it was delivered. Every frame must be delivered, or end
the job with one report naming the sender: never a crash, never a hang.

    python hostile_frames.py SCENARIO
"""

import asyncio
import random
import struct
import sys

import numpy as np

import mpiscale
from mpiscale.runtime import AskTimeout, compact, transport

_HEADER = struct.Struct("<IIQ")
_MAGIC = 0x4353504D
_INLINE_BIT = 1 << 31
_FIRST_SEQ = 1 << 40  # far from the sequence numbers the attacker's own runtime gives its messages


class Sink(mpiscale.Actor):
    def __init__(self) -> None:
        self.taken = 0

    def take(self, *args, **kwargs) -> None:
        self.taken += 1

    def count(self) -> int:
        return self.taken

    async def vector_later(self, seconds: float) -> np.ndarray:
        await asyncio.sleep(seconds)
        return np.arange(VECTOR, dtype=np.float64)


VECTOR = 20000  # float64s of the forged replies' array, and of the buffer rank 0 lends


def declaring(sizes: list[int], seq: int) -> bytes:
    """A frame whose parts follow apart, of ``sizes``."""
    return _HEADER.pack(_MAGIC, len(sizes), seq) + struct.pack(f"<{len(sizes)}Q", *sizes)


def compact_frame(envelope: tuple, seq: int) -> bytes:
    body = compact.encode(envelope)
    assert body is not None, envelope
    return transport.encode_compact(body, seq)


def named(scenario: str, seq: int) -> list[tuple[bytes, list[bytes]]]:
    """The frames of one named damage, each with the parts sent after it on its data tag."""
    if scenario == "garbage":
        return [(bytes(random.Random(1).randrange(256) for _ in range(48)), [])]
    if scenario == "truncated-part":  # a part declared of 100 bytes, 5,000 sent
        return [(declaring([100], seq), [bytes(5000)])]
    if scenario == "parts-never-come":
        return [(declaring([16 << 30], seq), [])]
    if scenario == "huge-part":
        return [(declaring([1 << 40], seq), [])]
    if scenario == "bad-pickle":
        body = b"\x80\x05this is no pickle"
        return [(_HEADER.pack(_MAGIC, 1 | _INLINE_BIT, seq) + struct.pack("<Q", len(body)) + body, [])]
    if scenario == "kind-2":
        return [(compact_frame((2, "sink", "take", (), {}, -1), seq), [])]
    if scenario == "void-kind":
        return [(compact_frame((np.zeros(1, "V16"), "sink", "take", (), {}, -1), seq), [])]
    if scenario == "foreign-tell":  # well formed, delivered, and sent by no rank of the job
        return [(compact_frame((0, "sink", "take", (), {}, -1), seq), [])]
    if scenario == "failed-reply-not-failure":
        return [(compact_frame((1, 7, "not a Failure", True), seq), [])]
    raise SystemExit(f"unknown scenario {scenario}")


def real_frames(seq: int) -> list[tuple[bytes, list[bytes]]]:
    """One frame of every kind the runtime sends to an actor, with its parts."""
    tell = (0, "sink", "take", (3, "x", np.arange(4.0)), {"k": 1.5}, -1)
    batch = transport.encode_batch([compact.encode(tell)] * 3, seq + 1)
    inline = transport.encode_pickled((0, "sink", "take", ({"a": [1, 2]},), {}, -1), seq + 2, 1 << 16)
    apart = transport.encode_pickled((0, "sink", "take", (np.arange(20000.0),), {}, -1), seq + 3, 0)
    reply = transport.encode_pickled((0, "sink", "take", (np.arange(20000.0),), {}, -1), seq + 4, 0, answers=5)
    return [(compact_frame(tell, seq), []), (batch, []), (inline.frame, []),
            (apart.frame, [bytes(part) for part in apart.parts]),
            (reply.frame, [bytes(part) for part in reply.parts])]  # fmt: skip


def damaged(frame: bytes, generator: random.Random) -> bytes:
    data = bytearray(frame)
    how = generator.randrange(4)
    if how == 0:
        for _ in range(generator.randint(1, 3)):
            data[generator.randrange(len(data))] ^= 1 << generator.randrange(8)
    elif how == 1:
        del data[generator.randrange(1, len(data)) :]
    elif how == 2:
        data[generator.randrange(len(data))] = generator.randrange(256)
    else:
        data += bytes(generator.randrange(256) for _ in range(generator.randint(1, 16)))
    return bytes(data)


def fuzzed(seed: int, seq: int, count: int) -> list[tuple[bytes, list[bytes]]]:
    generator = random.Random(seed)
    frames = []
    for index in range(count):
        frame, parts = generator.choice(real_frames(seq + 5 * index))
        frames.append((damaged(frame, generator), parts))
    return frames


def forged_replies(seq: int) -> list[tuple[bytes, list[bytes]]]:
    """Tells to rank 0's sink whose frames say they answer rank 0's asks 0 to 9, with an array of the size of the
    buffer rank 0 lent for its ask of the attacker."""
    frames = []
    for ask_id in range(10):
        forged = transport.encode_pickled((0, "sink", "take", (np.full(VECTOR, -1.0),), {}, -1), seq + ask_id, 0,
                                          answers=ask_id)  # fmt: skip
        frames.append((forged.frame, [bytes(part) for part in forged.parts]))
    return frames


async def lend_to_the_attacker(system, attacker: int) -> None:
    """Rank 0 in "forged-reply": its ask of the attacker lends a buffer that forged replies name meanwhile."""
    buffer = np.zeros(VECTOR)
    got = await mpiscale.ActorRef(attacker, "sink").ask("vector_later", 0.5, reply_into=buffer)
    assert got is buffer and np.array_equal(buffer, np.arange(VECTOR, dtype=np.float64)), buffer[:4]
    taken = await mpiscale.ActorRef(0, "sink").ask("count")
    assert taken == 10, f"the sink took {taken} of the 10 forged replies"
    print(f"forged-reply: the buffer holds the reply, the sink took {taken}", flush=True)


async def main(system):
    scenario = sys.argv[1]
    await system.spawn_group(Sink, name="sink")
    attacker = system.size - 1
    if system.rank == 0 and scenario == "forged-reply":
        return await lend_to_the_attacker(system, attacker)
    if system.rank != attacker:
        return
    MPI, comm = system.MPI, system._p2p  # the runtime's own point-to-point communicator
    tag_ub = comm.Get_attr(MPI.TAG_UB)
    fuzz = scenario.startswith("fuzz-")
    if scenario == "forged-reply":
        await asyncio.sleep(0.2)  # rank 0's ask is out
        frames = forged_replies(_FIRST_SEQ)
    else:
        frames = fuzzed(int(scenario[5:]), _FIRST_SEQ, 40) if fuzz else named(scenario, _FIRST_SEQ)
    sink = mpiscale.ActorRef(0, "sink")
    sent = []
    taken_before = 0
    for index, (frame, parts) in enumerate(frames):
        sent.append(comm.Isend([frame, MPI.BYTE], 0, transport.FRAME_TAG))
        seq = _HEADER.unpack_from(frame)[2] if len(frame) >= _HEADER.size else 0
        for part in parts:
            sent.append(comm.Isend([part, MPI.BYTE], 0, transport.data_tag(seq, tag_ub)))
        try:
            taken = await sink.ask("count", timeout=5)
        except AskTimeout:  # held up behind a frame whose parts never come: the job's end names it
            print(f"frame {index} holds up what follows it", flush=True)
            return
        print(f"frame {index} delivered (the sink took {taken})", flush=True)
        if scenario != "foreign-tell":  # the attacker's books: the messages its frames made count as its own
            system._engine.count_sent(taken - taken_before, 0)
        taken_before = taken
    print(f"{scenario}: all {len(frames)} frames delivered", flush=True)


mpiscale.run(main)
