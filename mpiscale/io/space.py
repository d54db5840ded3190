"""Free space, checked before a write starts: a write that cannot fit is refused with the sizes, not begun.

Running out of space in the middle of collective I/O is what hangs or kills
MPI jobs (one rank fails, another waits inside the collective, or HDF5 cannot
close a file it could not flush). ``statvfs`` does not see user quotas, so
the checkpointer's deadline stays the backstop for those.
"""

from __future__ import annotations

import os
import resource

MARGIN = 1.05  # HDF5's metadata and alignment on top of the arrays' bytes
SLACK = 1 << 20
NEARLY_FULL = 64 << 20  # free bytes under which a failed write is said to have met a full disk (HDF5's chunks: 1 MiB)


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes an unprivileged user may still write in ``directory``'s file system (quotas not counted)."""
    status = os.statvfs(directory)
    return status.f_bavail * status.f_frsize


def space_problem(directory: str | os.PathLike, nbytes: int, what: str) -> str | None:
    """Why ``nbytes`` of arrays cannot be written into ``directory`` (with room for metadata), or None."""
    needed = int(nbytes * MARGIN) + SLACK
    free = free_bytes(directory)
    if free >= needed:
        return None
    return (
        f"{what} needs {needed / 2**20:.1f} MiB in {os.fspath(directory)}, which has {free / 2**20:.1f} MiB free "
        "(No space left on device): free space or give another directory"
    )


def write_failure_note(directory: str | os.PathLike, failure: str) -> str:
    """What to add to ``failure``, a file call's error in ``directory``: HDF5 says only "file write failed", never
    why. Where the file system is (nearly) full, that; where it has room and a write failed, what else stops one: the
    process's file size limit (``ulimit -f``), or a quota, which ``statvfs`` does not see. Otherwise empty."""
    try:
        free = free_bytes(directory)
    except OSError:
        return ""
    where = os.fspath(directory)
    if free < NEARLY_FULL:
        return f" ({where} has {free / 2**20:.1f} MiB free: No space left on device, it seems)"
    if "write failed" not in failure:
        return ""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return (f" ({where} has room, but this process may write files of at most {limit / 2**20:.1f} MiB: its file "
                "size limit, ulimit -f, stopped the write, it seems)")  # fmt: skip
    return (f" ({where} has {free / 2**30:.1f} GiB free, so a quota is full, it seems, or the disk failed: `quota -s`, "
            f"or `lfs quota -h -u $USER {where}` on Lustre, shows your quotas)")  # fmt: skip
