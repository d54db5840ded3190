"""mpiscale installed as a user on a cluster installs it: ``pip install`` of a clone into a fresh venv over the
machine's Open MPI (the package index as the only source), not the project's own set-up.

The PEP 517 build compiles the message path against the MPI that ``mpicc`` names; doctor then says only what the
site must add (h5py built against parallel HDF5); a 2-rank job runs on the compiled path; a 2-rank job that needs
parallel HDF5 is refused in one line with status 2 (bad set-up, never retried). A build without an MPI compiler
still installs, the pure-Python path runs and says how to build it, and that command builds it. A wheel made by
``python -m build`` carries the compiled module and its source.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO, finish, launch

INSTALL_TIMEOUT = 900  # the first time, pip downloads numpy, numba, h5py, mpi4py... (cached afterwards)


def _run(*command: object, timeout: float = INSTALL_TIMEOUT, env: dict | None = None) -> subprocess.CompletedProcess:
    """``command`` run outside the checkout (``python -m`` would import the checkout's mpiscale there)."""
    return subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=Path(sys.executable).anchor)  # fmt: skip


def _pip(venv: Path, *args: object, env: dict | None = None) -> None:
    """``pip install ARGS`` into ``venv``, its byte-compiling of every module installed left out (about 10 s of
    CPU for scipy's and numba's; what the tests import is compiled as it is imported)."""
    done = _run(venv / "bin" / "pip", "install", "--disable-pip-version-check", "-q", "--no-compile", *args, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The repository's files as a clone has them (tracked and new ones; nothing built or ignored)."""
    folder = tmp_path_factory.mktemp("clone")
    listed = _run("git", "-C", REPO, "ls-files", "-co", "--exclude-standard", "-z", timeout=60)
    for name in filter(None, listed.stdout.split("\0")):
        source = REPO / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(source.read_bytes())
    return folder


@pytest.fixture(scope="module")
def venv(tmp_path_factory, clone) -> Path:
    folder = tmp_path_factory.mktemp("venv")
    made = _run(sys.executable, "-m", "venv", folder, timeout=300)
    assert made.returncode == 0, made.stderr
    _pip(folder, clone)
    return folder


def _package(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages/mpiscale"))


def _doctor(venv: Path) -> subprocess.CompletedProcess:
    return _run(venv / "bin" / "mpiscale", "doctor", timeout=300)


def test_pip_install_builds_the_message_path_and_doctor_names_only_what_the_site_adds(venv):
    runtime = _package(venv) / "runtime"
    assert list(runtime.glob("_wire.*.so")) and (runtime / "_wire.pyx").exists()
    doctor = _doctor(venv)
    assert "message path                 compiled" in doctor.stdout, doctor.stdout
    failing = [line for line in doctor.stdout.splitlines() if line.startswith("[FAIL]")]
    assert [line.split()[1] for line in failing] in ([], ["h5py"]), doctor.stdout  # the serial wheel from the index
    if failing:
        assert "HDF5_MPI=ON CC=mpicc pip install --no-binary=h5py" in doctor.stdout
    assert "launch/setup.sh" not in doctor.stdout.split("[ok  ] numba")[0]  # no checkout's file in the fixes above


def test_the_install_codes_new_data(venv):
    """Coding new data runs Numba's ``np.dot``, which needs scipy's BLAS: a plain install lacked scipy, and
    ``omp_encode`` (``mpiscale encode``, ``transform``) failed with "scipy 0.16+ is required for linear algebra"."""
    script = ("import numpy as np; from mpiscale.dictlearn import omp_encode; rng = np.random.default_rng(0); "
              "d = rng.standard_normal((8, 5)); d /= np.linalg.norm(d, axis=1, keepdims=True); "
              "codes = omp_encode(d[:3] * 2.0, d, 2); assert np.allclose(codes[:, :3], 2.0 * np.eye(3)); "
              "print('coded')")  # fmt: skip
    done = _run(venv / "bin" / "python", "-c", script, timeout=300)
    assert done.returncode == 0 and "coded" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


def test_a_two_rank_job_runs_on_the_compiled_path_and_one_needing_parallel_hdf5_is_refused(venv, tmp_path):
    mpiscale = str(venv / "bin" / "mpiscale")
    demo = finish(launch(2, [mpiscale, "demo"], cold=True, cwd=tmp_path), "demo from the venv", 180)
    assert demo.returncode == 0 and "demo ok: 2 ranks" in demo.stdout, demo.output[-3000:]
    assert "the message path is" not in demo.stderr  # the warning of a fallback nobody asked for
    out = tmp_path / "d.h5"
    job = launch(2, [mpiscale, "dictlearn", "--atoms", "4", "--features", "4", "--samples", "100", "--batch-size", "50",
                     "--out", str(out)], cold=True, cwd=tmp_path, env={"MPISCALE_TELEMETRY": "0"})  # fmt: skip
    refused = finish(job, "dictlearn from the venv", 180)
    h5py_has_mpi = "MPI yes" in _doctor(venv).stdout
    if not h5py_has_mpi:
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.output[-3000:]
        assert "was built without MPI" in refused.stderr and "HDF5_MPI=ON" in refused.stderr
        assert not out.exists()


def test_an_install_without_an_mpi_compiler_runs_pure_python_and_says_how_to_build_it(venv, clone):
    _pip(venv, "--force-reinstall", "--no-deps", clone, env={**os.environ, "MPICC": "/bin/false"})
    runtime = _package(venv) / "runtime"
    assert not list(runtime.glob("_wire.*.so")), "a build with a failing compiler left a module"
    doctor = _doctor(venv)
    assert "pure-Python (the compiled module is not built" in doctor.stdout, doctor.stdout
    assert "build it: python -m mpiscale.wire_build" in doctor.stdout
    lacking = _run(venv / "bin" / "python", "-m", "mpiscale.wire_build", timeout=600)  # an install has no Cython
    assert lacking.returncode == 1 and "the build needs Cython: pip install cython" in lacking.stdout, lacking.stdout
    _pip(venv, "cython")
    built = _run(venv / "bin" / "python", "-m", "mpiscale.wire_build", timeout=600)
    assert built.returncode == 0 and built.stdout.count("\n") == 1 and not built.stderr, built.stdout + built.stderr
    assert "the compiled message path is built" in built.stdout
    assert "message path                 compiled" in _doctor(venv).stdout


def test_a_wheel_made_by_python_build_carries_the_compiled_module_and_its_source(venv, clone, tmp_path):
    _pip(venv, "build")
    made = _run(venv / "bin" / "python", "-m", "build", "--wheel", "--outdir", tmp_path, clone)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    wheel = next(tmp_path.glob("mpiscale-*.whl"))
    assert "-none-any" not in wheel.name, wheel.name  # a platform's wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert "mpiscale/runtime/_wire.pyx" in names
    assert any(name.startswith("mpiscale/runtime/_wire.") and name.endswith(".so") for name in names), names
