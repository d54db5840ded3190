"""Waiting for a collective's MPI requests without blocking the event loop: tested in the caller's stack first
(a call whose ranks are all there ends in microseconds), then polled by the progress engine, then awaited."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .pair_reduce import CHECKING, HALVES_FROM_BYTES, MISMATCH, halves, in_rank_order
from .progress import ProgressEngine
from .waits import ends_in_place

#: How long a collective's request is tested in the caller's stack before the engine takes it over (seconds): MPI
#: ends a small one among ranks that are all there in 1-3 µs (2 ranks of a host).
INLINE_TEST_S = 20e-6


async def settle(engine: ProgressEngine, request: Any, what: str, keep: object, spin_s: float) -> None:
    """Wait for a collective's ``request``. One the other ranks are in already ends within microseconds: it is
    tested in the caller's stack first (for ``INLINE_TEST_S``), with no future and no task switch; then the engine
    polls for it in the caller's stack (for ``spin_s``); then it is awaited. While another task is ready to run, it
    is awaited at once: a loop of collectives that all end in place must not keep the event loop from the others."""
    if engine.others_ready():
        await engine.wait(request, what, keep)
        return
    if not ends_in_place(request.Test, INLINE_TEST_S):
        await engine.wait(request, what, keep, spin_s)


async def settle_all(engine: ProgressEngine, requests: list, what: str, keep: object, spin_s: float) -> None:
    """Wait for all of ``requests``: tested together in the caller's stack first (one MPI call a test: an
    exchange's send and receive end together), as :func:`settle` tests one, then each settled in turn. If a wait
    fails (the job ends, the call is abandoned), the engine still holds ``keep`` until the ones not yet settled
    complete: MPI may still read or write those buffers."""
    if requests and not engine.others_ready():
        testall = functools.partial(type(requests[0]).Testall, requests)  # (``MPI.Request.Testall``)
        if ends_in_place(testall, INLINE_TEST_S):
            return
    for settled, request in enumerate(requests):
        try:
            await settle(engine, request, what, keep, spin_s)
        except BaseException:
            for rest in requests[settled + 1 :]:
                engine.track(rest, what, keep)
            raise


async def reduce_pair(engine: ProgressEngine, pair: Any, row: np.ndarray | None, ufunc: np.ufunc, rank: int,
                      data: np.ndarray, result: np.ndarray, theirs: np.ndarray, what: str,
                      spin_s: float) -> np.ndarray | None:  # fmt: skip
    """A two-rank allreduce of C-contiguous ``data`` into ``result`` (which may be ``data``) by ``pair``'s steps (a
    ``pair_reduce.PairExchange``, or its compiled twin), the very messages of ``pair_reduce.rounds``, each tested in
    place for ``INLINE_TEST_S`` and then settled: the check of this rank's int64 ``row`` (None: no check), then the
    swap. Under ``HALVES_FROM_BYTES`` the whole buffers are swapped and each rank reduces the pair; from there each
    reduces its half and the reduced halves are swapped. ``theirs``: a 1-d uint8 array of ``room(data)`` bytes at
    least, for the other rank's values. None once done (its sends too: the caller may change its buffer); the two
    ranks' rows when their signatures differ (the caller reports it; nothing was swapped)."""
    whole = data.nbytes < HALVES_FROM_BYTES
    if whole:
        sent, received = data, theirs[: data.nbytes].view(data.dtype)
    else:
        flat, into = data.reshape(-1), result.reshape(-1)
        mine, its = halves(flat.size, rank)
        sent, received = flat[its], theirs[: into[mine].nbytes].view(data.dtype)
    every = None if row is None else np.empty(2 * row.size, np.int64)
    keep = (data, theirs, result)
    step, pending = pair.start(row, every, sent, received, 0.0 if engine.others_ready() else INLINE_TEST_S)
    if step == CHECKING:
        await settle(engine, pending[0], f"{what} check", (row, every), spin_s)
        step, pending = pair.swap(every, sent, received, 0.0 if engine.others_ready() else INLINE_TEST_S)
    if step == MISMATCH:
        return every
    if pending:
        await settle_all(engine, pending, what, keep, spin_s)
    if whole:
        in_rank_order(ufunc, rank, data, received.reshape(data.shape), result)
        return None
    in_rank_order(ufunc, rank, flat[mine], received, into[mine])
    # in place, ``into[its]`` is the half just sent: that swap has ended, so it may be overwritten now
    step, pending = pair.swap(None, into[mine], into[its], 0.0 if engine.others_ready() else INLINE_TEST_S)
    if pending:
        await settle_all(engine, pending, what, keep, spin_s)
    return None
