"""A user's own job on the runtime: steps of an allreduce, each reported with ``mpiscale.report_step``.

``user_job.py STEPS [HANG_RANK HANG_STEP [await | busy:SECONDS | raise]]``: with a hang,
that rank blocks its event loop (a stuck native call) at that step, or later if
it has run for less than HANG_AFTER_RUNNING_S by then (so telemetry saw some of
its steps on a slow machine too), while the others wait in the allreduce; with
``await`` it awaits something that never comes instead (its event loop, and its
reports, go on); with ``busy:SECONDS`` it holds its loop that long, once (Numba
compiling, a long kernel), and goes on; with ``raise`` it raises an error there
instead. It prints the step it blocks at.
"""

import asyncio
import sys
import time

import numpy as np

import mpiscale

STEPS = int(sys.argv[1])
HANG = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else None
AWAITS = sys.argv[4:5] == ["await"]
RAISES = sys.argv[4:5] == ["raise"]
BUSY_S = float(sys.argv[4].split(":")[1]) if sys.argv[4:5] and sys.argv[4].startswith("busy:") else None
HANG_AFTER_RUNNING_S = 2.0


async def main(system: mpiscale.ActorSystem) -> float:
    total, started, busy = 0.0, time.monotonic(), BUSY_S
    for step in range(1, STEPS + 1):
        if busy is not None and HANG and HANG[0] == system.rank and step == HANG[1]:
            print(f"rank {system.rank} holds its loop for {busy:g} s at step {step}", flush=True)
            time.sleep(busy)
        elif (
            busy is None
            and HANG
            and HANG[0] == system.rank
            and step >= HANG[1]
            and time.monotonic() - started > HANG_AFTER_RUNNING_S
        ):
            print(f"rank {system.rank} blocks at step {step}", flush=True)
            if RAISES:
                raise RuntimeError(f"the user's step {step} failed")
            if AWAITS:
                await asyncio.Event().wait()
            time.sleep(120)
        total += float((await system.world.allreduce(np.array([float(step)])))[0])
        time.sleep(0.01)  # the step's own work
        mpiscale.report_step(step, STEPS, items=100)
    if system.rank == 0:
        print(f"user job done: {STEPS} steps, sum {total:.0f}", flush=True)
    return total


mpiscale.run(main, name=None if len(sys.argv) > 3 else "my-steps")
