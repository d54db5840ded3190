"""allreduce_tensor on float64, float32, float16 and bfloat16 CPU tensors, against the sum computed here.

Every rank builds every rank's tensor (seeded by rank), so each knows the exact
sum; 16-bit results must be that sum of the 16-bit values rounded once (one
node) or within one rounding per stage (nodes), and the same bits everywhere.
"""

import torch

import mpiscale
from mpiscale.train import allreduce_tensor

SHAPE = (37, 101)
#: Relative error allowed per rounding stage (twice the unit roundoff, for the average's division too).
EPSILON = {torch.float64: 1e-15, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def tensor_of(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).to(dtype)


async def main(system) -> None:
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        mine = tensor_of(system.rank, dtype)
        everyone = torch.stack([tensor_of(r, dtype).double() for r in range(system.size)])
        exact = everyone.sum(dim=0)
        await allreduce_tensor(system, mine, average=False)
        if dtype in (torch.float16, torch.bfloat16) and system.hierarchy.node_count == 1:
            assert torch.equal(mine, exact.float().to(dtype)), dtype  # the float32 sum of a few halves is exact
        else:
            eps = {torch.float64: 1e-15, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
            assert (mine.double() - exact).abs().max() <= 2 * eps * everyone.abs().sum(dim=0).max(), dtype
        every = await system.world.allgather(
            mine.view(torch.int16 if mine.element_size() == 2 else torch.uint8).numpy()
        )
        assert (every == every[0]).all(), f"{dtype}: ranks differ"
        averaged = tensor_of(system.rank, dtype)
        await allreduce_tensor(system, averaged, average=True)
        tolerance = 4 * EPSILON[dtype] * float(everyone.abs().max())
        assert torch.allclose(averaged.double(), exact / system.size, rtol=0, atol=tolerance), dtype
    try:
        await allreduce_tensor(system, torch.zeros(3, dtype=torch.int32))
    except TypeError as error:
        assert "not torch.int32" in str(error)
    else:
        raise AssertionError("an int32 tensor was accepted")
    if system.rank == 0:
        print(f"tensor allreduce ok: {system.size} ranks")


mpiscale.run(main)
