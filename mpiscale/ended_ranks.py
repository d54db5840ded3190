"""Ranks whose program has ended normally, seen by the ranks of their host: outside ``mpiscale.run``, a rank that waits
in a blocking call one of them never came to ends the job instead of waiting for ever.

Under plain ``mpirun`` a rank whose program returns without a call every rank must make (the estimator's ``fit`` skipped
by a branch) finalizes MPI and waits there for the others, which wait in the call for it: no rank can answer for
another. At a normal end, as its last exit handler (before MPI is finalized), a rank of a launcher's job leaves a marker
named by the job and its world rank in the host's memory file system (:mod:`mpiscale.host_markers`);
:func:`~mpiscale.runtime.blocking_barrier` looks for its members' markers from 5 s into its wait (or the check). Ranks
of other hosts are not seen so (a wait on a communicator the ended rank used meets it below; on another, it is said).
The last rank of a host to end removes the job's markers, where the launcher says how many ranks the host runs
(mpirun, mpiexec.hydra, srun); a job that did not end so leaves them to be removed by a later end on the host, ten
minutes on.

After its marker, the rank makes the exchange that the runtime gives it (:func:`meet_at_end`), the first exchange of
every blocking call, on the world's communicator and each other one it made blocking calls on: a rank of any host that
waits in such a call on one of them meets it there, and the job ends at once naming both.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterable

from .host_markers import folder, marker_prefix, remove_old

_PREFIX = "mpiscale-ended-"
_KEPT_S = 600.0
_LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")  # Open MPI's, MPICH's
_AT_END: list[Callable[[], None]] = []  # the exchange a rank makes after its marker (the runtime's: this sits below it)


def meet_at_end(exchange: Callable[[], None]) -> None:
    """Make ``exchange()`` the last thing a rank does at its normal end, after its marker, before MPI is finalized."""
    _AT_END[:] = [exchange]


def note_normal_end() -> None:
    """Leave this rank's marker (an exit handler: a program that ends without an uncaught error), the last rank of
    the host to end removing the job's, then make the exchange of ``meet_at_end``. Nothing outside a job of several
    ranks, or once MPI is finalized."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        return
    where, prefix = folder(), marker_prefix(_PREFIX)
    with contextlib.suppress(OSError):
        open(os.path.join(where, f"{prefix}{MPI.COMM_WORLD.Get_rank()}"), "w").close()
        mine = remove_old(where, _PREFIX, _KEPT_S, prefix)  # (one pass: earlier jobs' old marks, the job's own)
        if len(mine) >= _ranks_on_host():
            for name in mine:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(where, name))
    for exchange in _AT_END:
        exchange()


def ended(ranks: Iterable[int]) -> list[int]:
    """Those of ``ranks`` (world ranks of this job) whose program has ended normally on this host."""
    prefix = marker_prefix(_PREFIX)
    try:
        names = {name[len(prefix) :] for name in os.listdir(folder()) if name.startswith(prefix)}
    except OSError:
        return []
    return [rank for rank in ranks if str(rank) in names]


def _ranks_on_host() -> int:
    """How many ranks of the job this host runs, as the launcher says (unknown: more than any)."""
    for name in _LOCAL_SIZE_VARIABLES:
        with contextlib.suppress(KeyError, ValueError):
            return int(os.environ[name])
    with contextlib.suppress(KeyError, ValueError, IndexError):  # srun: "2(x3),1" and this node's index
        return slurm_tasks_per_node(os.environ["SLURM_STEP_TASKS_PER_NODE"])[int(os.environ["SLURM_NODEID"])]
    return sys.maxsize


def slurm_tasks_per_node(spec: str) -> list[int]:
    """Slurm's count of a step's tasks on each of its nodes, ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if found is None:
            raise ValueError(f"not a count of tasks per node: {spec!r}")
        counts += [int(found[1])] * int(found[2] or 1)
    return counts
