"""Data sets whose rows HDF5 keeps in raw files of their own (external storage, ``H5Pset_external``, as tools wrap
an instrument's binary files without copying them): refused, in one line that says what to do, when their raw files
are not all where HDF5 will look.

HDF5 looks for a raw file named by a relative path from the current directory, or from ``HDF5_EXTFILE_PREFIX``
(``${ORIGIN}`` standing for the HDF5 file's directory). A job started elsewhere could not read the rows of a file
it was given by its full path (HDF5's "unable to open external raw data file", which read as a damaged file). And
for the bytes a raw file lacks (one cut short) HDF5 reads zeros, without a word.
"""

from __future__ import annotations

import math
import os

import h5py

from .errors import DataFileError

_PREFIX = "HDF5_EXTFILE_PREFIX"
_ORIGIN = "${ORIGIN}"


def check_raw_files(data: h5py.Dataset) -> None:
    """Refuse ``data`` if HDF5 would not find each of its raw files, or would find one shorter than the bytes the
    data set keeps in it; nothing for a data set whose rows lie in its HDF5 file."""
    create = data.id.get_create_plist()
    count = create.get_external_count()
    if not count:
        return
    path = data.file.filename
    origin = os.path.dirname(os.path.abspath(path))
    prefix = os.environ.get(_PREFIX, "").replace(_ORIGIN, origin)
    entries = [create.get_external(i) for i in range(count)]  # (name, offset, size), in the order of the bytes
    found = [os.path.join(prefix, os.fsdecode(name)) for name, _, _ in entries]  # (an absolute name stays whole)
    missing = next((name for name in found if not os.path.isfile(name)), None)
    if missing is not None:
        beside = os.path.join(origin, os.path.relpath(missing, prefix or "."))
        hint = (
            f"; it is beside the HDF5 file: start the job in {origin}, or set "
            f"{_PREFIX}='{_ORIGIN}' (HDF5 then looks beside each file)"
            if os.path.isfile(beside)
            else ""
        )
        where = f"{_PREFIX}={prefix!r}" if prefix else f"the current directory, {os.getcwd()}"
        raise DataFileError(path, f"keeps its rows in the raw file {missing} (external storage), which HDF5 looks "
                                  f"for from {where} and does not find there{hint}", data.name)  # fmt: skip
    _check_sizes(data, [(name, offset, size) for name, (_, offset, size) in zip(found, entries)])


def _check_sizes(data: h5py.Dataset, entries: list[tuple[str, int, int]]) -> None:
    """Refuse a raw file that ends before the bytes the data set keeps in it: HDF5 reads zeros in their place."""
    needed = data.dtype.itemsize * math.prod(data.shape)
    row_bytes = max(1, needed // max(1, data.shape[0]))
    done = 0
    for name, offset, size in entries:
        if done >= needed:
            return
        span = needed - done if size == h5py.h5f.UNLIMITED else min(size, needed - done)
        held = max(0, os.path.getsize(name) - offset)
        if held < span:
            raise DataFileError(data.file.filename, (
                f"keeps {span} bytes of its rows in the raw file {name} from byte {offset} (external storage), "
                f"which holds {held} of them: HDF5 would read zeros for the rows from {(done + held) // row_bytes} "
                "on; copy the raw file again from its source"
            ), data.name)  # fmt: skip
        done += span
