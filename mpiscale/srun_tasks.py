"""Whether the tasks of an srun step can form one MPI job, found before MPI starts, and the one line that says why not.

srun starts the tasks; an MPI plugin of Slurm's (``--mpi=pmix``, ``--mpi=pmi2``) tells each how to find the
others. Two launches cannot work, and Open MPI ends each task of them in ``MPI_Init`` with a banner that blames how
it was built: no plugin (``--mpi=none``, which many sites make the default), and Slurm's PMI-2 plugin under an Open
MPI that has no PMI-2 client (Debian's and many sites' speak PMIx alone). Both are read here from the environment
and, for the second, from the Open MPI that mpi4py loads; a program's entry says it once (``launch_refused``), a
library call raises :class:`LaunchError` (``refuse_unjoinable_launch``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys

from . import mpi_library
from .ranks import RANK_VARIABLES, LaunchError, launched_rank

#: What srun's PMI-2 plugin gives every task (and the PMIx one does not).
PMI2_VARIABLE = "PMI_FD"

#: Open MPI 2-4's clients of Slurm's PMI-1 and PMI-2 (components of its ``pmix`` framework).
OPEN_MPI_PMI_CLIENTS = ("s1", "s2")

_PLUGINS = ("run srun --mpi=pmix (what Open MPI speaks; srun --mpi=list shows the site's plugins), or "
            "launch/mpiscale-run, which chooses it")  # fmt: skip


def launch_problem() -> str | None:
    """Why this process, one of several tasks of an srun step, cannot join them in one MPI job; None when it can,
    when that cannot be told, or when MPI has started already (it is then one job, or MPI has said otherwise).

    srun with no MPI plugin starts tasks that know nothing of each other: Open MPI ends each in ``MPI_Init``, and
    other MPIs run every task as a job of its own, all writing the same results. srun's PMI-2 plugin works with
    MPICH, Intel MPI and an Open MPI built with Slurm's PMI; an Open MPI without it ends each task in ``MPI_Init``.
    """
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if "mpi4py.MPI" in sys.modules or "SLURM_STEP_ID" not in os.environ or not tasks.isdigit() or int(tasks) < 2:
        return None
    told = [variable for variable in RANK_VARIABLES if variable != "SLURM_PROCID" and variable in os.environ]
    if not told:
        return (f"srun started {tasks} tasks without an MPI plugin (srun --mpi=none, or the site's MpiDefault), so "
                f"they cannot form one MPI job: {_PLUGINS}")  # fmt: skip
    if PMI2_VARIABLE in os.environ and told == ["PMI_RANK"]:
        library = open_mpi_without_pmi2()
        if library is not None:
            return (f"srun started {tasks} tasks with Slurm's PMI-2 plugin (srun --mpi=pmi2, or the site's "
                    f"MpiDefault), and {library} has no PMI-2 client (it speaks PMIx), so MPI would end every "
                    f"task as it starts: {_PLUGINS}")  # fmt: skip
    return None


@functools.cache
def open_mpi_without_pmi2() -> str | None:
    """The Open MPI that mpi4py loads ("Open MPI 4.1.4 (/usr/lib/.../libmpi.so.40.30.4)") where its ``pmix``
    components, as its ``ompi_info`` of the same version lists them, hold no PMI-2 client; None where they do, where
    the library is another MPI, or where that cannot be told (no mpi4py, no ``ompi_info``, Open MPI 5, which has
    no such components). The library is named by a child process, so that MPI does not start here; asked once a
    process (a command's entry and the runtime's start both check before MPI starts)."""
    version, *libraries = _output([sys.executable, "-P", mpi_library.__file__]).splitlines() or [""]
    if not version.startswith("Open MPI v") or not libraries:
        return None
    number = version.split(",")[0].removeprefix("Open MPI v").strip()
    beside = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(libraries[0]))), "bin", "ompi_info")
    found = (beside, shutil.which("ompi_info"))
    for ompi_info in dict.fromkeys(path for path in found if path and os.path.isfile(path)):
        listing = _output([ompi_info, "--parsable"])
        if f"ompi:version:full:{number}\n" in listing:
            return without_pmi2(f"Open MPI {number} ({libraries[0]})", listing)
    return None


def without_pmi2(library: str, listing: str) -> str | None:
    """``library`` where ``listing`` (``ompi_info --parsable``) names ``pmix`` components and no PMI-2 client among
    them (Open MPI 2-4's ``s1`` and ``s2``); else None."""
    components = set(re.findall(r"^mca:pmix:(\w+):version:", listing, re.MULTILINE))
    return library if components and not components & set(OPEN_MPI_PMI_CLIENTS) else None


def _output(command: list[str]) -> str:
    """What ``command`` prints, or "" where it cannot run, fails or takes over a minute."""
    try:
        ran = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return ran.stdout if ran.returncode == 0 else ""


def refuse_unjoinable_launch() -> None:
    """Raise :class:`LaunchError` on every task where ``launch_problem`` finds one. For library calls (the
    estimator); a program's entry says it once instead (``launch_refused``)."""
    problem = launch_problem()
    if problem:
        raise LaunchError(problem)


def launch_refused() -> int | None:
    """For a program's entry (the command line, ``mpiscale.run``), before MPI starts: None where the tasks can form
    one job; else the status this task ends with, the problem said once, by rank 0 (status 2, which becomes the
    step's; the others leave with 0 and no words, so that one line, not one per task, says it)."""
    problem = launch_problem()
    if not problem:
        return None
    if launched_rank() != 0:
        return 0
    print(f"mpiscale: {problem}", file=sys.stderr)
    return 2
