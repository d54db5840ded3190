"""Pipeline-parallel training against one process that accumulates gradients over the same micro-batches.

usage: pipeline.py check DTYPE [REPLICAS]
                                  every schedule and case below, in float64 (to 1e-12) or float32 (to 1e-6)
       pipeline.py fail           stage 1 raises in the forward pass of micro-batch 2 at step 1

One stage per rank, or REPLICAS ranks per stage (each replica its own batch,
the reference accumulating every replica's micro-batches and dividing by
REPLICAS; the replicas other than 0 start from other weights, which the
pipeline replaces with replica 0's). The cuts make stages of unequal cost (the
widest layer sits alone on one stage). Cases: micro-batches as a batch tensor cut evenly, as a
list of micro-batches of different sizes, fewer micro-batches than stages, and
(at 2+ ranks) a first stage whose output is integer ids, so no gradient goes
back to it; in float64 also the training job's transformer encoder, split by
balanced parameter count, on token ids. Each rank compares its own stage's parameters by name with the
one-process run after every step.
"""

import asyncio
import sys
from collections import OrderedDict

import torch

import mpiscale
from mpiscale.train.encoder import build_encoder
from mpiscale.train.pipeline import Pipeline, split_sequential, stage_of

STEPS = 3
FEATURES = 6
ENCODER = {"vocab": 12, "length": 8, "width": 16, "heads": 2, "layers": 2, "classes": 1}


class Bucketize(torch.nn.Module):
    """Integer ids from the first feature: an output that carries no gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x[:, :3].abs() * 4).long().clamp(max=15)


class EmbedMean(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(16, FEATURES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).mean(dim=1)


def model(dtype: torch.dtype, kind: str) -> torch.nn.Sequential:
    """kind: mlp, ids (an MLP after a first stage of integer ids) or encoder."""
    torch.manual_seed(7)
    if kind == "encoder":
        return build_encoder(ENCODER).to(dtype)
    ids = kind == "ids"
    layers: list[tuple[str, torch.nn.Module]] = [("bucketize", Bucketize()), ("embed", EmbedMean())] if ids else []
    layers += [("hidden1", torch.nn.Linear(FEATURES, 32)), ("act1", torch.nn.Tanh()),
               ("hidden2", torch.nn.Linear(32, 256)), ("act2", torch.nn.Tanh()),
               ("hidden3", torch.nn.Linear(256, 16)), ("act3", torch.nn.Tanh()),
               ("output", torch.nn.Linear(16, 1))]  # fmt: skip
    return torch.nn.Sequential(OrderedDict(layers)).to(dtype)


def points(stages: int, kind: str) -> list[str] | None:
    if kind == "encoder":
        return None  # balanced parameter count
    if kind == "ids":
        return [["embed"], ["embed", "hidden2"], ["embed", "hidden2", "output"]][stages - 2]
    return [[], ["hidden2"], ["hidden2", "act2"], ["hidden2", "act2", "output"]][stages - 1]


def batches(
    dtype: torch.dtype, sizes: list[int], step: int, kind: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + step)
    if kind == "encoder":
        xs = [torch.randint(ENCODER["vocab"], (n, ENCODER["length"]), generator=generator) for n in sizes]
        return xs, [(x < 3).to(dtype).mean(dim=1, keepdim=True) for x in xs]
    xs = [torch.randn(n, FEATURES, generator=generator, dtype=dtype) for n in sizes]
    return xs, [x.sum(dim=1, keepdim=True).sin() for x in xs]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum() / 16


async def check_case(system, dtype, schedule: str, sizes: list[int], as_tensor: bool, kind: str, tolerance: float,
                     replicas: int):  # fmt: skip
    stages = system.size // replicas
    replica = system.rank % replicas
    whole = model(dtype, kind)
    reference = model(dtype, kind)
    stage = split_sequential(whole, stages, points(stages, kind))[stage_of(system.rank, replicas)]
    if replica:
        with torch.no_grad():
            for param in stage.parameters():
                param.add_(1.0)
    name = f"p.{schedule}.{len(sizes)}.{as_tensor}.{kind}.{dtype}".replace("torch.", "")
    pipeline = await Pipeline.start(system, stage, loss_fn, len(sizes), schedule, name=name, replicas=replicas)
    params = list(stage.parameters())  # none on a first stage that only makes ids
    optimizer = torch.optim.SGD(params or [torch.zeros(0, requires_grad=True)], lr=0.05, momentum=0.9)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        every = [batches(dtype, sizes, step * replicas + r, kind) for r in range(replicas)]
        xs, ys = every[replica]
        optimizer.zero_grad()
        if as_tensor:
            stats = await pipeline.step(torch.cat(xs), torch.cat(ys))
        else:
            stats = await pipeline.step(xs, ys)
        optimizer.step()
        expected_optimizer.zero_grad()
        losses = [0.0] * replicas
        for r, (rxs, rys) in enumerate(every):
            for x, y in zip(rxs, rys):
                loss = loss_fn(reference(x), y)
                loss.backward()
                losses[r] += loss.item()
        with torch.no_grad():
            for param in reference.parameters():
                param.grad /= replicas
        expected_optimizer.step()
        expected_loss = losses[replica]
        mine = dict(stage.named_parameters())
        for key, value in reference.named_parameters():
            if key in mine:
                difference = (mine[key] - value).abs().max().item()
                assert difference <= tolerance, (name, step, key, difference)
        if pipeline.last:
            bound = tolerance * max(1.0, abs(expected_loss))
            assert abs(stats.loss - expected_loss) <= bound, (stats.loss, expected_loss)
        else:
            assert stats.loss is None
        if pipeline.first:
            assert stats.micro_batch_sizes == sizes
        limit = min(stages - pipeline.stage, len(sizes)) if schedule == "1f1b" else len(sizes)
        assert stats.peak_held == limit, (name, stats.peak_held, limit)
        assert stats.compute_s > 0 and stats.idle_s >= 0


async def check(system, dtype_name: str, replicas: int) -> None:
    dtype = {"float64": torch.float64, "float32": torch.float32}[dtype_name]
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    stages = system.size // replicas
    for schedule in ("1f1b", "gpipe"):
        cases = [([6, 6, 6, 6, 6, 6], True, "mlp"), ([9, 1, 4, 7, 2, 5, 3], False, "mlp")]
        cases.append(([5] * max(1, stages - 1), False, "mlp"))  # fewer micro-batches than stages
        if stages >= 2:
            cases.append(([4, 8, 3], False, "ids"))
        if dtype == torch.float64 and replicas == 1:
            cases.append(([5, 3, 6, 4], False, "encoder"))
        for sizes, as_tensor, kind in cases:
            await check_case(system, dtype, schedule, sizes, as_tensor, kind, tolerance, replicas)
    await system.world.barrier()
    if system.rank == 0:
        print(f"pipeline ok on {stages} stages x {replicas} replicas ({dtype_name})", flush=True)


async def fail(system) -> None:
    class Failing(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.calls == 2 + 4:  # step 1, micro-batch 2
                raise ValueError("stage module failed on purpose")
            self.calls += 1
            return x * 2

        calls = 0

    stage = Failing() if system.rank == 1 else torch.nn.Linear(3, 3)
    pipeline = await Pipeline.start(system, stage, lambda out, y: out.sum(), 4)
    for _ in range(3):
        await pipeline.step(torch.ones(8, 3), torch.ones(8, 3))
    await asyncio.sleep(30)  # never reached: the job ends first


async def main(system) -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "check":
        await check(system, sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    else:
        await fail(system)


mpiscale.run(main)
