"""One full failure report per distinct error on a host, however many of its ranks fail with it.

A bug every rank meets (a ``KeyError`` in ``main``) printed one traceback per rank: 84 lines from 4 ranks, and a
node of 64 ranks buried the job's log in 64 copies. The first rank of a host to fail with an error (the same type,
message and traceback) leaves a marker named by the job and the error's digest in the host's memory file system
(``/dev/shm``), holding its pid; a rank of that host that fails the same way finds the marker and prints one line
naming that process, whose report carries the traceback. The marker outlives its writer on purpose: the first rank
aborts the job at once, and a rank the launcher has not killed yet may fail after it has gone (an abstract socket,
which goes with its process, left one traceback in two like that on a loaded host). Markers older than
``_KEPT_S`` are removed by the next failure on the host; a job's are a few empty-sized files. Ranks of other hosts
print their own report; where no marker can be written, every rank prints its own, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

from ..host_markers import folder, marker_prefix, remove_old

_PREFIX = "mpiscale-failure-"
_KEPT_S = 600.0  # a job's abort is over in seconds; its markers are left this long


def first_reporter(report: str) -> int | None:
    """None when this process is the first of its host to report the failure ``report`` describes (its type,
    message and traceback) in this job, or when that cannot be told; else the pid of the process that was."""
    where = folder()
    digest = hashlib.blake2b(report.encode(), digest_size=12).hexdigest()
    marker = os.path.join(where, f"{marker_prefix(_PREFIX)}{digest}")
    remove_old(where, _PREFIX, _KEPT_S)
    mine = f"{marker}.{os.getpid()}"
    try:
        with open(mine, "w") as out:
            out.write(str(os.getpid()))
        os.link(mine, marker)  # atomic, and the marker is whole when it appears: the first failure's pid
        return None
    except FileExistsError:
        return _pid_in(marker)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(mine)


def _pid_in(marker: str) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(marker) as text:
        pid = int(text.read())
        return pid if pid != os.getpid() else None
    return None
