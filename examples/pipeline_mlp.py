"""Pipeline-parallel training of a deep MLP: one stage per rank, 1F1B over 8 micro-batches.

    launch/mpiscale-run -n 3 -- python examples/pipeline_mlp.py [--schedule gpipe] [--steps 60]

Every rank builds the same model (same seed) and keeps its own stage; the first stage reads the inputs, the last
the targets and computes the loss; each rank steps the optimizer of its own stage's parameters.
"""

import argparse
from collections import OrderedDict

import torch

import mpiscale
from mpiscale.train.pipeline import Pipeline, split_sequential

parser = argparse.ArgumentParser()
parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--micro-batches", type=int, default=8)
args = parser.parse_args()


def deep_mlp(width: int = 64, depth: int = 8) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: OrderedDict[str, torch.nn.Module] = OrderedDict(input=torch.nn.Linear(10, width))
    for i in range(depth):
        layers[f"act{i}"] = torch.nn.Tanh()
        layers[f"hidden{i}"] = torch.nn.Linear(width, width)
    layers["output"] = torch.nn.Linear(width, 1)
    return torch.nn.Sequential(layers)


async def main(system: mpiscale.ActorSystem) -> None:
    torch.set_num_threads(1)
    stage = split_sequential(deep_mlp(), system.size)[system.rank]  # cuts balanced by parameter count
    pipeline = await Pipeline.start(system, stage, torch.nn.functional.mse_loss, args.micro_batches, args.schedule)
    optimizer = torch.optim.Adam(stage.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    losses: list[float] = []
    for step in range(args.steps):
        x = torch.randn(256, 10, generator=data)
        y = x[:, :3].sum(dim=1, keepdim=True).sin()
        optimizer.zero_grad()
        stats = await pipeline.step(x, y)  # the first stage uses x, the last y
        optimizer.step()
        if pipeline.last:
            losses.append(stats.loss / args.micro_batches)  # the sum of the micro-batches' mean losses
            if (step + 1) % 20 == 0:
                idle = stats.idle_s / (stats.idle_s + stats.compute_s)
                mean = sum(losses[-20:]) / 20
                print(f"steps {step - 18}-{step + 1}: mean loss {mean:.4f}, last stage idle {idle:.0%}", flush=True)


mpiscale.run(main)
