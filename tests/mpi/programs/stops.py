"""Stop requests (SIGTERM) to a job that steers, where they are hard to obey in time.

``stops.py startup FOLDER``: each rank writes ``rankN.started`` once ``import mpiscale`` has run, then takes
STARTUP_S more before the runtime runs (a slow import: torch's takes seconds); a stop that comes meanwhile must end
the job before its first step, saying so, with status 143.

``stops.py long-steps FOLDER``: steps of STEP_S that compute without awaiting (as compress-adapters' layer groups
do); rank 0 prints ``step N`` after each. A stop must be obeyed at the end of the step it came in.
"""

import sys
import time
from pathlib import Path

import mpiscale  # first: from here on a stop signal is held until the runtime takes it
from mpiscale.jobs import steer, stopped_at_start

STARTUP_S, STEP_S = 3.0, 0.6
mode, folder = sys.argv[1], Path(sys.argv[2])
rank = next(int(v) for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK") if (v := __import__("os").environ.get(k)))
if mode == "startup":
    (folder / f"rank{rank}.started").write_text("")
    time.sleep(STARTUP_S)


async def main(system: mpiscale.ActorSystem) -> None:
    system.steering.begin()
    try:
        if await stopped_at_start(system):
            return
        for step in range(1, 200):
            time.sleep(STEP_S)  # the step's work, without awaiting
            if await steer(system, f"step {step}", None):
                return
            if system.rank == 0:
                print(f"step {step}", flush=True)
    finally:
        system.steering.end()


mpiscale.run(main)
