"""`mpiscale doctor`: what this machine offers mpiscale, and how to fix what is missing."""

from __future__ import annotations

import argparse
import importlib
import shutil
from dataclasses import dataclass

from .io import PARALLEL_H5PY
from .runtime import library_line, message_path
from .wire_build import REBUILD


@dataclass
class Check:
    """One line of the report: what was checked, what was found, how to fix it."""

    name: str
    ok: bool
    found: str
    fix: str = ""
    required: bool = True


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except ImportError:
        return None


SETUP = "pip install mpiscale's dependencies (pip install . in its checkout; launch/setup.sh does it all)"


def _mpi_checks() -> list[Check]:
    try:
        from mpi4py import MPI
    except ImportError as error:
        return [Check("mpi4py", False, f"not importable ({error})", SETUP)]
    levels = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    library = library_line(MPI.Get_library_version()).rstrip(",")
    major, minor = MPI.Get_version()
    level = levels.get(MPI.Query_thread(), "unknown")
    return [
        Check("MPI library", True, f"{library} (MPI {major}.{minor})"),
        Check("mpi4py", True, _version("mpi4py") or "?"),
        _message_path(),
        Check(
            "MPI thread level",
            level in ("serialized", "multiple"),
            level,
            "set MPISCALE_THREAD_LEVEL=multiple; background checkpoint writes need it",
            required=False,
        ),
    ]


def _message_path() -> Check:
    path, as_asked = message_path()
    fix = f"{REBUILD}: it compiles mpiscale/runtime/_wire.pyx with the site's mpicc and says why a build fails"
    return Check("message path", as_asked, path, fix, required=False)


def _h5py_check() -> Check:
    try:
        import h5py
    except ImportError:
        return Check("h5py (parallel)", False, "not installed", SETUP)
    mpi = bool(h5py.get_config().mpi)
    found = f"{h5py.__version__}, HDF5 {h5py.version.hdf5_version}, MPI {'yes' if mpi else 'NO'}"
    return Check(
        "h5py (parallel)",
        mpi,
        found,
        f"rebuild h5py against parallel HDF5 (docs/hpc.md): {PARALLEL_H5PY}",
    )


def _numba_checks() -> list[Check]:
    version = _version("numba")
    if version is None:
        return [Check("numba", False, "not installed", SETUP)]
    from numba import cuda

    gpu = cuda.is_available()
    found = "available" if gpu else "no GPU visible (CPU kernels are used; NUMBA_ENABLE_CUDASIM=1 simulates CUDA)"
    return [Check("numba", True, version), Check("GPUs (numba.cuda)", True, found, required=False)]


def _gpu_checks() -> list[Check]:
    """What the torch jobs' --device sees: torch's GPUs, and whether MPI takes device buffers."""
    from .jobs import mpi_cuda_aware

    try:
        import torch
    except ImportError:
        found = "torch not installed (the train, collect, circuits and compress-adapters jobs need it)"
        return [Check("GPUs (torch)", True, found, required=False)]
    build = f"torch {torch.__version__}, " + (f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build")
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count()))
        found = f"{torch.cuda.device_count()}: {names} ({build})"
    else:
        found = f"none ({build})"
    aware = mpi_cuda_aware()
    staged = "device buffers go through host memory"
    answers = {True: "yes: device buffers go to MPI as they are",
               False: f"no (the library says so at run time): {staged}",
               None: f"unknown (the library has no MPIX_Query_cuda_support): {staged}"}  # fmt: skip
    mpi = answers[aware]
    return [Check("GPUs (torch)", True, found, required=False), Check("MPI CUDA-aware", True, mpi, required=False)]


def _module(name: str, module: str, fix: str, required: bool) -> Check:
    version = _version(module)
    return Check(name, version is not None, version or "not installed", fix, required=required)


def _program(name: str, fix: str, required: bool) -> Check:
    path = shutil.which(name)
    return Check(name, path is not None, path or "not found", fix, required=required)


def _job_extras() -> list[Check]:
    """One line per job that needs more than the required packages: which of its modules are missing, and the
    extra that installs them (from the job registry)."""
    from .jobs import JOBS

    found = []
    for entry in JOBS.values():
        if not entry.needs:
            continue
        missing = [module for module in entry.needs if _version(module) is None]
        text = f"needs {', '.join(entry.needs)}: " + (f"missing {', '.join(missing)}" if missing else "installed")
        fix = f"pip install '.[{entry.extra}]' (launch/setup.sh does it)"
        found.append(Check(f"mpiscale {entry.name}", not missing, text, fix, required=False))
    return found


def checks() -> list[Check]:
    """Run every check (imports MPI, so call it in the process that will use MPI)."""
    return [
        *_mpi_checks(),
        _h5py_check(),
        *_numba_checks(),
        *_gpu_checks(),
        _module("aiomqtt", "aiomqtt", SETUP, required=True),
        _module("scipy (Numba's BLAS)", "scipy", SETUP, required=True),
        *_job_extras(),
        _module("estimator (sklearn)", "sklearn", "pip install 'mpiscale[sklearn]'", False),
        _module("inspect --plot (matplotlib)", "matplotlib", "pip install matplotlib (the test extra has it)", False),
        _module("Blosc/Zstd/LZ4 (hdf5plugin)", "hdf5plugin", "pip install 'mpiscale[filters]'", False),
        _program("mpirun", "apt-get install openmpi-bin (launch/setup.sh does it)", required=True),
        _program("mosquitto", "apt-get install mosquitto (launch/setup.sh does it)", required=False),
        _program("srun", "only needed on a Slurm cluster", required=False),
    ]


def report(results: list[Check]) -> tuple[str, int]:
    """The printed report and the exit status (1 if a required check failed)."""
    width = max(len(c.name) for c in results)
    lines, failed = [], False
    for check in results:
        mark = "ok  " if check.ok else ("FAIL" if check.required else "warn")
        lines.append(f"[{mark}] {check.name.ljust(width)}  {check.found}")
        if not check.ok and check.fix:
            lines.append(f"       {' ' * width}  fix: {check.fix}")
        failed |= check.required and not check.ok
    lines.append("mpiscale doctor: " + ("problems found (see FAIL lines)" if failed else "ready"))
    return "\n".join(lines), int(failed)


def command(args: argparse.Namespace) -> int:
    """``mpiscale doctor``: the report printed; 1 when something required is missing."""
    text, status = report(checks())
    print(text)
    return status
