"""run() returns only after in-flight messages (and the messages they cause) are handled."""

import asyncio

import mpiscale

handled = {"slow": 0, "sink": 0}


class Slow(mpiscale.Actor):
    async def work(self, n: int, sink: mpiscale.ActorRef) -> None:
        await asyncio.sleep(0.002)
        handled["slow"] += 1
        sink.tell("take", n)


class Sink(mpiscale.Actor):
    def take(self, n: int) -> None:
        handled["sink"] += 1


COUNT = 200


async def main(system):
    slow = await system.spawn_group(Slow, name="slow")
    sinks = await system.spawn_group(Sink, name="sink")
    if system.rank == 0:
        for n in range(COUNT):  # fire and forget, then return at once
            slow[system.size - 1].tell("work", n, sinks[1 % system.size])


mpiscale.run(main)
from mpi4py import MPI  # noqa: E402

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
assert handled["slow"] == (COUNT if rank == size - 1 else 0), (rank, handled)
assert handled["sink"] == (COUNT if rank == 1 % size else 0), (rank, handled)
print(f"rank {rank}: drained {handled}")
