"""A DataParallel step every rank refuses alike (a layer frozen after wrapping), left uncaught: one report."""

import torch

import mpiscale
from mpiscale.train import DataParallel


async def main(system) -> None:
    model = torch.nn.Linear(4, 2)
    parallel = DataParallel(system, model)
    await parallel.broadcast_parameters()
    model.bias.requires_grad_(False)
    model(torch.ones(3, 4)).sum().backward()
    await parallel.synchronize()


mpiscale.run(main)
