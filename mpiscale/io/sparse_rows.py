"""Rows of a sparse matrix kept in HDF5 as CSR (``data``, ``indices``, ``indptr`` in one group), read as dense rows.

AnnData's ``.h5ad`` keeps a cell x gene count matrix so (the group's ``encoding-type``
is ``csr_matrix``, its ``shape`` attribute the matrix's), and so do ``mpiscale
encode``'s codes (the shape in the file's attributes) and any tool that writes the
three arrays with a ``shape`` attribute. A block of rows is one slice of each array: each rank reads its own
rows' values and scatters them into dense rows, so the jobs take the matrix as
they take any data set, without a dense copy on disk. A CSC matrix (columns
contiguous, rows scattered) is refused with the line that converts it.
"""

from __future__ import annotations

import h5py
import numpy as np

from ..ranks import Comm
from .errors import DataFileError, unreadable_rows
from .unfinished import unfinished_run

_PARTS = ("data", "indices", "indptr")


def sparse_group(node: object) -> bool:
    """Whether ``node`` (an HDF5 object) is a group holding a sparse matrix's ``data``, ``indices`` and ``indptr``."""
    return isinstance(node, h5py.Group) and all(isinstance(node.get(part), h5py.Dataset) for part in _PARTS)


def sparse_groups(file: h5py.File) -> list[str]:
    """The groups of ``file`` that hold a sparse matrix (``sparse_group``), by their paths."""
    found: list[str] = []
    file.visititems(lambda name, node: found.append(name) if sparse_group(node) else None)
    return found


class CsrSource:
    """Dense rows of the CSR matrix in ``group`` of an open file (read by each rank alone)."""

    independent = True

    def __init__(self, file: h5py.File, group: h5py.Group) -> None:
        self.file, self.path, self.name = file, file.filename, group.name
        unfinished = unfinished_run(file)
        if unfinished:
            raise DataFileError(self.path, unfinished, self.name)
        encoding = _text(group.attrs.get("encoding-type") or group.attrs.get("h5sparse_format") or "csr_matrix")
        if encoding.startswith("csc"):
            raise DataFileError(self.path, (
                "is a sparse matrix kept by columns (CSC): its rows are scattered through it; save it by rows, e.g. "
                "with anndata: adata.X = scipy.sparse.csr_matrix(adata.X); adata.write_h5ad(...)"
            ), self.name)  # fmt: skip
        self._data, self._indices, self._indptr = (group[part] for part in _PARTS)
        codes = _text(file.attrs.get("format", "")).startswith("mpiscale.codes/")  # (encode's: the file's shape)
        shape = group.attrs.get("shape", group.attrs.get("h5sparse_shape", file.attrs.get("shape") if codes else None))
        if shape is None or len(shape) != 2:
            raise DataFileError(self.path, (
                "is a sparse matrix (data, indices, indptr) without its shape: give the group an attribute shape = "
                "(rows, columns)"
            ), self.name)  # fmt: skip
        rows, self._columns = int(shape[0]), int(shape[1])
        if self._indptr.shape != (rows + 1,) or self._data.shape != self._indices.shape:
            raise DataFileError(self.path, (
                f"is a sparse matrix of shape {tuple(map(int, shape))} whose indptr holds {len(self._indptr)} values "
                f"(rows + 1 = {rows + 1}) and whose data and indices hold {len(self._data)} and {len(self._indices)}: "
                "its parts disagree (written by halves?)"
            ), self.name)  # fmt: skip
        if self._data.dtype.kind not in "biuf":
            raise DataFileError(self.path, f"is a sparse matrix of {self._data.dtype} values, not numbers", self.name)
        self.shape: tuple[int, ...] = (rows, self._columns)
        self.dtype: np.dtype = np.dtype(self._data.dtype).newbyteorder("=")

    def read(self, start: int, stop: int, comm: Comm | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Dense rows ``start:stop`` (into ``out`` when given); ``comm`` is not used: each rank reads alone."""
        try:  # (start <= stop <= rows, as the data set checks: indptr[start : stop + 1] holds one value or more)
            bounds = np.asarray(self._indptr[start : stop + 1], np.int64)
            first, last = int(bounds[0]), int(bounds[-1])
            values, columns = self._data[first:last], np.asarray(self._indices[first:last], np.int64)
        except OSError as error:
            raise unreadable_rows(self.path, self.name, start, stop, error) from None
        counts = np.diff(bounds)
        if (counts < 0).any() or len(values) != last - first:
            raise DataFileError(self.path, f"rows {start}..{stop - 1}: indptr does not ascend (damaged?)", self.name)
        if len(columns) and (columns.min() < 0 or columns.max() >= self._columns):
            raise DataFileError(self.path, (
                f"rows {start}..{stop - 1} name column {int(columns.max())}, past the {self._columns} columns of its "
                "shape (damaged, or the shape is not the matrix's?)"
            ), self.name)  # fmt: skip
        if out is None:
            rows = np.zeros((stop - start, self._columns), self.dtype)
        else:
            rows = out
            rows[...] = 0
        np.add.at(rows, (np.repeat(np.arange(stop - start), counts), columns), values)  # (a repeated entry adds up)
        return rows

    def close(self) -> None:
        self.file.close()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
