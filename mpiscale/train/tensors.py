"""Torch tensors through the hierarchical allreduce: float64, float32, float16 and bfloat16, summed in place.

The runtime takes numpy arrays and never imports torch. A CPU tensor shares its
memory with a numpy view, so float64 and float32 go straight through MPI's sum.
float16 and bfloat16 (numpy has no bfloat16) travel as their 16-bit patterns
and are added in float32 outside MPI (``kernels.halves.SumOfBits``): half the
bytes of float32, one rounding per stage.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.halves import SumOfBits
from ..runtime import ActorSystem

_SIXTEEN_BITS = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


async def allreduce_tensor(system: ActorSystem, tensor: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Sum (or average) ``tensor`` over every rank, in place, with the same bits everywhere (collective)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise TypeError(
            f"allreduce_tensor takes a contiguous CPU tensor, got {tensor.device} contiguous={tensor.is_contiguous()}"
        )
    if tensor.dtype in _SIXTEEN_BITS:
        bits = tensor.detach().view(torch.int16).numpy().view(np.uint16)
        await system.hierarchy.allreduce(bits, op=SumOfBits(_SIXTEEN_BITS[tensor.dtype]), out=bits)
    elif tensor.dtype in (torch.float32, torch.float64):
        values = tensor.detach().numpy()
        await system.hierarchy.allreduce(values, out=values)
    else:
        raise TypeError(f"allreduce_tensor sums float64, float32, float16 or bfloat16 tensors, not {tensor.dtype}")
    if average:
        with torch.no_grad():
            tensor.div_(system.size)
    return tensor
