"""Training step time: ``mpiscale.train.DataParallel`` against PyTorch's DistributedDataParallel (gloo).

The same MLP, batch, ranks and torch threads for both, in one run, plus the
step with no communication at all (what overlap could at best reach). Each
figure is the median over steps of the slowest rank's step time.
"""

from __future__ import annotations

import numpy as np

from ..kernels.threads import share_cores
from ..ranks import ranks_sharing_cores
from ..runtime import ActorSystem
from ..train import DataParallel
from .allreduce import init_gloo
from .report import median_slowest_async, table, write_json

WIDTH, DEPTH, BATCH = 2048, 3, 64  # about 12.6M parameters: 50 MB of gradients per step


def _model(torch):
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))


async def run_ddp_bench(system: ActorSystem, json_path: str, quick: bool = False) -> dict | None:
    """Time ``steps`` training steps three ways; rank 0 prints the table and writes the JSON record."""
    import torch

    comm = system.world.comm
    torch.set_num_threads(share_cores(ranks_sharing_cores(comm)))  # this rank's share of the host's cores
    gloo = init_gloo(comm)
    if gloo is None:
        raise SystemExit("bench ddp needs torch (pip install torch)")
    _, dist = gloo
    steps = 4 if quick else 12
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(system.rank))
    y = torch.randn(BATCH, 1, generator=torch.Generator().manual_seed(system.rank + 100))

    def plain_step(model, optimizer):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    local = _model(torch)
    local_optimizer = torch.optim.SGD(local.parameters(), lr=1e-4)

    async def compute_only() -> None:
        plain_step(local, local_optimizer)

    ours_model = _model(torch)
    parallel = DataParallel(system, ours_model)
    await parallel.broadcast_parameters()
    ours_optimizer = torch.optim.SGD(ours_model.parameters(), lr=1e-4)

    async def ours() -> None:
        ours_optimizer.zero_grad()
        torch.nn.functional.mse_loss(ours_model(x), y).backward()
        await parallel.synchronize()
        ours_optimizer.step()

    ddp_model = torch.nn.parallel.DistributedDataParallel(_model(torch))
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=1e-4)

    async def ddp() -> None:
        plain_step(ddp_model, ddp_optimizer)

    seconds = {name: await median_slowest_async(system, step, steps) for name, step in
               [("compute_only", compute_only), ("ours", ours), ("ddp_gloo", ddp)]}  # fmt: skip
    dist.destroy_process_group()
    if system.rank != 0:
        return None
    parameters = sum(p.numel() for p in local.parameters())
    print(f"training step of an MLP ({DEPTH} x {WIDTH}, {parameters / 1e6:.1f}M parameters, batch {BATCH} per rank), "
          f"{system.size} ranks, {torch.get_num_threads()} torch threads each; median of {steps} steps")  # fmt: skip
    rows = [[name, value * 1e3, seconds["ddp_gloo"] / value] for name, value in seconds.items()]
    print(table(["", "ms/step", "DDP/this"], rows))
    results = {
        "ranks": system.size,
        "nodes": system.hierarchy.node_count,
        "parameters": parameters,
        "batch_per_rank": BATCH,
        "torch_threads": torch.get_num_threads(),
        "seconds_per_step": seconds,
        "ours_vs_ddp": seconds["ddp_gloo"] / seconds["ours"],
        "gradient_bytes": int(np.float32().itemsize * parameters),
    }
    print(f"wrote {write_json(json_path, 'ddp', system.size, results)}")
    return results
