"""Data-parallel training with PyTorch over the runtime, and activation collection (the runtime never imports torch).

``DataParallel`` and ``allreduce_tensor`` are loaded on first use, so the command line can read the
settings of ``mpiscale train`` without importing torch.
"""

from typing import Any

__all__ = ["DataParallel", "allreduce_tensor"]


def __getattr__(name: str) -> Any:
    if name == "DataParallel":
        from .data_parallel import DataParallel

        return DataParallel
    if name == "allreduce_tensor":
        from .tensors import allreduce_tensor

        return allreduce_tensor
    raise AttributeError(f"module 'mpiscale.train' has no attribute {name!r}")
