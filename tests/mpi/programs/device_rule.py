"""The GPU rule on real ranks of one host, with made-up GPUs (the UUIDs each rank would see), and ``--intra-node
nccl`` refused up front where two ranks of a node would share a GPU.

Each case: what every rank sees, and what ``choose_torch_device`` must give each rank (a device, or a refusal
raised on every rank alike). ``auto`` runs every rank on the CPU where ``cuda`` refuses, with rank 0's one-line
note.
"""

import os

import mpiscale
from mpiscale.jobs import choose_torch_device, recorded_devices


def expect_refusal(setting, comm, seen, words):
    try:
        device = choose_torch_device(setting, comm, seen=seen)
    except ValueError as refused:
        assert words in str(refused) and "\n" not in str(refused), str(refused)
        return
    raise AssertionError(f"rank {comm.Get_rank()}: {setting} gave {device} instead of refusing")


async def main(system) -> None:
    comm, rank, size = system.world.comm, system.rank, system.size
    uuids = [f"GPU-{k}" for k in range(size)]
    os.environ.pop("MPISCALE_SHARE_GPUS", None)
    # Slurm --gpus-per-task=1: each rank sees its own GPU, at index 0
    assert choose_torch_device("cuda", comm, seen=[uuids[rank]]) == "cuda:0"
    assert recorded_devices("cuda:0", comm) == str([f"cuda:0 {u}" for u in uuids]).replace("'", '"')
    # plain mpirun on a node with a GPU per rank: rank k on GPU k
    assert choose_torch_device("cuda", comm, seen=uuids) == f"cuda:{rank}"
    assert choose_torch_device("auto", comm, seen=uuids) == f"cuda:{rank}"
    # more ranks than GPUs: cuda refused on every rank, auto on the CPU
    expect_refusal("cuda", comm, ["GPU-0"], f"ranks 0-{size - 1} of this host would share GPU GPU-0")
    assert choose_torch_device("auto", comm, seen=["GPU-0"]) == "cpu"
    # one rank without a GPU: cuda refused everywhere, auto on the CPU everywhere
    seen = [] if rank == size - 1 else [uuids[rank]]
    expect_refusal("cuda", comm, seen, f"torch sees no CUDA GPU for rank {size - 1}")
    assert choose_torch_device("auto", comm, seen=seen) == "cpu"
    os.environ["MPISCALE_SHARE_GPUS"] = "1"
    assert choose_torch_device("cuda", comm, seen=["GPU-0"]) == "cuda:0"
    os.environ.pop("MPISCALE_SHARE_GPUS")
    if rank == 0:
        print(f"device rule ok: {size} ranks", flush=True)


mpiscale.run(main)
