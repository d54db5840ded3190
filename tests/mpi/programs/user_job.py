"""A user's own job on the runtime: steps of an allreduce, each reported with ``mpiscale.report_step``.

``user_job.py STEPS [HANG_RANK HANG_STEP [await]]``: with a hang, that rank
blocks its event loop (a stuck native call) at that step, or later if it has run
for less than HANG_AFTER_RUNNING_S by then (so telemetry saw some of its steps
on a slow machine too), while the others wait in the allreduce; with ``await``
it awaits something that never comes instead (its event loop, and its reports,
go on). It prints the step it blocks at.
"""

import asyncio
import sys
import time

import numpy as np

import mpiscale

STEPS = int(sys.argv[1])
HANG = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else None
AWAITS = sys.argv[4:5] == ["await"]
HANG_AFTER_RUNNING_S = 2.0


async def main(system: mpiscale.ActorSystem) -> float:
    total, started = 0.0, time.monotonic()
    for step in range(1, STEPS + 1):
        if HANG and HANG[0] == system.rank and step >= HANG[1] and time.monotonic() - started > HANG_AFTER_RUNNING_S:
            print(f"rank {system.rank} blocks at step {step}", flush=True)
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
