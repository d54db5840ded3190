"""Data-parallel and pipeline training with PyTorch over the runtime, and activation collection.

The public face of the workload: what users and other packages (circuits reads trained models) use. Names are
loaded on first use, so the command line can read the settings of ``mpiscale train`` without importing torch.
``Compression`` is what a gradient-compression scheme of one's own implements (``DataParallel(compression=...)``).
"""

from ..lazy_exports import lazy_exports

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
    "model_rows": "model",
    "rows_refused": "model",
    "ScheduleError": "pipeline.schedule",
}

__all__ = sorted(_PUBLIC)

__getattr__ = lazy_exports(__name__, _PUBLIC)
