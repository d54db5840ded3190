"""An idle rank must not burn a core: CPU time while nothing happens, and while an ask waits."""

import asyncio
import time

import numpy as np

import mpiscale


class Sleeper(mpiscale.Actor):
    async def nap(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "rested"


async def cpu_share(awaitable) -> float:
    cpu, wall = time.process_time(), time.monotonic()
    await awaitable
    return (time.process_time() - cpu) / (time.monotonic() - wall)


async def main(system):
    sleepers = await system.spawn_group(Sleeper, name="sleeper")
    for _ in range(50):  # some traffic first, so the engine starts from its busy state
        await sleepers[(system.rank + 1) % system.size].ask("nap", 0)
    await system.world.barrier()
    idle = await cpu_share(asyncio.sleep(2.0))
    waiting = await cpu_share(sleepers[(system.rank + 1) % system.size].ask("nap", 2.0))
    shares = await system.world.allgather(np.array([idle, waiting]))
    if system.rank == 0:
        for rank, (a, b) in enumerate(shares):
            print(f"rank {rank}: idle {a:.1%} of a core, waiting on an ask {b:.1%}")
        assert (shares < 0.10).all(), f"an idle rank used 10% of a core or more: {shares}"
        print("idle ok")


mpiscale.run(main)
