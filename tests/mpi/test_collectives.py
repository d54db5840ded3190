"""Awaitable collectives on real MPI, with messages flowing at the same time.

These are library-level checks: each layout (ranks, ranks per node) runs every program it needs in one MPI world
(``programs/world.py``), launched once for the module, and each test reads its program's line from that world's
output. A failing program ends its world with its report, which every test of the layout then shows.
"""

import pytest
from helpers import Worlds, assert_ok, run_mpi

COMPRESSIONS = [
    "fp16",
    "bf16",
    "powersgd-full",
    "powersgd-low",
    "user",
    "late-copies",
    "copies-after-backward",
    "device-thread",
    "direct",
    "node-gloo",
]
ALL_SCHEMES = ",".join(["none", *COMPRESSIONS])
#: (ranks, ranks per node; 0: the host's) -> the programs that run in that world, in order
LAYOUTS = {
    (1, 0): ["hierarchical.py", "data_parallel.py 6 none", "fair_turns.py"],
    (2, 0): ["collectives.py", "fair_turns.py", "hierarchical.py", "narrow_sums.py", "tensor_allreduce.py",
             "device_rule.py", f"data_parallel.py 6 {ALL_SCHEMES}", "gpu_overlap.py cpu 20", "pair_allreduce.py",
             "concurrent_collectives.py"],
    (2, 1): ["hierarchical.py", "pair_allreduce.py"],
    (3, 0): ["data_parallel.py 6 none", "data_parallel_like_ddp.py"],
    (3, 2): ["hierarchical.py"],
    (4, 0): ["collectives.py", "hierarchical.py", "device_rule.py", "concurrent_collectives.py"],
    (4, 1): ["collectives.py"],
    (4, 2): ["collectives.py", "fair_turns.py", "hierarchical.py", "narrow_sums.py", "tensor_allreduce.py",
             f"data_parallel.py 6 {ALL_SCHEMES}"],
    (4, 3): ["collectives.py", "hierarchical.py"],
}  # fmt: skip


#: Hierarchical allreduces from 4 KiB run the stages, smaller ones MPI's own Allreduce, in pieces of 64 KiB (in
#: place where the result goes back into the buffer): the programs meet all of them.
STAGES_FROM = {"MPISCALE_HIERARCHICAL_MIN_BYTES": "4096", "MPISCALE_ALLREDUCE_PIECE_BYTES": "65536"}
world = Worlds(
    {
        layout: (layout[0], {"MPISCALE_RANKS_PER_NODE": str(layout[1])} | STAGES_FROM, programs)
        for layout, programs in LAYOUTS.items()
    }
)


def _out(ranks: int, per_node: int) -> str:
    return world((ranks, per_node)).stdout


def test_collectives_while_messages_flow(ranks):
    assert f"collectives ok on {ranks} ranks" in _out(ranks, 0)


@pytest.mark.parametrize(("ranks", "per_node"), [(1, 0), (2, 0), (4, 2)])
def test_calls_that_end_at_once_still_give_the_event_loop_its_turns(ranks, per_node):
    """A loop of collectives that all end in the caller's stack kept telemetry's timer and the user's other tasks
    from running (a straggler went unreported: its reports never left)."""
    assert f"fair turns ok: {ranks} ranks" in _out(ranks, per_node)


@pytest.mark.parametrize("per_node", [1, 2, 3])
def test_forced_ranks_per_node_hierarchy(per_node):
    assert f"collectives ok on 4 ranks, {-(-4 // per_node)} nodes" in _out(4, per_node)


@pytest.mark.parametrize(("ranks", "per_node"), [(1, 0), (2, 0), (2, 1), (3, 2), (4, 0), (4, 2), (4, 3)])
def test_hierarchical_allreduce_matches_numpy_on_any_layout(ranks, per_node):
    """Flat, one rank per node, and uneven nodes (3 ranks in nodes of 2; 4 in nodes of 3 and 1)."""
    assert f"hierarchical allreduce ok: {ranks} ranks" in _out(ranks, per_node)


