"""jobs.MarkedRounds in one process (MPI singleton), on a real file: which rounds a mark reaches, and when."""

import time
from dataclasses import dataclass
from types import SimpleNamespace

import h5py
import numpy as np
from mpi4py import MPI

from mpiscale.io import RowWriter
from mpiscale.jobs import MarkedRounds


@dataclass
class _Rows(MarkedRounds):
    system: SimpleNamespace
    config: SimpleNamespace
    command = "rows"
    kept_work = "the rows written so far"


def _rows_done(path) -> int:
    with h5py.File(path, "r", locking=False) as file:
        return int(file.attrs["rows_done"])


def test_the_first_round_is_marked_then_one_each_interval_and_a_save_marks_the_rest(tmp_path):
    out = tmp_path / "rows.h5.tmp"  # (the writer's name until it closes)
    # --mark-every 3600 s: no round comes due by the clock of a loaded machine, until the test asks for one
    job = _Rows(SimpleNamespace(size=1, rank=0), SimpleNamespace(batch_size=4, mark_every=3600.0))
    assert job.round_rows == 4
    layout = {"x": ((40,), np.dtype(np.float64))}
    job.writer = RowWriter(tmp_path / "rows.h5", layout, MPI.COMM_SELF, attrs={"rows_done": 0})

    def round_written(done: int, due: bool) -> None:
        job._writer.write(done - 4, {"x": np.full(4, float(done))})
        job.rounds_written(due, rows_done=done)

    try:
        for done in (4, 8, 12):
            round_written(done, job.mark_due())
        assert _rows_done(out) == 4  # the first round; the next two came within the interval
        assert not job.mark_due()
        job.config.mark_every = 0.05
        time.sleep(0.05)
        round_written(16, job.mark_due())
        job.config.mark_every = 3600.0
        assert _rows_done(out) == 16 and not job.mark_due()  # due after the interval, and the clock started again
        round_written(20, False)
        job.save(5)  # a stop: every round written is marked
        assert _rows_done(out) == 20
        with h5py.File(out, "r", locking=False) as file:
            assert file["x"][:20].tolist() == np.repeat([4.0, 8, 12, 16, 20], 4).tolist()  # flushed, then marked
    finally:
        job.writer.close()
