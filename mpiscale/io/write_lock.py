"""HDF5's file lock for a job's reads: who holds an input open for writing, and the shared lock a reader holds.

HDF5 (1.10 on) takes an exclusive ``flock`` on a file it opens for writing
and a shared one on a file it opens for reading, so that a reader never sees
a file half written: a second h5py program reading it is refused ("unable to
lock file"). A file opened through MPI-IO takes no lock, so a job's ranks
read a file that another program (h5py, a C tool) is still writing, rows
missing or half written, without a word. So the job takes the shared lock
an HDF5 reader holds (one rank for the job), and keeps it while the file is
open: a program that then opens the file for writing is refused by HDF5, as
another reader's lock refuses it. Each lock held is a file descriptor beside
MPI-IO's own, so at most ``MOST_HELD`` are held at once: past them a file is
checked as it opens, not held (a data set of many files would otherwise halve
the files a process may open under its ``ulimit -n``).
"""

from __future__ import annotations

import fcntl
import os
import threading

#: ``HDF5_USE_FILE_LOCKING`` values that turn HDF5's locks off (the user's choice: no check then).
_LOCKING_OFF = ("FALSE", "0")

#: The most locks a process holds at once (``read_lock``).
MOST_HELD = 256
_held = 0
_counting = threading.Lock()


def read_lock(path: str) -> tuple[int | None, str | None]:
    """The shared lock HDF5's readers hold on ``path``: (the descriptor holding it, for the caller to ``release`` once
    it has closed the file; None), or (None, who holds the file open for writing: ``"process 4242 (python3)"``, or
    ``"another process"`` where this host cannot say, one on another node). (None, None) where no lock is taken:
    ``HDF5_USE_FILE_LOCKING`` turns HDF5's locks off, the file system has no ``flock``, the file cannot be opened
    (the open that follows says why), or ``MOST_HELD`` locks are held (the file is checked, not held)."""
    if os.environ.get("HDF5_USE_FILE_LOCKING", "").strip().upper() in _LOCKING_OFF:
        return None, None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None, None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(os.fstat(fd))
        os.close(fd)
        return None, holder
    except OSError:  # no flock on this file system (ENOLCK, EOPNOTSUPP, ENOSYS): HDF5 cannot lock it either
        os.close(fd)
        return None, None
    global _held
    with _counting:
        kept = _held < MOST_HELD
        _held += kept
    if not kept:
        os.close(fd)  # (checked, not held: MOST_HELD are)
        return None, None
    return fd, None


def release(fd: int) -> None:
    """Let go of a lock ``read_lock`` gave."""
    global _held
    os.close(fd)
    with _counting:
        _held -= 1


def _holder(stat: os.stat_result) -> str:
    """The process of this host whose exclusive ``flock`` is on the file of ``stat`` (the kernel's ``/proc/locks``:
    ``1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF``), or ``"another process"``."""
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return "another process"
    for line in lines:
        fields = line.split()
        if "->" not in fields and fields[1:4] == ["FLOCK", "ADVISORY", "WRITE"] and fields[5] == device:
            pid = int(fields[4])
            if pid == os.getpid():
                return f"this process ({pid})"
            try:
                with open(f"/proc/{pid}/comm") as name:
                    return f"process {pid} ({name.read().strip()})"
            except OSError:
                return f"process {pid}"
    return "another process"
