"""One full failure report per distinct error on a host: the first process to report an error holds its name; one
that fails the same way learns that process's pid; another error, or a name whose holder has exited, is reported in
full. Real processes and real abstract Unix sockets."""

import os
import subprocess
import sys
import uuid

import pytest

from mpiscale.runtime.same_failure import first_reporter

REPORT = "main raised an exception\nTraceback ...\nKeyError: 'labels'\n"
HOLD = (
    "import sys\n"
    "from mpiscale.runtime.same_failure import first_reporter\n"
    "print(first_reporter(sys.argv[1]), flush=True)\n"
    "sys.stdin.readline()\n"
)


@pytest.fixture
def job(monkeypatch):
    """A job of its own (its PMIx namespace), so that no other test's or job's names meet these."""
    name = f"test-{uuid.uuid4().hex}"
    monkeypatch.setenv("PMIX_NAMESPACE", name)
    return name


def holding(report: str) -> subprocess.Popen:
    """A process of the job that reported ``report`` first and holds its name until its input closes."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, report], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=os.environ.copy())  # fmt: skip
    assert process.stdout.readline().strip() == "None"  # the first: it prints the full report
    return process


def test_the_same_failure_names_the_first_reporter_and_another_is_reported_in_full(job):
    first = holding(REPORT)
    try:
        assert first_reporter(REPORT) == first.pid
        assert first_reporter(REPORT.replace("labels", "inputs")) is None  # another error: a full report
    finally:
        first.communicate("")
    assert first_reporter(REPORT) is None  # its holder exited: nobody printed it now, so this one does


def test_another_job_on_the_host_reports_its_own(job, monkeypatch):
    first = holding(REPORT)
    try:
        monkeypatch.setenv("PMIX_NAMESPACE", f"{job}-other")
        assert first_reporter(REPORT) is None
    finally:
        first.communicate("")
