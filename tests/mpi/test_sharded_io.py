"""Sharded HDF5 datasets and the batch reader under real MPI jobs."""

from helpers import assert_ok, run_mpi


def test_sharded_datasets_and_reader(ranks, tmp_path):
    job = run_mpi("sharded_io.py", ranks, str(tmp_path))
    assert_ok(job)
    assert f"sharded io ok on {ranks} ranks" in job.stdout
