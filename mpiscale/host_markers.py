"""Files a job's ranks leave for one another on their host: named by the job, in the host's memory file system.

A rank cannot reach another through MPI once one of them has failed or finalized, but ranks of one host share
``/dev/shm``. Two uses: the first report of an error (:mod:`mpiscale.runtime.same_failure`) and a rank's normal end
(:mod:`mpiscale.ended_ranks`). Each kind has its own prefix, and markers older than the kind's keeping time are removed
by the next rank that writes one of that kind on the host.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time


def job_key() -> str:
    """What names this job alike on every rank of a host, and no other job there: the PMIx namespace (Open MPI,
    srun --mpi=pmix), else Slurm's job and step, else the parent process (mpirun's or orted's)."""
    if os.environ.get("PMIX_NAMESPACE"):
        return os.environ["PMIX_NAMESPACE"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '')}"
    return f"parent-{os.getppid()}"


def marker_prefix(kind: str) -> str:
    """The start of the names of this job's markers of ``kind`` (``"mpiscale-failure-"``)."""
    return f"{kind}{job_key().replace(os.sep, '_')}-"


def folder() -> str:
    """The host's memory file system where there is one (nothing reaches a disk), else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def remove_old(where: str, kind: str, kept_s: float, job: str = "") -> list[str]:
    """Remove the markers of ``kind`` in ``where`` older than ``kept_s`` seconds (earlier jobs'), in the same pass
    listing those whose names start with ``job`` (this job's prefix of the kind: never old, and never removed)."""
    now, found = time.time(), []
    with contextlib.suppress(OSError), os.scandir(where) as entries:
        for entry in entries:
            if job and entry.name.startswith(job):
                found.append(entry.name)
            elif entry.name.startswith(kind):
                with contextlib.suppress(OSError):
                    if now - entry.stat().st_mtime > kept_s:
                        os.unlink(entry.path)
    return found
