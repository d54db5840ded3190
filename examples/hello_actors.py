"""A first mpiscale program: run with  launch/mpiscale-run -n 4 -- python examples/hello_actors.py

Each rank hosts one ``Accumulator``; every rank sends numbers to the next
rank's accumulator, asks for its total, then all ranks sum the totals with an
awaitable allreduce.
"""

import numpy as np

import mpiscale


class Accumulator(mpiscale.Actor):
    """Sums what it is told; answers asks for the total."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.total = 0.0

    def add(self, values: np.ndarray) -> None:  # a handler may be plain...
        self.total += self.scale * float(values.sum())

    async def result(self) -> float:  # ...or async, and may await other actors
        return self.total


async def main(system: mpiscale.ActorSystem) -> float:
    accumulators = await system.spawn_group(Accumulator, 2.0, name="acc")  # one per rank
    right = accumulators[(system.rank + 1) % system.size]
    for step in range(10):
        right.tell("add", np.full(100, step))  # arrays travel without pickling their bytes
    mine = await accumulators[system.rank].ask("result", timeout=30)
    while mine < 2.0 * 100 * 45:  # the left neighbour's messages may still be arriving
        mine = await accumulators[system.rank].ask("result", timeout=30)
    everything = await system.world.allreduce(np.array([mine]))
    if system.rank == 0:
        print(f"{system.size} ranks, total {everything[0]:.0f}")
    return float(everything[0])


if __name__ == "__main__":
    mpiscale.run(main)
