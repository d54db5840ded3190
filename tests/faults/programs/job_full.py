"""A job of a user's own under ``jobs.run_lifecycle`` that makes a file too large for its disk in PHASE, with no
handler of its own for the ``WriteError``: the lifecycle must end every rank with status 1 and one line naming the
full disk (as the project's jobs end), release the results lock, and keep an output already open for ``--resume``.

usage: job_full.py OUT.h5 PHASE      (PHASE: restore, step or finish)

The job's output, opened after the restore's file, grows by 32 rows of 8 KiB a rank each step; the file of PHASE,
``OUT.PHASE.h5``, holds 64 MiB, on a disk of a few: making it fails, on every rank.
"""

import sys
from collections.abc import AsyncGenerator

import numpy as np

from mpiscale.io import RowWriter, write_dataset
from mpiscale.jobs import Ended, OutputAsState, Plan, Step, claim_outputs, run_lifecycle
from mpiscale.runtime import ActorSystem, run

OUT, PHASE = sys.argv[1], sys.argv[2]
WIDTH, ROUND, HUGE = 1024, 32, 8192


class Rows(OutputAsState):
    command = "rows"
    kept_work = "the rows written so far"

    def __init__(self, system: ActorSystem) -> None:
        self.system = system
        self.results_lock = claim_outputs(OUT, None, [], system.world.comm, "rows-test/1")
        self.plan = Plan("round", "rows", total=3, progress_every=None)
        self.rows = 0

    def _file_of(self, phase: str) -> None:
        """``OUT.PHASE.h5`` where ``phase`` is PHASE: 64 MiB of every rank's rows (collective)."""
        if phase == PHASE:
            rows = np.ones((HUGE // self.system.size, WIDTH))
            write_dataset(f"{OUT}.{phase}.h5", {"x": rows}, self.system.world.comm)

    async def restore(self) -> int:
        self._file_of("restore")
        comm = self.system.world.comm
        self.writer = RowWriter(OUT, {"x": ((0, WIDTH), np.float64)}, comm, growing=("x",), resumable=True)
        return 0

    async def steps(self, start: int) -> AsyncGenerator[Step, None]:
        for _ in range(start, self.plan.total):
            first = self.rows + self.system.rank * ROUND
            self.rows += ROUND * self.system.size
            self._writer.grow({"x": self.rows})
            self._writer.write(first, {"x": np.ones((ROUND, WIDTH))})
            self._file_of("step")
            yield Step("", ROUND)

    async def finish(self, ended: Ended) -> dict:
        self._file_of("finish")
        self._writer.close()
        return {"rows": self.rows}


async def main(system: ActorSystem) -> None:
    await run_lifecycle(system, "rows", lambda: Rows(system))
    raise SystemExit(f"rank {system.rank}: {PHASE}'s 64 MiB written on a disk of a few")


run(main)