@pytest.mark.parametrize("ranks", [2, 4])
def test_collectives_started_together_each_get_their_own_result_with_a_rank_late(ranks):
    """Four calls of one communicator in one ``asyncio.gather``, the last rank 5 ms late each round: MPI matched one
    call's data with another's before a communicator's calls ran one at a time (programs/concurrent_collectives.py)."""
    assert f"concurrent collectives ok: {ranks} ranks, 10 rounds" in _out(ranks, 0)


@pytest.mark.parametrize("per_node", [0, 1])
def test_two_ranks_reduce_by_exchange_exactly_and_alike(per_node):
    """Sums, products, minima and maxima of six dtypes, whole buffers and halves, on one node and on two: numpy's
    reduction of the pair in rank order, bit for bit on both ranks (programs/pair_allreduce.py)."""
    assert "pair allreduce ok: 78 cases on two paths (compiled,compiled)" in _out(2, per_node)


@pytest.mark.parametrize("checked", ["1", "0"])
def test_two_ranks_reduce_by_exchange_alike_on_either_message_path(checked):
    """Rank 0 compiled, rank 1 on the pure-Python reference: the check and the swap of a small call are the same
    messages on both (``pair_reduce.PairExchange`` and its compiled twin), and the swap alone without checks."""
    job = run_mpi("pair_allreduce.py", 2, "mixed", env={"MPISCALE_CHECK_COLLECTIVES": checked})
    assert_ok(job)
    assert "pair allreduce ok: 78 cases on two paths (compiled,pure-Python)" in job.stdout, job.stdout


@pytest.mark.parametrize(("ranks", "per_node"), [(2, 0), (4, 2)])
def test_sixteen_bit_sums_on_the_wire(ranks, per_node):
    assert f"narrow sums ok: {ranks} ranks" in _out(ranks, per_node)


@pytest.mark.parametrize(("ranks", "per_node"), [(2, 0), (4, 2)])
def test_torch_tensors_of_four_dtypes(ranks, per_node):
    assert f"tensor allreduce ok: {ranks} ranks" in _out(ranks, per_node)


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_gpu_rule_places_ranks_by_the_gpus_they_see(ranks):
    """Made-up GPUs: one seen by each rank (Slurm's --gpus-per-task=1), all seen by all, too few, a rank without
    one, shared on purpose (programs/device_rule.py)."""
    assert f"device rule ok: {ranks} ranks" in _out(ranks, 0)


def test_data_parallel_buckets_start_during_backward_and_average_exactly():
    """The GPU check's program on the CPU (programs/gpu_overlap.py): 4 buckets, each started during backward, and
    20 steps' averages the host's float32 average of the ranks' gradients, bit for bit."""
    assert "gpu overlap ok: 2 ranks on cpu, 4 buckets, 20 steps" in _out(2, 0)


def test_data_parallel_behaves_as_ddp_where_users_rely_on_it():
    """Unused and frozen parameters, channels_last, BatchNorm statistics (programs/data_parallel_like_ddp.py)."""
    job = world((3, 0))
    assert "data parallel like DDP ok: 3 ranks" in job.stdout, job.output[-3000:]


@pytest.mark.parametrize(("ranks", "per_node"), [(1, 0), (2, 0), (3, 0), (4, 2)])
def test_data_parallel_training_equals_one_process_on_the_whole_batch(ranks, per_node):
    """Exact sums on every layout; on a flat and a two-level one, the compressed schemes too (each within its own
    bound, the same on every rank)."""
    job = world((ranks, per_node))
    schemes = ALL_SCHEMES.split(",") if (ranks, per_node) in [(2, 0), (4, 2)] else ["none"]
    for scheme in schemes:
        assert f"data parallel ok: {ranks} ranks" in job.stdout and f", {scheme}, " in job.stdout, job.stdout
