"""The two job-wide agreements the runtime makes on its private communicator: a refusal every rank shares, and
the end of a job (no rank busy, no message in flight)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from .errors import JobRefused, TransportError
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
    until its report ends the job). Counts that stay apart with no such frame (a message no rank of the job sent,
    delivered) end the job the same way, with rank 0's :class:`TransportError`."""
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
        balanced = current[2] == 0 and current[0] == current[1]
        if balanced and current == previous:
            return
        if current == previous:  # stalled: every rank idle, and the counts do not meet
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > stalled_s:
                if current[2] and (refusal := engine.receiving.unfinished_refusal()) is not None:
                    raise refusal  # a frame's parts missing here
                if not current[2] and control.Get_rank() == 0:
                    raise TransportError(_unbalanced(*current[:2], stalled_s))
            await asyncio.sleep(0.05)
        else:
            stalled_since = 0.0
        previous = current


def _unbalanced(sent: int, delivered: int, stalled_s: float) -> str:
    """Why a job whose ranks are all idle cannot end: its counts of messages sent and delivered do not meet."""
    why = (f": {delivered - sent} delivered that no rank of the job sent as its messages (frames from outside the "
           "job, or damaged ones that read as messages)" if delivered > sent else "")  # fmt: skip
    return (f"the job cannot end: its ranks sent {sent} messages and delivered {delivered}, unchanged for "
            f"{stalled_s:g} s with every rank idle{why}")  # fmt: skip
