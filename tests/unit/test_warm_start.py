"""The tests' warm starts (``tests/warm_start.py``) behave as a cold ``python`` would: the same exit status, the same
death by a signal, signals delivered, the program's own environment, and nothing left behind when the stand-in dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from helpers import WARM_ENVIRONMENT, Preloaded, ended_within, finish, launch
from warm_start import HOLD

PROBE = """
import os, signal, sys, time
action = sys.argv[1]
if action == "wait":
    signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM handled", flush=True), sys.exit(7)))
print("torch" in sys.modules, os.environ.get("PROBE"), os.getcwd(), os.getpid(), flush=True)
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if action == "raise":
    raise ValueError("raised by the probe")
if action == "wait":
    time.sleep(60)
if action == "leave":  # what a program leaves for its end: a file never closed, a cycle with a finalizer, C's stdio
    import atexit, ctypes
    unclosed = open(sys.argv[2], "w")
    unclosed.write("written, never flushed")
    class Cycle:
        def __del__(self):
            print("cycle finalized", flush=True)
    cycle = Cycle()
    cycle.itself = cycle
    atexit.register(print, "exit handler ran", flush=True)
    ctypes.CDLL(None).printf(b"C stdio, flushed by the C library's end\\n")
    if sys.argv[3] == "exit":
        sys.exit(5)
if action == "node":
    import socket
    print(socket.gethostname(), open(os.path.join(sys.argv[2], "mark")).read(), flush=True)
"""


def start(tmp_path, *arguments, env: dict | None = None, prefix: tuple = ()) -> subprocess.Popen:
    if Preloaded.cold:
        pytest.skip("MPISCALE_TESTS_COLD=1: no preloaded process")
    program = tmp_path / "probe.py"
    program.write_text(PROBE)
    command = Preloaded.command([sys.executable, str(program), *arguments])
    assert command[0] == sys.executable and "warm_start.py" in command[3]
    return subprocess.Popen([*prefix, *command], env=WARM_ENVIRONMENT | (env or {}), cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def test_a_warm_program_runs_preloaded_in_its_own_directory_and_environment_and_exits_as_it_did(tmp_path):
    process = start(tmp_path, "exit", "3", env={"PROBE": "mine"})
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 3
    assert stdout.split()[:3] == ["True", "mine", str(tmp_path)]


@pytest.mark.parametrize("how", ["return", "exit"])
def test_a_warm_program_ends_with_what_it_left_flushed_finalized_and_its_exit_handlers_run(tmp_path, how):
    """A warm rank ends without the interpreter's teardown of the preloaded modules (``_end_before_teardown``), yet
    as a cold one would for what the program itself left: its objects freed, cycles collected, handlers run, C's
    buffers flushed, its status."""
    process = start(tmp_path, "leave", str(tmp_path / "unclosed"), how)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == (5 if how == "exit" else 0), stderr
    assert (tmp_path / "unclosed").read_text() == "written, never flushed", stdout
    assert sorted(stdout.splitlines()[1:]) == [
        "C stdio, flushed by the C library's end",
        "cycle finalized",
        "exit handler ran",
    ], stderr  # (C's buffer comes out when it is full)


def test_a_warm_rank_of_an_mpi_job_ends_with_mpi_finalized_and_its_hdf5_file_closed(tmp_path):
    """Without the interpreter's teardown mpi4py's own end of MPI would not run: mpirun took the ranks for failed
    (status 1, nothing said). A parallel HDF5 file left open is closed as MPI ends."""
    if Preloaded.cold:
        pytest.skip("MPISCALE_TESTS_COLD=1: no preloaded process")
    program = tmp_path / "left_open.py"
    program.write_text(
        "import sys\nfrom mpi4py import MPI\nimport h5py\n"
        "left = h5py.File(sys.argv[1], 'w', driver='mpio', comm=MPI.COMM_WORLD)\n"
        "left.create_dataset('ranks', (MPI.COMM_WORLD.size,), 'i8')[MPI.COMM_WORLD.rank] = MPI.COMM_WORLD.rank + 1\n"
    )
    out = tmp_path / "left_open.h5"
    job = finish(launch(2, [sys.executable, str(program), str(out)]), "a program that leaves its file open", 60)
    assert job.returncode == 0, job.output[-3000:]
    with h5py.File(out, "r") as written:
        assert list(written["ranks"][:]) == [1, 2]


def test_a_warm_program_killed_by_a_signal_kills_its_stand_in_with_the_same(tmp_path):
    process = start(tmp_path, "kill")
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


def test_an_uncaught_error_is_status_1_with_its_traceback(tmp_path):
    process = start(tmp_path, "raise")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1 and "ValueError: raised by the probe" in stderr


def test_signals_reach_the_program_and_a_killed_stand_in_takes_it_along(tmp_path):
    process = start(tmp_path, "wait")
    assert process.stdout.readline().split()[0] == "True"
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 7 and "SIGTERM handled" in stdout

    process = start(tmp_path, "wait")
    worker = int(process.stdout.readline().split()[3])
    process.kill()
    process.communicate(timeout=60)
    assert ended_within(worker, 10), "the program outlived its killed stand-in"


def test_a_hold_sent_to_the_stand_in_stops_the_program_until_it_is_continued(tmp_path):
    """SIGSTOP cannot be caught, so a stand-in cannot forward it: ``warm_start.HOLD`` stops the worker in its place
    (the tests hold a job's ranks while they signal them), SIGCONT lets it go on, and a signal sent while it is held
    is taken after."""
    process = start(tmp_path, "wait")
    worker = int(process.stdout.readline().split()[3])
    process.send_signal(HOLD)
    assert _state_becomes(worker, "T"), "the held program runs"
    assert process.poll() is None  # the stand-in itself is not stopped
    process.send_signal(signal.SIGTERM)
    process.send_signal(signal.SIGCONT)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 7 and "SIGTERM handled" in stdout


def _state_becomes(pid: int, state: str, within: float = 10) -> bool:
    """Whether process ``pid``'s state (``/proc/PID/stat``'s third field) becomes ``state`` within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == state:
            return True
        time.sleep(0.01)
    return False


def test_a_setting_the_preloaded_libraries_read_as_they_load_starts_the_program_cold(tmp_path):
    process = start(tmp_path, "exit", "0", env={"NUMBA_NUM_THREADS": "1"})
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and stdout.split()[0] == "False"


@pytest.mark.skipif(os.geteuid() != 0, reason="new UTS and mount namespaces need root")
def test_a_stand_in_in_other_namespaces_has_its_program_run_in_them(tmp_path):
    """As on a node of the local cluster: the program has the stand-in's hostname and sees its mounts."""
    private = tmp_path / "node-disk"
    private.mkdir()
    prepare = f"hostname warm-probe-node && mount -t tmpfs node-disk {private} && echo node-only > {private}/mark"
    node = ("unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", f'{prepare} && exec "$@"', "node")
    process = start(tmp_path, "node", str(private), prefix=node)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert stdout.split()[-2:] == ["warm-probe-node", "node-only"]
    assert not (private / "mark").exists(), "the mount leaked out of the stand-in's namespace"
