"""Remote failures reach the asker; unhandled failures end the whole job quickly."""

import pytest
from helpers import assert_ok, run_mpi


def test_remote_errors_deadlines_supervision(ranks):
    job = run_mpi("errors.py", ranks)
    assert_ok(job)
    assert f"errors ok on {ranks} ranks" in job.stdout


@pytest.mark.parametrize(
    "scenario, failing_rank, context, error",
    [
        ("main-raises", 1, "main raised an exception", "KeyError: 'rank 1 lost its data'"),
        ("restart-limit", 1, "restart limit reached (1 in 60s)", "ValueError: crash in a tell"),
        (
            "unknown-actor",
            1,
            "a tell was addressed to an actor that does not exist",
            "ActorNotFound: no actor 'nobody'",
        ),
        ("no-policy", -1, "it has no restart policy, so the failure escalates", "TypeError"),
        (
            "raises-in-collective-write",
            1,
            "main raised an exception",
            "ZeroDivisionError: rank 1 failed between two collective writes",
        ),
    ],
)
def test_unhandled_failure_ends_the_job(ranks, scenario, failing_rank, context, error, tmp_path):
    job = run_mpi("failures.py", ranks, scenario, str(tmp_path / "rows.h5"), timeout=60)
    failing_rank = failing_rank % ranks
    assert job.returncode != 0
    assert job.elapsed < 30, f"job took {job.elapsed:.1f}s to end"
    assert job.stderr.count("mpiscale: job failed on rank") == 1, job.stderr
    assert f"job failed on rank {failing_rank} of {ranks}" in job.stderr, job.stderr
    assert context in job.stderr, job.stderr
    assert error in job.stderr, job.stderr
