"""Samples of varying length, stored the two ways users store them, read as one packed array plus offsets.

A ragged data set is either an HDF5 *variable-length* data set (h5py's
``vlen_dtype``, one 1-D array per row), or the common *values + offsets*
layout: a flat data set of values (rows of any trailing shape: tokens, points
of a cloud, spectrum bins) and an integer index of where each sample starts.
The index may hold N+1 boundaries (the first 0, the last the number of
values: CSR, Arrow and PyTorch's nested tensors write it so) or N starts
(each sample runs to the next start, the last to the end). A starts index
whose last sample is empty reads as boundaries; write boundaries for that.
Either begins at 0: values before the first sample would be read by none,
so an index that begins later is refused, not read as a shorter data set.

Either way a read returns ``Ragged``: the samples' values packed end to end
and their N+1 boundaries, never a list of small arrays, so a batch is two
allocations whatever its count. The lengths of every sample are known when
the data set opens (they size batches by bytes): values + offsets read only
the index; a variable-length data set is scanned once, each rank a block.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import h5py
import numpy as np

from ..ranks import AnyComm, Comm, as_mpi, on_rank_0, rank_rows, size_and_rank
from .abandon import SOME_READERS, entered_by_all
from .errors import DataFileError, refuse_unreadable, unreadable_rows
from .h5file import dataset, open_file
from .numpy_files import is_npy, is_numpy_file
from .sharded import ShardedDataset
from .sources import in_native_order, only_dataset, resolve_files, split_spec
from .sparse_rows import sparse_group

MAPPED_FROM = 1 << 20  # arrays of at least this many bytes get a mapping of their own
READ_TASKS = 32  # groups of runs of one batch read as separate tasks
SCAN_ROWS = 1 << 14  # rows of a variable-length data set read at once when its lengths are scanned


@dataclass
class Ragged:
    """Samples packed end to end: sample ``i`` is ``values[offsets[i]:offsets[i+1]]``."""

    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Each sample's length (rows of values)."""
        return np.diff(self.offsets)

    def row(self, index: int) -> np.ndarray:
        """Sample ``index`` (a view)."""
        return self.values[self.offsets[index] : self.offsets[index + 1]]

    def take(self, rows: np.ndarray) -> Ragged:
        """The samples ``rows`` (in that order), packed anew."""
        lengths = self.lengths[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if not len(rows):
            return Ragged(self.values[:0].copy(), offsets)
        return Ragged(np.concatenate([self.row(int(row)) for row in rows]), offsets)

    def padded(self, fill: float | int = 0, length: int | None = None) -> np.ndarray:
        """The samples as one array of shape (samples, LENGTH, *trailing), the tail of each row ``fill``.

        LENGTH is the longest sample's by default; a longer ``length`` pads
        more, a shorter one is refused (a sample would be cut silently).
        """
        lengths = self.lengths
        longest = int(lengths.max(initial=0))
        length = longest if length is None else length
        if length < longest:
            raise ValueError(f"cannot pad to {length}: the longest sample holds {longest}")
        out = np.full((len(self), length, *self.values.shape[1:]), fill, dtype=self.values.dtype)
        rows = np.repeat(np.arange(len(self)), lengths)
        within = np.arange(len(self.values)) - np.repeat(self.offsets[:-1], lengths)
        out[rows, within] = self.values
        return out


def boundaries(raw: np.ndarray, values: int, path: str, name: str) -> np.ndarray:
    """N+1 sample boundaries from an index of N+1 boundaries or N starts, checked against ``values`` values."""
    if raw.ndim != 1 or raw.dtype.kind not in "iu":
        raise DataFileError(path, f"offsets must be one row of integers, got {raw.dtype} of shape {raw.shape}", name)
    raw = raw.astype(np.int64)
    if len(raw) and raw[0] != 0:
        raise DataFileError(path, (
            f"offsets must begin at 0, the first sample's start, but begin at {raw[0]}: values 0 .. {raw[0] - 1} "
            "would belong to no sample (an index of another slice of the values, or of rows counted from 1?)"
        ), name)  # fmt: skip
    whole = len(raw) >= 2 and raw[-1] == values
    edges = raw if whole else np.append(raw, values)
    outside = np.flatnonzero((edges < 0) | (edges > values))
    if len(outside):
        first = int(outside[0])
        raise DataFileError(
            path, f"offset {first} is {edges[first]}, outside 0 .. {values} (the number of values)", name
        )
    falling = np.flatnonzero(np.diff(edges) < 0)
    if len(falling):
        first = int(falling[0])
        raise DataFileError(
            path, f"offsets must not decrease: offset {first + 1} is {edges[first + 1]}, after {edges[first]}", name
        )
    return edges


class RaggedDataset:
    """One ragged data set of one or more files, read by sample ids; see the module docstring.

    ``path`` and ``name`` are as for ``ShardedDataset`` (a file, a glob, a
    list file, ``.npy``). ``offsets`` names the index: a data set name, found
    in each file beside its values (each file's index counts its own values),
    or a spec of its own (``other.h5:/offsets``, ``offsets.npy``) indexing all
    the values at once. Without ``offsets`` the data set must be
    variable-length. Reads are independent (no collective calls), so they may
    run in a background thread; with ``comm``, rank 0 lists the files and
    reads the index, and every rank gets the same.
    """

    def __init__(self, path: str | os.PathLike, name: str = "", offsets: str = "", comm: AnyComm | None = None) -> None:
        self.path, self.name, self.offsets_name = os.fspath(path), name.strip("/"), offsets
        comm = as_mpi(comm)
        self._values: ShardedDataset | None = None
        self._vlen: list[tuple[int, h5py.Dataset]] = []
        entered_by_all(comm, f"RaggedDataset({self.path})", "open it", SOME_READERS, self.path)
        files = on_rank_0(comm, lambda: resolve_files(self.path))
        try:
            if offsets:
                self._values = ShardedDataset(files, self.name)
                self.name = self._values.name
                self.dtype: np.dtype = self._values.dtype
                self.row_shape: tuple[int, ...] = self._values.shape[1:]
                self.offsets = on_rank_0(comm, self._read_index)
            else:
                self._open_vlen(files)
                self.offsets = np.concatenate([[0], np.cumsum(_agreed_lengths(self._vlen, comm))]).astype(np.int64)
        except BaseException:
            self.close()
            raise
        self.lengths = np.diff(self.offsets)
        self.unit_bytes = self.dtype.itemsize * math.prod(self.row_shape)

    def _read_index(self) -> np.ndarray:
        assert self._values is not None
        path, name = split_spec(self.offsets_name) if ":" in self.offsets_name else ("", self.offsets_name)
        if is_npy(name):
            path, name = name, ""
        if path:  # one index of all the values
            with ShardedDataset(path, name) as index:
                return boundaries(index.read(0, len(index)), len(self._values), path, index.name)
        parts, shift = [], 0
        for file, rows in zip(self._values.files, self._values.rows_per_file()):
            if is_npy(file):
                raise DataFileError(file, f"a .npy file holds no data set {name!r}: give --offsets as its own file")
            with ShardedDataset(file, name) as index:
                edges = boundaries(index.read(0, len(index)), rows, file, index.name)
            parts.append(edges[:-1] + shift)
            shift += rows
        return np.append(np.concatenate(parts), shift)

    def _open_vlen(self, files: list[str]) -> None:
        first = 0
        for path in files:
            if is_numpy_file(path):
                raise DataFileError(path, "is a NumPy file of fixed rows: give its index with --offsets")
            file = open_file(path)
            try:
                name = self.name or only_dataset(path, file)
                data = dataset(file, name)
                base = h5py.check_vlen_dtype(data.dtype)
                if base is None:
                    raise DataFileError(path, (
                        f"holds fixed rows of {data.dtype}{data.shape[1:]}, not variable-length ones: for values "
                        "plus an index of sample starts, name the index with --offsets"
                    ), name)  # fmt: skip
                if np.dtype(base).kind not in "biuf" or data.ndim != 1:
                    raise DataFileError(
                        path, f"variable-length rows of {base} in shape {data.shape}: numbers in one row each", name
                    )
            except BaseException:
                file.close()
                raise
            self.name = name
            self._vlen.append((first, data))
            first += len(data)
        self.dtype = _element_dtype(self._vlen[0][1])
        self.row_shape = ()
        for _, data in self._vlen[1:]:
            if _element_dtype(data) != self.dtype:
                raise DataFileError(data.file.filename, f"rows of {data.dtype}, the first file's {self.dtype}", name)

    def __len__(self) -> int:
        return len(self.lengths)

    def read(self, ids: np.ndarray, each: Callable = map) -> Ragged:
        """The samples ``ids`` (ascending), packed: one read per run of consecutive ids, the runs handed to
        ``each`` (``map``, or a thread pool's ``map`` to read them at once: the disk serves many requests
        better than one)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids[0] < 0 or ids[-1] >= len(self) or (np.diff(ids) <= 0).any()):
            raise IndexError(f"{self.path}:{self.name}: sample ids must ascend within 0 .. {len(self) - 1}")
        lengths = self.lengths[ids]
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = mapped((int(offsets[-1]), *self.row_shape), self.dtype)
        read_in_runs(ids, self._read_run, lambda lo, hi: values[offsets[lo] : offsets[hi]], each)
        return Ragged(values, offsets)

    def _read_run(self, start: int, stop: int, out: np.ndarray) -> None:
        if self._values is not None:
            self._values.read(int(self.offsets[start]), int(self.offsets[stop]), out=out)
            return
        filled = 0
        for first, data in self._vlen:
            lo, hi = max(start, first), min(stop, first + len(data))
            if lo < hi:
                rows = _vlen_rows(data, lo - first, hi - first)
                swapped = _read_unswapped(data)
                for row in rows:
                    out[filled : filled + len(row)] = row.byteswap() if swapped else row
                    filled += len(row)

    def close(self) -> None:
        """Close the files."""
        if self._values is not None:
            self._values.close()
        for _, data in self._vlen:
            data.file.close()
        self._vlen.clear()

    def __enter__(self) -> RaggedDataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _element_dtype(data: h5py.Dataset) -> np.dtype:
    """The numbers' dtype of a variable-length data set, in this machine's byte order (HDF5 reads either so)."""
    return in_native_order(np.dtype(h5py.check_vlen_dtype(data.dtype)))


def _read_unswapped(data: h5py.Dataset) -> bool:
    """Whether h5py hands this variable-length data set's rows with the file's bytes under this machine's dtype: so
    it does (h5py 3.16) for numbers stored in the other byte order, which a big-endian tool's file holds."""
    return not np.dtype(h5py.check_vlen_dtype(data.dtype)).isnative and _h5py_leaves_vlen_bytes_unswapped()


@functools.cache
def _h5py_leaves_vlen_bytes_unswapped() -> bool:
    """The h5py at hand, asked once, on a file in memory: a row of 1 stored big-endian, read back as 1 or not."""
    other = np.dtype(np.int32).newbyteorder("S")
    with h5py.File("probe", "w", driver="core", backing_store=False) as probe:
        rows = probe.create_dataset("rows", (1,), dtype=h5py.vlen_dtype(other))
        rows[0] = np.array([1], other)
        return int(rows[0][0]) != 1


def is_variable_length(path: str, name: str) -> bool:
    """Whether ``name`` in the first HDF5 file ``path`` names is a variable-length data set (one process)."""
    first = resolve_files(os.fspath(path))[0]
    if is_numpy_file(first):
        return False
    with open_file(first) as file:
        if name and sparse_group(file.get(name.strip("/"))):
            return False  # (a sparse matrix's rows are of one size)
        return h5py.check_vlen_dtype(dataset(file, name or only_dataset(first, file)).dtype) is not None


def mapped(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array in its own anonymous memory mapping, unmapped as soon as the array and its views are dropped.

    A batch of megabytes from malloc would go back to a per-thread arena that
    keeps it (glibc raises its mmap threshold after a large free), so a
    reader within its budget would still grow the process; a mapping of its
    own returns the memory at once.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes < MAPPED_FROM:
        return np.empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)


def read_in_runs(
    ids: np.ndarray, read_run: Callable[[int, int, np.ndarray], None], into: Callable[[int, int], np.ndarray],
    each: Callable = map, tasks: int = READ_TASKS,
) -> None:  # fmt: skip
    """``read_run(first id, past-last id, into(lo, hi))`` for each run ``ids[lo:hi]`` of consecutive ids, the runs
    cut into at most ``tasks`` groups of neighbours, each group one call of ``each``'s function (a thread pool's
    ``map`` reads them at once; a task per run would cost more than many small reads)."""
    found = runs(ids)
    step = -(-len(found) // tasks) if found else 1

    def read_group(group: list[tuple[int, int]]) -> None:
        for lo, hi in group:
            read_run(int(ids[lo]), int(ids[hi - 1]) + 1, into(lo, hi))

    for _ in each(read_group, [found[at : at + step] for at in range(0, len(found), step)]):
        pass


def runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """(first, past-last) positions of each run of consecutive ids in ascending ``ids``."""
    if not len(ids):
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], cuts])
    return list(zip(starts.tolist(), [*cuts.tolist(), len(ids)]))


