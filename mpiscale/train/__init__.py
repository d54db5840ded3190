"""Data-parallel and pipeline training with PyTorch over the runtime, and activation collection.

The public face of the workload: what users and other packages (circuits reads trained models) use. Names are
loaded on first use, so the command line can read the settings of ``mpiscale train`` without importing torch.
``Compression`` is what a gradient-compression scheme of one's own implements (``DataParallel(compression=...)``).
"""

from importlib import import_module
from typing import Any

# name -> the module of this package that defines it
_PUBLIC = {
    "DataParallel": "data_parallel",
    "Bucket": "compression",
    "Compression": "compression",
    "allreduce_tensor": "tensors",
    "RESULTS_FORMAT": "results",
    "load_trained": "results",
    "input_layout": "model",
    "layer_outputs": "model",
    "rows_refused": "model",
    "ScheduleError": "pipeline.schedule",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mpiscale.train' has no attribute {name!r}")
    value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # loaded once; documentation tools see it like any other name
    return value
