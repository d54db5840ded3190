"""What a rank says about itself when asked (SIGUSR1, a dump command) or when it fails: plain text for people."""

from __future__ import annotations

import asyncio
import io
import os
import time
import traceback
from collections.abc import Iterable, Mapping
from typing import Protocol

from ..words import counted
from .errors import MessageRefused
from .same_failure import first_reporter


class _Pending(Protocol):
    @property
    def ref(self) -> object: ...

    @property
    def method(self) -> str: ...

    @property
    def started(self) -> float: ...


class _Described(Protocol):
    def describe(self) -> str: ...


def rank_diagnostics(
    where: str,
    stopping: bool,
    traffic: tuple[int, int],
    requests: list[str],
    asks: Mapping[int, _Pending],
    cells: Iterable[_Described],
) -> str:
    """What a rank is doing: its pending MPI requests and asks, its mailboxes, and every asyncio task's stack.

    ``where`` names the rank ("rank 1 of 4 on node7"); ``traffic`` is (messages sent, received)."""
    now = time.monotonic()
    lines = [
        f"==== mpiscale diagnostics: {where} (pid {os.getpid()}) ====",
        f"state: {'stopping' if stopping else 'running'}; messages sent {traffic[0]}, received {traffic[1]}",
        "pending MPI requests:",
    ]
    lines += [f"  {line}" for line in requests] or ["  none"]
    lines.append("pending asks:")
    lines += [f"  ask #{i} to {p.ref} {p.method!r}: waiting {now - p.started:.3f}s" for i, p in asks.items()] or [
        "  none"
    ]
    lines.append("actors:")
    lines += [f"  {cell.describe()}" for cell in cells]
    lines.append("asyncio tasks:")
    for task in asyncio.all_tasks():
        stream = io.StringIO()
        task.print_stack(file=stream)
        lines.append("  " + stream.getvalue().rstrip().replace("\n", "\n  "))
    return "\n".join(lines) + "\n"


def failure_report(rank: int, size: int, host: str, context: str, error: BaseException) -> str:
    """The one report a failing rank prints before the job is aborted: where, in what, and the traceback (a
    deliberate ``SystemExit``'s message instead); one line where a rank of this host has printed the same report
    (:mod:`.same_failure`)."""
    text = f"{error.code}\n" if isinstance(error, SystemExit) else "".join(traceback.format_exception(error))
    reporter = first_reporter(f"{context}\n{text}")
    if reporter is not None:  # another rank of this host printed this very report: one line, not a second traceback
        last = text.rstrip().splitlines()[-1] if text.strip() else type(error).__name__
        return (f"mpiscale: rank {rank} of {size} (host {host}, pid {os.getpid()}) failed as pid {reporter} did, whose "
                f"report above has the traceback: {context}: {last}\n")  # fmt: skip
    bar = "=" * 72
    return (
        f"\n{bar}\nmpiscale: job failed on rank {rank} of {size} (host {host}, pid {os.getpid()})\n{context}\n\n"
        f"{text}{bar}\nmpiscale: aborting all {counted(size, 'rank')}\n"
    )


def refusal_report(rank: int, size: int, host: str, sender_host: str, refusal: MessageRefused) -> str:
    """The report of a rank that refused another rank's message: which message, from whom, why; no traceback (the
    receiver's stack says nothing about the sender)."""
    return (
        f"mpiscale: job failed on rank {rank} of {size} (host {host}, pid {os.getpid()}): it refused a message from "
        f"rank {refusal.source} (host {sender_host}): {refusal}\nmpiscale: aborting all {counted(size, 'rank')}\n"
    )
