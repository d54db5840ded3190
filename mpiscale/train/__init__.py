"""Data-parallel training with PyTorch over the runtime, and activation collection (the runtime never imports torch).

``DataParallel`` is loaded on first use, so the command line can read the
settings of ``mpiscale train`` without importing torch.
"""

from typing import Any

__all__ = ["DataParallel"]


def __getattr__(name: str) -> Any:
    if name == "DataParallel":
        from .data_parallel import DataParallel

        return DataParallel
    raise AttributeError(f"module 'mpiscale.train' has no attribute {name!r}")
