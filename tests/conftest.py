"""Fixtures every test may use: the world sizes, the MQTT broker and the Slurm cluster (helpers: ``helpers.py``)."""

from __future__ import annotations

import compileall

import helpers  # noqa: F401  (first: it keeps the environment as the session began, before MPI starts in-process)
import pytest

pytest_plugins = ["mqtt_broker", "slurm_cluster"]  # the broker, subscriber and slurm fixtures


def pytest_configure(config: pytest.Config) -> None:
    """Compile the project's modules and the tests' to bytecode once, in the session's first process (not in each
    worker): the suite starts over a thousand processes that import them, and where ``PYTHONDONTWRITEBYTECODE`` is
    set (it is on the project's VMs) none writes its bytecode, so each compiled them all again: 0.3-0.4 s of CPU a
    rank. Python reads bytecode that is there whatever that variable says, and compiles a changed module afresh."""
    if not hasattr(config, "workerinput"):
        for folder in ("mpiscale", "tests"):
            compileall.compile_dir(helpers.REPO / folder, quiet=1)


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request) -> int:
    """Run the test at 2 and at 4 ranks (4 oversubscribes this 2-core machine)."""
    return request.param