def _agreed_lengths(parts: list[tuple[int, h5py.Dataset]], comm: Comm | None) -> np.ndarray:
    """Every row's length of variable-length data sets, each rank scanning a block of the rows."""
    total = sum(len(data) for _, data in parts)
    size, rank = size_and_rank(comm)
    start, stop = rank_rows(total, size, rank)
    mine = np.empty(stop - start, dtype=np.int64)
    unreadable = None
    try:
        for first, data in parts:
            lo, hi = max(start, first), min(stop, first + len(data))
            for at in range(lo, hi, SCAN_ROWS):
                block = _vlen_rows(data, at - first, min(hi, at + SCAN_ROWS) - first)
                mine[at - start : at - start + len(block)] = [len(row) for row in block]
    except DataFileError as error:
        if comm is None:
            raise
        unreadable = (start, error)  # (said on every rank below: the others are not left in the allgather)
    if comm is None:
        return mine
    refuse_unreadable(comm, unreadable)
    return np.concatenate(comm.allgather(mine))


def _vlen_rows(data: h5py.Dataset, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a variable-length data set; rows HDF5 cannot read (a damaged heap) are said as such."""
    try:
        return data[start:stop]
    except OSError as error:
        raise unreadable_rows(data.file.filename, data.name.lstrip("/"), start, stop, error) from None
