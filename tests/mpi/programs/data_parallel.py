"""DataParallel against one process training on the whole batch: the same parameters, the same on every rank.

usage: data_parallel.py STEPS [SCHEME[,SCHEME...]]  (none, fp16, bf16, powersgd-full, powersgd-low, user,
late-copies, copies-after-backward, device-thread, direct, node-gloo)
Each scheme is checked in turn in the same job (a launch costs each rank
seconds of imports). Each step's global batch of 24 samples is split over the ranks; rank r's
model starts from its own seed, so the broadcast from rank 0 matters. A
parameter the model skips on odd steps tests unused gradients; no_sync()
accumulates two micro-batches per step. With compression, the bound on the
difference from one process is the scheme's own (16-bit rounding; PowerSGD at
full rank is exact up to float32 rounding); at low rank only the agreement of
the ranks and the fall of the loss are asserted. ``user`` is a scheme written
here as a user would, against the ``Compression`` protocol only: float64 sums
through the world's awaitable allreduce, started in ``finish``. ``late-copies``
drives the staging scheduler as a GPU does (``train.staging``): each bucket's
copy to host memory is said to arrive only after a few later questions, so
buckets start late, some only in ``synchronize``, yet in index order.
``copies-after-backward`` drives it as a GPU does when autograd has queued the
whole backward long before the GPU has run it: each copy arrives 20 ms after it
was sent, in another thread, when no later gradient is there to ask, and every
bucket but one its rank left without a gradient must start before
``synchronize()`` all the same.
``device-thread`` runs backward in a thread without an event loop, as autograd
runs the gradient hooks of GPU parameters in its device thread: buckets start
from that thread, during backward.
``direct`` sums the buckets' tensors with MPI where they lie (``DirectSums``:
device memory under a CUDA-aware MPI, here host memory), ``node-gloo`` with a
gloo group per node and MPI between the nodes' first ranks (``NodeSums``).
"""

import asyncio
import sys
import threading

import numpy as np
import torch

import mpiscale
from mpiscale.ranks import rank_rows
from mpiscale.train import Bucket, Compression, DataParallel
from mpiscale.train.compression import Exact, Narrow, PowerSGD
from mpiscale.train.staging import HostGradients
from mpiscale.train.tensor_sums import DirectSums, NodeSums

BATCH, FEATURES = 24, 10


