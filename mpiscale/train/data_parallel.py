"""Data-parallel training of a ``torch.nn.Module`` over the runtime, as PyTorch's DDP does it.

Rank 0's parameters and buffers are broadcast at the start. During backward,
a hook on each parameter copies its accumulated gradient into a bucket;
buckets hold parameters in reverse registration order (the order backward
produces them), the first one small so communication starts early, the
others up to ``bucket_mib``. A full bucket starts a hierarchical allreduce at
once (in a worker thread, so it runs while backward goes on); buckets start
strictly in index order, the same on every rank. ``await synchronize()`` after
backward starts what is left (a parameter that got no gradient on a rank
counts as zero there, as DDP's ``find_unused_parameters`` does, so it cannot
hang the job), waits, and writes the averaged gradients back; a parameter no
rank gave a gradient keeps its gradient unset, as in DDP, so momentum and
weight decay leave it alone. Then, as DDP does before each forward, rank 0's
buffers (BatchNorm's running statistics) go to every rank, in one broadcast
(``broadcast_buffers=False`` keeps each rank's own). Inside ``no_sync()``
backward only accumulates, for micro-batches; a second backward outside it
before ``synchronize()`` is refused, as DDP refuses marking a gradient ready
twice (its first gradient is already being averaged), and so is one inside
``no_sync()`` after one outside it (its gradient would be lost: ``synchronize``
writes the first pass's average over it). ``compression``
(``compression.Exact`` by default, ``Narrow`` or ``PowerSGD``) decides what
travels. Parameters in any memory format (``channels_last`` too) work, on the
CPU or on a GPU (:mod:`.staging`: gradients staged through pinned host memory,
the copies overlapping backward). On one rank nothing is copied or sent: each
gradient is already the average, as DDP skips its reducer there. With ``tensor_sums`` (:mod:`.tensor_sums`:
MPI on device memory where it takes it, or ``--intra-node``'s torch.distributed
inside each node and MPI between nodes) the buckets are summed where they lie,
after backward.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch

from ..runtime import ActorSystem, Communicator, Group
from .compression import Compression, Exact
from .staging import DeviceGradients, HostGradients, gradients_for
from .tensor_sums import TensorSums

FIRST_BUCKET_MIB = 1.0  # DDP's defaults: a small first bucket, then 25 MB
BUCKET_MIB = 25.0


class _Bucket:
    """Parameters whose gradients travel in one buffer."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], gradients: HostGradients) -> None:
        self.index, self.params = index, params
        self.shapes = [tuple(p.shape) for p in params]
        sizes = [p.numel() for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self.buffer, self.staging = gradients.buffer(int(self.offsets[-1]))
        self.ready: set[int] = set()
        self.sent = False  # its device-to-host copy is under way (or done)
        self.used = np.zeros(len(params), np.int32)  # 1 where this rank had a gradient this step

    def view(self, index: int) -> np.ndarray:
        """Parameter ``index``'s part of the host buffer."""
        return self.buffer[self.offsets[index] : self.offsets[index + 1]]


async def broadcast_module(world: Communicator, module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers of ``module`` on every rank of ``world`` (collective over it)."""
    with torch.no_grad():
        for tensor in module.parameters():
            array = tensor.detach().cpu().numpy()  # on a GPU: a host copy, broadcast, and back
            if array.flags.c_contiguous and tensor.device.type == "cpu":
                await world.bcast_array(array, root=0)
                continue
            ordered = np.ascontiguousarray(array)  # channels_last and other strides: in logical order, and back
            await world.bcast_array(ordered, root=0)
            tensor.copy_(torch.from_numpy(ordered))
    await broadcast_buffers(world, module)


async def broadcast_buffers(world: Communicator, module: torch.nn.Module) -> None:
    """Rank 0's buffers of ``module`` on every rank of ``world``, their bytes packed into one broadcast."""
    buffers = list(module.buffers())
    if not buffers:
        return
    with torch.no_grad():
        arrays = [np.array(b.detach().cpu().numpy(), order="C") for b in buffers]  # (0-d ones stay 0-d)
        packed = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
        await world.bcast_array(packed, root=0)
        offset = 0
        for tensor, array in zip(buffers, arrays):
            size = array.nbytes
            values = packed[offset : offset + size].view(array.dtype).reshape(array.shape)
            tensor.copy_(torch.from_numpy(values))
            offset += size


class DataParallel:
    """Wraps ``module`` for data-parallel training on every rank of ``system``, or of a ``Group`` of ranks (a pipeline
    stage's replicas); construct it on each of them."""

    def __init__(
        self,
        system: ActorSystem | Group,
        module: torch.nn.Module,
        bucket_mib: float = BUCKET_MIB,
        first_bucket_mib: float = FIRST_BUCKET_MIB,
        compression: Compression | None = None,
        broadcast_buffers: bool = True,
        tensor_sums: TensorSums | None = None,
    ) -> None:
        self.system, self.module, self.broadcast_buffers = system, module, broadcast_buffers
        if tensor_sums is not None and compression is not None:
            raise ValueError("sums where the gradients lie carry float32 gradients: they take no compression")
        self.tensor_sums = tensor_sums
        self.compression: Compression = compression or Exact(system)
        params = [p for p in module.parameters() if p.requires_grad]
        wrong = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
        devices = sorted({str(p.device) for p in params})
        if wrong or len(devices) > 1:
            raise TypeError(f"DataParallel takes float32 parameters on one device, got {', '.join(wrong + devices)}")
        self._alone = system.size == 1  # one rank: each gradient is already the average, as DDP skips its work
        # (alone, the buckets only keep the books: host buffers never written, no device or pinned memory)
        device = params[0].device if params and not self._alone else torch.device("cpu")
        self.gradients = gradients_for(device, staged=tensor_sums is None)
        self._buckets = self._plan(params[::-1], first_bucket_mib, bucket_mib, self.gradients)
        self._where = {id(p): (b, i) for b, bucket in enumerate(self._buckets) for i, p in enumerate(bucket.params)}
        self._launched = 0
        self._launching = threading.Lock()
        self._syncing = True
        for param in params:
            param.register_post_accumulate_grad_hook(self._gradient_ready)

    @property
    def gradient_path(self) -> str:
        """How the gradients are averaged, in words (results files and telemetry record it)."""
        if self._alone:
            return "none (one rank)"
        if self.tensor_sums is not None:
            return self.tensor_sums.name
        if isinstance(self.gradients, DeviceGradients):
            return "staged through pinned host memory, MPI on the host"
        return "MPI on the host"

    async def broadcast_parameters(self) -> None:
        """Give every rank rank 0's parameters and buffers (collective; call once before training)."""
        await broadcast_module(self.system.world, self.module)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the first one after it communicates."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _gradient_ready(self, param: torch.nn.Parameter) -> None:
        index, position = self._where[id(param)]
        taken = position in self._buckets[index].ready  # its gradient is already on its way
        if not self._syncing and not taken:
            return  # no_sync(): it accumulates, and the next backward outside sends the sum
        if taken:  # a second backward (inside no_sync or not) before synchronize(): it would be lost, or halved
            names = {id(p): name for name, p in self.module.named_parameters()}
            inside = " inside no_sync()" if not self._syncing else ""
            raise RuntimeError(
                f"a second backward(){inside} reached parameter {names.get(id(param), '?')!r} before synchronize(): "
                "its gradient was already being averaged, so the step would leave this pass out or average a part "
                "of it. Call synchronize() after each backward() outside no_sync(), and run the passes to "
                "accumulate inside no_sync() before it"
            )
        self._take(self._buckets[index], position, param.grad)  # the hook runs after the gradient was accumulated
        self._launch_ready()

    def _take(self, bucket: _Bucket, position: int, grad: torch.Tensor | None) -> None:
        """A parameter's gradient (None: zeros) into its bucket; a bucket complete now goes to host memory."""
        bucket.used[position] = grad is not None
        bucket.ready.add(position)
        if self._alone:
            return
        self.gradients.take(bucket, position, grad)
        if len(bucket.ready) == len(bucket.params) and self.tensor_sums is None:
            bucket.sent = True
            self.gradients.send(bucket, self._launch_ready)

    def _launch_ready(self) -> None:
        """Start, in index order, every bucket whose gradients are all in host memory (without waiting). Called
        at each gradient, and when a bucket's copy to host memory arrives (from the adaptor's thread: a GPU's
        copies finish after autograd has queued the whole backward), so the lock keeps the order."""
        with self._launching:
            while self._launched < len(self._buckets):  # (alone, no bucket is ever sent)
                bucket = self._buckets[self._launched]
                if not bucket.sent or not self.gradients.arrived(bucket, wait=False):
                    return
                self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        self.compression.start(bucket)  # the allreduce runs during the rest of backward
        self._launched += 1

    async def synchronize(self) -> None:
        """After backward: average every gradient over the ranks, then rank 0's buffers to all (collective).

        A parameter no rank gave a gradient keeps its gradient unset; one frozen (``requires_grad=False``)
        after wrapping is refused on every rank, as DDP refuses it: wrap the model again.
        """
        for bucket in self._buckets[self._launched :]:
            for position, param in enumerate(bucket.params):
                if position not in bucket.ready:  # no gradient this step (or only inside no_sync): as it stands
                    self._take(bucket, position, param.grad)
        if not self._alone:
            await self._average_buckets()
        # per parameter: 2 frozen since wrapping, 1 given a gradient, 0 neither; the maximum over the ranks
        states = np.concatenate([np.where([not p.requires_grad for p in b.params], 2, b.used) for b in self._buckets])
        await self.system.world.allreduce(states, op="max", out=states)
        if (states == 2).any():
            names = {id(p): name for name, p in self.module.named_parameters()}
            frozen = [names.get(id(p), "?") for b in self._buckets for p in b.params if not p.requires_grad]
            refusal = RuntimeError(f"parameters {frozen or 'of another rank'} were frozen after DataParallel wrapped "
                                   "the model: wrap it again after changing requires_grad")  # fmt: skip
            refusal.reporter = self.system.world.world_ranks[0]  # type: ignore[attr-defined]  # every rank: one report
            raise refusal
        first = 0
        with torch.no_grad():
            for bucket in self._buckets:
                for position, param in enumerate(bucket.params):
                    if not states[first + position] or self._alone:  # no rank had a gradient: unset, as DDP
                        continue  # leaves it; or this rank's is the average
                    average = self.gradients.average(bucket, position, tuple(param.shape))
                    if param.grad is None:
                        param.grad = average.clone()
                    else:
                        param.grad.copy_(average)
                first += len(bucket.params)
                bucket.ready.clear()
                bucket.sent = False
        self._launched = 0
        if self.broadcast_buffers and not self._alone:
            await broadcast_buffers(self.system.world, self.module)

    async def _average_buckets(self) -> None:
        """Every bucket's average over the ranks, where ``average`` reads it (the buckets not started yet started)."""
        if self.tensor_sums is not None:
            await self._sum_in_place()
            return
        with self._launching:  # (a copy's arrival may start buckets meanwhile, from the adaptor's thread)
            for bucket in self._buckets[self._launched :]:
                self.gradients.arrived(bucket, wait=True)
                self._start(bucket)
        for bucket in self._buckets:
            await self.compression.finish(bucket)
            self.gradients.back(bucket)

    async def _sum_in_place(self) -> None:
        """``tensor_sums``: each bucket summed where its gradients lie, in bucket order, then averaged."""
        assert self.tensor_sums is not None
        for bucket in self._buckets:
            flat = self.gradients.flat(bucket)
            await self.tensor_sums.allreduce(flat)
            flat *= 1.0 / self.system.size

    @staticmethod
    def _plan(
        params: list[torch.nn.Parameter], first_mib: float, cap_mib: float, gradients: HostGradients
    ) -> list[_Bucket]:
        groups: list[list[torch.nn.Parameter]] = []
        current: list[torch.nn.Parameter] = []
        size, limit = 0, first_mib * 2**20
        for param in params:
            current.append(param)
            size += param.numel() * 4
            if size >= limit:
                groups.append(current)
                current, size, limit = [], 0, cap_mib * 2**20
        if current:
            groups.append(current)
        return [_Bucket(index, group, gradients) for index, group in enumerate(groups)]
