"""Free space, checked before a write starts: a write that cannot fit is refused with the sizes, not begun.

Running out of space in the middle of collective I/O is what hangs or kills
MPI jobs (one rank fails, another waits inside the collective, or HDF5 cannot
close a file it could not flush). ``statvfs`` does not see user quotas: one
process per directory also asks the file system to set the room aside
(``fallocate``), which meets them; where it cannot (no ``fallocate``), the
checkpointer's deadline stays the backstop. A file HDF5 writes on the disk has
its room set aside in it as it is made (``set_room_aside``), so that no write of
its data meets a full disk later: HDF5 1.10.8, a one-process file's write
refused, raised from the close and crashed the process; a parallel one's left
the other ranks waiting in MPI-IO.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import tempfile

from .errors import RoomRefused

MARGIN = 1.05  # HDF5's metadata and alignment on top of the arrays' bytes
SLACK = 1 << 20
_LIBC = ctypes.CDLL(None, use_errno=True)  # (fallocate(2) itself: os.posix_fallocate writes zeros where it lacks)
# HDF5's metadata in a file of unaligned data sets, set aside with their bytes (measured: 6 KiB, and 0.4 KiB a data
# set). On btrfs, room set aside and left unused stays taken while the file lasts (an extent is freed whole).
METADATA_ROOM, DATASET_ROOM = 64 << 10, 4 << 10
CHUNK_ROOM = 256  # a chunk's entry in its data set's chunk index (measured: 48 bytes, 400 for the first few)
_KEEP_SIZE = 1  # FALLOC_FL_KEEP_SIZE: the blocks are allocated past the file's end, its size stays
NEARLY_FULL = 64 << 20  # free bytes under which a failed write is said to have met a full disk (HDF5's chunks: 1 MiB)


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes an unprivileged user may still write in ``directory``'s file system (quotas not counted)."""
    status = os.statvfs(directory)
    return status.f_bavail * status.f_frsize


def space_problem(directory: str | os.PathLike, nbytes: int, what: str, reserve: bool = False) -> str | None:
    """Why ``nbytes`` of arrays cannot be written into ``directory`` (with room for metadata), or None.

    ``reserve``: where the free space suffices, ask the file system for the
    room too (``reserve_refused``), which meets the user's quota; one process
    per directory and save, since the room several ask for at once adds up.
    """
    needed = int(nbytes * MARGIN) + SLACK
    free = free_bytes(directory)
    where = f"{what} needs {needed / 2**20:.1f} MiB in {os.fspath(directory)}"
    if free < needed:
        return (f"{where}, which has {free / 2**20:.1f} MiB free (No space left on device): free space or give another "
                "directory")  # fmt: skip
    refused = reserve_refused(directory, needed) if reserve else None
    if refused is None:
        return None
    return f"{where}, and the file system refused to set it aside {_refusal_words(directory, refused)}"


def file_bytes(nbytes: int, datasets: int) -> int:
    """The most bytes an HDF5 file of ``datasets`` unaligned data sets holding ``nbytes`` takes: theirs, and HDF5's
    metadata (a close bound: the room set aside for the file, and what its file size limit is held to)."""
    return nbytes + METADATA_ROOM + DATASET_ROOM * datasets


