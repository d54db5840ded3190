"""Rank 0's ``main`` holds the event loop in a blocking call (``ranks.agree``) that the other ranks come to late;
meanwhile they tell an actor of rank 0's whose handler never suspends, so that it may run where its message lands.
Past the collective check the call asks the other ranks where they stand and polls for their answers in its own
stack: the tells it finds then must wait for the loop, as any message to a rank whose ``main`` is busy does, and
run once ``main`` awaits again, never inside the call."""

import asyncio

import mpiscale
from mpiscale.ranks import agree

INSIDE = [False]  # rank 0's main is inside the blocking call
TELLS = 20


class Tally(mpiscale.Actor):
    def __init__(self) -> None:
        self.runs: list[tuple[int, bool]] = []

    def bump(self, value: int) -> None:
        self.runs.append((value, INSIDE[0]))

    def seen(self) -> list:
        return self.runs


async def main(system):
    tallies = await system.spawn_group(Tally, name="held-tally")
    comm = system.world.comm
    if system.rank == 0:
        INSIDE[0] = True
        agree(comm, None, "the late ranks")
        INSIDE[0] = False
        while len(await tallies[0].ask("seen")) < TELLS * (system.size - 1):
            await asyncio.sleep(0.01)
        inside = [value for value, held in await tallies[0].ask("seen") if held]
        assert not inside, f"tells {inside} ran inside the blocking call that held rank 0's event loop"
        print(f"held inline ok: {TELLS * (system.size - 1)} tells ran after the call", flush=True)
    else:
        for value in range(TELLS):
            tallies[0].tell("bump", value)
            await asyncio.sleep(0.1)  # 2 s of tells: past the check (1 s), when rank 0 asks where the ranks stand
        agree(comm, None, "the late ranks")
    await system.world.barrier()


mpiscale.run(main, name="held-inline")
