"""Jobs that must end with a non-zero status and one report, never hang."""

import asyncio
import os
import re
import signal
import sys

import mpiscale
from mpiscale import ActorRef, RestartPolicy


class Fragile(mpiscale.Actor):
    restart_policy = RestartPolicy(max_restarts=1, window_s=60)

    def crash(self):
        raise ValueError("crash in a tell")


class Waiter(mpiscale.Actor):
    def wait(self):
        return "never"


async def main(system):
    scenario = sys.argv[1]
    await system.spawn_group(Fragile, name="fragile")
    await system.spawn_group(Waiter, name="waiter")
    if scenario == "main-raises":
        if system.rank == 1:
            await asyncio.sleep(0.2)
            raise KeyError("rank 1 lost its data")
        await ActorRef(1, "waiter").ask("wait")  # ranks blocked on the failing rank
        await asyncio.sleep(3600)
    elif scenario == "every-rank-raises":  # one bug that every rank meets
        await system.world.barrier()
        {"inputs": 1}["labels"]
    elif scenario == "raises-in-collective-write":
        # rank 1 fails alone between two collective writes while the others enter the second one
        import numpy as np

        from mpiscale.io import RowWriter

        layout = {"x": ((4 * system.size,), np.dtype(np.float64))}
        with RowWriter(sys.argv[2], layout, system.world.comm) as writer:
            for round_ in range(2):
                if round_ == 1 and system.rank == 1:
                    raise ZeroDivisionError("rank 1 failed between two collective writes")
                writer.write(4 * system.rank + 2 * round_, {"x": np.ones(2)})
    elif scenario == "restart-limit":
        if system.rank == 0:
            for _ in range(3):
                ActorRef(1, "fragile").tell("crash")
        await asyncio.sleep(3600)
    elif scenario == "unknown-actor":
        if system.rank == 0:
            ActorRef(1, "nobody").tell("hello")
        await asyncio.sleep(3600)
    elif scenario == "no-policy":
        if system.rank == 0:
            ActorRef(system.size - 1, "waiter").tell("wait", "unexpected argument")
        await asyncio.sleep(3600)
    elif scenario == "segfault":  # a crash in native code, as an extension's bug would cause
        if system.rank == 1:
            import ctypes

            await asyncio.sleep(0.2)
            ctypes.string_at(0)
        await asyncio.sleep(3600)
    elif scenario == "killed-beside-a-held-rank":
        # rank 1 is killed while rank 0's Python is held in native code that keeps the GIL (as h5py does through a
        # parallel write's collective): rank 0 can say nothing before the launcher kills it too
        if system.rank == 1:
            await asyncio.sleep(0.5)
            print("rank 1 kills itself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        re.match(r"(a+)+$", "a" * 64 + "b")  # backtracks for ages, the GIL held, signals left pending
    elif scenario == "killed-in-small-allreduces":
        # rank 1 dies between two of the small calls whose check and swap the compiled path posts and tests in place
        import numpy as np

        values = np.ones(1024, np.float32)
        for call in range(100_000):
            if system.rank == 1 and call == 2000:
                print("rank 1 kills itself", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            await (system.world if call % 2 else system.hierarchy).allreduce(values, out=np.empty_like(values))
    else:
        raise SystemExit(f"unknown scenario {scenario}")


def plain_main(system):  # a plain def where run wants an async one: it runs, and returns no awaitable
    return system.rank


if sys.argv[1] == "plain-def-main":
    mpiscale.run(plain_main)
elif sys.argv[1] == "plain-def-main-bare":
    mpiscale.runtime.run(plain_main)
else:
    mpiscale.run(main)
