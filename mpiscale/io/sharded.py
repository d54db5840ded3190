"""Sharded datasets: arrays stored with their global shape, written and read by row ranges.

``write_dataset`` is collective: each rank passes its own rows, and they land in global row order (rank 0's
first) in one HDF5 file written with the MPI driver and collective I/O. ``write_index`` puts several HDF5 files
(written by jobs of any world size, or by any other tool) behind one index file; ``ShardedDataset`` reads a plain
file, an index, a glob or a list of files the same way, so callers never see the shards. The index also holds an
HDF5 virtual dataset per array, so plain serial ``h5py`` reads it as one array.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import h5py
import numpy as np
from numpy.typing import DTypeLike

from ..errors import refuse_a_str
from ..ranks import AnyComm, as_mpi, on_rank_0, rank_rows, size_and_rank, world_ranks
from .abandon import ONE_WRITER, SOME_READERS, close_after, closed, entered_by_all, keep_open, leave_open
from .errors import DataFileError, refuse_unreadable
from .h5file import (
    INDEX_FORMAT,
    check_array,
    check_virtual_sources,
    dataset,
    datasets_in,
    file_format,
    open_file,
    settle_background_io,
    stamp,
    write_file,
)
from .numpy_files import NpySource, is_numpy_file
from .same_calls import NO_ROWS_READ, on_files
from .sources import H5Source, distinct_files, in_native_order, only_dataset, resolve_files, same_file
from .sparse_rows import CsrSource, sparse_group, sparse_groups
from .writer import RowWriter

#: Where a data set's rows come from, file by file.
Source: TypeAlias = H5Source | NpySource | CsrSource

#: Colour channels an image row may have (RGB, RGBA), last or first: (H, W, C) or (C, H, W).
COLOURS = {3, 4}


def write_dataset(
    path: str | os.PathLike, arrays: dict[str, np.ndarray], comm: AnyComm | None = None, config: dict | None = None
) -> dict[str, tuple[int, ...]]:
    """Write each rank's rows of every array into one file (collective); returns the global shapes.

    Ranks may hold any number of rows (zero included), but trailing shapes and
    dtypes must agree. The file appears under ``path`` only once complete.
    """
    path, comm = os.fspath(path), as_mpi(comm)
    entered_by_all(comm, f"write_dataset({path})", "write it", ONE_WRITER, path)
    size, rank = size_and_rank(comm)
    arrays = {name: np.asarray(array) for name, array in arrays.items()}
    single = sorted(name for name, array in arrays.items() if array.ndim == 0)  # no rows: refused by every rank
    layout = {
        name: (len(array) if array.ndim else 0, array.shape[1:], array.dtype.str) for name, array in arrays.items()
    }
    gathered = comm.allgather((layout, single)) if comm is not None else [(layout, single)]
    for at, (_, values) in enumerate(gathered):  # (each rank named by its rank in the job)
        if values:
            raise ValueError(f"write_dataset {path}: rank {world_ranks(comm)[at]} passes {values[0]} as a single "
                             "value; arrays hold rows on their first axis (np.atleast_1d makes it a row)")  # fmt: skip
    every = [other for other, _ in gathered]
    for at, other in enumerate(every):
        if {k: v[1:] for k, v in other.items()} != {k: v[1:] for k, v in layout.items()}:
            raise ValueError(
                f"write_dataset {path}: rank {world_ranks(comm)[at]} passes arrays {_describe(other)} but rank "
                f"{world_ranks(comm)[rank]} passes {_describe(layout)}; names, row shapes and dtypes must agree"
            )
    shapes = {name: (sum(other[name][0] for other in every), *trailing) for name, (_, trailing, _) in layout.items()}
    offsets = {name: sum(other[name][0] for other in every[:rank]) for name in layout}
    with RowWriter(path, {name: (shapes[name], np.dtype(layout[name][2])) for name in layout}, comm, config) as writer:
        for name, array in arrays.items():  # one data set at a time, each at this rank's offset
            writer.write(offsets[name], {name: array})
    return shapes


def _describe(layout: dict) -> str:
    return ", ".join(
        f"{name}: {np.dtype(dtype)} rows of {tuple(trailing)}" for name, (_, trailing, dtype) in layout.items()
    )


def _check_index_path(path: str, shards: Sequence[str | os.PathLike]) -> None:
    """Refuse an index path that would replace data: one of the shards, or an existing file that is not an index."""
    for shard in shards:
        if same_file(path, shard):
            raise DataFileError(path, f"is a file the index would list ({os.fspath(shard)}): writing the index there "
                                "would replace it; name the index another file")  # fmt: skip
    if not os.path.exists(path):
        return
    kind = None
    if h5py.is_hdf5(path):
        with open_file(path) as file:
            kind = file_format(file)
    if kind != INDEX_FORMAT:
        raise DataFileError(path, f"exists and is not an index ({kind or 'not an mpiscale file'}): writing the index "
                            "there would replace it; name the index another file, or remove it first")  # fmt: skip


def _refuse_sparse_parts(shard: str | os.PathLike, file: h5py.File, wanted: list[str]) -> None:
    """Refuse to index a sparse matrix (its parts joined file after file make no matrix: each indptr starts at 0)."""
    for group in sparse_groups(file):
        if group in wanted or any(name.startswith(f"{group}/") for name in wanted):
            raise DataFileError(shard, (
                "is a sparse matrix (its data, indices and indptr), which an index cannot join: its parts are no rows "
                f"(each file's indptr starts at 0); read the files as one with a quoted glob or a list instead, e.g. "
                f"'FILES-*.h5ad:/{group}'" + ("" if len(wanted) == 1 else ", or index the other data sets by name "
                                               "(--dataset)")
            ), group)  # fmt: skip


def write_index(
    path: str | os.PathLike, shards: Sequence[str | os.PathLike], names: list[str] | None = None
) -> dict[str, tuple[int, ...]]:
    """Write an index that presents the shard files, in order, as one dataset file (one process).

    Shards are any HDF5 files (mpiscale's own or a user's); ``names`` picks the data sets (paths such as
    ``/run/X``), by default every data set of the first shard. Shard paths are stored relative to the index, so
    the directory can move. Returns the global shape of every array.
    """
    path = os.fspath(path)
    refuse_a_str(shards, "shards", "files")
    refuse_a_str(names or [], "names", "data set names")
    if not shards:
        raise ValueError(f"write_index {path}: no shard files given")
    _check_index_path(path, shards)
    distinct_files(path, [os.fspath(shard) for shard in shards])
    base = os.path.dirname(os.path.abspath(path))
    entries: list[dict] = []
    layouts = []
    for shard in shards:
        with open_file(shard) as file:
            wanted = [n.strip("/") for n in names] if names else datasets_in(file)
            if not wanted:
                raise DataFileError(shard, "holds no data sets")
            _refuse_sparse_parts(shard, file, wanted)
            layout = {}
            for name in wanted:
                data = dataset(file, name)
                if not data.shape:
                    raise DataFileError(shard, f"is a scalar {data.dtype}, not rows", name)
                layout[name] = (data.shape, in_native_order(data.dtype))  # HDF5 reads either order as this
            layouts.append(layout)
            entries.append({"path": os.path.relpath(os.path.abspath(shard), base)})
    first = layouts[0]
    for shard, layout in zip(shards, layouts):
        if set(layout) != set(first):
            raise DataFileError(shard, f"holds arrays {sorted(layout)}, the first shard {sorted(first)}")
        for name, (shape, dtype) in layout.items():
            if shape[1:] != first[name][0][1:] or dtype != first[name][1]:
                raise DataFileError(
                    shard, f"rows of {dtype}{shape[1:]} differ from the first shard's {first[name][1]}"
                    f"{first[name][0][1:]}", name,
                )  # fmt: skip
    for entry, layout in zip(entries, layouts):
        entry["rows"] = {name: int(shape[0]) for name, (shape, _) in layout.items()}
    shapes = {}

    def write(file: h5py.File) -> None:
        stamp(file, INDEX_FORMAT, 1, {"shards": len(entries)})
        file.attrs["shards"] = json.dumps(entries)
        for name in sorted(first):
            total = sum(layout[name][0][0] for layout in layouts)
            shape = (total, *first[name][0][1:])
            virtual = h5py.VirtualLayout(shape=shape, dtype=first[name][1])
            start = 0
            for entry, layout in zip(entries, layouts):
                rows = layout[name][0][0]
                if rows:
                    virtual[start : start + rows] = h5py.VirtualSource(entry["path"], name, shape=layout[name][0])
                start += rows
            file.create_virtual_dataset(name, virtual)
            shapes[name] = shape

    write_file(path, write)
    return shapes


@dataclass
class _Segment:
    start: int
    stop: int
    source: Source

    def within(self, start: int, stop: int) -> tuple[int, int]:
        """Rows ``start:stop`` of the data set as rows of this segment's source; an empty range where they miss."""
        return min(max(start, self.start), self.stop) - self.start, max(min(stop, self.stop), self.start) - self.start


