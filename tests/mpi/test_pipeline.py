"""Pipeline-parallel training on real MPI ranks, one stage per rank.

The checks of each world size run in one MPI world (``helpers.Worlds``); the failing stage has a job of its own.
"""

import pytest
from helpers import Worlds, run_mpi

world = Worlds({
    2: (2, {}, ["pipeline.py check float64", "pipeline.py check float32 2"]),
    3: (3, {}, ["pipeline.py check float64"]),
    4: (4, {}, ["pipeline.py check float32", "pipeline.py check float64 2"]),
})  # fmt: skip


@pytest.mark.parametrize("ranks, dtype", [(2, "float64"), (3, "float64"), (4, "float32")])
def test_stages_train_as_one_process_accumulating_the_same_micro_batches(ranks, dtype):
    """Both schedules; micro-batches cut from a tensor, of different sizes, fewer than the stages, integer ids
    between stages, the training job's transformer encoder (float64); float64 to 1e-12, float32 to 1e-6 after every
    step."""
    assert f"pipeline ok on {ranks} stages x 1 replicas ({dtype})" in world(ranks).stdout


@pytest.mark.parametrize("ranks, replicas, dtype", [(4, 2, "float64"), (2, 2, "float32")])
def test_stage_replicas_train_as_one_process_accumulating_every_replicas_micro_batches(ranks, replicas, dtype):
    """S x D ranks: each replica its own batch; replicas that start from other weights take replica 0's; the
    gradients averaged over a stage's replicas equal one process's sum over all micro-batches divided by D."""
    assert f"pipeline ok on {ranks // replicas} stages x {replicas} replicas ({dtype})" in world(ranks).stdout


def test_a_stage_that_fails_ends_the_job_with_one_report_naming_it():
    job = run_mpi("pipeline.py", 3, "fail", timeout=60)
    assert job.returncode != 0
    assert job.elapsed < 30, f"job took {job.elapsed:.1f}s to end"
    assert job.stderr.count("mpiscale: job failed on rank") == 1, job.stderr
    assert "job failed on rank 1 of 3" in job.stderr
    assert "ValueError: stage module failed on purpose\nin pipeline stage 1 of 3, F2 (step 1)" in job.stderr
