"""The examples in docs/ run as written."""

import sys

from conftest import REPO, assert_ok, finish, launch


def test_hello_actors(ranks):
    process = launch(ranks, [sys.executable, str(REPO / "examples" / "hello_actors.py")])
    job = finish(process, "examples/hello_actors.py", timeout=90)
    assert_ok(job)
    assert f"{ranks} ranks, total {2 * 100 * 45 * ranks}" in job.stdout
