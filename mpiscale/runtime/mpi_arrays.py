"""Numpy arrays as MPI takes them: an ``out`` that can hold a reduction, dtypes this MPI has no type for moved as
words or bytes, and the arrays MPI can reduce. Every check here runs before any MPI call, so a refusal raises on
the rank that made it and leaves the others in the collective's check, where the hang watch finds it."""

from __future__ import annotations

import numpy as np


def out_of_size(data: np.ndarray, out: object, what: str) -> None:
    """Refuse an ``out`` that cannot take the result of reducing ``data``: not an array, of another size, or
    read-only (mpi4py refuses that only when it posts the call, with the other ranks' part already under way)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{what}: out must be a numpy array, got {type(out).__name__}")
    if out.size != data.size:
        raise ValueError(f"{what}: out holds {out.size} elements, the array {data.size}")
    if not out.flags.writeable:
        raise ValueError(f"{what}: out is read-only, so it cannot take the result")


def out_of_kind(data: np.ndarray, out: np.ndarray, what: str) -> None:
    """Refuse an ``out`` that a reduction of ``data`` may only be cast into with loss of kind (float into int, complex
    into float: numpy's ufuncs refuse the same), where a result that is copied into ``out`` would be cut without a
    word."""
    if out.dtype is not data.dtype and not np.can_cast(data.dtype, out.dtype, "same_kind"):
        raise TypeError(f"{what}: out of {out.dtype} cannot take a result of {data.dtype} (numpy's same_kind rule)")


def out_for_mpi(data: np.ndarray, out: np.ndarray | None, what: str) -> None:
    """Refuse an ``out`` that MPI cannot reduce ``data`` into: of another size, dtype or layout (refused before any
    MPI call: the other ranks wait in the check, where the watch finds it)."""
    if out is not None:
        out_of_size(data, out, what)
        if out.dtype != data.dtype or not out.flags.c_contiguous:
            raise ValueError(f"{what}: out must be a C-contiguous {data.dtype} array, got {out.dtype}")


def apart(data: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``data``, or a copy of it where ``out`` may share its memory without being it (a view of it, or of a buffer
    they both lie in): MPI reads a send buffer that overlaps its receive buffer as the receive buffer is written, and
    the result came out wrong (as numpy's ufuncs do, the input is copied first)."""
    if out is None or out is data or not np.may_share_memory(out, data):
        return data
    return data.copy()


#: Kinds of dtype that mpi4py cannot type (bytes, strings, records, dates): moved as their bytes.
_AS_BYTES = "SUVMm"


def words(array: np.ndarray) -> np.ndarray:
    """C-contiguous ``array`` as MPI moves it: float16, for which this MPI has no type (Open MPI 4 answers
    MPI_ERR_TYPE), as its 16-bit words; bytes, strings, records, dates and arrays not in the machine's byte order as
    their bytes, flat (mpi4py refused them); any other dtype as it is."""
    if array.dtype.char == "e":
        return array.view(np.uint16)
    if _as_bytes(array.dtype):
        return array.reshape(-1).view(np.uint8)
    return array


def words_each(dtype: np.dtype) -> int:
    """How many of :func:`words`'s elements one element of ``dtype`` makes."""
    return dtype.itemsize if _as_bytes(dtype) else 1


def _as_bytes(dtype: np.dtype) -> bool:
    return dtype.char != "e" and (dtype.kind in _AS_BYTES or not dtype.isnative)


def reducible(data: np.ndarray, what: str, op: str) -> None:
    """Refuse, before any MPI call, an array that MPI cannot reduce by ``op``: booleans (MPI adds none: MPI_ERR_OP),
    bytes, strings, records and dates; complex numbers by min or max (MPI_ERR_OP too: they have no order)."""
    if data.dtype.kind not in "iufc":
        hint = " (count them in an integer type, or reduce uint8 by 'max' for any, 'min' for all)"
        raise TypeError(f"{what} reduces numbers, not {data.dtype} arrays{hint if data.dtype.kind == 'b' else ''}")
    if data.dtype.kind == "c" and op in ("min", "max"):
        raise TypeError(f"{what}: {op} of {data.dtype} has no meaning, complex numbers have no order (reduce their "
                        "magnitudes, or the real and imaginary parts apart)")  # fmt: skip


#: Dtypes MPI cannot reduce here, reduced in a wider one and rounded back once: float16 in float32.
WIDER = {np.dtype(np.float16): np.dtype(np.float32)}


def widened(data: np.ndarray) -> np.ndarray:
    """``data`` as MPI reduces it: a copy in the wider dtype where :data:`WIDER` names one, else ``data`` itself."""
    wide = WIDER.get(data.dtype)
    return data if wide is None else data.astype(wide)


def narrowed(wide: np.ndarray, dtype: np.dtype, out: np.ndarray | None) -> np.ndarray:
    """A widened reduction's result (:func:`widened`), rounded into ``out`` or a new array of ``dtype``."""
    if out is None:
        return wide.astype(dtype)
    np.copyto(out, wide.reshape(out.shape))
    return out
