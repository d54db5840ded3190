"""Under a launcher, importing mpiscale makes an error no code catches end every rank (the MPI test runs it); in a
process whose MPI never started it is Python's own report and exit, and a program's own hook stays in place."""

import os
import subprocess
import sys

LAUNCHED = {**os.environ, "OMPI_COMM_WORLD_RANK": "0"}


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=LAUNCHED, capture_output=True, text=True, timeout=120)


def test_without_mpi_started_the_error_is_pythons_own_report_and_exit():
    ran = python("import mpiscale\nraise KeyError('labels')")
    assert ran.returncode == 1 and ran.stderr.rstrip().endswith("KeyError: 'labels'"), ran.stderr
    assert "ending every rank" not in ran.stderr


def test_a_programs_own_hook_stays():
    ran = python("import sys\nhook = lambda *a: print('own hook', file=sys.stderr)\nsys.excepthook = hook\n"
                 "import mpiscale\nassert sys.excepthook is hook\nraise KeyError('labels')")  # fmt: skip
    assert ran.returncode == 1 and ran.stderr.strip() == "own hook", ran.stderr
