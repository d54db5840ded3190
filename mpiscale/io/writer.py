"""A file of data sets written collectively, block of rows by block of rows, visible only once complete.

``write_dataset`` writes each rank's rows at once; ``RowWriter`` is for
producers that cannot hold their rows (activations of a whole data set): every
rank writes its rows of each round where they belong, and the memory a rank
needs is one round's rows whatever the data size. The file goes to a temporary
name, is checked for room first (a full disk mid-write hangs MPI-IO), and is
renamed into place by ``close``; a failure on any rank is raised on every rank
and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os

import h5py
import numpy as np

from ..ranks import AgreedError, AnyComm, agree, as_mpi, size_and_rank
from .errors import WriteError
from .h5file import DATASET_FORMAT, file_access, publish, settle_background_io, stamp
from .rows import write_rows
from .space import space_problem


class RowWriter:
    """Creates ``path`` with data sets ``{name: (global shape, dtype)}`` (collective); ``write`` and ``close`` too.

    ``attrs`` are extra file attributes (strings or numbers) besides the usual
    mpiscale ones.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        layout: dict[str, tuple[tuple[int, ...], np.dtype]],
        comm: AnyComm | None = None,
        config: dict | None = None,
        attrs: dict | None = None,
        file_format: str = DATASET_FORMAT,
    ) -> None:
        self.path, self.comm = os.fspath(path), as_mpi(comm)
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"writing {self.path}: the directory {directory} does not exist")
        self.size, self.rank = size_and_rank(self.comm)
        self.temporary = f"{self.path}.tmp"
        total = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in layout.values())
        room = space_problem(directory, total, "the file") if self.rank == 0 else None
        agree(self.comm, room, f"writing {self.path}", WriteError)
        settle_background_io()
        self.file: h5py.File | None = None
        failure = None
        try:
            self.file = h5py.File(self.temporary, "w", **file_access(self.comm))
            stamp(self.file, file_format, self.size, config)
            for key, value in (attrs or {}).items():
                self.file.attrs[key] = value
            for name, (shape, dtype) in layout.items():
                self.file.create_dataset(name, shape, np.dtype(dtype), fill_time="never")  # every row is written
        except (OSError, RuntimeError) as error:
            failure = error
        self._agree(failure)

    def add(self, layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        """Create more data sets (collective: the same ``layout`` on every rank), for shapes known only later."""
        assert self.file is not None, "add after close"
        failure = None
        try:
            for name, (shape, dtype) in layout.items():
                self.file.create_dataset(name, shape, np.dtype(dtype), fill_time="never")
        except (OSError, RuntimeError, ValueError) as error:
            failure = error
        self._agree(failure)

    def write(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        """Write ``arrays``' rows at global row ``start`` (collective: a rank with no rows passes empty ones)."""
        assert self.file is not None, "write after close"
        failure = None
        try:
            for name, rows in arrays.items():
                write_rows(self.file[name], start, np.asarray(rows), self.comm)
        except (OSError, RuntimeError) as error:  # a full disk or quota: h5py says so in either
            failure = error
        self._agree(failure)

    def close(self) -> None:
        """Flush and put the file in place (collective)."""
        failure = None
        try:
            if self.file is not None:
                self.file.close()
                self.file = None
            if self.rank == 0:
                publish(self.temporary, self.path)
        except (OSError, RuntimeError) as error:
            failure = error
        self._agree(failure)

    def abort(self) -> None:
        """Close and remove the temporary file (collective: after a failure every rank saw)."""
        with contextlib.suppress(OSError, RuntimeError):
            if self.file is not None:
                self.file.close()
        self.file = None
        if self.rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(self.temporary)

    def _agree(self, failure: BaseException | None) -> None:
        try:
            agree(self.comm, failure, f"writing {self.path}", WriteError)
        except WriteError:
            self.abort()  # nothing half-written stays behind to fill the disk
            raise

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        elif issubclass(kind, (WriteError, AgreedError)) or self.size == 1:
            self.abort()  # every rank raised it together, or there is no other rank
        elif self.rank == 0:
            # An error of this rank's alone, raised while the others wait in a collective write: closing the
            # file (collective with MPI-IO) would wait for them forever. The error ends the job (the runtime
            # aborts every rank); only the temporary name goes.
            with contextlib.suppress(OSError):
                os.unlink(self.temporary)
