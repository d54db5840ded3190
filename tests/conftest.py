"""Fixtures every test may use: the world sizes, the MQTT broker and the Slurm cluster (helpers: ``helpers.py``)."""

from __future__ import annotations

import helpers  # noqa: F401  (first: it keeps the environment as the session began, before MPI starts in-process)
import pytest

pytest_plugins = ["mqtt_broker", "slurm_cluster"]  # the broker, subscriber and slurm fixtures


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request) -> int:
    """Run the test at 2 and at 4 ranks (4 oversubscribes this 2-core machine)."""
    return request.param


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With pytest-xdist's ``--dist loadgroup`` (make test): the tests of a file that share a fixture wider than one
    test (a trained model, a broker) stay on one worker, which builds it once, and so do the integration tests of a
    file (each starts daemons: a second Slurm on the same host would fight the first); the others go wherever a
    worker is free."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = info is not None and any(
            definition.scope != "function" and not definition.func.__module__.startswith(("_pytest", "pytest"))
            for definitions in info.name2fixturedefs.values()
            for definition in definitions
        )
        if shared or "integration" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group(name=item.path.stem))
