"""Build mpiscale's compiled message path, mpiscale/runtime/_wire.pyx, in place (Cython, with mpicc against this
machine's MPI), unless the built one is current.

A failed build is not fatal: it says so in one line (the compiler's output goes to build/wire.log) and exits 0,
and the pure-Python path runs instead; ``mpiscale doctor`` says which path is active.

Usage: .venv/bin/python launch/build-extension.py [--force]
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "mpiscale" / "runtime" / "_wire.pyx"
BUILD = REPO / "build"
STAMP = BUILD / "wire.stamp"
LOG = BUILD / "wire.log"


def _mpi_library() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()


def _built() -> list[Path]:
    return sorted(SOURCE.parent.glob("_wire.*.so"))


def _compile(digest: str, library: str) -> None:
    import numpy
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    os.environ.setdefault("CC", "mpicc")  # MPI's headers and library, as mpi4py's own build finds them
    extension = Extension(
        "mpiscale.runtime._wire",
        [str(SOURCE.relative_to(REPO))],
        include_dirs=[numpy.get_include()],
        define_macros=[
            ("MPISCALE_WIRE_SOURCE_SHA256", f'"{digest}"'),
            ("MPISCALE_WIRE_MPI_LIBRARY", '"' + library.replace('"', "'") + '"'),
        ],
        extra_compile_args=["-O2"],
    )
    modules = cythonize([extension], build_dir=str(BUILD / "cython"), quiet=True, language_level=3)
    distribution = Distribution({"name": "mpiscale-wire", "ext_modules": modules})
    command = distribution.get_command_obj("build_ext")
    command.inplace = True
    command.build_temp = str(BUILD / "temp")
    distribution.run_command("build_ext")


def main(argv: list[str]) -> int:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
    library = _mpi_library()
    want = f"{digest} {library}"
    if "--force" not in argv and _built() and STAMP.exists() and STAMP.read_text() == want:
        print("[setup] compiled message path up to date")
        return 0
    BUILD.mkdir(exist_ok=True)
    for stale in _built():
        stale.unlink()
    os.chdir(REPO)
    with open(LOG, "w") as log, redirect_stdout(log), redirect_stderr(log):
        try:
            _compile(digest, library)
            failure = None
        except BaseException as error:  # a compiler's SystemExit included: the fallback is the point
            traceback.print_exc()
            failure = f"{type(error).__name__}: {error}".splitlines()[0]
    if failure is not None or not _built():
        print(f"[setup] compiled message path NOT built ({failure or 'no module made'}; see {LOG}): "
              "the pure-Python path runs")  # fmt: skip
        return 0
    STAMP.write_text(want)
    print(f"[setup] compiled message path built ({_built()[0].name}, against {library.split(',')[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
