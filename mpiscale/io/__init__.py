"""Parallel I/O and data-pipeline helpers: sharded HDF5 datasets, checkpoints, batch reader, per-sample randomness."""

from .checkpoint import Checkpointer, CheckpointError, Restored
from .h5file import DataFileError
from .reader import Batch, BatchReader, epoch_order
from .sample_random import SampleRandom
from .sharded import ShardedDataset, rank_rows, read_dataset, write_dataset, write_index

__all__ = [
    "Batch",
    "BatchReader",
    "CheckpointError",
    "Checkpointer",
    "DataFileError",
    "Restored",
    "SampleRandom",
    "ShardedDataset",
    "epoch_order",
    "rank_rows",
    "read_dataset",
    "write_dataset",
    "write_index",
]
