"""Build the compiled message path, ``mpiscale/runtime/_wire.pyx``, against the MPI library jobs run with.

``pip install`` builds it (``setup.py`` loads this file on its own: the package's dependencies need not be there
yet), and so does ``python -m mpiscale.wire_build`` for a package installed without it, or after the site's MPI
changed. The compiler is MPI's wrapper, ``$MPICC`` or ``mpicc`` on ``PATH``: the library whose headers and
``libmpi`` it names is the one mpi4py loads on a site (its wheels load the system's ``libmpi``). The build records
its source's SHA-256 and that library's version line, which the runtime checks before it uses the module
(``runtime.wire``). A build that fails is not fatal: it says why in one line, and the pure-Python path runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "runtime" / "_wire.pyx"
MODULE = "mpiscale.runtime._wire"
#: What every message about a missing or stale build tells the user to run.
REBUILD = "python -m mpiscale.wire_build"
#: Where the in-place build leaves the compiler's output.
LOG = Path(tempfile.gettempdir()) / "mpiscale-wire-build.log"
_PROBE = """#include <mpi.h>
#include <stdio.h>
int main(void) { char v[MPI_MAX_LIBRARY_VERSION_STRING]; int n; MPI_Get_library_version(v, &n); puts(v); return 0; }
"""


def mpi_compiler() -> str:
    """MPI's compiler wrapper: ``$MPICC``, else ``mpicc`` on ``PATH`` (``OSError`` when there is neither)."""
    named = os.environ.get("MPICC") or shutil.which("mpicc")
    if not named:
        raise OSError("no MPI compiler wrapper: set MPICC, or put the site's mpicc on PATH (module load ...)")
    return named


def library_line(compiler: str) -> str:
    """The first line of ``MPI_Get_library_version`` of the library ``compiler`` links, as a build records it (a probe
    compiled and run; the call is allowed before ``MPI_Init``)."""
    with tempfile.TemporaryDirectory() as folder:
        source, program = Path(folder, "probe.c"), Path(folder, "probe")
        source.write_text(_PROBE)
        subprocess.run([*compiler.split(), str(source), "-o", str(program)], check=True, capture_output=True,
                       timeout=300)  # fmt: skip
        printed = subprocess.run([str(program)], check=True, capture_output=True, text=True, timeout=60).stdout
    return printed.replace("\0", "").strip().splitlines()[0].strip().replace('"', "'")  # (a C string's quotes)


def placeholder() -> Any:
    """The extension as ``setup.py`` declares it (its build cythonizes it first): the wheel then holds a platform's
    build, and the build step runs."""
    from setuptools import Extension

    return Extension(MODULE, ["mpiscale/runtime/_wire.pyx"])


def extension(source: str, library: str, build_dir: str) -> Any:
    """The extension of ``source`` (a path relative to the build's root), cythonized into ``build_dir``, with its
    provenance: the source's digest and ``library`` (``library_line``)."""
    import numpy
    from Cython.Build import cythonize
    from setuptools import Extension

    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    made = Extension(
        MODULE,
        [source],
        include_dirs=[numpy.get_include()],
        define_macros=[("MPISCALE_WIRE_SOURCE_SHA256", f'"{digest}"'), ("MPISCALE_WIRE_MPI_LIBRARY", f'"{library}"')],
        extra_compile_args=["-O2"],
    )
    return cythonize([made], build_dir=build_dir, quiet=True, language_level=3)[0]


def failure_line(error: BaseException) -> str:
    """One line on a build that failed, and what runs instead."""
    text = str(error).strip().splitlines()
    why = f"{type(error).__name__}: {text[-1] if text else ''}".rstrip(": ")
    return (
        f"mpiscale: the compiled message path was not built ({why}): the pure-Python path runs; {REBUILD} tries again"
    )


def built_modules(folder: Path = SOURCE.parent) -> list[Path]:
    """The compiled modules beside the source."""
    return sorted(folder.glob("_wire.*.so"))


def current(module: Path, library: str) -> bool:
    """Whether ``module`` was built from the source beside it against ``library`` (``library_line``; the
    provenance strings are in its bytes)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest().encode()
    body = module.read_bytes()
    return digest in body and library.encode() in body


def build_in_place(force: bool = False) -> str:
    """Build the module beside its source (where mpiscale is: a checkout or site-packages), unless a current one is
    there; returns the outcome in one line. Raises nothing: a failure is the line."""
    try:
        _tools()
        compiler = mpi_compiler()
        library = library_line(compiler)
        if not force and any(current(module, library) for module in built_modules()):
            return "mpiscale: the compiled message path is up to date"
        root = SOURCE.parents[2]  # the folder that holds the mpiscale package
        with tempfile.TemporaryDirectory() as scratch, _quiet(LOG) as log:
            os.environ["CC"] = compiler
            previous = os.getcwd()
            os.chdir(root)
            try:
                made = extension(str(SOURCE.relative_to(root)), library, str(Path(scratch) / "cython"))
                _install(_compile(made, Path(scratch)))
            except BaseException as error:  # a compiler's SystemExit included: the fallback is the point
                raise RuntimeError(f"{_last_error(log) or error}; the compiler's output is in {log}") from None
            finally:
                os.chdir(previous)
    except Exception as error:
        return failure_line(error)
    if not built_modules():
        return failure_line(RuntimeError("no module was made"))
    return f"mpiscale: the compiled message path is built ({built_modules()[0].name}, with {compiler})"


def _tools() -> None:
    """Refuse, saying what to install, where the build's tools are missing (an installed package needs none)."""
    import importlib.util

    missing = [name for name in ("Cython", "setuptools") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"the build needs {' and '.join(missing)}: pip install {' '.join(m.lower() for m in missing)}"
        )


def _compile(made: Any, scratch: Path) -> Path:
    """The module built in ``scratch``; its path."""
    from setuptools import Distribution

    distribution = Distribution({"name": "mpiscale-wire", "ext_modules": [made]})
    command = distribution.get_command_obj("build_ext")
    command.build_lib, command.build_temp = str(scratch / "lib"), str(scratch / "temp")
    distribution.run_command("build_ext")
    return Path(command.get_ext_fullpath(MODULE))


def _install(module: Path) -> None:
    """``module`` beside the source, as a new file renamed over any earlier build: a running job that has the old
    one mapped keeps it (writing over it in place could crash that job)."""
    for stale in built_modules():
        if stale.name != module.name:
            stale.unlink()
    partial = SOURCE.parent / f".{module.name}.partial"
    shutil.copyfile(module, partial)
    os.replace(partial, SOURCE.parent / module.name)


class _quiet:
    """The compiler's chatter (file descriptors 1 and 2) into ``path``, kept for the error's last line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Path:
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = os.dup(1), os.dup(2)
        log = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        return self.path

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self._saved):
            os.dup2(saved, fd)
            os.close(saved)


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if "error" in line.lower()]
    return lines[-1] if lines else ""


def main(argv: list[str]) -> int:
    """``python -m mpiscale.wire_build [--force]``: build it where mpiscale is installed; status 1 if it failed."""
    outcome = build_in_place(force="--force" in argv)
    print(outcome, flush=True)
    return 1 if "was not built" in outcome else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
