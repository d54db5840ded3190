"""Where input rows come from: the files a data spec names, and one reader per file kind.

A data spec is what a user types after ``--data``: ``FILE.h5:/path/to/dataset``,
a glob (``'run-*.h5:/X'``), a text file listing paths (``files.txt:/X``, one path
a line, relative to the list, ``#`` for comments), or NumPy files
(``data.npy``, ``'part-*.npy'``, an array of a ``.npz``: ``data.npz:/X``; see
:mod:`.numpy_files`). Without a dataset name an HDF5 file must hold exactly one
data set (a ``.npz`` one array). Any HDF5 file is input, whoever wrote it; the
``format`` attribute only tells mpiscale's own index files apart.
"""

from __future__ import annotations

import codecs
import glob
import math
import os
import re

import h5py
import numpy as np

from ..ranks import Comm
from .errors import DataFileError, not_found, unreadable_rows
from .h5file import datasets_in, describe_datasets
from .rows import read_rows, rounds_of
from .sparse_rows import sparse_groups
from .unfinished import unfinished_run

LIST_SUFFIXES = (".txt", ".lst", ".list")
_GLOB_CHARS = re.compile(r"[*?\[]")


def split_spec(spec: str) -> tuple[str, str]:
    """(files, dataset name) of a data spec; the name is empty when none follows a colon. A path that holds a colon
    itself (a directory named by a time, ``run-12:30/acts.h5``) and names no data set is that path, when it exists
    and the part before its last colon does not."""
    files, colon, name = spec.rpartition(":")
    if not colon or (not os.path.exists(files) and os.path.exists(spec)):
        return spec, ""
    return files, name.strip("/")


def natural_key(path: str) -> list:
    """Sort key that puts ``run-2`` before ``run-10``, so numbered files keep their numeric order."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def resolve_files(pattern: str) -> list[str]:
    """The files a spec's file part names, in a stable order (one process; callers broadcast it)."""
    if is_list_file(pattern):
        return distinct_files(pattern, listed_paths(pattern))
    if os.path.exists(pattern) or not _GLOB_CHARS.search(pattern):
        return [pattern]
    matches = sorted((path for path in glob.glob(pattern) if os.path.isfile(path)), key=natural_key)
    if not matches:
        raise DataFileError(pattern, not_found(pattern, "no files match this pattern"))
    return distinct_files(pattern, matches)


def distinct_files(spec: str, files: list[str]) -> list[str]:
    """``files``, refused where two of them are one file (a link beside its target, as a ``latest`` link kept
    among numbered runs is; a file listed twice; a hard link): its rows were read twice, without a word."""
    seen: dict[tuple[int, int], str] = {}
    for file in files:
        try:
            found = os.stat(file)
        except OSError:  # a file that is not there: said where it is opened
            continue
        first = seen.get((found.st_dev, found.st_ino))
        seen[(found.st_dev, found.st_ino)] = file
        if first is not None:
            twice = os.path.abspath(first) == os.path.abspath(file)
            what = f"{file} twice" if twice else f"{first} and {file}, one file (a link to the other)"
            hint = ", with a pattern the link does not match" if _GLOB_CHARS.search(spec) else ""
            raise DataFileError(spec, f"names {what}: its rows would be read twice; name each file once{hint}")
    return files


def same_file(first: str | os.PathLike, second: str | os.PathLike) -> bool:
    """Whether two paths name one file (an existing one, through symlinks, ``./`` spellings and hard links; or the
    same path once symlinks are resolved, where one does not exist yet)."""
    try:
        return os.path.samefile(first, second)
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(first) == os.path.realpath(second)


def is_list_file(path: str) -> bool:
    """Whether ``path`` is a text file listing paths (by its suffix: .txt, .lst or .list)."""
    return os.path.isfile(path) and path.endswith(LIST_SUFFIXES)


def listed_paths(path: str) -> list[str]:
    """The paths a list file names, one a line, relative to the list's directory; ``#`` starts a comment. A list
    written on Windows reads alike: CRLF line ends, and UTF-8 or UTF-16 with its byte order mark (as Notepad and
    PowerShell write them; the mark was read as part of the first path)."""
    base = os.path.dirname(os.path.abspath(path))
    try:
        with open(path, "rb") as stream:
            raw = stream.read()
        text = raw.decode("utf-16" if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) else "utf-8-sig")
        lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    except (OSError, UnicodeDecodeError) as error:
        raise DataFileError(path, f"cannot read the list of files: {error}") from error
    files = [os.path.join(base, line) for line in lines if line]
    if not files:
        raise DataFileError(path, "the list of files is empty")
    return files


