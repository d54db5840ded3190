"""Sharded datasets: arrays stored with their global shape, written and read by row ranges.

``write_dataset`` is collective: each rank passes its own rows, and they land
in global row order (rank 0's first) in one HDF5 file written with the MPI
driver and collective I/O. ``write_index`` puts several such files (written by
jobs of any world size) behind one index file; ``ShardedDataset`` reads a plain
dataset file or an index the same way, so callers never see the shards. The
index also holds an HDF5 virtual dataset per array, so plain serial ``h5py``
reads it as one array.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import h5py
import numpy as np

from ..runtime.collectives import block_rows
from .h5file import (
    DATASET_FORMAT,
    INDEX_FORMAT,
    DataFileError,
    check_array,
    dataset,
    open_file,
    publish,
    settle_background_io,
    stamp,
)
from .rows import read_rows, write_rows


def rank_rows(total: int, size: int, rank: int) -> tuple[int, int]:
    """Row range ``[start, stop)`` of ``rank`` when ``total`` rows are split into ``size`` blocks."""
    rows = block_rows(total, size)
    start = sum(rows[:rank])
    return start, start + rows[rank]


def write_dataset(
    path: str | os.PathLike, arrays: dict[str, np.ndarray], comm=None, config: dict | None = None
) -> dict[str, tuple[int, ...]]:
    """Write each rank's rows of every array into one file (collective); returns the global shapes.

    Ranks may hold any number of rows (zero included), but trailing shapes and
    dtypes must agree. The file appears under ``path`` only once complete.
    """
    path = os.fspath(path)
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise FileNotFoundError(
            f"write_dataset {path}: the directory {os.path.dirname(os.path.abspath(path))} does not exist"
        )
    size = comm.Get_size() if comm is not None else 1
    rank = comm.Get_rank() if comm is not None else 0
    layout = {name: (len(array), array.shape[1:], np.asarray(array).dtype.str) for name, array in arrays.items()}
    every = comm.allgather(layout) if comm is not None else [layout]
    for other_rank, other in enumerate(every):
        if {k: v[1:] for k, v in other.items()} != {k: v[1:] for k, v in layout.items()}:
            raise ValueError(
                f"write_dataset {path}: rank {other_rank} passes arrays {_describe(other)} "
                f"but rank {rank} passes {_describe(layout)}; names, row shapes and dtypes must agree"
            )
    temporary = f"{path}.tmp"
    kwargs = {"driver": "mpio", "comm": comm} if comm is not None else {}
    settle_background_io()
    shapes = {}
    with h5py.File(temporary, "w", **kwargs) as file:
        stamp(file, DATASET_FORMAT, size, config)
        for name, (_, trailing, dtype) in layout.items():
            counts = [other[name][0] for other in every]
            shape = (sum(counts), *trailing)
            target = file.create_dataset(name, shape=shape, dtype=np.dtype(dtype))
            write_rows(target, sum(counts[:rank]), np.asarray(arrays[name]), comm)
            shapes[name] = shape
    if rank == 0:
        publish(temporary, path)
    if comm is not None:
        comm.Barrier()
    return shapes


def _describe(layout: dict) -> str:
    return ", ".join(
        f"{name}: {np.dtype(dtype)} rows of {tuple(trailing)}" for name, (_, trailing, dtype) in layout.items()
    )


def write_index(path: str | os.PathLike, shards: list[str | os.PathLike]) -> dict[str, tuple[int, ...]]:
    """Write an index that presents the shard files, in order, as one dataset file (one process).

    Shard paths are stored relative to the index, so the directory can move.
    Returns the global shape of every array.
    """
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    entries, layouts = [], []
    for shard in shards:
        with open_file(shard, (DATASET_FORMAT,)) as file:
            layouts.append({name: (ds.shape, ds.dtype) for name, ds in file.items()})
            entries.append({"path": os.path.relpath(os.path.abspath(shard), base)})
    if not layouts:
        raise ValueError(f"write_index {path}: no shard files given")
    names = set(layouts[0])
    for shard, layout in zip(shards, layouts):
        if set(layout) != names:
            raise DataFileError(shard, f"holds arrays {sorted(layout)}, the first shard {sorted(names)}")
        for name in names:
            if layout[name][0][1:] != layouts[0][name][0][1:] or layout[name][1] != layouts[0][name][1]:
                raise DataFileError(shard, "row shape or dtype differs from the first shard", name)
    for entry, layout in zip(entries, layouts):
        entry["rows"] = {name: int(shape[0]) for name, (shape, _) in layout.items()}
    shapes = {}
    temporary = f"{path}.tmp"
    with h5py.File(temporary, "w") as file:
        stamp(file, INDEX_FORMAT, 1, {"shards": len(entries)})
        file.attrs["shards"] = json.dumps(entries)
        for name in sorted(names):
            total = sum(layout[name][0][0] for layout in layouts)
            shape = (total, *layouts[0][name][0][1:])
            virtual = h5py.VirtualLayout(shape=shape, dtype=layouts[0][name][1])
            start = 0
            for entry, layout in zip(entries, layouts):
                rows = layout[name][0][0]
                if rows:
                    virtual[start : start + rows] = h5py.VirtualSource(entry["path"], name, shape=layout[name][0])
                start += rows
            file.create_virtual_dataset(name, virtual)
            shapes[name] = shape
    publish(temporary, path)
    return shapes


@dataclass
class _Segment:
    start: int
    stop: int
    dataset: h5py.Dataset


class ShardedDataset:
    """One array of a dataset file or index, read by global row ranges.

    With ``comm``, files are opened collectively with the MPI driver (every rank
    of ``comm`` must construct it, and ``read_collective`` must be called by all);
    ``read`` is independent and may run in a background thread.
    """

    def __init__(self, path: str | os.PathLike, name: str, comm=None, dtype=None, row_shape=None) -> None:
        self.path = os.fspath(path)
        self.name = name
        self._comm = comm
        self._files: list[h5py.File] = []
        try:
            self._segments = self._open()
        except BaseException:
            self.close()
            raise
        first = self._segments[0].dataset
        self.dtype: np.dtype = first.dtype
        self.shape: tuple[int, ...] = (self._segments[-1].stop, *first.shape[1:])
        check_array(self.path, name, self.shape, self.dtype, row_shape, dtype)

    def _open(self) -> list[_Segment]:
        top = open_file(self.path, (DATASET_FORMAT, INDEX_FORMAT), self._comm)
        if top.attrs["format"] == DATASET_FORMAT:
            self._files.append(top)
            data = dataset(top, self.name)
            return [_Segment(0, data.shape[0], data)]
        entries = json.loads(top.attrs["shards"])
        dataset(top, self.name)  # a clear error if the index lacks the array
        top.close()
        base = os.path.dirname(os.path.abspath(self.path))
        segments, start = [], 0
        for entry in entries:
            shard = open_file(os.path.join(base, entry["path"]), (DATASET_FORMAT,), self._comm)
            self._files.append(shard)
            data = dataset(shard, self.name)
            if data.shape[0] != entry["rows"][self.name]:
                message = f"has {data.shape[0]} rows, the index says {entry['rows'][self.name]}"
                raise DataFileError(shard.filename, message, self.name)
            segments.append(_Segment(start, start + data.shape[0], data))
            start += data.shape[0]
        return segments

    def __len__(self) -> int:
        return self.shape[0]

    def _check(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.shape[0]:
            raise IndexError(f"{self.path}:{self.name}: rows {start}:{stop} outside 0:{self.shape[0]}")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (independent I/O)."""
        self._check(start, stop)
        parts = [
            read_rows(s.dataset, max(start, s.start) - s.start, min(stop, s.stop) - s.start)
            for s in self._segments
            if max(start, s.start) < min(stop, s.stop)
        ]
        return self._join(parts)

    def read_collective(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` with collective I/O: every rank of ``comm`` calls, with any ranges."""
        self._check(start, stop)
        settle_background_io()
        parts = []
        for s in self._segments:
            lo, hi = max(start, s.start), min(stop, s.stop)
            if hi < lo:
                lo = hi = s.start
            parts.append(read_rows(s.dataset, lo - s.start, hi - s.start, self._comm))
        return self._join(parts)

    def _join(self, parts: list[np.ndarray]) -> np.ndarray:
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty((0, *self.shape[1:]), self.dtype)

    def close(self) -> None:
        """Close the files (collective when opened with ``comm``)."""
        if self._comm is not None:
            settle_background_io()
        for file in self._files:
            file.close()
        self._files.clear()

    def __enter__(self) -> ShardedDataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_dataset(path: str | os.PathLike, name: str, comm=None, dtype=None, row_shape=None) -> np.ndarray:
    """This rank's block of rows of ``name`` (collective), split as ``np.array_split`` would."""
    with ShardedDataset(path, name, comm, dtype, row_shape) as data:
        size = comm.Get_size() if comm is not None else 1
        rank = comm.Get_rank() if comm is not None else 0
        start, stop = rank_rows(len(data), size, rank)
        return data.read_collective(start, stop) if comm is not None else data.read(start, stop)
