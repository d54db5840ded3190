"""Sharded HDF5 datasets and the batch reader under real MPI jobs."""

import re
import time

import h5py
import numpy as np
import pytest
from helpers import assert_ok, run_mpi


def test_sharded_datasets_and_reader(ranks, tmp_path):
    job = run_mpi("sharded_io.py", ranks, str(tmp_path))
    assert_ok(job)
    assert f"sharded io ok on {ranks} ranks" in job.stdout


def test_one_ranks_error_inside_a_collective_open_ends_the_job_with_its_report(tmp_path):
    """Rank 1 raises inside ``with ShardedDataset(path, name, comm)`` while rank 0 goes on to a collective read: the
    block's close, collective with MPI-IO, waited for rank 0 forever and the error was never said. The data set is
    left open after such an error now, and the job ends with rank 1's report."""
    with h5py.File(tmp_path / "rows.h5", "w") as file:
        file["X"] = np.arange(32.0).reshape(16, 2)
    started = time.monotonic()
    job = run_mpi("sharded_error.py", 2, str(tmp_path / "rows.h5"), timeout=120)
    assert job.returncode != 0 and time.monotonic() - started < 60, job.output[-3000:]
    assert "job failed on rank 1 of 2" in job.stderr and "planted on rank 1" in job.stderr, job.stderr[-3000:]


def test_a_data_set_only_rank_0_opens_with_the_worlds_comm_ends_the_job_with_a_report(tmp_path):
    """Only rank 0 opens it, passing ``system.world``; the others return from main. Rank 0 waited in the open's
    first collective for ever; it now waits in a barrier the runtime watches, and the job ends naming the line."""
    with h5py.File(tmp_path / "rows.h5", "w") as file:
        file["X"] = np.arange(32.0).reshape(16, 2)
    job = run_mpi("sharded_error.py", 2, str(tmp_path / "rows.h5"), "rank-0-alone", timeout=60,
                  env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})  # fmt: skip
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    said = "CollectiveAbandoned: a collective that not every rank will enter: ShardedDataset #1 on world (blocking "
    assert said in job.stderr and "called at sharded_error.py:" in job.stderr, job.stderr[-3000:]
    assert f"ShardedDataset({tmp_path / 'rows.h5'}): rank 0 has waited 1 s for the other ranks" in job.stderr


@pytest.mark.parametrize(
    "call, doing, entered",
    [
        ("RowWriter", "make it", "RowWriter #1 on world"),
        ("RowWriter.reopen", "reopen it", "RowWriter.reopen #2 on world"),  # (every rank made the first)
        ("write_dataset", "write it", "write_dataset #1 on world"),
        ("Checkpointer", "open it", "Checkpointer #1 on world"),
        ("Checkpointer.save", "save it", "Checkpointer.save #1 on checkpoints/"),
        ("Checkpointer.load", "load it", "Checkpointer.load #2 on checkpoints/"),
    ],
)
def test_a_collective_file_call_only_rank_0_makes_ends_the_job_with_a_report(tmp_path, call, doing, entered):
    """Only rank 0 makes the call, given the world's communicator; rank 1 returns from main. Rank 0 waited in the
    call's first collective for ever; it now waits in a barrier the runtime watches, and the job ends naming it
    (a checkpointer's on its own communicator, named for its directory)."""
    job = run_mpi("only_rank_0.py", 2, str(tmp_path), call, timeout=60, env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    said = f"not every rank will enter: {entered} (blocking calls) (rank 0 waits in it; "
    assert said + "rank 1 never will)" in job.stderr, job.stderr[-3000:]
    assert "called at only_rank_0.py:" in job.stderr, job.stderr[-3000:]
    assert re.search(rf"{re.escape(call)}\(.*\): rank 0 has waited 1 s for the other ranks of its communicator to "
                     rf"{doing} too: each rank of the comm given must", job.stderr), job.stderr  # fmt: skip
