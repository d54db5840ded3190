"""Parallel I/O and data-pipeline helpers: sharded HDF5 datasets, batch reader, per-sample randomness."""

from .h5file import DataFileError
from .reader import Batch, BatchReader, epoch_order
from .sample_random import SampleRandom
from .sharded import ShardedDataset, read_dataset, write_dataset, write_index

__all__ = [
    "Batch",
    "BatchReader",
    "DataFileError",
    "SampleRandom",
    "ShardedDataset",
    "epoch_order",
    "read_dataset",
    "write_dataset",
    "write_index",
]
