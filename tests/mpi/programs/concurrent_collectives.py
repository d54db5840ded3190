"""Collectives of one communicator started together (``asyncio.gather``), in the same order on every rank, with one
rank late: each call gets its own result. Before the calls of a communicator ran one at a time, the late rank
posted its steps in another order than the others and MPI matched one call's data with another's (two allgathers
ended in MPI_ERR_TRUNCATE)."""

import asyncio
import time

import numpy as np

import mpiscale

TRIALS = 10


async def main(system) -> None:
    world, rank, size = system.world, system.rank, system.size
    for trial in range(TRIALS):
        if rank == size - 1:
            time.sleep(0.005)  # late: the others' first call waits past its spin and yields to the next ones
        short, long = np.full(3, 10 * rank + 1), np.full(5, 10 * rank + 2.0)
        gathered, summed, sent, ones = await asyncio.gather(
            world.allgather(short),
            world.allreduce(long),
            world.bcast({"trial": trial, "from": rank}, root=size - 1),
            world.allgather(np.ones((2, 2), np.float32)),
        )
        assert (gathered == 10 * np.arange(size)[:, None] + 1).all(), gathered
        assert (summed == sum(10 * r + 2.0 for r in range(size))).all(), summed
        assert sent == {"trial": trial, "from": size - 1}, sent
        assert ones.shape == (size, 2, 2) and (ones == 1).all()
    if rank == 0:
        print(f"concurrent collectives ok: {size} ranks, {TRIALS} rounds of 4 calls with a late rank")


mpiscale.run(main)
