"""Rows of NumPy files: a ``.npy`` array, or one array of a ``.npz`` archive (``numpy.savez``), memory-mapped.

``numpy.savez`` stores each array as a ``.npy`` member of an uncompressed ZIP
archive, so the member's rows lie in the archive as they would in a ``.npy``
file, and are mapped the same way: no rank reads more than its rows. A member
``numpy.savez_compressed`` deflated has no such rows; it is refused with the
line that saves it uncompressed, rather than inflated whole on every rank.
"""

from __future__ import annotations

import os
import struct
import zipfile

import numpy as np

from ..ranks import Comm
from .errors import DataFileError, not_found
from .sources import in_native_order

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a ZIP member's local header: signature, ..., name and extra lengths
_LOCAL_SIGNATURE = b"PK\x03\x04"


def is_npy(path: str) -> bool:
    return path.endswith(".npy")


def is_numpy_file(path: str) -> bool:
    """Whether ``path`` is read as a NumPy file (``.npy`` or ``.npz``), not as HDF5."""
    return path.endswith((".npy", ".npz"))


class NpySource:
    """Rows of a NumPy file (``name``: the array of a ``.npz``, none for its only one; a ``.npy`` has no names),
    memory-mapped (reads are copies of row ranges)."""

    independent = True  # (reads take no collective call)

    def __init__(self, path: str, name: str = "") -> None:
        self.path, self.name = path, name
        kind = "a .npz archive" if path.endswith(".npz") else "a .npy file"
        if os.path.isdir(path):
            raise DataFileError(path, f"is a directory, not {kind}")
        if os.path.isfile(path) and not os.path.getsize(path):
            raise DataFileError(path, "is empty")  # (as HDF5 files are; NumPy said "EOF: reading magic string")
        try:
            if path.endswith(".npz"):
                self.name, self._array = _archived(path, name)
            else:
                self.name, self._array = "", _mapped(path, "", 0)
        except FileNotFoundError:
            raise DataFileError(path, not_found(path, "no such file")) from None
        except DataFileError:
            raise
        except (OSError, ValueError, zipfile.BadZipFile) as error:
            raise DataFileError(path, f"not a readable {kind[2:]}{_cut_archive(path, error)}: {error}") from error
        if self._array.ndim == 0:
            raise DataFileError(path, "holds a single value, not rows", self.name or None)
        self.shape: tuple[int, ...] = self._array.shape
        self.dtype: np.dtype = in_native_order(self._array.dtype)

    def read(self, start: int, stop: int, comm: Comm | None = None, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return np.array(self._array[start:stop], dtype=self.dtype, order="C")
        out[...] = self._array[start:stop]
        return out

    def close(self) -> None:
        self._array = np.empty((0, *self.shape[1:]), self.dtype)  # (the mapping goes with the array)


def _cut_archive(path: str, error: Exception) -> str:
    """Why a ``.npz`` that begins as a ZIP archive has no index: the index is at a ZIP file's end, so one cut short
    (a copy or a save that did not finish, a full disk) has none ("File is not a zip file")."""
    if not isinstance(error, zipfile.BadZipFile):
        return ""
    with open(path, "rb") as stream:
        begins_as_zip = stream.read(len(_LOCAL_SIGNATURE)) == _LOCAL_SIGNATURE
    return " (it begins as one but has no index, which a ZIP archive keeps at its end: cut short?)" if begins_as_zip \
        else ""  # fmt: skip


def _archived(path: str, name: str) -> tuple[str, np.ndarray]:
    """(the array's name, the array mapped where the archive stores it) of ``path``'s array ``name`` (none: its
    only array)."""
    with zipfile.ZipFile(path) as archive:
        members = {info.filename[: -len(".npy")]: info for info in archive.infolist() if info.filename.endswith(".npy")}
    listed = ", ".join(sorted(members)) or "none"
    if {"format", "shape", "data"} <= members.keys() and ({"indices", "indptr"} <= members.keys() or "row" in members):
        stem = os.path.splitext(path)[0]
        raise DataFileError(path, (
            "is a SciPy sparse matrix (scipy.sparse.save_npz), not arrays of rows: save it as CSR in HDF5, which the "
            "jobs read by rows (m = scipy.sparse.load_npz(...).tocsr(); a group of m.data, m.indices and m.indptr "
            f"with an attribute shape = m.shape, as AnnData writes it), or dense, numpy.save('{stem}.npy', "
            "m.toarray())"
        ))  # fmt: skip
    if not name:
        if len(members) != 1:
            raise DataFileError(path, f"holds {len(members)} arrays; name one as {path}:/NAME (arrays: {listed})")
        name = next(iter(members))
    member = members.get(name)
    if member is None:
        raise DataFileError(path, f"holds no array {name!r} (arrays: {listed})")
    if member.compress_type != zipfile.ZIP_STORED:
        raise DataFileError(path, (
            f"stores {name!r} compressed (numpy.savez_compressed): each rank would inflate all of it to read its "
            f"rows; save it uncompressed, e.g. numpy.save('{name}.npy', numpy.load('{path}')['{name}']), and give "
            f"{name}.npy"
        ), name)  # fmt: skip
    with open(path, "rb") as stream:
        stream.seek(member.header_offset)
        signature, name_bytes, extra_bytes = _LOCAL_HEADER.unpack(stream.read(_LOCAL_HEADER.size))
    if signature != _LOCAL_SIGNATURE:
        raise DataFileError(path, f"its member {member.filename} is damaged (no ZIP header where the index says)")
    return name, _mapped(path, name, member.header_offset + _LOCAL_HEADER.size + name_bytes + extra_bytes)


def _mapped(path: str, name: str, at: int) -> np.ndarray:
    """The array whose ``.npy`` header starts at byte ``at`` of ``path`` (a ``.npy`` file's 0), mapped where its data
    follows; refused if it holds Python objects."""
    with open(path, "rb") as stream:
        stream.seek(at)
        version = np.lib.format.read_magic(stream)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = header(stream)
        offset = stream.tell()
    _refuse_objects(path, name, dtype)
    if not shape or 0 in shape:  # (nothing to map: a single value is refused, no rows are rows)
        return np.empty(shape, dtype)
    _refuse_cut_short(path, name, shape, dtype, offset)
    return np.memmap(path, dtype, "r", offset, shape, "F" if fortran_order else "C")


def _refuse_cut_short(path: str, name: str, shape: tuple[int, ...], dtype: np.dtype, offset: int) -> None:
    """Refuse an array whose file ends before its data does (a copy or a save that did not finish, a full disk):
    mapping it failed with "mmap length is greater than file size"."""
    needed, held = int(np.prod(shape)) * dtype.itemsize, os.path.getsize(path) - offset
    if held < needed:
        what = f"{name!r} of shape" if name else "an array of shape"
        raise DataFileError(path, (
            f"is cut short: its header gives {what} {shape} {dtype} ({needed:,} bytes), and the file holds "
            f"{max(held, 0):,} of them (a copy or a save that did not finish, or a full disk): write it again"
        ), name or None)  # fmt: skip


def _refuse_objects(path: str, name: str, dtype: np.dtype) -> None:
    """Refuse an array of Python objects (sequences of varying length, as users keep them): no rank can map it."""
    if dtype.hasobject:
        what = f"{name!r} as" if name else "its array as"
        raise DataFileError(path, (
            f"stores {what} Python objects (sequences of varying length, say), which cannot be read without "
            "unpickling all of it: save numbers; sequences as their values one after another and where each starts, "
            "numpy.savez('tokens.npz', values=numpy.concatenate(rows), starts=numpy.cumsum([0] + [len(r) for r in "
            "rows[:-1]])), read with --inputs values --offsets starts"
        ), name or None)  # fmt: skip
