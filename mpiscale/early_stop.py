"""Stop requests that come before the runtime runs: a SIGTERM while a rank still imports or starts MPI.

A launcher asks a job to stop with SIGTERM (Slurm's cancel and time limit)
or SIGUSR2 (``launch/mpiscale-run``, which mpirun passes on). A rank that
gets one while it still imports torch or starts MPI has no handler yet, and
SIGUSR2's default action kills it without a word: the job ended silently, or
with another status under load. ``hold`` (run on ``import mpiscale`` in a
process a launcher started) notes such a signal instead; the runtime, once it
runs, ``take``s it and stops as for any stop request (a job that steers
stops before its first step, saying so; others drain), so the job ends with
one line and status 143. Copies of one request that come together (Slurm signals
every process: the rank, and mpirun, which passes its own on) count as one; a
second request before the runtime runs, or a process that never starts the
runtime, keeps the default: the signal ends it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from . import run_dir

SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
#: Stop signals this close after the first are the same request (one cancel reaches a rank several times at once).
SAME_STOP_S = 2.0
_held: list[int] = []  # the signals noted, oldest first
_first_at = [0.0]  # when the first was noted (time.monotonic)


def hold() -> None:
    """Note SIGTERM and SIGUSR2 until the runtime takes them (main thread only; handlers of the user's are kept)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _note)
    run_dir.note("held")  # the launcher may pass a stop on now


def take() -> int | None:
    """The first stop signal noted before the runtime ran, and no more holding (None: none came)."""
    for signum in SIGNALS:
        if signal.getsignal(signum) is _note:
            signal.signal(signum, signal.SIG_DFL)
    first = _held[0] if _held else None
    _held.clear()
    return first


def _note(signum: int, frame: object) -> None:
    now = time.monotonic()
    if _held and now - _first_at[0] < SAME_STOP_S:
        return  # a copy of the same request
    if _held:  # asked twice before the runtime took the first: the default action, at once
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _held.append(signum)
    _first_at[0] = now
