"""Files opened with MPI-IO where one rank may be missing: left open after an error that may be one rank's alone,
not closed collectively; opened, made and saved only once every rank has come to do so.

Closing such a file is collective: a rank whose own error ends a loop would
wait in the close for ranks that went on to a collective of their own, and
the error would never be said. So what holds the files is abandoned (left
open) after such an error, and the job ends: the runtime aborts every rank.
Where every rank raised the error and the process ends normally, what was
left open is closed as it exits, before MPI is finalized; so is every file
still open with MPI-IO over one rank, whatever holds it.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from typing import Protocol

import h5py

from ..ranks import EACH_RANK, AnyComm, report_and_abort
from ..runtime import blocking_entry
from .errors import raised_together
from .same_calls import named_alike

ONE_WRITER = f"{EACH_RANK} (a file that one rank writes alone takes no comm)"
SOME_READERS = f"{EACH_RANK} (a data set that only some ranks read takes no comm)"

#: What ``leave_open`` and ``keep_open`` keep for the rest of the process, in the order they were left (by id): the
#: object, and how it is closed at the process's end.
_LEFT_OPEN: dict[int, tuple[object, Callable[[], None]]] = {}


def leave_open(*held: Closable) -> None:
    """Keep ``held`` (data sets, or what holds them) unclosed, after an error that may be this rank's alone: closing
    a file opened with MPI-IO is collective, and the other ranks may wait in a collective of their own, so the close
    would wait forever and the error never be reported. Nothing closes them meanwhile, the garbage collector
    included. Where the error is one rank's, the runtime aborts every rank; where every rank raised it (a refusal)
    and the process ends normally, they are closed as it exits, before MPI is finalized (HDF5 would close them
    after, which MPI refuses), in the order they were left: the same on every rank."""
    for each in held:
        keep_open(each, each.close)


def keep_open(owner: object, close_at_exit: Callable[[], None]) -> None:
    """Keep ``owner`` (what holds a file opened with MPI-IO over several ranks) from the garbage collector until
    ``closed(owner)``, as ``leave_open`` does; ``close_at_exit`` closes it if the process ends first. A rank that
    drops it unclosed (returns early, past the others' next call on it) would otherwise close it, collectively, as
    it is freed, and wait there for the others for ever; at the exit its close meets the others' call instead."""
    if not _LEFT_OPEN:  # (registered now, after MPI's own exit handler: handlers run last registered first)
        atexit.register(_close_left_open)
    _LEFT_OPEN.setdefault(id(owner), (owner, close_at_exit))


def closed(owner: object) -> None:
    """``owner`` was closed: ``keep_open`` lets it go."""
    _LEFT_OPEN.pop(id(owner), None)


def _close_left_open() -> None:
    """Close what ``leave_open`` and ``keep_open`` kept (at a normal exit), in the order they were kept; an error
    there ends the job as one no code caught (a close that met another rank's other call: each rank raises it)."""
    try:
        while _LEFT_OPEN:
            _, close = _LEFT_OPEN.pop(next(iter(_LEFT_OPEN)))
            close()
    except Exception as error:
        report_and_abort(type(error), error, error.__traceback__)


def _close_one_rank_files() -> None:
    """Close every HDF5 file still open with MPI-IO over a communicator of one rank (at a normal exit, after what
    ``keep_open`` kept). What the interpreter's end does not free (a daemon thread's arguments, say: a thread left
    running with the job's writer) is closed by HDF5 only as the process exits, after MPI is finalized, and Open MPI
    then ends the process in its abort ("MPI_Barrier ... called after MPI_FINALIZE"): a refusal's status 2 became 1.
    Files over several ranks are left as they are: their close is collective, and another rank may hold none."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or not h5py.get_config().mpi:
        return
    try:
        for file in h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE):
            access = file.get_access_plist()
            if access.get_driver() != h5py.h5fd.MPIO:
                continue
            comm, info = access.get_fapl_mpio()  # (HDF5's own copies: freed here)
            alone = comm.Get_size() == 1
            comm.Free()
            if info != MPI.INFO_NULL:
                info.Free()
            if alone and file.valid:
                h5py.File(file).close()  # (the file's data sets and groups with it)
    except Exception as error:
        report_and_abort(type(error), error, error.__traceback__)


atexit.register(_close_one_rank_files)  # (handlers run last registered first: after _close_left_open)


class Closable(Protocol):
    """What holds files: a data set, or what holds data sets."""

    def close(self) -> None: ...


class Abandonable(Closable, Protocol):
    """What holds files opened with MPI-IO: closed collectively, or abandoned after an error of one rank's."""

    def abandon(self) -> None: ...


def close_after(held: Abandonable, error: BaseException | None) -> None:
    """Close ``held`` (a reader, a data set) as the loop that ``error`` ended (None: none) ends; or, where that
    error may be this rank's alone (``raised_together``), abandon it: the other ranks may wait in a collective of
    the loop, and the close, collective too, would wait for them forever with the error unsaid."""
    if raised_together(error):
        held.close()
    else:
        held.abandon()


def entered_by_all(
    comm: AnyComm | None, what: str, doing: str, must: str = EACH_RANK, path: str | os.PathLike | list | None = None
) -> None:
    """Wait until every rank of ``comm`` comes to the collective file call ``what`` (``"RowWriter(out.h5)"``), as
    ``runtime.blocking_entry`` waits; ``path``: the file or files it is on, by whose real paths two ranks at calls of
    one kind on different files are told apart (two opens of different files on one communicator wait for ever)."""
    blocking_entry(comm, what, doing, must, alike=None if path is None else named_alike(what.split("(")[0], path))
