"""The two job-wide agreements the runtime makes on its private communicator: a refusal every rank shares, and
the end of a job (no rank busy, no message in flight)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from .errors import JobRefused
from .progress import ProgressEngine


async def agree_or_refuse(
    engine: ProgressEngine, control: Any, error: BaseException | None, what: str, timeout: float, status: int
) -> None:
    """Return if no rank has an ``error``; else raise :class:`JobRefused` on every rank with the lowest failing
    rank's message and status. A rank missing for ``timeout`` seconds raises this rank's error (or a RuntimeError)."""
    rank, size = control.Get_rank(), control.Get_size()
    message = b"" if error is None else str(error).encode()
    lengths = np.empty((size, 2), dtype=np.int64)  # per rank: message length (-1: no error), status
    mine = np.array([len(message) if error is not None else -1, status], dtype=np.int64)
    try:
        await asyncio.wait_for(engine.wait(control.Iallgather(mine, lengths), f"agreement on {what}"), timeout)
        failed = np.flatnonzero(lengths[:, 0] >= 0)
        if not len(failed):
            return
        root = int(failed[0])
        text = np.empty(lengths[root, 0], np.uint8)
        if root == rank:
            text[:] = np.frombuffer(message, np.uint8)
        await asyncio.wait_for(engine.wait(control.Ibcast(text, root), f"message of {what}"), timeout)
    except TimeoutError:
        if error is not None:
            raise error from None
        raise RuntimeError(
            f"rank {rank}: other ranks did not reach the agreement on {what} within {timeout:g}s"
        ) from None
    raise JobRefused(text.tobytes().decode(errors="replace"), int(lengths[root, 1]))


async def until_quiet(
    MPI: ModuleType, engine: ProgressEngine, control: Any, locally_idle: Callable[[], bool], stalled_s: float
) -> None:
    """Return when every rank is idle and every sent message was delivered: two votes in a row with the same
    counts, sent equal to received.

    A rank that holds a frame whose parts never began to come (:attr:`ProgressEngine.unfinished`: a frame no rank
    sent as one of its messages, which also holds up what its sender sent after it) would keep the counts apart,
    or the job's end waiting, for ever: once the counts have not moved for ``stalled_s`` seconds with such a frame
    anywhere, the rank that holds it raises its :class:`MessageRefused`, naming the sender (the others vote on
    until its report ends the job)."""
    previous = None
    stalled_since = 0.0
    while True:
        delay = 0.0
        while not locally_idle():
            await asyncio.sleep(delay)
            delay = min(delay * 2 or 1e-4, 5e-3)
        counts = np.array([engine.messages_sent, engine.messages_received, engine.unfinished], dtype=np.int64)
        await engine.wait(control.Iallreduce(MPI.IN_PLACE, counts, MPI.SUM), "termination vote")
        current = (int(counts[0]), int(counts[1]), int(counts[2]))
        if current[2] == 0 and current[0] == current[1] and current == previous:
            return
        if current[2] and current == previous:  # stalled, with a frame's parts missing somewhere
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > stalled_s and (refusal := engine.unfinished_refusal()) is not None:
                raise refusal
            await asyncio.sleep(0.05)
        else:
            stalled_since = 0.0
        previous = current
