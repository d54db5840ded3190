"""Opening and stamping mpiscale HDF5 files, with errors that name the file and dataset.

Every file the project writes carries ``mpiscale_version``, ``format``,
``created``, ``world_size`` and ``config`` (JSON) attributes. Readers of the
project's own kinds of file (indexes, checkpoints, results) check ``format``;
input data is any HDF5 file, whoever wrote it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from datetime import UTC, datetime
from typing import TypeVar

import h5py
import numpy as np
from numpy.typing import DTypeLike

from .._version import __version__
from ..ranks import Comm, on_rank_0
from .errors import DataFileError, not_found
from .external_raw import check_raw_files
from .filters import undecodable
from .other_formats import other_directory, other_format
from .space import file_bytes, give_back_room, set_room_aside
from .write_lock import read_lock, release

DATASET_FORMAT = "mpiscale.dataset/1"
INDEX_FORMAT = "mpiscale.dataset-index/1"
CHECKPOINT_FORMAT = "mpiscale.checkpoint/1"
SHARD_FORMAT = "mpiscale.checkpoint-shard/1"
T = TypeVar("T")


_background: set[Future] = set()
_background_lock = threading.Lock()


def track_background_io(future: Future) -> None:
    """Register a background task that makes collective HDF5 calls (a checkpoint write)."""
    with _background_lock:
        _background.add(future)
    future.add_done_callback(_forget)


def _forget(future: Future) -> None:
    with _background_lock:
        _background.discard(future)


def settle_background_io() -> None:
    """Wait for background collective HDF5 work before this thread makes a collective HDF5 call.

    h5py lets one thread at a time into HDF5. If one rank's main thread entered
    a collective call (say, closing an MPI-IO file) while its checkpoint thread
    waited for its turn, and another rank did the opposite, both would wait
    forever. Letting the background work finish first gives every rank the
    same order. Its errors are not consumed here; the checkpointer raises them.
    """
    with _background_lock:
        pending = list(_background)
    if pending:  # (waiting for none took 5 µs a round)
        wait(pending)


def utc_timestamp() -> str:
    """Now, in UTC, as ISO 8601 to the second: every time mpiscale writes into a file or record."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def stamp(file: h5py.File, file_format: str, world_size: int, config: dict | None = None) -> None:
    """Write the attributes every mpiscale file carries."""
    file.attrs["mpiscale_version"] = __version__
    file.attrs["format"] = file_format
    file.attrs["created"] = utc_timestamp()
    file.attrs["world_size"] = int(world_size)
    file.attrs["config"] = json.dumps(config or {}, sort_keys=True, default=str)


def fixed_strings(values: list[str]) -> np.ndarray:
    """Fixed-length UTF-8 bytes (parallel HDF5 writes no variable-length strings)."""
    encoded = [value.encode() for value in values]
    return np.array(encoded, dtype=f"S{max(1, *map(len, encoded))}")


#: How a pip user rebuilds h5py against the site's parallel HDF5 (HDF5_DIR too where it is not found by itself).
PARALLEL_H5PY = "HDF5_MPI=ON CC=mpicc pip install --no-binary=h5py --no-build-isolation --force-reinstall h5py"


def file_access(comm: Comm | None) -> dict:
    """``h5py.File`` keywords for a file every rank of ``comm`` opens: the MPI-IO driver.

    A job of one rank (or no communicator) with an h5py built without MPI (a
    workstation's pip wheel) opens files plainly, so single-rank jobs run
    anywhere; a job of several ranks needs parallel HDF5 and says so.
    """
    if comm is None or (comm.Get_size() == 1 and not h5py.get_config().mpi):
        return {}
    if not h5py.get_config().mpi:
        raise ValueError(  # the installation's, not the run's: status 2, never retried
            f"h5py {h5py.__version__} was built without MPI, so a job of {comm.Get_size()} ranks cannot share an "
            f"HDF5 file: rebuild it against parallel HDF5 ({PARALLEL_H5PY}; launch/setup.sh does it in a checkout), "
            "or run one rank"
        )
    return {"driver": "mpio", "comm": comm}


