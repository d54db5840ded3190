"""Parallel I/O and data-pipeline helpers: sharded HDF5 datasets, checkpoints, batch reader, per-sample randomness."""

from ..ranks import rank_rows
from .abandon import close_after, entered_by_all, leave_open
from .batching import STRATEGIES, Batching, length_batches
from .checkpoint import Checkpointer, Restored
from .checkpoint.files import checksum
from .errors import (
    CheckpointError,
    DataFileError,
    LockedError,
    WriteError,
    not_found,
    not_numbers,
    raised_together,
    refuse_unreadable,
)
from .fingerprint import Fingerprint
from .h5file import (
    DATASET_FORMAT,
    PARALLEL_H5PY,
    check_virtual_sources,
    file_format,
    fixed_strings,
    leading_rows,
    open_file,
    publish,
    stamp,
    utc_timestamp,
    write_atomically,
    write_file,
)
from .lock import OutputLock
from .numpy_files import is_npy
from .ragged import Ragged, RaggedDataset, is_variable_length
from .reader import Batch, BatchReader, available_memory, epoch_order, epoch_plan
from .references import locate, recorded
from .sample_random import SampleRandom
from .sample_reader import ReaderStats, SampleBatch, SampleReader, open_arrays
from .sharded import ShardedDataset, read_dataset, write_dataset, write_index
from .sources import is_list_file, listed_paths, natural_key, resolve_files, same_file, split_spec
from .unfinished import unfinished_run
from .wal import ReplayReport, WriteAheadLog, encode_record, replay
from .writer import RowWriter

__all__ = [
    "DATASET_FORMAT",
    "PARALLEL_H5PY",
    "STRATEGIES",
    "Batch",
    "BatchReader",
    "Batching",
    "length_batches",
    "Ragged",
    "RaggedDataset",
    "ReaderStats",
    "SampleBatch",
    "SampleReader",
    "CheckpointError",
    "Checkpointer",
    "DataFileError",
    "Fingerprint",
    "leading_rows",
    "LockedError",
    "OutputLock",
    "ReplayReport",
    "Restored",
    "RowWriter",
    "SampleRandom",
    "ShardedDataset",
    "WriteAheadLog",
    "WriteError",
    "available_memory",
    "checksum",
    "encode_record",
    "epoch_order",
    "epoch_plan",
    "file_format",
    "fixed_strings",
    "is_variable_length",
    "is_list_file",
    "is_npy",
    "listed_paths",
    "locate",
    "natural_key",
    "not_found",
    "not_numbers",
    "open_arrays",
    "open_file",
    "check_virtual_sources",
    "publish",
    "rank_rows",
    "raised_together",
    "read_dataset",
    "refuse_unreadable",
    "close_after",
    "entered_by_all",
    "leave_open",
    "recorded",
    "replay",
    "resolve_files",
    "same_file",
    "split_spec",
    "unfinished_run",
    "stamp",
    "utc_timestamp",
    "write_dataset",
    "write_atomically",
    "write_file",
    "write_index",
]
