"""Awaitable collectives on real MPI, with messages flowing at the same time."""

import pytest
from conftest import assert_ok, run_mpi


def test_collectives_while_messages_flow(ranks):
    job = run_mpi("collectives.py", ranks)
    assert_ok(job)
    assert f"collectives ok on {ranks} ranks" in job.stdout


@pytest.mark.parametrize("per_node", [1, 2, 3])
def test_forced_ranks_per_node_hierarchy(per_node):
    job = run_mpi("collectives.py", 4, env={"MPISCALE_RANKS_PER_NODE": str(per_node)})
    assert_ok(job)
    assert f"collectives ok on 4 ranks, {-(-4 // per_node)} nodes" in job.stdout