class H5Source:
    """Rows of one data set of an open HDF5 file.

    Reads are collective when the file was opened with a communicator, except
    for filtered (compressed, shuffled) data sets: HDF5 1.10's collective path
    cannot decompress every filter (LZF reads fail), so those are read
    independently. Independent reads of a contiguous, unfiltered data set
    bypass HDF5: the rows are one byte range of the file, read with ``pread``,
    which releases the GIL (h5py holds it for the whole read), so a background
    reader thread does not stall the compute thread.
    """

    def __init__(self, file: h5py.File, dataset: h5py.Dataset) -> None:
        self.file = file
        self.path = file.filename
        self.dataset = dataset
        if dataset.shape is None:
            raise DataFileError(self.path, "is an empty (null) data set", dataset.name)
        if not dataset.shape:
            raise DataFileError(self.path, f"is a single {dataset.dtype} value, not rows", dataset.name)
        if h5py.check_vlen_dtype(dataset.dtype) not in (None, str, bytes):
            raise DataFileError(self.path, (
                "holds variable-length rows (samples of varying length), and this reads rows of one size: ragged "
                "samples are read by RaggedDataset, and taken by mpiscale train and collect (sequences of tokens)"
            ), dataset.name)  # fmt: skip
        unwritten = unfinished_run(file) or _unwritten(dataset)
        if unwritten:
            raise DataFileError(self.path, unwritten, dataset.name)
        element, inner = dataset.dtype.subdtype or (dataset.dtype, ())  # values of an HDF5 array type: more dims
        self.shape: tuple[int, ...] = (*dataset.shape, *inner)
        self.dtype: np.dtype = in_native_order(element)
        self._swapped = self.dtype != element  # stored in the other byte order: read rows are swapped
        create = dataset.id.get_create_plist()
        self.filtered = create.get_nfilters() > 0
        # read by each rank alone: filtered data sets (below) and files opened without MPI-IO (a virtual data set's)
        self.independent = self.filtered or file.driver != "mpio"
        self._offset: int | None = None
        if create.get_layout() == h5py.h5d.CONTIGUOUS and not create.get_external_count() and not self.filtered \
                and _stored_as_read(dataset):  # fmt: skip
            self._offset = dataset.id.get_offset()  # None until the data set's storage is allocated
        self._row_bytes = self.dtype.itemsize * math.prod(self.shape[1:])
        self._descriptor: int | None = None

    def read(
        self,
        start: int,
        stop: int,
        comm: Comm | None = None,
        out: np.ndarray | None = None,
        rounds: int | None = None,
    ) -> np.ndarray:
        """Rows ``start:stop``; collective over ``comm`` when given (in ``rounds`` rounds where the ranks agreed on
        them: at least each one's ``rounds``); into ``out`` (C-contiguous) when given. Rows that cannot be read (a
        chunk whose checksum or compressed bytes are damaged, a disk's I/O error) are a DataFileError naming the
        file, the data set and the rows (it was HDF5's bare OSError)."""
        try:
            if comm is None and self._offset is not None:
                if out is None:
                    out = np.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
                self._pread(start, stop, out)
                if self._swapped:
                    out.byteswap(inplace=True)
                return out
            collective = None if self.independent else comm
            rows = read_rows(self.dataset, start, stop, collective, dtype=self.dtype,
                             rounds=None if collective is None else rounds, mpio=True)  # fmt: skip
        except OSError as error:
            raise unreadable_rows(self.path, self.dataset.name, start, stop, error) from None
        if out is None:
            return rows
        out[...] = rows
        return out

    def rounds(self, rows: int) -> int:
        """The rounds this rank needs to read ``rows`` rows collectively (``read``'s ``rounds``; 0 where it reads
        independently)."""
        return 0 if self.independent else rounds_of(self._row_bytes, rows)  # (not the data set's shape: HDF5 calls)

    def _pread(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        view = memoryview(out.reshape(-1).view(np.uint8))
        if self._descriptor is None:
            self._descriptor = os.open(self.path, os.O_RDONLY)
        assert self._offset is not None, "only a data set stored as read is read as its bytes"
        done, where = 0, self._offset + start * self._row_bytes
        while done < len(view):
            got = os.preadv(self._descriptor, [view[done:]], where + done)
            if got == 0:
                raise DataFileError(self.path, f"ends before row {stop} (truncated?)", self.dataset.name)
            done += got
        return out

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None
        self.file.close()


def _stored_as_read(dataset: h5py.Dataset) -> bool:
    """Whether the data set's bytes on disk are its values as numpy holds them (in either byte order): a type a C
    tool narrowed (a 12-bit integer at bit 4 of 16, a float of its own layout) is read by HDF5, which converts it;
    read as its bytes, each value came out shifted, without a word."""
    return bool(dataset.id.get_type() == h5py.h5t.py_create(dataset.dtype))


def _unwritten(dataset: h5py.Dataset) -> str | None:
    """Why some of ``dataset``'s rows were never written, or None. HDF5 reads its fill value for storage no writer
    reached (a script that stopped early but closed its file), without a word; a chunk is stored once written, and
    contiguous storage at the first write."""
    create = dataset.id.get_create_plist()
    if not math.prod(dataset.shape) or create.get_external_count():  # (no values, none unwritten: said elsewhere)
        return None
    fill = f"its fill value, {np.asarray(dataset.fillvalue).tolist()}"
    if create.get_layout() == h5py.h5d.CHUNKED:
        expected = math.prod(math.ceil(size / chunk) for size, chunk in zip(dataset.shape, dataset.chunks))
        missing = expected - dataset.id.get_num_chunks()
        if missing > 0:
            return (f"{missing} of its {expected} chunks were never written ({fill}, would stand for their rows): "
                    "write them, or keep only the rows written")  # fmt: skip
    elif create.get_layout() == h5py.h5d.CONTIGUOUS and dataset.id.get_storage_size() == 0:
        return f"was never written ({fill}, would stand for every row): write it first"
    return None


def in_native_order(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order: rows are read so (kernels, MPI and torch take no other), and files
    stored in either order are one data set."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def only_dataset(path: str, file: h5py.File) -> str:
    """The name of the single data set of a file opened without a dataset name, or a clear error."""
    names = datasets_in(file)
    if len(names) != 1:
        sparse = sparse_groups(file)
        matrices = f"; sparse matrices, read as rows: {', '.join(sparse)}" if sparse else ""
        raise DataFileError(path, f"holds {len(names)} data sets; name one as {path}:/NAME (data sets: "
                                  f"{describe_datasets(file)}{matrices})")  # fmt: skip
    return names[0]
