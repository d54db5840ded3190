"""A file of data sets written collectively, block of rows by block of rows, visible only once complete.

``write_dataset`` writes each rank's rows at once; ``RowWriter`` is for
producers that cannot hold their rows (activations of a whole data set): every
rank writes its rows of each round where they belong, and the memory a rank
needs is one round's rows whatever the data size. The file goes to a temporary
name, is checked for room first (a full disk mid-write hangs MPI-IO), and is
renamed into place by ``close``; a failure on any rank is raised on every rank
and leaves nothing behind. A job stopped half-way may ``close`` the file under
another name instead and ``reopen`` it in a later run, on any number of ranks
(the data sets are global: no rank owns a part of them).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import NoReturn

import h5py
import numpy as np

from ..ranks import AgreedError, AnyComm, Comm, agree, as_mpi, size_and_rank
from ..runtime import CollectiveMismatch, end_job
from .abandon import ONE_WRITER, closed, entered_by_all, keep_open
from .errors import WriteError, plain_write_error
from .h5file import DATASET_FORMAT, file_access, publish, settle_background_io, stamp, unstorable
from .rows import rounds_of, write_rows
from .same_calls import NO_ROWS_WRITTEN, on_files
from .space import (
    CHUNK_ROOM,
    file_bytes,
    give_back_room,
    set_room_aside,
    space_problem,
    write_failure_note,
)


class RowWriter:
    """Creates ``path`` with data sets ``{name: (global shape, dtype)}`` (collective); ``write`` and ``close`` too.

    ``attrs`` are extra file attributes (strings or numbers) besides the usual
    mpiscale ones. The data sets named in ``growing`` start with the first
    dimension of their shape and grow with ``grow`` (chunked): for output whose
    size is known only as it is made (the non-zeros of sparse codes).
    A write that fails on every rank once the file is open (a full disk) ends
    the job (see ``_failed``), its temporary file removed, or kept where
    ``resumable``: the file is a job's only state, marked as it goes, which a
    resumed run reopens (``reopen``'s writers are). The data sets' room is set
    aside as the file is made, and as they grow (``set_room_aside``): a disk
    (or an ext4 or XFS quota) another job fills while this one runs for hours
    meets that job's writes, not these; what stays unused is given back at the
    close.
    """

    _kept = False  # left open for a resumed run by ``keep``, which said so

    def __init__(
        self,
        path: str | os.PathLike,
        layout: dict[str, tuple[tuple[int, ...], np.dtype]],
        comm: AnyComm | None = None,
        config: dict | None = None,
        attrs: dict | None = None,
        file_format: str = DATASET_FORMAT,
        growing: tuple[str, ...] = (),
        resumable: bool = False,
    ) -> None:
        self.path, self.comm = os.fspath(path), as_mpi(comm)
        self.resumable = False  # (a file that could not be made holds nothing to keep)
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"writing {self.path}: the directory {directory} does not exist")
        self.size, self.rank = size_and_rank(self.comm)
        self._calls = on_files(self.comm, "RowWriter", self.path, NO_ROWS_WRITTEN)
        self._calls.enter("make it", ONE_WRITER)
        self.temporary = f"{self.path}.tmp"
        self._open: dict[str, h5py.Dataset] = {}  # (see _dataset)
        for name, (_, dtype) in layout.items():  # before any file is made: h5py refused them half-way, leaving .tmp
            problem = unstorable(np.dtype(dtype))
            if problem is not None:
                raise TypeError(f"writing {self.path}: {name} is {np.dtype(dtype)}, {problem}")
        room = space_problem(directory, _layout_bytes(layout), "the file", reserve=True) if self.rank == 0 else None
        agree(self.comm, room, f"writing {self.path}", WriteError, entered=True)
        settle_background_io()
        self.file: h5py.File | None = None
        self._counted: dict[str, int] = {}  # rank 0's: the most rows of a growing data set whose room is in _data
        failure = None
        try:
            self.file = h5py.File(self.temporary, "w", **file_access(self.comm))
            stamp(self.file, file_format, self.size, config)
            for key, value in (attrs or {}).items():
                self.file.attrs[key] = value
            for name, (shape, dtype) in layout.items():
                growth = {}  # (every row is written: none is filled first, nor a grown one, where MPI-IO filled it)
                if name in growing:
                    rows = max(1, (1 << 20) // max(np.dtype(dtype).itemsize * math.prod(shape[1:]), 1))
                    growth = {"maxshape": (None, *shape[1:]), "chunks": (rows, *shape[1:])}
                self.file.create_dataset(name, shape, np.dtype(dtype), fill_time="never", **growth)
            self._data, self._sets = _contents(self.file) if self.rank == 0 else (0, 0)  # (rank 0 sets it aside)
        except (OSError, RuntimeError) as error:
            failure = error
        self._agree(failure)
        self._opened()
        try:
            self._agree_room(f"writing {self.path}")
        except WriteError:
            self.abort()
            raise
        self.resumable = resumable

    @classmethod
    def reopen(cls, path: str | os.PathLike, kept: str | os.PathLike, comm: AnyComm | None = None) -> RowWriter:
        """Go on writing ``kept`` (a file an earlier run left with ``close(kept)``) as the temporary file of
        ``path`` (collective); its data sets and attributes stay as they are."""
        writer = cls.__new__(cls)
        writer.path, writer.comm = os.fspath(path), as_mpi(comm)
        writer.size, writer.rank = size_and_rank(writer.comm)
        writer._calls = on_files(writer.comm, "RowWriter", writer.path, NO_ROWS_WRITTEN)
        entered_by_all(writer.comm, f"RowWriter.reopen({kept})", "reopen it", ONE_WRITER, kept)
        writer.temporary, writer.file, writer._open, writer._counted = f"{writer.path}.tmp", None, {}, {}
        writer.resumable = True
        failure: BaseException | None = None
        try:
            if writer.rank == 0:
                os.replace(kept, writer.temporary)
        except OSError as error:
            failure = error
        agree(writer.comm, failure, f"reopening {kept}", WriteError, entered=True)
        settle_background_io()
        try:
            writer.file = h5py.File(writer.temporary, "r+", **file_access(writer.comm))
            writer._data, writer._sets = _contents(writer.file) if writer.rank == 0 else (0, 0)
            if writer.rank == 0:  # (the rows not yet written are holes of the file, or past its end)
                writer._set_room_aside()
        except (OSError, RuntimeError) as error:
            failure = error
        try:
            agree(writer.comm, failure, f"reopening {kept}", WriteError, entered=True)
        except WriteError:
            with contextlib.suppress(OSError, RuntimeError):
                if writer.file is not None:
                    writer.file.close()
            if writer.rank == 0:  # the stopped run's work stays where it was, never removed
                with contextlib.suppress(OSError):
                    os.replace(writer.temporary, kept)
            raise
        writer._opened()
        return writer

    def mark(self, **attrs: str | int | float | np.number) -> None:
        """Set file attributes (collective: the same values on every rank). An attribute that exists keeps its type
        and place, and only its value is written: a mark of numbers is one small write in the file's header, which a
        kill mid-way leaves readable (a replaced one, or a string of another length, takes several)."""
        assert self.file is not None, "mark after close"
        self._begin(f"mark({', '.join(attrs)})")
        failure = None
        try:
            for key, value in attrs.items():
                self.file.attrs.modify(key, value)
        except (OSError, RuntimeError) as error:
            failure = error
        self._agree(failure)

    def flush(self) -> None:
        """Push what was written to the disk (collective)."""
        assert self.file is not None, "flush after close"
        self._begin("flush")
        failure = None
        try:
            self.file.flush()
        except (OSError, RuntimeError) as error:
            failure = error
        self._agree(failure)

    def add(self, layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        """Create more data sets (collective: the same ``layout`` on every rank), for shapes known only later."""
        assert self.file is not None, "add after close"
        self._begin(f"add({', '.join(layout)})")
        failure = None
        try:
            for name, (shape, dtype) in layout.items():
                self.file.create_dataset(name, shape, np.dtype(dtype), fill_time="never")
        except (OSError, RuntimeError, ValueError) as error:
            failure = error
        self._agree(failure)
        self._data += _layout_bytes(layout)
        self._sets += len(layout)
        self._agree_room(f"adding {', '.join(layout)} to {self.path}")

    def grow(self, rows: dict[str, int]) -> None:
        """Set the first dimension of growing data sets (collective: the same ``rows`` on every rank); smaller
        drops the rows past it (a resumed run drops what its predecessor wrote after its last mark).

        A data set made smaller is flushed and closed (opened again by its next call): with MPI-IO, HDF5 (1.10.8)
        keeps the chunk the cut falls in, filled past the cut, in the data set's chunk cache, dirty, while later
        writes go past the cache to the file, and the next flush wrote that stale chunk over them (a resumed encode
        lost its first round's codes: zeros where they belonged).

        The room of the rows grown is set aside (rank 0, before any rank writes them): a disk or quota that cannot
        hold them ends the job in one line here, where HDF5 met it inside the rows' write ("file write failed")."""
        assert self.file is not None, "grow after close"
        self._begin(f"grow({', '.join(rows)})")
        for name, count in rows.items():  # (the same on every rank: refused before the file changes)
            if self._dataset(name).chunks is None:
                raise TypeError(f"grow: {name} of {self.path} was not made growing (RowWriter's growing=)")
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
                raise ValueError(
                    f"grow: {name} of {self.path} to {count!r} rows: a count of rows is a whole number >= 0"
                )
        failure = None
        try:
            shrunk, grown = [], 0
            for name, count in rows.items():
                dataset = self._dataset(name)
                extent = dataset.id.shape  # (one call into HDF5: h5py's resize makes two more around set_extent)
                dataset.id.set_extent((count, *extent[1:]))
                if count < extent[0]:
                    shrunk.append(name)
                if self.rank == 0 and count > (counted := self._counted.get(name, extent[0])):
                    grown -= _stored_bytes(dataset, (counted, *extent[1:]))
                    grown += _stored_bytes(dataset, (count, *extent[1:]))
                    self._counted[name] = count
            if grown:
                self._data += grown
                self._set_room_aside()
            if shrunk:
                self.file.flush()
                for name in shrunk:
                    del self._open[name]  # (closed: its chunk cache goes with it)
        except (OSError, RuntimeError, ValueError) as error:
            failure = error
        self._agree(failure)

    def remove(self, names: list[str]) -> None:
        """Delete the data sets or groups ``names`` that exist (collective: the same ``names`` on every rank): what a
        killed run began after its last mark, which the run that resumes it writes again."""
        assert self.file is not None, "remove after close"
        self._begin(f"remove({', '.join(names)})")
        failure = None
        try:
            for name in names:
                for opened in [key for key in self._open if key == name or key.startswith(f"{name}/")]:
                    del self._open[opened]
                if name in self.file:
                    del self.file[name]
        except (OSError, RuntimeError) as error:
            failure = error
        self._agree(failure)

    def write(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        """Write ``arrays``' rows at global row ``start`` (collective: a rank with no rows passes empty ones)."""
        assert self.file is not None, "write after close"
        arrays = {name: np.asarray(rows) for name, rows in arrays.items()}
        most = max((rounds_of(self._dataset(name), len(rows)) for name, rows in arrays.items()), default=0)
        rounds = self._begin(f"write({', '.join(arrays)})", most=most)  # (agreed with the call: one exchange)
        self._agree(self._written(start, arrays, self.comm, rounds))

    def write_replicated(self, arrays: dict[str, np.ndarray]) -> None:
        """Write whole arrays every rank holds (collective): rank 0 writes them alone, with independent I/O (the
        other ranks would only take part with no rows), and every rank learns whether that failed."""
        self._begin(f"write_replicated({', '.join(arrays)})")
        self._agree(self._written(0, arrays, None) if self.rank == 0 else None)

    def _written(
        self, start: int, arrays: dict[str, np.ndarray], comm: Comm | None, rounds: int | None = None
    ) -> BaseException | None:
        """Write ``arrays`` at row ``start``, collective over ``comm`` when given (in ``rounds`` rounds each, where
        agreed); the failure, or None."""
        assert self.file is not None, "write after close"
        try:
            for name, rows in arrays.items():
                write_rows(self._dataset(name), start, np.asarray(rows), comm, rounds=rounds, mpio=self._mpio)
        except (OSError, RuntimeError) as error:  # a full disk or quota: h5py says so in either
            return error
        return None

    def close(self, name: str | os.PathLike | None = None) -> None:
        """Flush and put the file in place (collective); ``name``: under that name instead (an unfinished file a
        later run will ``reopen``)."""
        self._begin("close")
        failure = None
        try:
            if self.file is not None:
                self.file.close()
                self.file = None
                self._open.clear()
            if self.rank == 0:
                give_back_room(self.temporary)
                publish(self.temporary, self.path if name is None else name)
        except (OSError, RuntimeError) as error:
            failure = error
        self._agree(failure)
        closed(self)

    def abort(self) -> None:
        """Close and remove the temporary file (collective: after a failure every rank saw)."""
        with contextlib.suppress(OSError, RuntimeError):
            if self.file is not None:
                self.file.close()
        self.file = None
        self._open.clear()
        closed(self)
        if self.rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(self.temporary)

    def _failed(self, error: WriteError) -> NoReturn:
        """After a write that failed on every rank, end the job, said by rank 0: the file cannot be closed (closing
        one whose write met a full disk crashed HDF5 1.10.8 in ``H5F__close_cb``, and one left open to the process's
        end never closed). A ``resumable`` file is kept for a resumed run, complete as far as it was marked; any
        other is removed."""
        if self.rank == 0 and not self.resumable:
            with contextlib.suppress(OSError):
                os.unlink(self.temporary)
        end_job(str(error) if self.rank == 0 else None)

    def _dataset(self, name: str) -> h5py.Dataset:
        """The data set ``name``, opened once and kept open (h5py opens it anew on each ``file[name]``, 60-70 µs a
        round; see ``grow`` for what a data set kept open needs when it shrinks)."""
        assert self.file is not None, "write after close"
        found = self._open.get(name)
        if found is None:
            found = self._open[name] = self.file[name]
        return found

    def _set_room_aside(self) -> None:
        """Have the file system allocate the file's room (rank 0's call: the blocks are the file's, for every rank)."""
        set_room_aside(self.temporary, file_bytes(self._data, self._sets))

    def _agree_room(self, what: str) -> None:
        """Rank 0 sets the file's room aside (collective); a refusal (a full disk, a quota) raises ``WriteError`` on
        every rank, before a row of the new room is written, so that the file stays whole and can be closed."""
        failure = None
        if self.rank == 0:
            try:
                self._set_room_aside()
            except OSError as error:
                failure = error
        agree(self.comm, failure, what, WriteError, entered=True)

    def _opened(self) -> None:
        """The file made or reopened: whether it uses MPI-IO, asked once (25-45 µs a round); over several ranks,
        this writer kept from the garbage collector until closed or aborted: a rank that drops it unclosed would
        close its file, collectively, as it is freed, and wait there for ever."""
        self._mpio = self.file is not None and self.file.driver == "mpio"
        if self.size > 1:
            keep_open(self, self._close_at_exit)

    def keep(self) -> None:
        """Leave the file open under its temporary name for a resumed run, after a failure mid-run (not
        collective): closing it is collective, and could wait for a dead rank for ever. The program's end closes it
        as every rank comes; the caller has said where it stays, so that close says nothing more."""
        self._kept = True

    def _close_at_exit(self) -> None:
        """At the process's end, a writer never closed (nor aborted): its file closed as every rank comes, kept under
        the temporary name with what was written (said by rank 0); never put in place unfinished."""
        if self.file is None:
            return
        self._begin("close", "the program's end (it never closed the writer)")
        self.file.close()
        self.file = None
        self._open.clear()
        if self.rank == 0 and not self._kept:
            print(f"mpiscale: RowWriter({self.path}) was never closed: what was written stays in {self.temporary} "
                  "(close() puts the file in place)", file=sys.stderr, flush=True)  # fmt: skip

    def _begin(self, call: str, site: str | None = None, most: int = 0) -> int:
        """Wait for every rank to come to ``call`` (``write(X)``), its next on this writer; where one came to another
        call, every rank raises ``CollectiveMismatch`` and nothing of the file stays (where one came to a call on
        another object, the file is left as it is: its close, collective, would wait for that rank). Returns the most
        any rank gave as ``most`` (``SameCalls.begin``)."""
        try:
            return self._calls.begin(call, site, most)
        except CollectiveMismatch:
            if not self._calls.met_other_calls:
                self.abort()
            raise

    def _agree(self, failure: BaseException | None) -> None:
        if isinstance(failure, (OSError, RuntimeError)):  # (a full disk: HDF5 says only that a write failed)
            failure = plain_write_error(failure)
            note = write_failure_note(os.path.dirname(os.path.abspath(self.path)), failure)
            if self.resumable:  # (said in the line that ends the job, whichever rank says it)
                note += (f"; what was marked done is kept in {self.temporary}: free space (or mend what failed), then "
                         "run the same command with --resume")  # fmt: skip
            failure = type(failure)(f"{failure}{note}") if note else failure
        if failure is not None and not self.resumable:  # (removed whatever follows: by this rank too, which may end
            with contextlib.suppress(OSError):  # the job alone, the others held in HDF5's own collective step)
                os.unlink(self.temporary)
        try:
            agree(self.comm, failure, f"writing {self.path}", WriteError, entered=True)
        except WriteError as error:
            if self.file is None:  # (no file was made: nothing to close)
                self.abort()
                raise
            self._failed(error)  # nothing half-written stays behind to fill the disk, but a resumed run's work

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        elif issubclass(kind, (WriteError, AgreedError, CollectiveMismatch)):
            self.abort()  # every rank raised it together
        else:
            self.abandon()

    def abandon(self) -> None:
        """After an error that may be this rank's alone (not collective): remove what a later run cannot use.

        The other ranks may wait in a collective write, so closing the file
        (collective with MPI-IO) could wait for them forever; the error ends
        the job (the runtime aborts every rank), and rank 0 unlinks the
        temporary name (a ``resumable`` file stays for a resumed run). With one rank there is nobody to wait for.
        """
        if self.resumable:
            return
        if self.size == 1:
            self.abort()
        elif self.rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(self.temporary)


def _layout_bytes(layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> int:
    """The bytes of the data sets of ``layout`` ({name: (shape, dtype)}) at their shapes."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in layout.values())


def _contents(file: h5py.File) -> tuple[int, int]:
    """The bytes the data sets of ``file`` take at their present shapes, and how many there are."""
    sizes: list[int] = []
    file.visititems(lambda _, item: sizes.append(_stored_bytes(item)) if isinstance(item, h5py.Dataset) else None)
    return sum(sizes), len(sizes)


def _stored_bytes(dataset: h5py.Dataset, shape: tuple[int, ...] | None = None) -> int:
    """The bytes ``dataset`` takes in its file (at ``shape`` where given: asking HDF5 for its own costs 4 µs): a
    chunked one's chunks each whole (HDF5 writes them so), with their entries in its chunk index."""
    shape = dataset.shape if shape is None else shape
    if dataset.chunks is None:
        return math.prod(shape) * dataset.dtype.itemsize
    chunks = math.prod(-(-extent // side) for extent, side in zip(shape, dataset.chunks))
    return chunks * (math.prod(dataset.chunks) * dataset.dtype.itemsize + CHUNK_ROOM)
