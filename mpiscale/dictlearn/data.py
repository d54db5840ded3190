"""The learner's view of its data: checks before any work, the initial atoms, and the batch streams."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import numpy as np

from ..io import (
    BatchReader,
    DataFileError,
    Fingerprint,
    ShardedDataset,
    available_memory,
    not_numbers,
    rank_rows,
    read_dataset,
    refuse_unreadable,
)
from ..ranks import Comm, host_placement
from ..words import counted

_SCAN_BYTES = 64 << 20  # bytes per collective read while scanning for NaN
#: Values of whose magnitude the squares stay normal float64 numbers: outside, the Gram matrix and the residuals
#: underflow (all codes zero, atoms off unit norm) or overflow.
_SMALLEST, _LARGEST = float(np.sqrt(np.finfo(np.float64).tiny)), float(np.sqrt(np.finfo(np.float64).max)) / 1e3

log = logging.getLogger(__name__)


@dataclass
class DataInfo:
    """What the checks learned: where the signals are, how many, their length and their shape."""

    path: str
    name: str
    samples: int
    features: int
    patch_shape: list[int] | None = None  # image patches: the rows' 2-D shape, for plots
    fingerprint: str = ""  # the digest of every value (``io.Fingerprint``; "" for a synthetic set, made by its seed)

    @property
    def spec(self) -> str:
        """The data as a user names it: FILE:/dataset (or just the file for .npy)."""
        return f"{self.path}:/{self.name}" if self.name else self.path


def check_data(path: str, name: str, atoms: int, sparsity: int, batch_size: int | None, comm: Comm) -> DataInfo:
    """Open the signals (collective), check shape and sizes, and scan every value for NaN or infinity, and the data
    for a scale it can be learned at (not all zero, squares neither underflowing nor overflowing); the same scan
    takes the values' fingerprint, which a resumed run compares with its checkpoint's.

    ``batch_size``: the global mini-batch, which may not exceed the signals; None where the method takes the
    whole data set at once (mod) and reads no mini-batches.

    Signals are the rows of any numeric data set; further axes are flattened
    (an N x 8 x 8 stack of patches is N signals of 64 values). Raises
    ``DataFileError`` or ``ValueError`` naming the file and the fix; every rank
    raises the same error because every rank sees the same totals.
    """
    from mpi4py import MPI

    with ShardedDataset(path, name, comm) as data:
        name = data.name
        if data.dtype.kind not in "biuf":
            raise DataFileError(path, f"signals must be numbers, got {not_numbers(data.dtype)}", name)
        if len(data.shape) < 2:
            raise DataFileError(
                path, f"signals are rows: a 1-D array of {data.shape[0]} values is not a set of signals "
                "(store it as signals x features)", name,
            )  # fmt: skip
        samples, features = data.shape[0], int(np.prod(data.shape[1:]))
        if not samples or not features:
            raise DataFileError(path, f"holds no signals (shape {data.shape})", name)
        matlab = data.matlab_note("signals")
        if matlab and comm.Get_rank() == 0:
            log.warning(matlab)
        patch_shape = data.image_shape()
        start, stop = rank_rows(samples, comm.Get_size(), comm.Get_rank())
        largest_block = -(-samples // comm.Get_size())
        rows_per_read = max(1, _SCAN_BYTES // (features * data.dtype.itemsize))
        rounds = -(-largest_block // rows_per_read)  # the same on every rank: each read is collective
        first_bad, largest = samples, 0.0
        fingerprint = Fingerprint()
        unreadable: tuple[int, DataFileError] | None = None  # this rank's first rows that cannot be read
        for part in range(rounds):
            lo = min(stop, start + part * rows_per_read)
            hi = min(stop, lo + rows_per_read)
            try:
                rows = data.read_collective(lo, hi).reshape(hi - lo, features)
            except DataFileError as error:  # (a damaged chunk: refused below on every rank, as a NaN is)
                if not data.reads_independently:
                    raise
                unreadable = unreadable or (lo, error)
                continue
            fingerprint.add(lo, rows)
            bad = np.empty(0, np.int64)
            if rows.size and data.dtype.kind == "f":
                bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))
            if len(bad):
                first_bad = min(first_bad, lo + int(bad[0]))
            elif rows.size:
                largest = max(largest, float(np.abs(rows).max()))
    first_bad = comm.allreduce(first_bad, op=MPI.MIN)
    refuse_unreadable(comm, unreadable)
    digest = fingerprint.digest(comm, samples, features)
    if first_bad < samples:
        raise DataFileError(path, f"signal {first_bad} holds NaN or infinite values; clean the data first", name)
    problem = scale_problem(comm.allreduce(largest, op=MPI.MAX))
    if problem:
        raise DataFileError(path, problem, name)
    problems = size_problems(atoms, sparsity, batch_size, samples, features)
    if problems:
        raise DataFileError(path, problems, name)
    return DataInfo(path, name, samples, features, patch_shape, digest)


def size_problems(atoms: int, sparsity: int, batch_size: int | None, samples: int, features: int) -> str:
    """Why signals of this count and length cannot be learned from with these settings ("" when they can)."""
    problems = []
    if atoms > samples:
        problems.append(f"{atoms} atoms need at least as many signals to start from, the data has {samples}")
    if sparsity > features:
        problems.append(
            f"sparsity {sparsity} exceeds the signal length {features}: OMP cannot pick more independent atoms"
        )
    if batch_size is not None and batch_size > samples:
        problems.append(f"batch size {batch_size} exceeds the {samples} signals")
    return "; ".join(problems)


def memory_problem(atoms: int, comm: Comm, matrices: int = 2) -> str:
    """Why ``atoms`` atoms cannot fit in memory ("" when they may; collective, the same on every rank). Each rank
    keeps at least ``matrices`` atoms x atoms float64 matrices (learning: the Gram matrix and the statistics, and the
    update makes more; coding: the Gram matrix), and a host's ranks share its memory. Past it, the first of them
    failed to be allocated mid-start (numpy's "Unable to allocate 26.8 GiB"), or the kernel's OOM killer ended a rank
    without a report."""
    ranks = host_placement(comm)[1]
    need, have = matrices * atoms * atoms * 8 * ranks, available_memory()
    problem = "" if need <= have else (
        f"{atoms} atoms keep matrices of {atoms} x {atoms} numbers on every rank: at least {need / 2**30:.1f} GiB "
        f"for the {counted(ranks, 'rank')} of host {socket.gethostname()}, which has {have / 2**30:.1f} GiB "
        "available: use fewer atoms (or fewer ranks a host)"
    )  # fmt: skip
    return next((said for said in comm.allgather(problem) if said), "")


def scale_problem(largest: float) -> str:
    """Why data whose largest magnitude is ``largest`` cannot be learned from ("" when it can)."""
    if largest == 0:
        return "every value is zero: there is nothing to learn from"
    if not _SMALLEST <= largest <= _LARGEST:
        way = "underflow" if largest < _SMALLEST else "overflow"
        return (f"the largest value is {largest:.3g}: at that scale the squares of the data {way} in float64 and "
                "nothing is learned; scale the data first (divide it by its standard deviation)")  # fmt: skip
    return ""


def initial_ids(samples: int, atoms: int, rng: np.random.Generator) -> np.ndarray:
    """The sorted ids of the distinct signals the first atoms are made of (all of them when there are fewer)."""
    return np.sort(rng.choice(samples, min(atoms, samples), replace=False))


def unit_atoms(rows: np.ndarray, atoms: int, rng: np.random.Generator) -> np.ndarray:
    """``atoms`` unit rows: ``rows`` scaled, then random directions for zero rows and for atoms beyond ``rows``."""
    chosen = np.zeros((atoms, rows.shape[1]))
    chosen[: len(rows)] = rows
    norms = np.linalg.norm(chosen, axis=1)
    flat = norms <= 1e-12 * max(norms.max(), 1e-300)
    chosen[flat] = rng.standard_normal((int(flat.sum()), chosen.shape[1]))
    return chosen / np.linalg.norm(chosen, axis=1, keepdims=True)


def initial_dictionary(info: DataInfo, atoms: int, seed: int, comm: Comm, remove_mean: bool = False) -> np.ndarray:
    """Distinct signals chosen by ``seed`` (each less its mean with ``remove_mean``), scaled to unit norm (zero ones
    become random directions)."""
    rng = np.random.default_rng(seed)
    ids = initial_ids(info.samples, atoms, rng)
    with ShardedDataset(info.path, info.name, comm) as data:
        rows = np.array([data.read(int(i), int(i) + 1)[0] for i in ids], dtype=np.float64).reshape(len(ids), -1)
    if remove_mean:
        rows -= rows.mean(axis=1, keepdims=True)
    return unit_atoms(rows, atoms, rng)


async def online_batches(reader: BatchReader, name: str, start: int) -> AsyncGenerator[tuple[np.ndarray, np.ndarray]]:
    """(sample ids, signals) of this rank for iterations ``start``, ``start + 1``, ... across epochs."""
    epoch, step = divmod(start, reader.steps)
    while True:
        async for batch in reader.aepoch(epoch, step):
            signals = np.asarray(batch.data[name], dtype=np.float64)
            # by its shape, not -1: a rank with no rows in this batch (fewer rows than ranks) gets an empty block
            yield batch.ids, signals.reshape(len(signals), int(np.prod(signals.shape[1:])))
        epoch, step = epoch + 1, 0


def resident_block(info: DataInfo, comm: Comm) -> tuple[np.ndarray, np.ndarray]:
    """(global ids, rows) of this rank's block of the whole data set, read collectively."""
    start, stop = rank_rows(info.samples, comm.Get_size(), comm.Get_rank())
    rows = np.asarray(read_dataset(info.path, info.name, comm), dtype=np.float64).reshape(stop - start, info.features)
    return np.arange(start, stop, dtype=np.int64), rows
