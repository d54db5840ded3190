"""Collectives and asks that end at once in the caller's stack still give the event loop its turns.

A callback made ready before a call runs before the call returns; a timer falls due during a loop of calls, with
nothing else ready (telemetry's reports and the asks' deadlines are timers). Rank 0 comes last to every call, so its
calls end in its stack at once; on one rank every call does.
"""

import asyncio
import time

import numpy as np

import mpiscale


class Echo(mpiscale.Actor):
    def echo(self, value):
        return value


async def main(system):
    rank, size, world, hierarchy = system.rank, system.size, system.world, system.hierarchy
    loop = asyncio.get_running_loop()
    echoes = await system.spawn_group(Echo, name="fair-turns-echo")
    ran = []
    for step in range(60):
        loop.call_soon(ran.append, step)
        if step % 3 == 0:
            await world.allreduce(np.ones(4))
        elif step % 3 == 1:
            await hierarchy.allreduce(np.ones(4))
        else:
            await echoes[(rank + 1) % size].ask("echo", step)
        assert ran[-1:] == [step], f"call {step} returned before a callback ready since it began ran: {ran[-3:]}"

    fired = asyncio.Event()
    loop.call_later(0.01, fired.set)
    calls = 0
    while calls < 2000:  # the same number of calls on every rank: until every rank saw its timer
        if rank == 0:
            time.sleep(1e-4)
        calls += 1
        if (await world.allreduce(np.array([fired.is_set()], dtype=np.int64)))[0] == size:
            break
    assert fired.is_set(), f"a timer due in 10 ms did not fire during {calls} allreduces (at least 0.2 s)"
    if rank == 0:
        print(f"fair turns ok: {size} ranks, the timer after {calls} allreduces")


mpiscale.run(main)
