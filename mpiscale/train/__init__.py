"""Data-parallel training with PyTorch over the runtime, and activation collection (the runtime never imports torch).

``DataParallel`` and ``allreduce_tensor`` are loaded on first use, so the command line can read the
settings of ``mpiscale train`` without importing torch. ``Compression`` is what a gradient-compression
scheme of one's own implements (``DataParallel(compression=...)``).
"""

from typing import Any

__all__ = ["Bucket", "Compression", "DataParallel", "allreduce_tensor"]


def __getattr__(name: str) -> Any:
    if name == "DataParallel":
        from .data_parallel import DataParallel

        return DataParallel
    if name in ("Bucket", "Compression"):
        from . import compression

        return getattr(compression, name)
    if name == "allreduce_tensor":
        from .tensors import allreduce_tensor

        return allreduce_tensor
    raise AttributeError(f"module 'mpiscale.train' has no attribute {name!r}")
