"""Per-sample random values do not depend on which rank, or how many, generate them."""

from helpers import assert_ok, run_mpi


def test_values_independent_of_world_size(ranks):
    job = run_mpi("sample_random.py", ranks)
    assert_ok(job)
    assert f"sample random ok on {ranks} ranks" in job.stdout
