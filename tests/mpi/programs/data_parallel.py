"""DataParallel against one process training on the whole batch: the same parameters, the same on every rank.

usage: data_parallel.py STEPS
Each step's global batch of 24 samples is split over the ranks; rank r's
model starts from its own seed, so the broadcast from rank 0 matters. A
parameter the model skips on odd steps tests unused gradients; no_sync()
accumulates two micro-batches per step.
"""

import sys

import numpy as np
import torch

import mpiscale
from mpiscale.ranks import rank_rows
from mpiscale.train import DataParallel

BATCH, FEATURES = 24, 10


class Model(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.hidden = torch.nn.Linear(FEATURES, 2000)  # 80 KB of weights: several buckets at 0.05 MiB
        self.out = torch.nn.Linear(2000, 1)
        self.sometimes = torch.nn.Linear(FEATURES, 1)

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


async def main(system) -> None:
    steps = int(sys.argv[1])
    model = Model(seed=system.rank)
    parallel = DataParallel(system, model, bucket_mib=0.05, first_bucket_mib=0.01)
    await parallel.broadcast_parameters()
    rows = rank_rows(BATCH, system.size, system.rank)
    for _, optimizer in train(model, steps, rows, system.size / BATCH, parallel):
        await parallel.synchronize()
        optimizer.step()
    reference = Model(seed=0)
    for _, optimizer in train(reference, steps, (0, BATCH), 1.0 / BATCH):
        optimizer.step()
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    theirs = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).numpy()
    assert np.allclose(mine, theirs, rtol=1e-4, atol=1e-5), float(np.abs(mine - theirs).max())
    every = await system.world.allgather(mine)
    assert (every == every[0]).all(), "ranks ended with different parameters"
    if system.rank == 0:
        print(
            f"data parallel ok: {system.size} ranks, {len(parallel._buckets)} buckets, "
            f"largest difference from one process {np.abs(mine - theirs).max():.2e}"
        )


mpiscale.run(main)
