"""The allreduce of two ranks as an exchange: each rank sends the other what it needs and reduces its part itself.

Open MPI's non-blocking ``Iallreduce`` always takes its binomial algorithm on
fewer than four ranks: a reduce onto one rank, then a broadcast, two transfers
one after the other. On two ranks of a host that was 0.49-0.89x its blocking
``Allreduce`` from 4 KiB to 16 MiB (raw mpi4py, float32, medians of 300 calls,
2026-11-29), and the loop of a rank never blocks (see ``hierarchical``).

Here, under :data:`HALVES_FROM_BYTES`, the ranks swap their whole buffers and
each reduces the pair: one round (1.1-1.25x the blocking call from 16 to 256
KiB in the same run). From there each rank reduces one half, the other rank's
copy of it received, and the reduced halves are swapped: two rounds, but half
the arithmetic, which is what costs at large sizes (1.16x at 1 MiB, 1.39x at
16 MiB, 2.6x at 64 MiB, where the whole-buffer swap was 1.01x, 0.89x and
1.83x). Each rank sends and receives the buffer once either way, as in a ring.

Both ranks reduce in rank order (``op(rank 0's, rank 1's)``), so they end with
the very same bits, signed zeros and NaN payloads included.

On the event loop a call's check (the allgather of its signature that begins
every collective) and each of its swaps are posted and tested in the caller's
stack by :class:`PairExchange`, whose compiled twin (``_wire.PairExchange``)
makes no Python object per MPI call: in Python those steps cost 2-3x the
messages they send (2026-12-02).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from ..ranks import Comm
from .nan_ops import nan_keeping
from .waits import ends_in_place

#: numpy's twin of each reduction MPI names, by the name the collectives take.
UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_KINDS = {np.add: "iufc", np.multiply: "iufc", np.minimum: "iuf", np.maximum: "iuf"}  # the dtypes MPI reduces alike
_TAG = 29  # the exchange's messages, on a communicator that carries no other point-to-point traffic on this tag


def mpi_ops(MPI: ModuleType) -> dict[str, Any]:
    """MPI's own operation of each reduction the collectives take, by the name they take it by."""
    return {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}


def ufuncs_by_handle(MPI: ModuleType) -> dict[int, np.ufunc]:
    """numpy's twin of each MPI operation the collectives reduce by, NaN-keeping min and max included (``nan_ops``),
    by its handle (MPI's operations are not hashable)."""
    twins: dict[int, np.ufunc] = {op.py2f(): UFUNCS[name] for name, op in mpi_ops(MPI).items()}
    twins.update({nan_keeping(MPI, name).py2f(): UFUNCS[name] for name in ("min", "max")})
    return twins


def exchanged(comm_size: int, dtype: np.dtype, ufunc: np.ufunc | None) -> np.ufunc | None:
    """``ufunc`` when an allreduce of ``dtype`` over ``comm_size`` ranks by it is done by exchange, else None (MPI's
    own call). The choice depends on nothing else, so every rank of a call makes the same one."""
    if comm_size != 2 or ufunc not in _KINDS or dtype.kind not in _KINDS[ufunc] or dtype.char == "e":  # float16
        return None
    return ufunc


#: From this size the ranks reduce a half each and swap the results; below it they swap whole buffers.
HALVES_FROM_BYTES = 512 << 10