def open_file(path: str | os.PathLike, formats: tuple[str, ...] | None = None, comm: Comm | None = None) -> h5py.File:
    """Open ``path`` read-only (collectively with the MPI driver when ``comm`` is given).

    ``formats``: the ``format`` attributes accepted (mpiscale's own kinds of
    file); None accepts any HDF5 file. Every problem is a DataFileError naming
    the file, raised before the MPI-IO layer sees a path it cannot open.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        store = other_directory(path)
        raise DataFileError(path, f"is a directory, not an HDF5 file: {store}" if store else
                            "is a directory, not an HDF5 file (give FILE.h5:/dataset)")  # fmt: skip
    if not os.path.exists(path):
        raise DataFileError(path, not_found(path, "no such file"))
    if not os.access(path, os.R_OK):
        raise DataFileError(path, "is not readable (permission denied)")
    if not h5py.is_hdf5(path):
        if os.path.getsize(path) == 0:
            raise DataFileError(path, "is empty")
        what = other_format(path)
        raise DataFileError(path, f"not an HDF5 file but {what}" if what else
                            "not an HDF5 file (no HDF5 signature: truncated, or another format?)")  # fmt: skip
    lock = _read_lock(path, comm)
    try:
        if comm is not None:
            settle_background_io()
        file = ReadLockedFile(path, "r", **file_access(comm))
    except OSError as error:
        if lock is not None:
            release(lock)
        raise DataFileError(path, f"not a readable HDF5 file (truncated or corrupt?): {error}") from error
    file.hold(lock)
    if formats is None:
        return file
    found = file_format(file)
    if found not in formats:
        file.close()
        expected = " or ".join(formats)
        what = f"format attribute {found!r}" if found is not None else "no format attribute"
        raise DataFileError(path, f"not an mpiscale file of format {expected} ({what})")
    return file


class ReadLockedFile(h5py.File):
    """An HDF5 file opened for reading that holds the shared lock HDF5's readers hold (``write_lock``) until it is
    closed (or freed unclosed), so that a program opening it for writing meanwhile is refused, as HDF5 refuses it
    beside any reader: the MPI-IO driver takes no lock of its own."""

    _release: weakref.finalize | None = None

    def hold(self, lock: int | None) -> None:
        """Keep ``lock`` (a descriptor holding the shared lock; None: no lock) until the file is closed."""
        if lock is not None:
            self._release = weakref.finalize(self, release, lock)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._release is not None:
                self._release()


def _read_lock(path: str, comm: Comm | None) -> int | None:
    """Rank 0's shared lock on ``path`` (one rank holds it for the job), or None (another rank; no lock taken); a
    DataFileError on every rank where another program holds the file open for writing: read through MPI-IO, which
    takes no lock, its rows could be missing or half written, where h5py alone refuses it ("unable to lock file")."""
    taken: list[int] = []

    def lock() -> None:
        fd, holder = read_lock(path)
        if holder is not None:
            raise DataFileError(path, f"is open for writing by {holder} (HDF5's lock on it is held): its rows may "
                                "be missing or half written; read it once that program has closed it "
                                "(HDF5_USE_FILE_LOCKING=FALSE reads it anyway)")  # fmt: skip
        if fd is not None:
            taken.append(fd)

    on_rank_0(comm, lock, (DataFileError,))
    return taken[0] if taken else None


def file_format(file: h5py.File) -> str | None:
    """The ``format`` attribute mpiscale stamps on its files, or None (a file from elsewhere)."""
    found = file.attrs.get("format")
    return found.decode() if isinstance(found, bytes) else found if isinstance(found, str) else None


def dataset(file: h5py.File, name: str) -> h5py.Dataset:
    """The dataset ``name`` of ``file`` (a path such as ``/run/3/X``), or a DataFileError naming both; one
    compressed with a filter that cannot be loaded is refused here, before its first read, and so is one whose raw
    files (external storage) are not all where HDF5 looks (see ``check_raw_files``)."""
    name = name.strip("/") or "/"
    try:
        node = file[name]
    except KeyError:
        parent, _, _ = name.rpartition("/")
        link = file.get(name, getlink=True) if not parent or parent in file else None
        if isinstance(link, h5py.ExternalLink):
            beside = os.path.join(os.path.dirname(file.filename), link.filename)  # where HDF5 looks, as here
            there = os.path.isfile(beside) or os.path.isfile(link.filename)
            message = (f"is a link to {link.filename}:{link.path}, "
                       + ("a data set that file does not hold" if there else "a file that is not there"))  # fmt: skip
        elif isinstance(link, h5py.SoftLink):
            message = f"is a link to {link.path}, which is not there"
        elif parent and parent not in file:
            message = f"no group {parent!r}"
        else:
            message = f"no dataset {name!r}"
        raise DataFileError(file.filename, f"{message} (datasets: {describe_datasets(file)})", name) from None
    if not isinstance(node, h5py.Dataset):
        inside = describe_datasets(node)
        categorical = isinstance(node.get("codes"), h5py.Dataset) and "categories" in node
        hint = f"; a categorical column (as AnnData keeps one): its class numbers are {name}/codes" if categorical \
            else ""  # fmt: skip
        raise DataFileError(file.filename, f"is a group, not a dataset (datasets in it: {inside}){hint}", name)
    problem = undecodable(node)
    if problem:
        raise DataFileError(file.filename, problem, name)
    check_raw_files(node)
    return node


def unstorable(dtype: np.dtype) -> str | None:
    """Why HDF5 cannot store ``dtype`` (unicode strings, dates and durations, Python objects), with what to store
    instead; None when it can."""
    try:
        h5py.h5t.py_create(dtype, logical=True)
    except TypeError:
        counts = "int64 counts of its unit"
        instead = {"U": "bytes (.astype('S'))", "M": counts, "m": counts}.get(dtype.kind, "numbers, bool or bytes")
        return f"which HDF5 cannot store; store {instead}"
    return None


def check_virtual_sources(data: h5py.Dataset) -> None:
    """Refuse a virtual data set whose rows come from a file or data set that is not there: HDF5 reads the fill
    value (0 unless set) in their place, without a word; and one whose sources need a filter nothing here decodes
    (``undecodable``, which loads hdf5plugin's where needed). Source files named relative to the virtual data set's
    file are looked up beside it, as HDF5 does; patterns (``%b``) are left to HDF5."""
    base = os.path.dirname(os.path.abspath(data.file.filename))
    for mapping in data.virtual_sources():
        name = mapping.file_name
        if name == "." or "%" in name:  # this same file; the files of an unlimited mapping
            continue
        found = next((p for p in (os.path.join(base, name), name) if os.path.isfile(p)), None)
        why = f"maps rows to {name}, which is not there" if found is None else None
        compressed = None
        if found is not None:
            try:
                with h5py.File(found, "r") as source:
                    if mapping.dset_name.strip("/") not in source:
                        why = f"maps rows to {name}:{mapping.dset_name}, a data set that file does not hold"
                    else:
                        compressed = undecodable(source[mapping.dset_name])
            except OSError:
                why = f"maps rows to {name}, which is no readable HDF5 file"
        if compressed is not None:
            raise DataFileError(data.file.filename, f"is a virtual data set of {name}:{mapping.dset_name}, which "
                                                    f"{compressed}", data.name)  # fmt: skip
        if why is not None:
            raise DataFileError(data.file.filename, f"is a virtual data set that {why}: HDF5 would give its fill "
                                                    "value for those rows; restore the file, or map only what "
                                                    "exists", data.name)  # fmt: skip


def datasets_in(group: h5py.Group) -> list[str]:
    """Paths of every dataset under ``group`` (visiting nested groups), in HDF5's name order."""
    found: list[str] = []
    group.visititems(lambda name, node: found.append(name) if isinstance(node, h5py.Dataset) else None)
    return found


SUMMARY_BYTES = 64 << 20  # what a report reads of a data set for its numbers: quick on a file of any size


def leading_rows(data: h5py.Dataset, budget_bytes: int = SUMMARY_BYTES) -> np.ndarray:
    """The first rows of ``data`` that fit in ``budget_bytes`` (one at least, where it has any), for a report."""
    row_bytes = max(1, int(np.prod(data.shape[1:])) * data.dtype.itemsize)
    return data[: min(len(data), max(1, budget_bytes // row_bytes))]


def describe_datasets(group: h5py.Group, most: int = 12) -> str:
    """A short list of the datasets under ``group`` with their shapes and dtypes, for error messages."""
    names = datasets_in(group)
    if not names:
        return "none"
    shown = [f"{name} {group[name].shape} {group[name].dtype}" for name in names[:most]]
    more = f", and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(shown) + more


def check_array(
    path: str,
    name: str,
    shape: tuple,
    dtype: np.dtype,
    expect_shape: tuple[int, ...] | None = None,
    expect_dtype: DTypeLike | None = None,
) -> None:
    """Raise DataFileError if a stored array's trailing shape or dtype is not what the caller expects."""
    if expect_dtype is not None and np.dtype(expect_dtype) != dtype:
        raise DataFileError(path, f"dtype is {dtype}, expected {np.dtype(expect_dtype)}", name)
    if expect_shape is not None and tuple(expect_shape) != tuple(shape[1:]):
        raise DataFileError(path, f"rows have shape {tuple(shape[1:])}, expected {tuple(expect_shape)}", name)


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file or directory to stable storage."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(temporary: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make the complete file ``temporary`` appear as ``path``: flush it, rename it, flush the directory.

    Readers see the old ``path`` or the whole new one, even after a crash.
    """
    fsync_path(temporary)
    os.replace(temporary, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def published(path: str | os.PathLike) -> Iterator[str]:
    """The temporary name to write the file ``path`` under: published as ``path`` when the block ends (``publish``),
    removed if it raised. Readers see the old file or the whole new one, and a failed write leaves nothing."""
    temporary = f"{os.fspath(path)}.tmp"
    try:
        yield temporary
        publish(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def write_atomically(path: str | os.PathLike, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    with published(path) as temporary, open(temporary, "wb") as file:
        file.write(data)


def write_file(
    path: str | os.PathLike, write: Callable[[h5py.File], T], start_from: str | os.PathLike | None = None
) -> T:
    """Write the HDF5 file ``path`` (one process) through ``write(file)``, under a temporary name first; what
    ``write`` returns.

    Readers see the old file or the whole new one; a failure (a full disk, a
    quota, the file size limit) leaves nothing behind, and the system's error
    (``OSError``, its reason in one line) goes on to the caller. The file is
    made in memory (HDF5's core driver) and its image written to the disk:
    HDF5 1.10.8, left a file whose write had failed, raised a ``RuntimeError``
    closing it, and crashed (SIGSEGV) at the process's end. ``start_from``: an
    HDF5 file the new one begins as a copy of (read whole; itself untouched),
    for an append that replaces it.
    """
    with _in_memory(f"{os.fspath(path)}.tmp", start_from) as file:  # (nothing on the disk)
        result = write(file)
        file.flush()
        image = file.id.get_file_image()
    write_atomically(path, image)
    return result


def _in_memory(name: str, start_from: str | os.PathLike | None) -> h5py.File:
    """A writable HDF5 file held in memory alone (HDF5's core driver): new, or a copy of the file ``start_from``."""
    if start_from is None:
        return h5py.File(name, "w", driver="core", backing_store=False)
    access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    access.set_fapl_core(backing_store=False)
    with open(start_from, "rb") as source:
        access.set_file_image(source.read())
    return h5py.File(h5py.h5f.open(os.fsencode(name), h5py.h5f.ACC_RDWR, fapl=access))


@contextlib.contextmanager
def file_with_room(path: str | os.PathLike, nbytes: int, datasets: int) -> Iterator[h5py.File]:
    """A new HDF5 file ``path`` (one process, on the disk) for ``nbytes`` of data in ``datasets`` data sets, whose
    writes cannot fail for want of room: it is set aside as the file is made, HDF5's metadata with it
    (``space.set_room_aside``: a full disk or quota raises ``OSError`` there, before any data is written), and what
    stays unused is freed as it is closed. For files too large to be made in memory as ``write_file``'s are, whose
    failed write HDF5 would turn into a crash."""
    file = h5py.File(path, "w")
    try:
        set_room_aside(path, file_bytes(nbytes, datasets))
    except BaseException:
        file.close()
        raise
    with file:
        yield file
    give_back_room(path)
