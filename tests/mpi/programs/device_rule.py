"""The GPU rule on real ranks of one host, with made-up GPUs (the UUIDs each rank would see); ``--intra-node nccl``
refused up front where two ranks of a node would share a GPU; ``DirectSums``' MPI calls made in a thread whose GPU
is the rank's; whether MPI takes device buffers agreed by every rank, from each library's run-time answer and a
trial allreduce (both made up here).

Each case: what every rank sees, and what ``choose_torch_device`` must give each rank (a device, or a refusal
raised on every rank alike). ``auto`` runs every rank on the CPU where ``cuda`` refuses, with rank 0's one-line
note.
"""

import os
import threading

import numpy as np
import torch

import mpiscale
from mpiscale.jobs import agreed_cuda_aware, choose_torch_device, recorded_devices
from mpiscale.train.tensor_sums import DirectSums, NodeSums


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
    # NCCL on a GPU two ranks of the node share: one line on every rank, before any group is made
    try:
        NodeSums(system, "nccl", torch.device("cuda", 0), gpu="GPU-0")
    except ValueError as refused:
        assert f"ranks 0-{size - 1} of node 0 share GPU GPU-0: use --intra-node mpi" in str(refused), str(refused)
    else:
        raise AssertionError("--intra-node nccl with ranks sharing a GPU was not refused")
    # DirectSums makes the rank's GPU current in the thread that calls MPI, before its first sum
    selected = []
    sums = DirectSums(
        system, torch.device("cuda", 1), select=lambda d: selected.append((d, threading.current_thread()))
    )
    flat = torch.ones(8)
    await sums.allreduce(flat)
    sums.close()
    assert np.array_equal(flat.numpy(), np.full(8, float(size)))
    assert [(d, t.name.startswith("mpiscale-direct-sums")) for d, t in selected] == [(torch.device("cuda", 1), True)]

    # CUDA-aware MPI: every rank's library says yes and every rank's trial sums right, or no rank uses it
    def trial(result):
        def run(comm, device):
            tried.append(device)
            if isinstance(result, Exception):
                raise result
            return result

        return run

    tried = []
    assert agreed_cuda_aware(comm, "cuda:0", lambda: True, trial(True)) is True and tried == ["cuda:0"]
    assert agreed_cuda_aware(comm, "cuda:0", lambda: rank == 0, trial(True)) is False and len(tried) == 1
    assert agreed_cuda_aware(comm, "cuda:0", lambda: None, trial(True)) is False
    assert agreed_cuda_aware(comm, "cuda:0", lambda: True, trial(rank != size - 1)) is False
    assert agreed_cuda_aware(comm, "cuda:0", lambda: True, trial(RuntimeError("no") if rank else True)) is False
    assert agreed_cuda_aware(comm, "cpu", lambda: True, trial(True)) is False and len(tried) == 3
    if rank == 0:
        print(f"device rule ok: {size} ranks", flush=True)


mpiscale.run(main)
