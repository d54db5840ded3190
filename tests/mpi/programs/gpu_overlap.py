"""DataParallel as a GPU job uses it: buckets start while backward still runs, and the averages are exact.

usage: gpu_overlap.py DEVICE STEPS  (DEVICE: cuda, or cpu for the same checks without a GPU)

A 4-layer MLP in at least 3 buckets. On a GPU each layer's backward is
lengthened on the device (``torch.cuda._sleep``) and each step's backward is
only queued when ``backward()`` returns: the first bucket's allreduce must
start before the GPU has finished backward (its copy to host memory lands
while later layers still run, and the staging adaptor's thread starts it), so
communication overlaps the device's compute. For STEPS back-to-back steps
every averaged gradient must be, bit for bit, the float32 average of the
ranks' own gradients computed on the host. Prints the gradient path it took.
"""

import sys
import time

import numpy as np
import torch

import mpiscale
from mpiscale.jobs import choose_torch_device
from mpiscale.train import DataParallel
from mpiscale.train.compression import Exact

WIDTH, LAYERS, BATCH = 256, 4, 32
SLEEP_CYCLES = 20_000_000  # about 10 ms of a GPU's clock per layer


class Slow(torch.autograd.Function):
    """The identity, whose backward keeps the device busy a while (on a GPU)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        if grad.is_cuda:
            torch.cuda._sleep(SLEEP_CYCLES)
        return grad


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = Slow.apply(torch.tanh(layer(x)))
        return x


class Timed(Exact):
    """Exact, noting when each bucket started."""

    def __init__(self, system) -> None:
        super().__init__(system)
        self.started: list[float] = []

    def start(self, bucket) -> None:
        self.started.append(time.perf_counter())
        super().start(bucket)


async def main(system) -> None:
    device = torch.device(choose_torch_device(sys.argv[1], system.world.comm))  # the jobs' rule, made current
    steps = int(sys.argv[2])
    model = Model().to(device)
    scheme = Timed(system)
    size = WIDTH * (WIDTH + 1) * 4 / 2**20  # one layer's MiB: a bucket each
    parallel = DataParallel(system, model, bucket_mib=size, first_bucket_mib=size, compression=scheme)
    assert len(parallel._buckets) >= 3, len(parallel._buckets)
    await parallel.broadcast_parameters()
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(system.rank)
    early = []
    for step in range(steps):
        x = torch.randn(BATCH, WIDTH, generator=generator).to(device)
        model.zero_grad()
        model(x).square().mean().backward()  # on a GPU: queued, not yet run
        raw = [p.grad.detach().clone() for p in params]  # this rank's own gradients, before averaging
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        computed = time.perf_counter()  # the device has finished backward
        first = len(scheme.started) - step * len(parallel._buckets)
        early.append(first > 0 and scheme.started[step * len(parallel._buckets)] < computed)
        await parallel.synchronize()
        mine = np.concatenate([g.cpu().numpy().reshape(-1) for g in raw])
        every = await system.world.allgather(mine)
        expected = every.sum(axis=0, dtype=np.float32) * np.float32(1.0 / system.size)
        if system.size == 2:  # (two addends: the same bits in any order; more would depend on MPI's order)
            averaged = np.concatenate([p.grad.cpu().numpy().reshape(-1) for p in params])
            assert np.array_equal(averaged, expected), (step, np.abs(averaged - expected).max())
    assert system.size == 1 or all(early), (
        f"steps whose first bucket started only after the device's backward: {early.count(False)}"
    )
    if system.rank == 0:
        print(f"gpu overlap ok: {system.size} ranks on {device.type}, {len(parallel._buckets)} buckets, {steps} steps, "
              f"gradients {parallel.gradient_path}", flush=True)  # fmt: skip


mpiscale.run(main)
