"""Gradient buckets summed where they lie (GPU memory on GPUs), instead of through the host buffers of the runtime.

``DirectSums``: the buckets go to MPI as they are, device memory included,
where the MPI library takes device buffers (a CUDA-aware Open MPI): no host
copy on the gradient path. A reduce then a broadcast, so every rank ends with
the same bits. On the CPU the same class sums host tensors (the tests' path).

``NodeSums`` (``--intra-node nccl|gloo``): inside a node by torch.distributed, between nodes by MPI.

The hierarchical design Horovod uses on GPU clusters: inside a node, NCCL sums
the ranks' buffers where they lie (GPU memory, over NVLink or PCIe); only the
node's first rank takes the node's sum to host memory, where MPI sums it with
the other nodes' first ranks (a reduce then a broadcast, so every rank ends
with the same bits); the node's first rank then broadcasts the total inside
the node, again by NCCL. gloo takes NCCL's place for buffers in host memory:
the same path on CPUs, which the tests run.

The node's torch.distributed group is made from the runtime's node
communicator (its first rank picks a free port on its host and tells the
others over MPI: ``ranks.rendezvous``), so the nodes are the runtime's nodes, simulated ones
included (``MPISCALE_RANKS_PER_NODE``). It is the process's default group: a
job that made one already is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Protocol

import torch

from ..jobs import device_uuid
from ..ranks import agree, rendezvous
from ..runtime import ActorSystem
from ..words import ranks_named


class TensorSums(Protocol):
    """What sums a bucket's tensor over every rank for ``DataParallel(tensor_sums=...)``."""

    #: How it sums, for the record (``DataParallel.gradient_path``).
    name: str

    async def allreduce(self, flat: torch.Tensor) -> None:
        """``flat`` summed over every rank, in place (collective; called in the same order everywhere)."""
        ...

    def close(self) -> None:
        """Give back what it holds (communicators, groups)."""
        ...


BACKENDS = ("nccl", "gloo")
#: How long a rank waits in the node group's set-up and calls before torch gives up on a missing rank.
TIMEOUT = timedelta(minutes=10)


class NodeSums:
    """Sums a tensor over every rank: torch.distributed (``backend``) inside the node, MPI between nodes.

    NCCL takes one rank per GPU: two ranks of a node on one GPU (``MPISCALE_SHARE_GPUS=1``) are refused here, on
    every rank and in one line, not by NCCL's "Duplicate GPU detected" inside the first step. ``gpu`` is the UUID of
    this rank's GPU (by default the one the device rule chose for ``device``).
    """

    def __init__(
        self, system: ActorSystem, backend: str, device: torch.device | None = None, gpu: str | None = None
    ) -> None:
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"intra-node sums take one of {', '.join(BACKENDS)}, got {backend!r}")
        if dist.is_initialized():
            raise ValueError("--intra-node makes the process's torch.distributed group, and one exists already")
        node = system.node.comm
        problem = None
        if backend == "nccl":
            gpus = node.allgather(gpu or (device_uuid(str(device)) if device is not None else None))
            shared = sorted({uuid for uuid in gpus if uuid and gpus.count(uuid) > 1})
            if shared:
                ranks = [rank for rank, uuid in enumerate(gpus) if uuid == shared[0]]
                problem = (f"--intra-node nccl takes one rank per GPU, and {ranks_named(ranks)} of node "
                           f"{system.hierarchy.node_index} share GPU {shared[0]}: use --intra-node mpi, or one rank "
                           "per GPU")  # fmt: skip
        agree(system.world.comm, problem, "making the node's group", ValueError)
        address, port = rendezvous(node)
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=node.Get_rank(),
                                world_size=node.Get_size(), timeout=TIMEOUT,
                                device_id=device if backend == "nccl" else None)  # fmt: skip
        self.dist, self.backend, self.system = dist, backend, system
        self.name = f"{backend} in each node, MPI between nodes"

    async def allreduce(self, flat: torch.Tensor) -> None:
        """``flat`` summed over every rank of the job, in place (collective; call in the same order everywhere)."""
        dist, leaders = self.dist, self.system.leaders
        await asyncio.to_thread(dist.reduce, flat, 0)  # the node's sum on its first rank
        if leaders is not None and leaders.size > 1:
            host = flat.cpu()  # the same memory on the CPU; on a GPU a copy, once the node's sum is done
            array = host.numpy()
            await leaders.reduce(array, root=0, out=array)
            await leaders.bcast_array(array, root=0)
            if host is not flat:
                flat.copy_(host)
        await asyncio.to_thread(dist.broadcast, flat, 0)

    def close(self) -> None:
        """Leave the node's group."""
        self.dist.destroy_process_group()


def _use_device(device: torch.device, select: Callable[[torch.device], None]) -> None:
    """A worker thread's first act: ``device`` made its current GPU (a new thread's is GPU 0)."""
    if device.type == "cuda":
        select(device)


class DirectSums:
    """Sums a tensor over every rank by MPI, on the tensor's own memory (device memory with a CUDA-aware MPI).

    The MPI calls run in a worker thread of its own, whose current GPU is made ``device``: a new thread's is GPU 0,
    and on GPU k != 0 mpi4py's DLPack export refuses the tensor ("Can't export tensors on a different CUDA device
    index") or MPI works in the wrong context. ``select`` is what makes it current (``torch.cuda.set_device``).
    """

    def __init__(
        self,
        system: ActorSystem,
        device: torch.device | None = None,
        select: Callable[[torch.device], None] = torch.cuda.set_device,
    ) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, system.world.comm.Dup()  # a communicator of its own, used from the worker
        self.name = "MPI on the gradients' own memory"
        where = device if device is not None else torch.device("cpu")
        self._worker = ThreadPoolExecutor(1, "mpiscale-direct-sums", _use_device, (where, select))

    async def allreduce(self, flat: torch.Tensor) -> None:
        """``flat`` summed over every rank, in place (collective; call in the same order everywhere)."""
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()  # backward's writes done before MPI reads
        await asyncio.wrap_future(self._worker.submit(self._reduce_and_broadcast, flat))

    def _reduce_and_broadcast(self, flat: torch.Tensor) -> None:
        MPI, comm = self.MPI, self.comm
        if comm.Get_rank() == 0:
            comm.Reduce(MPI.IN_PLACE, flat, MPI.SUM, root=0)
        else:
            comm.Reduce(flat, None, MPI.SUM, root=0)
        comm.Bcast(flat, root=0)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self.comm.Free()
