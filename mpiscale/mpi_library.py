"""The MPI library of this process, named by its version line and the files it maps.

Shared by the runtime (which build of the compiled message path is current),
the device choice (whether the library takes GPU buffers) and the srun launch
check, which runs this file as a program in a child process (``python -P
FILE``) to name the library mpi4py would load without starting MPI where it
asks. So it uses the standard library alone and imports nothing of mpiscale:
importing mpiscale under a launcher holds signals and installs exit handlers,
and takes a second.
"""

from __future__ import annotations


def library_line(version: str) -> str:
    """The first line of ``MPI.Get_library_version()``, without the NUL that Open MPI leaves in it."""
    return version.replace("\0", "").splitlines()[0].strip()


def mapped_mpi_libraries() -> list[str]:
    """The paths of the MPI libraries mapped into this process (those mpi4py loaded), from /proc/self/maps, sorted;
    none where that cannot be read."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line and ".so" in line}
    except OSError:
        return []
    return sorted(path for path in paths if path.startswith("/"))


def _name_the_library() -> None:
    """Print the version line of the library mpi4py loads, then its files, one a line, without starting MPI."""
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    print(library_line(MPI.Get_library_version()))
    print(*mapped_mpi_libraries(), sep="\n")


if __name__ == "__main__":
    _name_the_library()