class ShardedDataset:
    """One array of one or more input files, read by global row ranges as if it were one array.

    ``path`` is a file, a glob, a text file listing files, or a list of paths
    (see ``mpiscale.io.sources``); files are HDF5 of any origin (an mpiscale
    index brings in its shards) or ``.npy``. ``name`` is the data set in each
    HDF5 file; empty means the file's only data set. With ``comm``, HDF5 files
    are opened collectively with the MPI driver (every rank of ``comm`` must
    construct it, and ``read_collective`` must be called by all); ``read`` is
    independent and may run in a background thread.
    """

    def __init__(
        self,
        path: str | os.PathLike | list,
        name: str = "",
        comm: AnyComm | None = None,
        dtype: DTypeLike | None = None,
        row_shape: tuple[int, ...] | None = None,
    ) -> None:
        self.path = os.fspath(path) if not isinstance(path, list) else ", ".join(map(os.fspath, path))
        self.name = name.strip("/")
        self._comm = as_mpi(comm)
        self._sources: list[Source] = []
        self._calls = on_files(self._comm, "ShardedDataset", path, NO_ROWS_READ)
        self._calls.enter("open it", SOME_READERS)
        try:
            self._segments = self._open(path)
        except BaseException:
            self.close()
            raise
        first = self._segments[0].source
        self.dtype: np.dtype = first.dtype
        self.shape: tuple[int, ...] = (self._segments[-1].stop, *first.shape[1:])
        check_array(self.path, self.name, self.shape, self.dtype, row_shape, dtype)
        if self._comm is not None and self._comm.Get_size() > 1:
            keep_open(self, self.close)  # (never closed by the garbage collector: its close is collective)

    def _open(self, path) -> list[_Segment]:
        files = [os.fspath(p) for p in path] if isinstance(path, list) else None
        if files is None:  # one listing for all ranks: a glob never differs between them
            files = on_rank_0(self._comm, lambda: resolve_files(os.fspath(path)))
        else:
            distinct_files(self.path, files)
        sources: list[Source] = []
        for file in files:
            sources += self._open_file(file)
        segments, start = [], 0
        for source in sources:
            if source.shape[1:] != sources[0].shape[1:] or source.dtype != sources[0].dtype:
                raise DataFileError(
                    source.path, f"rows of {source.dtype}{source.shape[1:]} differ from those of {sources[0].path} "
                    f"({sources[0].dtype}{sources[0].shape[1:]}); files read as one data set must agree", self.name,
                )  # fmt: skip
            segments.append(_Segment(start, start + source.shape[0], source))
            start += source.shape[0]
        return segments

    def _open_file(self, path: str) -> list[Source]:
        if is_numpy_file(path):
            npy = NpySource(path, self.name)
            self._sources.append(npy)
            self.name = self.name or npy.name
            return [npy]
        file = open_file(path, None, self._comm)
        try:
            if not self.name:
                self.name = only_dataset(path, file)
            if file_format(file) != INDEX_FORMAT:
                return [self._h5_source(file)]
            entries = json.loads(file.attrs["shards"])
            dataset(file, self.name)  # a clear error if the index lacks the array
        except BaseException:
            file.close()
            raise
        file.close()
        base = os.path.dirname(os.path.abspath(path))
        sources: list[Source] = []
        for entry in entries:
            source = self._h5_source(open_file(os.path.join(base, entry["path"]), None, self._comm))
            expected = entry["rows"][self.name]
            if source.shape[0] != expected:
                raise DataFileError(source.path, f"has {source.shape[0]} rows, the index says {expected}", self.name)
            sources.append(source)
        return sources

    def _h5_source(self, file: h5py.File) -> H5Source | CsrSource:
        """This data set of an open file, kept for ``close`` (the file is closed if the data set is unusable).

        A data set behind an external link is read from the file the link leads to, where its rows lie (HDF5
        opened that file on following it). A virtual data set (a user's, joining files) is read by each rank alone:
        HDF5 reads none through MPI-IO."""
        try:
            node = file.get(self.name.strip("/") or "/")
            if sparse_group(node):
                csr = CsrSource(file, node)
                self._sources.append(csr)
                return csr
            found = dataset(file, self.name)
            if found.file.id != file.id:
                linked = found.file
                file.close()  # (collective, as every open and close here: every rank follows the same links)
                file = linked
            if found.is_virtual:
                check_virtual_sources(found)
                if file.driver == "mpio":
                    path, inside = file.filename, found.name
                    file.close()  # (collective: every rank opens the same files in the same order)
                    file = open_file(path)
                    found = dataset(file, inside)
            source = H5Source(file, found)
        except BaseException:
            file.close()
            raise
        self._sources.append(source)
        return source

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def files(self) -> list[str]:
        """The files behind the data set, in row order."""
        return [segment.source.path for segment in self._segments]

    def rows_per_file(self) -> list[int]:
        """Rows of each file behind the data set, in the order of ``files``."""
        return [segment.stop - segment.start for segment in self._segments]

    def attrs(self) -> dict:
        """Attributes of the first file (an empty dict for ``.npy``): mpiscale files keep their config here."""
        first = self._segments[0].source
        return dict(first.file.attrs) if isinstance(first, H5Source) else {}

    @property
    def from_matlab(self) -> bool:
        """Whether the data set is a MATLAB array (``save -v7.3`` marks each with ``MATLAB_class``): a matrix HDF5
        holds transposed, so its rows here are MATLAB's columns."""
        first = self._segments[0].source
        return isinstance(first, H5Source) and "MATLAB_class" in first.dataset.attrs and len(self.shape) == 2

    def matlab_note(self, what: str) -> str | None:
        """For a MATLAB array (``from_matlab``), how it is read (``what``: what a row is); else None. Not refused:
        signals as columns is MATLAB's and SPAMS's own layout, read right as it is."""
        if not self.from_matlab:
            return None
        rows, columns = self.shape
        return (f"{self.path}:{self.name} is a MATLAB array (save -v7.3), which HDF5 holds transposed: it is read as "
                f"{rows} {what} of {columns} values, MATLAB's columns of its {columns} x {rows} array; if MATLAB's "
                "rows are the samples, save the array transposed (X = X.') and give that")  # fmt: skip

    def image_shape(self) -> list[int] | None:
        """The shape of a row when rows are images: a 3-D data set (grey images), a 4-D one with 3 or 4 colour
        channels last or first (RGB patches), or a ``patch_shape`` in the file's config."""
        if len(self.shape) == 3 or (len(self.shape) == 4 and COLOURS & {self.shape[1], self.shape[3]}):
            return [int(v) for v in self.shape[1:]]
        config = self.attrs().get("config")
        try:
            shape = json.loads(config).get("patch_shape") if config else None
        except (ValueError, AttributeError):
            return None
        return [int(v) for v in shape] if shape else None

    def _check(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.shape[0]:
            raise IndexError(f"{self.path}:{self.name}: rows {start}:{stop} outside 0:{self.shape[0]}")

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``start:stop`` (independent I/O), into ``out`` when given (rows of this data set's dtype)."""
        self._check(start, stop)
        if out is None:
            out = np.empty((stop - start, *self.shape[1:]), self.dtype)
        for s in self._segments:
            lo, hi = max(start, s.start), min(stop, s.stop)
            if lo < hi:
                s.source.read(lo - s.start, hi - s.start, out=out[lo - start : hi - start])
        return out

    @property
    def reads_independently(self) -> bool:
        """Whether ``read_collective`` takes no collective call (every file compressed, ``.npy`` or virtual): a
        rank whose read failed may go on to the next without leaving the others in a collective."""
        return all(segment.source.independent for segment in self._segments)

    def read_collective(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` with collective I/O: every rank of ``comm`` calls, with any ranges."""
        self._check(start, stop)
        spans = [(s.source, *s.within(start, stop)) for s in self._segments]  # (every segment takes part)
        most = max((source.rounds(hi - lo) for source, lo, hi in spans if isinstance(source, H5Source)), default=0)
        rounds = self._calls.begin("read_collective", most=most)  # (the transfers' rounds agreed with the call)
        settle_background_io()
        parts = [source.read(lo, hi, self._comm, rounds=rounds) if isinstance(source, H5Source)
                 else source.read(lo, hi, self._comm) for source, lo, hi in spans]  # fmt: skip
        return self._join(parts)

    def _join(self, parts: list[np.ndarray]) -> np.ndarray:
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty((0, *self.shape[1:]), self.dtype)

    def close(self) -> None:
        """Close the files (collective when opened with ``comm``); closing again does nothing."""
        if not self._sources:  # (closed, or none opened)
            return
        if self._comm is not None:
            self._calls.begin("close")
            settle_background_io()
        for source in self._sources:
            source.close()
        self._sources.clear()
        closed(self)

    def abandon(self) -> None:
        """After an error that may be this rank's alone: leave the files open (``leave_open``), not closed
        collectively."""
        leave_open(self)

    def __enter__(self) -> ShardedDataset:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: object) -> None:
        """Closed as the block ends; files opened with MPI-IO are left open after an error that may be this rank's
        alone (``close_after``): their close is collective, and would wait forever for ranks that went on."""
        if self._comm is None:
            self.close()
        else:
            close_after(self, error)


def read_dataset(
    path: str | os.PathLike,
    name: str = "",
    comm: AnyComm | None = None,
    dtype: DTypeLike | None = None,
    row_shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """This rank's block of rows of ``name`` (collective), split as ``np.array_split`` would."""
    comm = as_mpi(comm)
    with ShardedDataset(path, name, comm, dtype, row_shape) as data:
        size, rank = size_and_rank(comm)
        start, stop = rank_rows(len(data), size, rank)
        if comm is None or not data.reads_independently:
            return data.read_collective(start, stop) if comm is not None else data.read(start, stop)
        rows, unreadable = None, None
        try:
            rows = data.read_collective(start, stop)
        except DataFileError as error:  # (a damaged chunk on this rank's rows: refused on every rank alike)
            unreadable = (start, error)
        refuse_unreadable(comm, unreadable)
        assert rows is not None, "read, or refused on every rank"
        return rows
