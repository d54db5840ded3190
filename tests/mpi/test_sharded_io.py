"""Sharded HDF5 datasets and the batch reader under real MPI jobs."""

import time

import h5py
import numpy as np
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
