"""Damaged and foreign frames inside a real job, on both message paths: each is delivered, or ends the job with one
report that names the sender; never a crash, a hang, or a traceback of the receiver's."""

import pytest
from helpers import run_mpi

PATHS = {"compiled": "0", "pure": "1"}
NAMED = {
    "garbage": "not an mpiscale frame",
    "truncated-part": "parts came with 5000 bytes where 100 were declared",
    "parts-never-come": "declared 17179869184 bytes of parts, 17179869184 of which never came",
    "huge-part": "declares 1099511627776 bytes of parts, more than this host's memory",
    "bad-pickle": "UnpicklingError",
    "kind-2": "no envelope of this runtime: a tuple of 6 items (int, str, str, tuple, dict, int), of kind 2",
    "void-kind": "no envelope of this runtime: a tuple of 6 items (ndarray,",
    "failed-reply-not-failure": "no envelope of this runtime: a tuple of 4 items (int, int, str, bool), of kind 1",
}


def _hostile(scenario: str, ranks: int, path: str):
    env = {"MPISCALE_PURE_PYTHON": PATHS[path], "MPISCALE_SHUTDOWN_TIMEOUT_S": "2"}
    return run_mpi("hostile_frames.py", ranks, scenario, env=env, timeout=90)


def _one_report_naming_the_sender(job) -> None:
    assert job.returncode == 1, job.output[-3000:]  # an abort, not a signal (139 was a crash in Testsome)
    assert job.stderr.count("mpiscale: job failed on rank") == 1, job.stderr
    assert "Traceback" not in job.stderr and "Segmentation" not in job.stderr, job.stderr
    assert "killed by a signal" not in job.stderr and "a SIGTERM came" not in job.stderr, job.stderr


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scenario", NAMED)
def test_a_damaged_frame_ends_the_job_with_one_report_naming_its_sender(scenario, path):
    job = _hostile(scenario, 2, path)
    _one_report_naming_the_sender(job)
    assert "job failed on rank 0 of 2 (host " in job.stderr, job.stderr
    assert "it refused a message from rank 1 (host " in job.stderr, job.stderr
    assert NAMED[scenario] in job.stderr, job.stderr


@pytest.mark.parametrize("scenario", ["truncated-part", "parts-never-come"])
def test_on_four_ranks_the_sender_is_named_too(scenario):
    job = _hostile(scenario, 4, "compiled")
    _one_report_naming_the_sender(job)
    assert "it refused a message from rank 3 (host " in job.stderr, job.stderr


@pytest.mark.parametrize("path", PATHS)
def test_a_delivered_message_no_rank_sent_ends_the_job_with_one_report_not_a_hang(path):
    """A well-formed tell from outside the job's books: the counts of the job's end never meet. It ended in a hang."""
    job = _hostile("foreign-tell", 2, path)
    assert job.returncode == 1, job.output[-3000:]
    assert job.stderr.count("mpiscale: job failed on rank") == 1, job.stderr
    assert "1 delivered that no rank of the job sent as its messages" in job.stderr, job.stderr


@pytest.mark.parametrize("path", PATHS)
def test_forged_frames_that_name_an_ask_never_stay_in_the_buffer_lent_for_its_reply(path):
    """Rank 0 lends a buffer for its ask of rank 1, and rank 1 sends tells of its size whose frames say they answer
    rank 0's asks 0 to 9: each is moved to memory of its own and delivered to the actor it names, and the buffer
    then takes the real reply."""
    job = _hostile("forged-reply", 2, path)
    assert job.returncode == 0, job.output[-3000:]
    assert "forged-reply: the buffer holds the reply, the sink took 10" in job.stdout, job.output[-3000:]
    assert "forged-reply: all 10 frames delivered" in job.stdout, job.output[-3000:]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", range(1, 7))
def test_fuzzed_frames_are_delivered_or_end_the_job_with_one_report(seed, path):
    """Random damage to real frames of every kind (compact, batch, pickled inline, parts apart), 40 in a row, each
    followed by an ask that says whether it was taken."""
    job = _hostile(f"fuzz-{seed}", 2, path)
    if job.returncode == 0:
        assert "all 40 frames delivered" in job.stdout, job.output[-3000:]
        return
    _one_report_naming_the_sender(job)
    assert "rank 1" in job.stderr.split("mpiscale: job failed on rank", 1)[1], job.stderr
