"""Several programs of this folder in one MPI world, one after another: ``world.py "PROGRAM ARGS..." ...``.

A launch costs every rank its start-up (Python, numpy, mpi4py, Numba's kernels, torch where a program needs it);
the library-level checks of one test module share one launch per layout instead. Each program is loaded as a
module of its own (named after its file, so actor classes pickle by reference as they do in a program run alone)
with ``mpiscale.run`` standing in as a collector of its ``main``; then one ``mpiscale.run`` runs every ``main``
in order on every rank, each with the ``sys.argv`` its program was given, and a barrier between them. A failing
check ends the world as it ends its own program, with its report.
"""

import importlib.util
import shlex
import sys
from pathlib import Path

import mpiscale

HERE = Path(__file__).resolve().parent


def _collected(spec: str) -> tuple[list[str], object]:
    """(the program's argv, its main), its module loaded with mpiscale.run collecting instead."""
    words = shlex.split(spec)
    name, argv = words[0], [str(HERE / words[0]), *words[1:]]
    found = []
    real_run, mpiscale.run = mpiscale.run, lambda main, **settings: found.append(main)
    sys.argv = argv
    try:
        module_spec = importlib.util.spec_from_file_location(Path(name).stem, HERE / name)
        assert module_spec is not None and module_spec.loader is not None, name
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    finally:
        mpiscale.run = real_run
    assert len(found) == 1, f"{name} called mpiscale.run {len(found)} times"
    return argv, found[0]


PROGRAMS = [_collected(spec) for spec in sys.argv[1:]]


async def main(system: mpiscale.ActorSystem) -> None:
    for argv, program_main in PROGRAMS:
        sys.argv = argv
        await program_main(system)
        await system.world.barrier()  # every rank done with one program before the next begins


mpiscale.run(main)