def set_room_aside(path: str | os.PathLike, nbytes: int) -> None:
    """Have the file system allocate the blocks of the file ``path``'s first ``nbytes`` that it lacks now, its size
    kept (``fallocate``, FALLOC_FL_KEEP_SIZE): writes within them then meet no full disk and no quota, which raise
    here instead (``RoomRefused``, an ``OSError``), before a byte of them is written; so does a file past the
    process's file size limit (EFBIG). A file system that cannot set room aside is asked nothing. ``give_back_room``
    frees what stays unused past the file's end."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and nbytes > limit:
        raise RoomRefused(errno.EFBIG, f"{os.strerror(errno.EFBIG)}: {os.fspath(path)} would need "
                          f"{nbytes / 2**20:.1f} MiB, and this process may write files of at most "
                          f"{limit / 2**20:.1f} MiB (its file size limit, ulimit -f)")  # fmt: skip
    descriptor = os.open(path, os.O_WRONLY)
    try:
        code = _refused(descriptor, _KEEP_SIZE, nbytes)
    finally:
        os.close(descriptor)
    if code is not None:
        directory = os.path.dirname(os.path.abspath(path))
        raise RoomRefused(code, f"{os.fspath(path)} needs {nbytes / 2**20:.1f} MiB, which the file system refused "
                          f"to set aside {_refusal_words(directory, code)}")  # fmt: skip


def give_back_room(path: str | os.PathLike) -> None:
    """Free the blocks ``set_room_aside`` allocated past the end of ``path`` that its writes left unused (a
    truncation to the size it has)."""
    os.truncate(path, os.stat(path).st_size)


def _refused(descriptor: int, mode: int, nbytes: int) -> int | None:
    """The errno of the file system's refusal (EDQUOT, ENOSPC) to allocate the first ``nbytes`` of the open file
    ``descriptor`` (``fallocate`` with ``mode``), or None: allocated, or a file system that cannot (no room is known
    to be missing)."""
    if _LIBC.fallocate(descriptor, mode, ctypes.c_int64(0), ctypes.c_int64(nbytes)) == 0:
        return None
    code = ctypes.get_errno()
    return code if code in (errno.EDQUOT, errno.ENOSPC) else None


def _refusal_words(directory: str | os.PathLike, code: int) -> str:
    """Why the file system refused room in ``directory`` (errno ``code``), and what to do."""
    why = f"your quota is full, it seems ({_quota_commands(directory)})" if code == errno.EDQUOT else (
        f"the disk is full, it seems ({_free_words(directory)})")  # fmt: skip
    return f"({os.strerror(code)}): {why}; free space or give another directory"


def reserve_refused(directory: str | os.PathLike, nbytes: int) -> int | None:
    """The errno of the file system's refusal to set ``nbytes`` aside in ``directory`` now (``fallocate`` of a
    nameless file, freed at once): what ``statvfs`` does not see, the user's quota (EDQUOT). None where it fits, and
    where the file system cannot set room aside (no ``fallocate``) or the probe cannot be made: the free space is all
    that is known. At most the process's file size limit is asked for (the files are each below it, or their write
    says so)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    size = nbytes if limit == resource.RLIM_INFINITY else min(nbytes, limit)
    try:
        descriptor, name = tempfile.mkstemp(prefix=".mpiscale-room-", dir=directory)
    except OSError:
        return None
    try:
        os.unlink(name)  # (nothing stays behind, even if this process is killed now)
        return _refused(descriptor, 0, size)
    finally:
        os.close(descriptor)


def _free_words(directory: str | os.PathLike) -> str:
    """How much ``directory``'s file system has free, in words."""
    try:
        return f"{free_bytes(directory) / 2**20:.1f} MiB free"
    except OSError as error:
        return f"its free space unknown: {error.strerror}"


def write_failure_note(directory: str | os.PathLike, failure: BaseException | str) -> str:
    """What to add to ``failure``, a file call's error (or its words) in ``directory``: HDF5 says only "file write
    failed", never why. Where the file system is (nearly) full, that; where it has room and a write failed, what else
    stops one: the process's file size limit (``ulimit -f``), or a quota, which ``statvfs`` does not see. Otherwise,
    and after a room refused (whose words say why), empty."""
    if isinstance(failure, RoomRefused):
        return ""
    failure = str(failure)
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
    return (f" ({where} has {free / 2**30:.1f} GiB free, so a quota is full, it seems, or the disk failed: "
            f"{_quota_commands(directory)}, shows your quotas)")  # fmt: skip


def _quota_commands(directory: str | os.PathLike) -> str:
    """The commands that show a user's quota on ``directory``'s file system, in words."""
    return f"`quota -s`, or `lfs quota -h -u $USER {os.fspath(directory)}` on Lustre"
