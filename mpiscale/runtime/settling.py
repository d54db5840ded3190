"""Waiting for a collective's MPI requests without blocking the event loop: tested in the caller's stack first
(a call whose ranks are all there ends in microseconds), then polled by the progress engine, then awaited."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .pair_reduce import CHECKING, MISMATCH
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
        done = engine.wait(request, what, keep)
        engine.poll_until(done, spin_s)
        await done


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


async def swap_pair(engine: ProgressEngine, pair: Any, row: np.ndarray | None, data: np.ndarray,
                    received: np.ndarray, what: str, keep: object, spin_s: float) -> np.ndarray | None:  # fmt: skip
    """A small two-rank allreduce's check and swap by ``pair``'s steps (a ``pair_reduce.PairExchange``, or its
    compiled twin), each tested in place for ``INLINE_TEST_S`` and then settled: the check of this rank's int64
    ``row`` (None: no check), then the swap of ``data`` into ``received``. None once both have ended; the two
    ranks' rows when their signatures differ (the caller reports it; nothing was swapped)."""
    every = None if row is None else np.empty(2 * row.size, np.int64)
    step, pending = pair.start(row, every, data, received, 0.0 if engine.others_ready() else INLINE_TEST_S)
    if step == CHECKING:
        await settle(engine, pending[0], f"{what} check", (row, every), spin_s)
        step, pending = pair.swap(every, data, received, 0.0 if engine.others_ready() else INLINE_TEST_S)
    if step == MISMATCH:
        return every
    if pending:  # its send too: the caller may change its buffer on return
        await settle_all(engine, pending, what, keep, spin_s)
    return None
