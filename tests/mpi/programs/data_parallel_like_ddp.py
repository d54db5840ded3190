"""DataParallel where users rely on DDP's behaviour: unused parameters, frozen ones, channels_last, BatchNorm.

- A head no rank uses keeps its gradient unset, so SGD with momentum and weight
  decay, and Adam with weight decay, leave it exactly where it started (a zero
  gradient would move it); a layer only rank 0 uses gets rank 0's gradient
  averaged with the others' zeros.
- A layer frozen after wrapping is refused on every rank with one message.
- A convolutional model in ``channels_last`` memory format broadcasts and trains.
- BatchNorm's running statistics: rank 0's on every rank after each step
  (``broadcast_buffers``, the default), each rank's own without it.
- A second backward before ``synchronize`` is refused (as DDP does); inside
  ``no_sync`` backward passes accumulate.
"""

import numpy as np
import torch

import mpiscale
from mpiscale.train import DataParallel


class Heads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 8)
        self.used = torch.nn.Linear(8, 1)
        self.rank0_only = torch.nn.Linear(8, 1)
        self.never = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        hidden = torch.relu(self.body(x))
        return self.used(hidden) + (self.rank0_only(hidden) if rank == 0 else 0.0)


async def unused_parameters_stay_put(system) -> None:
    for make in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
                 lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1)):  # fmt: skip
        model = Heads()
        parallel = DataParallel(system, model)
        await parallel.broadcast_parameters()
        optimizer = make(model.parameters())
        start = {name: p.detach().clone() for name, p in model.named_parameters()}
        for step in range(4):
            optimizer.zero_grad()
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(10 * step + system.rank))
            model(x, system.rank).pow(2).sum().backward()
            own = model.rank0_only.weight.grad.clone() if system.rank == 0 else None
            await parallel.synchronize()
            optimizer.step()
            assert model.never.weight.grad is None and model.never.bias.grad is None
            every = await system.world.allgather(model.rank0_only.weight.grad.numpy().copy())
            assert (every == every[0]).all()
            if system.rank == 0:
                torch.testing.assert_close(model.rank0_only.weight.grad, own / system.size)
        for name in ("never.weight", "never.bias"):
            assert torch.equal(dict(model.named_parameters())[name], start[name]), f"{name} moved"
        assert not torch.equal(model.used.weight, start["used.weight"])


async def freezing_after_wrapping_is_refused(system) -> None:
    model = Heads()
    parallel = DataParallel(system, model)
    model.used.weight.requires_grad_(False)
    model(torch.ones(2, 6), system.rank).sum().backward()
    try:
        await parallel.synchronize()
    except RuntimeError as error:
        assert "parameters ['used.weight'] were frozen after DataParallel wrapped the model" in str(error), error
    else:
        raise AssertionError("a parameter frozen after wrapping was averaged")


async def channels_last_trains(system) -> None:
    torch.manual_seed(system.rank)  # every rank its own start: the broadcast must give rank 0's
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(1))
    model(torch.zeros(1, 3, 6, 6))  # materialise the lazy layer
    model = model.to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    parallel = DataParallel(system, model)
    await parallel.broadcast_parameters()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        optimizer.zero_grad()
        x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(step + 100 * system.rank))
        model(x.to(memory_format=torch.channels_last)).pow(2).mean().backward()
        await parallel.synchronize()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    every = await system.world.allgather(flat)
    assert (every == every[0]).all(), "the ranks' channels_last models differ"


async def batchnorm_statistics(system, broadcast: bool) -> np.ndarray:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    parallel = DataParallel(system, model, broadcast_buffers=broadcast)
    await parallel.broadcast_parameters()
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(system.rank)) + system.rank  # different data
    model(x).sum().backward()
    await parallel.synchronize()
    means = await system.world.allgather(model[1].running_mean.numpy().copy())
    counts = await system.world.allgather(model[1].num_batches_tracked.numpy().reshape(1).copy())
    assert (counts == 1).all()
    return means


async def a_second_backward_before_synchronize_is_refused(system) -> None:
    """As DDP refuses marking a gradient ready twice: the first backward's buckets are already being averaged, so
    a second one would leave part of its gradient out (once off by 1e-3, silently). Inside no_sync it accumulates."""
    model = Heads()
    parallel = DataParallel(system, model)
    await parallel.broadcast_parameters()
    x = torch.ones(2, 6) * (system.rank + 1)
    with parallel.no_sync():
        model(x, 1).sum().backward()
    model(x, 1).sum().backward()  # the accumulated gradient of both passes is averaged
    await parallel.synchronize()
    accumulated = model.used.weight.grad.clone()
    model.zero_grad()
    model(x, 1).sum().backward()
    try:
        model(x, 1).sum().backward()
    except RuntimeError as error:
        assert "a second backward() reached parameter" in str(error) and "no_sync()" in str(error), error
    else:
        raise AssertionError("a second backward before synchronize() went on")
    await parallel.synchronize()  # the first pass's buckets finish; the job goes on
    torch.testing.assert_close(model.used.weight.grad * 2, accumulated)
    model.zero_grad()  # a pass inside no_sync after one outside it: exit 0 with the second pass lost, before
    model(x, 1).sum().backward()
    try:
        with parallel.no_sync():
            model(x, 1).sum().backward()
    except RuntimeError as error:
        assert "a second backward() inside no_sync() reached parameter" in str(error), error
    else:
        raise AssertionError("a backward inside no_sync() after one outside it went on, and its gradient was lost")
    await parallel.synchronize()


async def main(system) -> None:
    await unused_parameters_stay_put(system)
    await freezing_after_wrapping_is_refused(system)
    await channels_last_trains(system)
    shared = await batchnorm_statistics(system, True)
    own = await batchnorm_statistics(system, False)
    assert (shared == shared[0]).all(), "broadcast_buffers left the ranks' running statistics apart"
    assert system.size == 1 or not (own == own[0]).all(), "without broadcast_buffers each rank keeps its own"
    await a_second_backward_before_synchronize_is_refused(system)
    if system.rank == 0:
        print(f"data parallel like DDP ok: {system.size} ranks")


mpiscale.run(main)
