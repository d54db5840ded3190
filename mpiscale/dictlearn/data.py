"""The learner's view of its data: checks before any work, the initial atoms, and the batch streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from ..io import BatchReader, ShardedDataset, rank_rows, read_dataset
from ..io.h5file import DataFileError

_SCAN_ROWS = 1 << 16  # rows per collective read while scanning for NaN


@dataclass
class DataInfo:
    """What the checks learned: the number of signals and their length."""

    path: str
    name: str
    samples: int
    features: int


def check_data(path: str, name: str, atoms: int, sparsity: int, batch_size: int, comm) -> DataInfo:
    """Open the signals (collective), check shape and sizes, and scan every value for NaN or infinity.

    Raises ``DataFileError`` or ``ValueError`` naming the file and the fix; every
    rank raises the same error because every rank sees the same totals.
    """
    from mpi4py import MPI

    with ShardedDataset(path, name, comm) as data:
        if len(data.shape) != 2:
            raise DataFileError(path, f"signals must be a 2-D array (signals, features), got shape {data.shape}", name)
        if not np.issubdtype(data.dtype, np.floating) and not np.issubdtype(data.dtype, np.integer):
            raise DataFileError(path, f"signals must be numbers, got dtype {data.dtype}", name)
        samples, features = data.shape
        start, stop = rank_rows(samples, comm.Get_size(), comm.Get_rank())
        largest_block = -(-samples // comm.Get_size())
        rounds = -(-largest_block // _SCAN_ROWS)  # the same on every rank: each read is collective
        first_bad = samples
        for part in range(rounds):
            lo = min(stop, start + part * _SCAN_ROWS)
            hi = min(stop, lo + _SCAN_ROWS)
            rows = data.read_collective(lo, hi)
            bad = np.flatnonzero(~np.isfinite(rows).all(axis=1)) if rows.size else []
            if len(bad):
                first_bad = min(first_bad, lo + int(bad[0]))
    first_bad = comm.allreduce(first_bad, op=MPI.MIN)
    if first_bad < samples:
        raise DataFileError(path, f"signal {first_bad} holds NaN or infinite values; clean the data first", name)
    problems = []
    if atoms > samples:
        problems.append(f"{atoms} atoms need at least as many signals to start from, the data has {samples}")
    if sparsity > features:
        problems.append(
            f"sparsity {sparsity} exceeds the signal length {features}: OMP cannot pick more independent atoms"
        )
    if batch_size > samples:
        problems.append(f"batch size {batch_size} exceeds the {samples} signals")
    if problems:
        raise ValueError(f"{path}:{name}: " + "; ".join(problems))
    return DataInfo(path, name, samples, features)


def initial_dictionary(info: DataInfo, atoms: int, seed: int, comm) -> np.ndarray:
    """Distinct signals chosen by ``seed``, scaled to unit norm (zero ones become random directions)."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(info.samples, atoms, replace=False))
    with ShardedDataset(info.path, info.name, comm) as data:
        rows = np.array([data.read(int(i), int(i) + 1)[0] for i in ids], dtype=np.float64)
    norms = np.linalg.norm(rows, axis=1)
    flat = norms <= 1e-12 * max(norms.max(), 1e-300)
    rows[flat] = rng.standard_normal((int(flat.sum()), info.features))
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


async def online_batches(reader: BatchReader, name: str, start: int) -> AsyncIterator[tuple[np.ndarray, np.ndarray]]:
    """(sample ids, signals) of this rank for iterations ``start``, ``start + 1``, ... across epochs."""
    epoch, step = divmod(start, reader.steps)
    while True:
        async for batch in reader.aepoch(epoch, step):
            yield batch.ids, np.asarray(batch.data[name], dtype=np.float64)
        epoch, step = epoch + 1, 0


def resident_block(info: DataInfo, comm) -> tuple[np.ndarray, np.ndarray]:
    """(global ids, rows) of this rank's block of the whole data set, read collectively."""
    start, stop = rank_rows(info.samples, comm.Get_size(), comm.Get_rank())
    rows = np.asarray(read_dataset(info.path, info.name, comm), dtype=np.float64)
    return np.arange(start, stop, dtype=np.int64), rows
