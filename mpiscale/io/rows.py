"""Collective reads and writes of row ranges of an HDF5 dataset.

h5py's high-level slicing skips the HDF5 call for an empty selection, which
would leave the other ranks waiting inside a collective transfer. These helpers
use the low-level API so that a rank with no rows still takes part (with an
empty selection), and they split large transfers into rounds of at most
``max_bytes`` per rank (MPI-IO counts are 32-bit), the same number of rounds on
every rank.
"""

from __future__ import annotations

import functools
import math

import h5py
import numpy as np

from ..ranks import Comm

MAX_TRANSFER_BYTES = 256 << 20


@functools.cache
def _collective_transfer() -> h5py.h5p.PropDXID:
    """The transfer settings of collective I/O, made once (not each round)."""
    plist = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    plist.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
    return plist


def _rows_per_round(row_bytes: int, max_bytes: int) -> int:
    return max(1, max_bytes // max(row_bytes, 1))


def rounds_of(dset: h5py.Dataset | int, rows: int, max_bytes: int = MAX_TRANSFER_BYTES) -> int:
    """How many rounds this rank needs to move ``rows`` rows of ``dset`` (or of rows of that many bytes); a
    collective transfer takes the most of any rank's (``rounds`` of ``write_rows``)."""
    row_bytes = dset if isinstance(dset, int) else dset.dtype.itemsize * math.prod(dset.shape[1:])
    return math.ceil(rows / _rows_per_round(row_bytes, max_bytes))


def _rounds(rows: int, per_round: int, comm: Comm | None) -> int:
    """The number of rounds, the same on every rank (collective over ``comm``)."""
    mine = math.ceil(rows / per_round)
    if comm is None:
        return mine
    from mpi4py import MPI

    return comm.allreduce(mine, op=MPI.MAX)


def _transfer(
    dset: h5py.Dataset,
    start: int,
    buffer: np.ndarray,
    comm: Comm | None,
    max_bytes: int,
    write: bool,
    memory_type: h5py.h5t.TypeID | None = None,
    rounds: int | None = None,
    mpio: bool | None = None,
) -> None:
    """Move ``buffer``'s rows to or from rows ``start:`` of ``dset``, in the same number of rounds on every rank
    (``rounds``, where the caller has agreed on it: at least every rank's ``rounds_of``); ``memory_type``: the HDF5
    type of the buffer's values (by default, that of its dtype); ``mpio``: whether the file was opened with MPI-IO,
    where the caller knows (asking HDF5 takes 25-45 µs, a round of a few rows 30-50). The data set's space is asked
    of HDF5 once: each ask of its shape is a call into HDF5."""
    file_space = dset.id.get_space()
    row_shape = file_space.shape[1:]
    per_round = _rows_per_round(dset.dtype.itemsize * math.prod(row_shape), max_bytes)
    if rounds is None:
        rounds = _rounds(len(buffer), per_round, comm)
    if comm is not None and mpio is None:
        mpio = dset.file.driver == "mpio"
    plist = _collective_transfer() if comm is not None and mpio else None
    placeholder = np.empty((1, *buffer.shape[1:]), dtype=buffer.dtype)
    move = dset.id.write if write else dset.id.read
    for round_index in range(rounds):
        lo = min(round_index * per_round, len(buffer))
        hi = min(lo + per_round, len(buffer))
        memory_space = h5py.h5s.create_simple((max(hi - lo, 1), *row_shape))
        if hi > lo:
            file_space.select_hyperslab((start + lo,) + (0,) * len(row_shape), (hi - lo, *row_shape))
        else:  # (this rank takes part with nothing)
            file_space.select_none()
            memory_space.select_none()
        move(memory_space, file_space, buffer[lo:hi] if hi > lo else placeholder, memory_type, dxpl=plist)


def write_rows(
    dset: h5py.Dataset,
    start: int,
    data: np.ndarray,
    comm: Comm | None = None,
    max_bytes: int = MAX_TRANSFER_BYTES,
    rounds: int | None = None,
    mpio: bool | None = None,
) -> None:
    """Write ``data`` into rows ``start:start+len(data)``; collective over ``comm`` when given, in ``rounds`` rounds
    where the caller agreed on them (else an allreduce finds them); ``mpio`` as ``_transfer``'s."""
    data = np.ascontiguousarray(data, dtype=dset.dtype)
    _transfer(dset, start, data, comm, max_bytes, write=True, rounds=rounds, mpio=mpio)


def read_rows(
    dset: h5py.Dataset,
    start: int,
    stop: int,
    comm: Comm | None = None,
    max_bytes: int = MAX_TRANSFER_BYTES,
    dtype: np.dtype | None = None,
    rounds: int | None = None,
    mpio: bool | None = None,
) -> np.ndarray:
    """Read rows ``start:stop``; collective over ``comm`` when given (every rank must call); as ``dtype`` when given
    (HDF5 converts: a big-endian data set read in this machine's order). Values of an HDF5 array type (each a
    fixed array, as C tools store a vector) come as the array's numbers, in more dimensions. ``rounds`` and
    ``mpio``: as ``write_rows``'s."""
    element, inner = dset.dtype.subdtype or (dset.dtype, ())
    dtype = element if dtype is None else np.dtype(dtype)
    out = np.empty((max(stop - start, 0), *dset.shape[1:], *inner), dtype=dtype)
    memory_type = h5py.h5t.py_create(np.dtype((dtype, inner))) if inner else None
    _transfer(dset, start, out, comm, max_bytes, write=False, memory_type=memory_type, rounds=rounds, mpio=mpio)
    return out
