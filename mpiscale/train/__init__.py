"""Data-parallel training with PyTorch over the runtime (the runtime itself never imports torch)."""

from .data_parallel import DataParallel

__all__ = ["DataParallel"]
