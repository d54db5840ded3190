"""Actor messaging across real MPI ranks."""

import pytest
from helpers import assert_ok, run_mpi


def test_order_payloads_spawn(ranks):
    job = run_mpi("messaging.py", ranks)
    assert_ok(job)
    assert f"messaging ok on {ranks} ranks" in job.stdout


def test_large_buffers_are_chunked(ranks):
    """Buffers above MPISCALE_CHUNK_BYTES travel as several MPI messages and reassemble."""
    job = run_mpi("messaging.py", ranks, "chunked", env={"MPISCALE_CHUNK_BYTES": "4096", "MPISCALE_INLINE_BYTES": "0"})
    assert_ok(job)
    assert "messaging ok" in job.stdout


def test_ranks_on_either_message_path_talk_to_each_other():
    """Odd ranks on the pure-Python reference, even ones compiled: every exchange of the program crosses paths."""
    job = run_mpi("messaging.py", 4, "mixed")
    assert_ok(job)
    paths = "compiled,pure-Python,compiled,pure-Python"
    assert f"messaging ok on 4 ranks (['mixed']), paths {paths}" in job.stdout, job.stdout


def test_frames_whose_bytes_follow_their_match():
    """Without the kernel's single copy, a frame near the 4 KiB eager limit is matched before its sender has pushed
    its bytes: the receiver keeps the buffer they come into for it while frames from other ranks arrive, and order
    and payloads hold."""
    job = run_mpi("messaging.py", 4, env={"OMPI_MCA_btl_vader_single_copy_mechanism": "none"})
    assert_ok(job)
    assert "messaging ok on 4 ranks" in job.stdout


def test_replies_go_into_the_buffer_the_asker_lends(ranks):
    """``ask(..., reply_into=buffer)``: large replies land in the buffer (counted in place), small and local ones are
    copied in, a reply after a timeout never lands there, and replies that do not fit are refused."""
    job = run_mpi("reply_into.py", ranks)
    assert_ok(job)
    assert f"reply_into ok on {ranks} ranks" in job.stdout


def test_replies_go_into_lent_buffers_on_the_pure_path_too():
    job = run_mpi("reply_into.py", 2, env={"MPISCALE_PURE_PYTHON": "1"})
    assert_ok(job)
    assert "reply_into ok on 2 ranks" in job.stdout


@pytest.mark.parametrize("path", ["compiled", "pure-Python"])
def test_no_handler_runs_inside_a_blocking_call_that_holds_the_event_loop(path):
    """Rank 0's main waits in ``ranks.agree`` (holding its loop) while rank 1 tells rank 0's actor, a handler that
    may run where its message lands. Past the collective check the call polls for the other ranks' answers in its
    own stack: every tell it found there ran inside the call (main's state changed under it). They now wait for the
    loop and run once main awaits again."""
    env = {"MPISCALE_COLLECTIVE_CHECK_S": "1"} | ({"MPISCALE_PURE_PYTHON": "1"} if path == "pure-Python" else {})
    job = run_mpi("held_inline.py", 2, env=env, timeout=60)
    assert_ok(job)
    assert "held inline ok: 20 tells ran after the call" in job.stdout, job.output[-3000:]
    assert "agree(the late ranks): rank 0 has waited 1 s" in job.stderr, job.stderr  # (its check asked the others)
