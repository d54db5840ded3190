"""One job per output: an advisory lock on a checkpoint directory or a results file, held while the job runs.

The lock is ``flock`` on a small file that names its holder (job id, host,
pid, start time). The kernel releases it when the holder dies, however it
dies, so a lock file that names a holder but is not locked was left by a job
that ended without cleaning up: it is taken over, with a warning. On a file
system without ``flock`` (some Lustre mounts) the check is skipped with a
warning rather than refusing to run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
from pathlib import Path

from .errors import LockedError
from .h5file import utc_timestamp

log = logging.getLogger(__name__)

_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def job_id() -> str:
    """The batch system's job id, or ``host:pid`` outside one."""
    return os.environ.get("SLURM_JOB_ID") or f"{socket.gethostname()}:{os.getpid()}"


class OutputLock:
    """Held by one process of a job (rank 0) for ``what`` at ``path`` (the lock file itself)."""

    def __init__(self, path: str | os.PathLike, what: str) -> None:
        self.path, self.what = Path(path), what
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise LockedError naming the job that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise LockedError(
                f"{self.what} is in use by another job ({holder or 'holder unknown'}; lock {self.path}): wait for "
                "it to end, or choose another path"
            ) from None
        except OSError as error:
            if error.errno not in _UNSUPPORTED:
                os.close(fd)
                raise
            log.warning("%s: this file system has no flock, so other jobs using it cannot be detected", self.path)
        previous = _read(fd)
        if previous:
            log.warning("%s: taking over the lock of a job that ended without releasing it (%s)", self.what, previous)
        record = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(), "since": utc_timestamp()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the lock back and remove the lock file (a no-op if not held)."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def _read(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    try:
        holder = json.loads(text)
    except ValueError:
        return text
    return f"job {holder.get('job')} on {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}"
