"""One full failure report per distinct error on a host, however many of its ranks fail with it.

A bug every rank meets (a ``KeyError`` in ``main``) printed one traceback per rank: 84 lines from 4 ranks, and a
node of 64 ranks buried the job's log in 64 copies. The first rank of a host to fail with an error (the same type,
message and traceback) holds an abstract Unix socket named by the job and the error's digest; a rank of that host
that fails the same way finds the name taken, asks the socket whose it is (``SO_PEERCRED``) and prints one line
naming that process, whose report carries the traceback. The name goes with the process that holds it, so an
aborted job leaves nothing behind. Ranks of other hosts cannot see the name and print their own report; where the
name cannot be taken or its holder found (no such sockets, a network namespace per rank), every rank prints its own,
as before.
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import struct

_HELD: list[socket.socket] = []  # the names this process holds, kept until it exits
_ASK_TIMEOUT_S = 1.0


def first_reporter(report: str) -> int | None:
    """None when this process is the first of its host to report the failure ``report`` describes (its type,
    message and traceback) in this job, or when that cannot be told; else the pid of the process that was."""
    name = f"\0mpiscale-failure-{job_key()}-{hashlib.blake2b(report.encode(), digest_size=12).hexdigest()}"
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        holder.bind(name)
        holder.listen(256)  # the ranks that fail the same way each connect once, to learn whose the name is
    except OSError as error:
        holder.close()
        return _holder_of(name) if error.errno == errno.EADDRINUSE else None
    _HELD.append(holder)
    return None


def job_key() -> str:
    """What names this job alike on every rank of a host, and no other job there: the PMIx namespace (Open MPI,
    srun --mpi=pmix), else Slurm's job and step, else the parent process (mpirun's or orted's)."""
    if os.environ.get("PMIX_NAMESPACE"):
        return os.environ["PMIX_NAMESPACE"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '')}"
    return f"parent-{os.getppid()}"


def _holder_of(name: str) -> int | None:
    """The pid of the process listening on the abstract socket ``name``; None where it cannot be told (it exited)."""
    asking = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    asking.settimeout(_ASK_TIMEOUT_S)
    try:
        asking.connect(name)
        pid, _, _ = struct.unpack("3i", asking.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return None
    finally:
        asking.close()
    return pid if pid > 0 and pid != os.getpid() else None