class Model(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.sometimes = torch.nn.Linear(FEATURES, 1)  # registered first: the last bucket, as backward goes
        self.hidden = torch.nn.Linear(FEATURES, 2000)  # 80 KB of weights: three buckets at 0.05 MiB
        self.out = torch.nn.Linear(2000, 1)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.out(torch.tanh(self.hidden(x)))
        return y + self.sometimes(x) if step % 2 == 0 else y


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(model: torch.nn.Module, steps: int, rows: tuple[int, int], scale: float, parallel=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        x, y = batch(step)
        x, y = x[rows[0] : rows[1]], y[rows[0] : rows[1]]
        half = (len(x) + 1) // 2
        for part, (lo, hi) in enumerate([(0, half), (half, len(x))]):
            loss = ((model(x[lo:hi], step) - y[lo:hi]) ** 2).sum() * scale
            if parallel is not None and part == 0:
                with parallel.no_sync():
                    loss.backward()
            else:
                loss.backward()
        yield step, optimizer


class Float64Sums:
    """A user's own scheme: nothing to do during backward, then the average in float64."""

    def __init__(self, system) -> None:
        self.system = system

    def start(self, bucket: Bucket) -> None:
        pass

    async def finish(self, bucket: Bucket) -> None:
        wide = bucket.buffer.astype(np.float64)
        await self.system.world.allreduce(wide, out=wide)
        bucket.buffer[:] = wide / self.system.size


class LateCopies(HostGradients):
    """The host adaptor, but each bucket's copy arrives only at the third question after it was sent (or when
    waited for): what a GPU's copy stream looks like to the scheduler."""

    def __init__(self) -> None:
        self.asked: dict[int, int] = {}
        self.late = 0  # questions answered "not yet"

    def send(self, bucket, arrived) -> None:
        self.asked[bucket.index] = 0

    def arrived(self, bucket, wait: bool) -> bool:
        self.asked[bucket.index] += 1
        here = wait or self.asked[bucket.index] > 2
        self.late += not here
        return here


class CopiesAfterBackward(HostGradients):
    """The host adaptor, but each bucket's copy arrives 20 ms after it was sent, said from a timer's thread."""

    def __init__(self) -> None:
        self.landed: dict[int, threading.Event] = {}

    def send(self, bucket, arrived) -> None:
        self.landed[bucket.index] = landed = threading.Event()

        def land() -> None:
            landed.set()
            arrived()

        threading.Timer(0.02, land).start()

    def arrived(self, bucket, wait: bool) -> bool:
        landed = self.landed.get(bucket.index)
        if landed is not None and wait:
            assert landed.wait(10), "a copy never arrived"
        return landed is None or landed.is_set()


class Counted(HostGradients):
    """The host adaptor, counting the gradients copied into buckets (on one rank there must be none)."""

    def __init__(self) -> None:
        self.taken = 0

    def take(self, bucket, position, grad) -> None:
        self.taken += 1
        super().take(bucket, position, grad)


class InOrder(Exact):
    """Exact, checking that buckets start in index order, each once a step."""

    def __init__(self, system) -> None:
        super().__init__(system)
        self.started: list[int] = []

    def start(self, bucket: Bucket) -> None:
        self.started.append(bucket.index)
        super().start(bucket)


def users_scheme(system) -> Compression:
    return Float64Sums(system)  # type-checks against the protocol, no base class


SCHEMES = {  # name: (scheme, largest difference from one process allowed; None: not compared)
    "none": (Exact, 1e-5),
    "fp16": (lambda system: Narrow(system, "float16"), 2e-4),
    "bf16": (lambda system: Narrow(system, "bfloat16"), 2e-3),
    "powersgd-full": (lambda system: PowerSGD(system, rank=FEATURES, start_step=0, min_rate=0.0), 1e-5),
    "powersgd-low": (lambda system: PowerSGD(system, rank=1, start_step=1, min_rate=0.0), None),
    "user": (users_scheme, 1e-5),
    "late-copies": (InOrder, 1e-5),
    "copies-after-backward": (InOrder, 1e-5),
    "device-thread": (InOrder, 1e-5),
    "direct": (None, 1e-5),
    "node-gloo": (None, 1e-5),
}
SUMS = {"direct": DirectSums, "node-gloo": lambda system: NodeSums(system, "gloo")}


def loss_of(model: torch.nn.Module) -> float:
    with torch.no_grad():
        x, y = batch(10_000)
        return float(((model(x, 1) - y) ** 2).mean())


async def check(system, steps: int, name: str) -> None:
    make, tolerance = SCHEMES[name]
    model = Model(seed=system.rank)
    sums = SUMS[name](system) if name in SUMS else None
    compression = make(system) if make is not None else None
    parallel = DataParallel(
        system, model, bucket_mib=0.05, first_bucket_mib=0.01, compression=compression, tensor_sums=sums
    )
    if name == "late-copies":
        parallel.gradients = LateCopies()
    elif name == "copies-after-backward":
        parallel.gradients = CopiesAfterBackward()
    elif system.size == 1:
        parallel.gradients = Counted()
    await parallel.broadcast_parameters()
    before = loss_of(model)
    rows = rank_rows(BATCH, system.size, system.rank)
    passes = train(model, steps, rows, system.size / BATCH, parallel)
    early = []  # per step, the buckets started before synchronize()
    while done := await asyncio.to_thread(next, passes, None) if name == "device-thread" else next(passes, None):
        if name == "copies-after-backward":
            await asyncio.sleep(0.2)  # the rest of the step's host work, while the copies land
        if name in ("device-thread", "copies-after-backward"):
            early.append(len(parallel.compression.started) - done[0] * len(parallel._buckets))
        await parallel.synchronize()
        done[1].step()
    reference = Model(seed=0)
    for _, optimizer in train(reference, steps, (0, BATCH), 1.0 / BATCH):
        optimizer.step()
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    theirs = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).numpy()
    difference = float(np.abs(mine - theirs).max())
    if tolerance is not None:
        assert difference <= tolerance + 1e-4 * np.abs(theirs).max(), (name, difference)
    else:
        assert loss_of(model) < 0.9 * before, (name, before, loss_of(model))
    if name in ("device-thread", "copies-after-backward"):
        assert len(parallel._buckets) >= 3 and min(early) >= len(parallel._buckets) - 1, (len(parallel._buckets), early)
    if name in ("late-copies", "device-thread", "copies-after-backward"):
        count = len(parallel._buckets)
        assert parallel.compression.started == list(range(count)) * steps, parallel.compression.started
    if name == "late-copies":
        assert parallel.gradients.late > 0, "no bucket was late: the scheduler's waiting went untested"
    if system.size == 1:
        assert parallel.gradients.taken == 0, f"one rank copied {parallel.gradients.taken} gradients into buckets"
    if sums is not None:
        sums.close()
    every = await system.world.allgather(mine)
    assert (every == every[0]).all(), f"{name}: ranks ended with different parameters"
    if system.rank == 0:
        print(
            f"data parallel ok: {system.size} ranks, {len(parallel._buckets)} buckets, {name}, "
            f"largest difference from one process {difference:.2e}"
        )


async def main(system) -> None:
    steps = int(sys.argv[1])
    for name in (sys.argv[2] if len(sys.argv) > 2 else "none").split(","):
        await check(system, steps, name)


mpiscale.run(main)
