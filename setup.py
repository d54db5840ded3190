"""The compiled message path, built by ``pip install`` as mpi4py and h5py build theirs: against the MPI that MPI's
compiler wrapper names (``$MPICC``, or ``mpicc`` on ``PATH``). Everything else is in ``setup.cfg``. A build that
fails still installs: it says why in one line, and the pure-Python path runs (``mpiscale doctor`` says which)."""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

_spec = importlib.util.spec_from_file_location("wire_build", Path(__file__).parent / "mpiscale" / "wire_build.py")
wire_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wire_build)


class OptionalWire(build_ext):
    """build_ext that cythonizes the module against the site's MPI, and falls back (visibly) when it cannot."""

    def finalize_options(self) -> None:
        self._failure = None
        try:
            compiler = wire_build.mpi_compiler()
            library = wire_build.library_line(compiler)
            self.distribution.ext_modules = [wire_build.extension("mpiscale/runtime/_wire.pyx", library, "build")]
            os.environ["CC"] = compiler
        except Exception as error:  # no mpicc, no Cython, a probe that does not compile
            self._failure = error
        super().finalize_options()

    def run(self) -> None:
        if self._failure is None:
            try:
                super().run()
            except Exception as error:  # the compiler's error: install without the module
                self._failure = error
        if self._failure is not None:
            self.extensions = []  # nothing to install from here, and no earlier build's module either
            Path(self.get_ext_fullpath(wire_build.MODULE)).unlink(missing_ok=True)
            print(wire_build.failure_line(self._failure), flush=True)


setup(ext_modules=[wire_build.placeholder()], cmdclass={"build_ext": OptionalWire})