def room(data: np.ndarray) -> int:
    """Bytes the other rank's values take in an exchange of ``data``: all of them, or from
    :data:`HALVES_FROM_BYTES` the larger half."""
    if data.nbytes < HALVES_FROM_BYTES:
        return data.nbytes
    return (data.size - data.size // 2) * data.itemsize


def rounds(comm: Comm, ufunc: np.ufunc, data: np.ndarray, result: np.ndarray, theirs: np.ndarray) -> Iterator[list]:
    """The allreduce of C-contiguous ``data`` on a two-rank ``comm`` into ``result`` (which may be ``data``), as
    rounds: it yields each round's requests, and the caller waits for all of them (the event loop settles them,
    a thread polls them) before it resumes. ``theirs``: at least :func:`room` bytes for the other rank's values."""
    rank, other = comm.Get_rank(), 1 - comm.Get_rank()
    scratch = theirs.reshape(-1).view(np.uint8)[: room(data)].view(data.dtype)
    if data.nbytes < HALVES_FROM_BYTES:
        received = scratch.reshape(data.shape)
        yield [comm.Irecv(received, other, _TAG), comm.Isend(data, other, _TAG)]  # (posted first: no wait for it)
        in_rank_order(ufunc, rank, data, received, result)
        return
    sent, into = data.reshape(-1), result.reshape(-1)
    mine, its = halves(sent.size, rank)
    received = scratch[: into[mine].size]
    yield [comm.Irecv(received, other, _TAG), comm.Isend(sent[its], other, _TAG)]
    in_rank_order(ufunc, rank, sent[mine], received, into[mine])
    # in place, ``into[its]`` is the half just sent: the round above has ended, so it may be overwritten now
    yield [comm.Irecv(into[its], other, _TAG), comm.Isend(into[mine], other, _TAG)]


def halves(size: int, rank: int) -> tuple[slice, slice]:
    """From :data:`HALVES_FROM_BYTES`, the half of ``size`` elements that ``rank`` reduces, and the other rank's."""
    parts = (slice(0, size // 2), slice(size // 2, None))
    return parts[rank], parts[1 - rank]


def direct_result(data: np.ndarray, out: np.ndarray | None, by_exchange: bool) -> tuple[np.ndarray, bool]:
    """Where a direct call of ``data`` reduces into, and whether that is ``out``'s memory (else :func:`delivered`
    copies it there). The caller's ``out`` takes the result where it is of ``data``'s dtype and C-contiguous: for
    the exchange even in place; for MPI's call when it is ``data`` itself (the result is then ``data``'s memory:
    reduce with ``MPI.IN_PLACE``) or of its size and apart from it. Else a new array (a 1 MiB allreduce of 4 ranks
    once took a new buffer and a copy every call)."""
    if (
        out is not None
        and out.dtype == data.dtype
        and out.flags.c_contiguous
        and (by_exchange or out is data or (out.size == data.size and not np.may_share_memory(out, data)))
    ):
        return out.reshape(data.shape), True
    return np.empty_like(data), False


def delivered(result: np.ndarray, out: np.ndarray | None, in_out: bool) -> np.ndarray:
    """The caller's result of a direct call that reduced into ``result`` (:func:`direct_result`): ``out`` filled,
    else ``result``."""
    if out is None:
        return result
    if not in_out:
        np.copyto(out, result.reshape(out.shape), casting="same_kind")
    return out


def in_rank_order(ufunc: np.ufunc, rank: int, mine: np.ndarray, theirs: np.ndarray, out: np.ndarray) -> None:
    """``out`` = the pair reduced in rank order (``out`` may be ``mine``: element-wise, in place)."""
    first, second = (mine, theirs) if rank == 0 else (theirs, mine)
    ufunc(first, second, out=out)


#: Where :class:`PairExchange` left a call: done; its check's request pending; its ranks' signatures differ; its
#: swap's requests pending.
DONE, CHECKING, MISMATCH, SWAPPING = 0, 1, 2, 3


class PairExchange:
    """The messages of a two-rank allreduce, posted and tested in the caller's stack: the check's allgather of the
    ranks' signature rows on ``check_comm``, then a swap of values on ``swap_comm`` (the very messages of a round of
    :func:`rounds`). Each step returns (where the call is, the requests still
    pending); the caller waits for those and goes on. ``MPI`` is taken as the compiled twin takes it (it reads MPI's
    types there); mpi4py picks them here."""

    def __init__(self, MPI: ModuleType, check_comm: Comm, swap_comm: Comm) -> None:
        self._check_comm, self._swap_comm, self._other = check_comm, swap_comm, 1 - swap_comm.Get_rank()

    def start(self, row: np.ndarray | None, every: np.ndarray | None, data: np.ndarray, received: np.ndarray,
              inline_s: float) -> tuple[int, Any]:  # fmt: skip
        """Post the check, the allgather of this rank's int64 ``row`` into ``every`` (None: no check), test it for
        ``inline_s``, and once it has ended go on with :meth:`swap`."""
        if row is None or every is None:
            return self.swap(None, data, received, inline_s)
        request = self._check_comm.Iallgather(row, every)
        if not ends_in_place(request.Test, inline_s):
            return CHECKING, [request]
        return self.swap(every, data, received, inline_s)

    def swap(
        self, every: np.ndarray | None, data: np.ndarray, received: np.ndarray, inline_s: float
    ) -> tuple[int, Any]:
        """Unless the two halves of ``every`` (the ranks' rows) differ in their first word (the signature's digest),
        send ``data`` to the other rank and receive its values into ``received`` (C-contiguous, of the same dtype;
        the other rank sends as many), tested for ``inline_s``."""
        if every is not None and every.flat[0] != every.flat[every.size // 2]:
            return MISMATCH, ()
        comm, other = self._swap_comm, self._other
        requests = [comm.Irecv(received, other, _TAG), comm.Isend(data, other, _TAG)]
        if ends_in_place(functools.partial(type(requests[0]).Testall, requests), inline_s):
            return DONE, ()
        return SWAPPING, requests
