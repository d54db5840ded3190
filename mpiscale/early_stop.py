"""Stop requests that come before the runtime runs: a SIGTERM while a rank still imports or starts MPI.

A launcher asks a job to stop with SIGTERM (Slurm's cancel and time limit)
or SIGUSR2 (``launch/mpiscale-run``, which mpirun passes on). A rank that
gets one while it still imports torch or starts MPI has no handler yet, and
SIGUSR2's default action kills it without a word: the job ended silently, or
with another status under load. ``hold`` (run on ``import mpiscale`` in a
process a launcher started) notes such a signal instead; the runtime, once it
runs, ``take``s it and stops as for any stop request (a job that steers
stops before its first step, saying so; others drain), so the job ends with
one line and status 143. A second signal before that, or a process that never
starts the runtime, keeps the default: the signal ends it.
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
_held: list[int] = []  # the signals noted, oldest first


def hold() -> None:
    """Note SIGTERM and SIGUSR2 until the runtime takes them (main thread only; handlers of the user's are kept)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _note)


def take() -> int | None:
    """The first stop signal noted before the runtime ran, and no more holding (None: none came)."""
    for signum in SIGNALS:
        if signal.getsignal(signum) is _note:
            signal.signal(signum, signal.SIG_DFL)
    first = _held[0] if _held else None
    _held.clear()
    return first


def _note(signum: int, frame: object) -> None:
    if _held:  # asked twice before the runtime took the first: the default action, at once
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _held.append(signum)
