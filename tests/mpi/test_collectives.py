"""Awaitable collectives on real MPI, with messages flowing at the same time."""

import pytest
from helpers import assert_ok, run_mpi


def test_collectives_while_messages_flow(ranks):
    job = run_mpi("collectives.py", ranks)
    assert_ok(job)
    assert f"collectives ok on {ranks} ranks" in job.stdout


@pytest.mark.parametrize("per_node", [1, 2, 3])
def test_forced_ranks_per_node_hierarchy(per_node):
    job = run_mpi("collectives.py", 4, env={"MPISCALE_RANKS_PER_NODE": str(per_node)})
    assert_ok(job)
    assert f"collectives ok on 4 ranks, {-(-4 // per_node)} nodes" in job.stdout


@pytest.mark.parametrize(("ranks", "per_node"), [(1, 0), (2, 0), (2, 1), (3, 2), (4, 0), (4, 2), (4, 3)])
def test_hierarchical_allreduce_matches_numpy_on_any_layout(ranks, per_node):
    """Flat, one rank per node, and uneven nodes (3 ranks in nodes of 2; 4 in nodes of 3 and 1)."""
    job = run_mpi("hierarchical.py", ranks, env={"MPISCALE_RANKS_PER_NODE": str(per_node)}, timeout=180)
    assert_ok(job)
    assert f"hierarchical allreduce ok: {ranks} ranks" in job.stdout


@pytest.mark.parametrize(("ranks", "per_node"), [(2, 0), (4, 2)])
def test_sixteen_bit_sums_on_the_wire(ranks, per_node):
    job = run_mpi("narrow_sums.py", ranks, env={"MPISCALE_RANKS_PER_NODE": str(per_node)}, timeout=120)
    assert_ok(job)
    assert f"narrow sums ok: {ranks} ranks" in job.stdout


@pytest.mark.parametrize(("ranks", "per_node"), [(2, 0), (4, 2)])
def test_torch_tensors_of_four_dtypes(ranks, per_node):
    job = run_mpi("tensor_allreduce.py", ranks, env={"MPISCALE_RANKS_PER_NODE": str(per_node)}, timeout=120)
    assert_ok(job)
    assert f"tensor allreduce ok: {ranks} ranks" in job.stdout


COMPRESSIONS = ["fp16", "bf16", "powersgd-full", "powersgd-low", "user"]


@pytest.mark.parametrize("ranks", [3])  # one world size: 2 ranks checked nothing that 3 do not
def test_data_parallel_behaves_as_ddp_where_users_rely_on_it(ranks):
    """Unused and frozen parameters, channels_last, BatchNorm statistics (programs/data_parallel_like_ddp.py)."""
    job = run_mpi("data_parallel_like_ddp.py", ranks, timeout=180)
    assert_ok(job)
    assert f"data parallel like DDP ok: {ranks} ranks" in job.stdout, job.output[-3000:]


@pytest.mark.parametrize(("ranks", "per_node"), [(1, 0), (2, 0), (3, 0), (4, 2)])
def test_data_parallel_training_equals_one_process_on_the_whole_batch(ranks, per_node):
    """Exact sums on every layout; on a flat and a two-level one, the compressed schemes too (each within its own
    bound, the same on every rank)."""
    schemes = ["none", *COMPRESSIONS] if (ranks, per_node) in [(2, 0), (4, 2)] else ["none"]
    env = {"MPISCALE_RANKS_PER_NODE": str(per_node)}
    job = run_mpi("data_parallel.py", ranks, "6", ",".join(schemes), env=env, timeout=180)
    assert_ok(job)
    for scheme in schemes:
        assert f"data parallel ok: {ranks} ranks" in job.stdout and f", {scheme}, " in job.stdout, job.stdout
