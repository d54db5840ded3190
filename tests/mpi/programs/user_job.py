"""A user's own job on the runtime: steps of an allreduce, each reported with ``mpiscale.report_step``.

``user_job.py STEPS [HANG_RANK HANG_STEP]``: with a hang, that rank blocks its
event loop (a stuck native call) at that step while the others wait in the
allreduce.
"""

import sys
import time

import numpy as np

import mpiscale

STEPS = int(sys.argv[1])
HANG = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else None


async def main(system: mpiscale.ActorSystem) -> float:
    total = 0.0
    for step in range(1, STEPS + 1):
        if HANG == (system.rank, step):
            time.sleep(120)
        total += float((await system.world.allreduce(np.array([float(step)])))[0])
        time.sleep(0.01)  # the step's own work
        mpiscale.report_step(step, STEPS, items=100)
    if system.rank == 0:
        print(f"user job done: {STEPS} steps, sum {total:.0f}", flush=True)
    return total


mpiscale.run(main, name=None if len(sys.argv) > 3 else "my-steps")
