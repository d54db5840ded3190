"""Fixtures every test may use: the world sizes, the MQTT broker and the Slurm cluster (helpers: ``helpers.py``)."""

from __future__ import annotations

import helpers  # noqa: F401  (first: it keeps the environment as the session began, before MPI starts in-process)
import pytest

pytest_plugins = ["mqtt_broker", "slurm_cluster"]  # the broker, subscriber and slurm fixtures


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request) -> int:
    """Run the test at 2 and at 4 ranks (4 oversubscribes this 2-core machine)."""
    return request.param
