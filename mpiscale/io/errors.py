"""Exceptions of the I/O layer: bad data files and failed checkpoints."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import numpy as np

from ..errors import MpiscaleError

if TYPE_CHECKING:
    from ..ranks import Comm


class DataFileError(MpiscaleError, ValueError):
    """An input or mpiscale file is missing, unreadable, of another format, or lacks the data set asked for."""

    def __init__(self, path: str | os.PathLike, message: str, dataset: str | None = None) -> None:
        self.path = os.fspath(path)
        self.dataset = dataset
        self.message = message
        where = f"{self.path}:{dataset}" if dataset else self.path
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # travels between ranks (one rank lists the files, all raise)
        return type(self), (self.path, self.message, self.dataset)


def not_found(path: str, message: str) -> str:
    """``message`` about ``path`` that is not there, saying why where the path holds what only a shell expands: a
    settings file, single quotes and ``--data=~/x`` pass a ``~`` or a ``$VARIABLE`` on as it is written."""
    if path.startswith("~") or re.search(r"\$\{?[A-Za-z_]", path):
        return f"{message} (a shell expands a ~ or a $VARIABLE, but not in a settings file or in single quotes, " \
            "nor a ~ after --option=: write the path out)"  # fmt: skip
    return message


def not_numbers(dtype: np.dtype) -> str:
    """What a data set of ``dtype`` holds, in a user's words, where numbers were asked for: a table (records of
    named fields, as pandas and NumPy record arrays write them) is named by its fields, with the call that turns it
    into one array; strings and complex numbers are named as such."""
    if dtype.names and dtype.fields:
        fields = ", ".join(f"{name} ({dtype.fields[name][0]})" for name in dtype.names[:8])
        more = f" and {len(dtype.names) - 8} more" if len(dtype.names) > 8 else ""
        return (f"a table (records of the fields {fields}{more}), not one array of numbers: store its number fields "
                "as one array, e.g. numpy.lib.recfunctions.structured_to_unstructured(table)")  # fmt: skip
    metadata: dict = dict(dtype.metadata or {})
    if metadata.get("vlen") in (str, bytes):  # (how h5py marks variable-length strings)
        return "strings (of variable length)"
    kinds = {"S": "byte strings", "U": "strings", "O": "Python objects", "c": "complex numbers"}
    return f"{kinds[dtype.kind]} ({dtype})" if dtype.kind in kinds else f"dtype {dtype}"


def unreadable_rows(path: str, name: str, start: int, stop: int, error: OSError) -> DataFileError:
    """The error of rows ``start:stop`` HDF5 could not read (a damaged chunk or heap, a disk's I/O error), naming
    the file, the data set and the rows (HDF5's own is a bare OSError)."""
    why = f"rows {start}..{stop - 1} cannot be read ({error}): the file is damaged there, or its disk failed"
    return DataFileError(path, f"{why}; copy it again from its source", name)


def refuse_unreadable(comm: Comm, unreadable: tuple[int, DataFileError] | None) -> None:
    """Raise on every rank the error of the first rows any rank could not read (collective; ``unreadable``: this
    rank's first, as (row, error), or None). For reads without collectives (compressed, ``.npy``, virtual), where a
    rank that failed went on: the others are never left waiting in the next collective for a rank that raised."""
    found = [each for each in comm.allgather(unreadable) if each is not None]
    if found:
        raise min(found, key=lambda each: each[0])[1]


class RoomRefused(MpiscaleError, OSError):
    """The file system would not set a file's room aside (a full disk or quota), or the file would pass the
    process's file size limit: the words say which, and what to do (HDF5's say only that a write failed)."""


class WriteError(MpiscaleError, OSError):
    """A file could not be written (full disk, quota, read-only file system); raised on every rank alike."""


def plain_write_error(error: BaseException) -> BaseException:
    """``error``, or where it is h5py's for a write the system refused (the sec2 driver: one process's file), the
    system's reason in HDF5's words: that error holds HDF5's whole record of the call (time, descriptor, buffer
    address, "bytes actually written = 18446744073709551615") on two lines."""
    text = str(error)
    if not isinstance(error, OSError) or not error.errno or "(file write failed: time = " not in text:
        return error
    call = text.split("(file write failed", 1)[0].split("] ", 1)[-1].strip()
    return OSError(error.errno, f"{os.strerror(error.errno)} (HDF5: {call}, file write failed)")


class CheckpointError(MpiscaleError, RuntimeError):
    """A save failed (raised on every rank), or no checkpoint could be restored."""


class LockedError(MpiscaleError, RuntimeError):
    """Another job holds the checkpoint directory or results file this one was given."""


def raised_together(error: BaseException | None) -> bool:
    """Whether a loop that ``error`` ended (None: none) ended on every rank alike, so that collective clean-up, such
    as closing a file opened with MPI-IO, may follow: no error, a stop or cancellation, or an error every rank
    raises together (a refusal, an agreed failure, a failed write or checkpoint). Not after an error that may be
    this rank's alone (a GPU out of memory on one rank, a row it cannot read): the others may wait in a collective
    of their own, a collective close waits for them forever, and the error is never reported."""
    from ..ranks import AgreedError
    from ..runtime import JobRefused

    return (
        error is None
        or not isinstance(error, Exception)
        or isinstance(error, (JobRefused, AgreedError, WriteError, CheckpointError))
    )
