"""One full failure report per distinct error on a host: the first process to report an error leaves a marker with
its pid; one that fails the same way, even after the first has gone (it aborts the job at once), learns that pid;
another error, another job, or a marker of a failure long past is reported in full. Real processes and files."""

import glob
import os
import subprocess
import sys
import time
import uuid

import pytest

from mpiscale import host_markers
from mpiscale.runtime import same_failure
from mpiscale.runtime.same_failure import first_reporter

REPORT = "main raised an exception\nTraceback ...\nKeyError: 'labels'\n"
FIRST = (
    "import os, sys\nfrom mpiscale.runtime.same_failure import first_reporter\n"
    "print(first_reporter(sys.argv[1]), os.getpid())\n"
)


@pytest.fixture
def job(monkeypatch):
    """A job of its own (its PMIx namespace), so that no other test's or job's markers meet these; its markers are
    removed after."""
    name = f"test-{uuid.uuid4().hex}"
    monkeypatch.setenv("PMIX_NAMESPACE", name)
    yield name
    for marker in glob.glob(os.path.join(host_markers.folder(), f"mpiscale-failure-{name}*")):
        os.unlink(marker)


def first_failure(report: str) -> int:
    """The pid of a process of the job that failed with ``report`` first (and has exited since)."""
    process = subprocess.run([sys.executable, "-c", FIRST, report], capture_output=True, text=True, timeout=60,
                             env=os.environ.copy(), check=True)  # fmt: skip
    reporter, pid = process.stdout.split()
    assert reporter == "None", process.stdout  # the first: it printed the full report
    return int(pid)


def test_the_same_failure_names_the_first_reporter_even_gone_and_another_is_reported_in_full(job):
    first = first_failure(REPORT)
    assert first != os.getpid()
    assert first_reporter(REPORT) == first
    assert first_reporter(REPORT.replace("labels", "inputs")) is None  # another error: a full report


def test_another_job_on_the_host_reports_its_own(job, monkeypatch):
    first_failure(REPORT)
    monkeypatch.setenv("PMIX_NAMESPACE", f"{job}-other")
    try:
        assert first_reporter(REPORT) is None
    finally:
        for marker in glob.glob(os.path.join(host_markers.folder(), f"mpiscale-failure-{job}-other*")):
            os.unlink(marker)


def test_a_marker_of_a_failure_long_past_is_removed(job):
    first_failure(REPORT)
    (marker,) = glob.glob(os.path.join(host_markers.folder(), f"mpiscale-failure-{job}-*"))
    past = time.time() - 2 * same_failure._KEPT_S
    os.utime(marker, (past, past))
    assert first_reporter(REPORT) is None  # the old marker went; this failure is the first again
    assert open(marker).read() == str(os.getpid())
