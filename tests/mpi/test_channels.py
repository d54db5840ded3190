"""Raw arrays between real MPI ranks over a channel: order, buffers posted ahead, damaged headers."""

import pytest
from helpers import assert_ok, run_mpi


def test_arrays_arrive_in_order_into_buffers_posted_ahead(ranks):
    job = run_mpi("channels.py", ranks)
    assert_ok(job)
    assert job.stdout.count("channel ok") == ranks, job.stdout


def test_arrays_in_many_chunks_arrive_whole():
    """Chunks of 64 bytes: no lane can be posted ahead, every array is received after its header, in pieces."""
    job = run_mpi("channels.py", 4, env={"MPISCALE_CHUNK_BYTES": "64"})
    assert_ok(job)
    assert "channel ok, 0 of 360 arrays in place" in job.stdout, job.stdout


@pytest.mark.parametrize(
    "kind, says",
    [
        ("noise", "is not one of its headers"),
        ("fit-without-capacity", "as fitting the lane's buffer, and it has no buffer (nothing came on it before)"),
        ("shape-disagrees", "gives shape (4,) of float64 for 24 bytes"),
        ("object-dtype", "names no dtype of plain numbers (code 10000)"),
        ("inline-without-its-bytes", "came in a message of 80 bytes, not 104"),
    ],
)
def test_a_header_that_is_not_one_ends_the_job_with_a_report(kind, says):
    job = run_mpi("channels.py", 2, "damaged", kind, timeout=60)
    assert job.returncode != 0
    assert "job failed on rank 1 of 2" in job.stderr, job.stderr
    assert "TransportError: channel 'test.damaged': " in job.stderr and says in job.stderr, job.stderr


def test_a_channel_only_some_ranks_open_ends_the_job_with_a_report():
    job = run_mpi("channels.py", 2, "only-rank-0", env={"MPISCALE_COLLECTIVE_CHECK_S": "2"}, timeout=60)
    assert job.returncode != 0
    assert "CollectiveAbandoned: a collective that not every rank will enter: barrier #2 on world" in job.stderr, (
        job.stderr
    )
    assert "rank 1 never will" in job.stderr, job.stderr
