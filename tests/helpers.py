"""Helpers of the MPI, fault and integration tests: run a program or a command under real mpirun with a hard
timeout, and name the one that hung.

Import them with ``from helpers import ...`` (``tests`` is on pytest's path); ``conftest.py`` holds only
fixtures.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpiscale.runtime.death_watch import alive

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launch" / "mpiscale-run"
PROGRAMS = REPO / "tests" / "mpi" / "programs"


@dataclass
class Job:
    """A finished MPI job: exit status, output streams and wall time."""

    returncode: int
    stdout: str
    stderr: str
    elapsed: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def scratch_folder(prefix: str) -> str:
    """A new folder under the system's temporary directory, removed when this process ends."""
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


# Jobs' control tokens go to a directory of this session, not the user's home: two test sessions at once (CI beside
# a developer's run) never take each other's tokens for the same job ids. (The test workers inherit the session's.)
if "MPISCALE_TOKEN_DIR" not in os.environ:
    os.environ["MPISCALE_TOKEN_DIR"] = scratch_folder("mpiscale-tokens-")
# The environment as the test session began, before any unit test initialised an MPI singleton in this
# process (which leaves OMPI_/PMIX_ variables that mpirun would mistake for a job of its own). A site's
# own settings (OMPI_MCA_plm_rsh_agent on a machine with no ssh, say) are part of it and are kept.
SESSION_ENVIRONMENT = dict(os.environ)
# Once a rank exits with an error, mpirun waits odls_base_sigkill_timeout (1 s) before it kills the other ranks and
# as long again before it exits, though they have all exited already: 2 s of every refused job, of which the suite
# runs hundreds. Tests in which the surviving ranks must report a dead one in that grace take mpirun's default back.
SESSION_ENVIRONMENT.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "0")
MPIRUN_GRACE = {"OMPI_MCA_odls_base_sigkill_timeout": "1"}  # mpirun's own default
# Every process the tests start has this environment, with what the test adds; the preloaded one too.
WARM_ENVIRONMENT = SESSION_ENVIRONMENT | {"PYTHONUNBUFFERED": "1"}
WARM_START = REPO / "tests" / "warm_start.py"


class Preloaded:
    """This test worker's preloaded process (``tests/warm_start.py``): started at its first use, ended with the
    worker. ``MPISCALE_TESTS_COLD=1`` leaves it out: every process of the suite starts cold."""

    cold = os.environ.get("MPISCALE_TESTS_COLD") == "1"
    _socket: str | None = None

    @classmethod
    def command(cls, command: list[str], cold: bool = False) -> list[str]:
        """``command`` (``python -m MODULE ...`` or ``python PROGRAM.py ...``) as a warm start, or as it is."""
        runs_python = command[0] == sys.executable and len(command) > 1
        if cold or cls.cold or not runs_python or not (command[1] == "-m" or command[1].endswith(".py")):
            return command
        return [sys.executable, "-I", "-S", str(WARM_START), cls._started(), *command[1:]]

    @classmethod
    def _started(cls) -> str:
        if cls._socket is None:
            folder = scratch_folder("mpiscale-warm-")
            socket_path, log = f"{folder}/socket", Path(folder, "log")
            with open(log, "w") as output:
                server = subprocess.Popen(
                    [sys.executable, str(WARM_START), "serve", socket_path], env=WARM_ENVIRONMENT, cwd=folder,
                    stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                )  # fmt: skip
            deadline = time.monotonic() + 120
            while not os.path.exists(socket_path):
                if server.poll() is not None or time.monotonic() > deadline:
                    server.kill()
                    pytest.fail(f"the preloaded process did not start:\n{log.read_text()[-6000:]}")
                time.sleep(0.05)
            cls._socket = socket_path
        return cls._socket


def launch(
    ranks: int,
    command: list[str],
    env: dict | None = None,
    options: tuple[str, ...] = (),
    cold: bool = False,
    **popen,
) -> subprocess.Popen:
    """Start ``command`` on ``ranks`` ranks through the project's launcher (with its ``options``), in its own
    process group; a ``python`` command starts warm (``Preloaded``) unless ``cold``."""
    environment = dict(WARM_ENVIRONMENT)
    environment.update(env or {})
    return subprocess.Popen(
        [str(LAUNCHER), "-n", str(ranks), *options, "--", *Preloaded.command(command, cold)],
        env=environment,
        text=True,
        start_new_session=True,
        cwd=popen.pop("cwd", REPO),
        stdout=popen.pop("stdout", subprocess.PIPE),
        stderr=popen.pop("stderr", subprocess.PIPE),
        **popen,
    )


def start_mpi(program: str, ranks: int, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """Start ``tests/mpi/programs/<program>`` on ``ranks`` ranks (their telemetry off unless ``env`` turns it on:
    ``mpiscale.run`` would write PROGRAM.telemetry.jsonl in the repository)."""
    environment = {"MPISCALE_TELEMETRY": "0", **(env or {})}
    return launch(ranks, [sys.executable, str(PROGRAMS / program), *args], env=environment, **popen)


# Open MPI's event library may warn as a job ends with a failed rank: a race of its own (open-mpi/ompi#2004, #5520).
# On a loaded machine one refused job in the suite's thousands printed "[warn] Epoll MOD(1) on fd 24 failed. Old events
# were 6; ...: Bad file descriptor" beside its one line (2026-12-03). It is not the job's: the tests read the job's own.
LIBEVENT_WARNING = re.compile(r"^\[warn\] Epoll [A-Z]+\(\d+\) on fd \d+ failed\. .*\n?", re.MULTILINE)


def finish(process: subprocess.Popen, what: str, timeout: float) -> Job:
    """Wait for a job; on timeout ask every rank for diagnostics, kill it, and fail naming it. Open MPI's event
    library's warnings are left out of its stderr (``LIBEVENT_WARNING``)."""
    start = time.monotonic()
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)  # mpirun forwards it: every rank dumps its state
        time.sleep(2)
        # the launcher runs mpirun in a session of its own, out of the launcher's process group: each process under
        # it is killed too (a warm rank's worker then goes with its stand-in), else they kept the job's pipes open
        # and the wait for its output hung until pytest's own timeout, with no diagnostics (2026-12-04)
        for pid in [process.pid, *descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired as held:
            stdout = _text(held.stdout)
            stderr = "(the job's output stayed open after it was killed)\n" + _text(held.stderr)
        pytest.fail(
            f"HUNG: {what} did not finish within {timeout}s; rank diagnostics follow\n"
            f"--- stdout ---\n{(stdout or '')[-6000:]}\n--- stderr ---\n{(stderr or '')[-12000:]}"
        )
    return Job(process.returncode, stdout or "", LIBEVENT_WARNING.sub("", stderr or ""), time.monotonic() - start)


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (its children, theirs, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def ended_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run_mpi(program: str, ranks: int, *args: str, timeout: float = 90, env: dict | None = None) -> Job:
    """Run a program to completion under mpirun with a hard timeout."""
    return finish(start_mpi(program, ranks, *args, env=env), f"{program} {' '.join(args)} on {ranks} ranks", timeout)


class Worlds:
    """A test module's library-level programs in one MPI world per layout (``tests/mpi/programs/world.py``).

    ``layouts`` maps a layout's key to (ranks, environment, the programs with their arguments). The first test
    that asks for a layout launches its world; the others of the module read the same finished job (a hang or a
    failed launch is kept too, so no test launches it again). Each test then asserts its program's own line.
    """

    def __init__(self, layouts: dict) -> None:
        self.layouts = layouts
        self._ran: dict = {}

    def __call__(self, key) -> Job:
        """The finished world of ``key``, every program in it passed."""
        if key not in self._ran:
            ranks, env, programs = self.layouts[key]
            try:
                self._ran[key] = run_mpi("world.py", ranks, *programs, env=env, timeout=60 + 60 * len(programs))
            except BaseException as error:  # a hang (pytest's Failed, with the ranks' diagnostics), or a bad launch
                self._ran[key] = error
        job = self._ran[key]
        if isinstance(job, BaseException):
            raise job
        assert_ok(job)
        return job


def ended_after(job: Job, started: float, pattern: str) -> float:
    """Seconds from the moment a program printed (``pattern``'s group 1: Unix time) to the job's end, for a job
    whose ``finish`` began at ``started`` (``time.time()``): how soon a fault ended it, however slowly it started."""
    found = re.search(pattern, job.stdout)
    assert found, f"no {pattern!r} in the output:\n{job.output[-4000:]}"
    return started + job.elapsed - float(found[1])


def assert_ok(job: Job) -> None:
    assert job.returncode == 0, f"exit status {job.returncode}\n{job.output[-10000:]}"


def real_gpu() -> bool:
    """Whether Numba sees a real CUDA GPU (asked in a child process: the simulator must not leak in)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    probe = "from numba import cuda; print(cuda.is_available())"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    return _required(done.stdout.strip() == "True", f"Numba finds no CUDA GPU: {done.stdout}{done.stderr[-2000:]}")


def _required(found: bool, missing: str) -> bool:
    """``found``; under ``MPISCALE_REQUIRE_GPU=1`` (make gpu-check) its absence fails the test instead."""
    if not found and os.environ.get("MPISCALE_REQUIRE_GPU") == "1":
        pytest.fail(f"MPISCALE_REQUIRE_GPU=1 but {missing}")
    return found


def gpu_ranks() -> list[tuple[int, dict]]:
    """The GPU tests' runs: (ranks, environment) for one rank, and for two (sharing the GPU on purpose where there
    is one). Two ranks need parallel HDF5: where h5py lacks MPI (a GPU machine's own h5py) the two-rank run is left
    out, and under ``MPISCALE_REQUIRE_GPU=1`` (make gpu-check) the test fails saying so instead."""
    import h5py
    import torch

    runs = [(1, {})]
    if _required(
        h5py.get_config().mpi,
        "this h5py lacks MPI, so the GPU tests' 2-rank runs cannot write parallel "
        "HDF5: carry an h5py wheel built against the machine's MPI (docs/hpc.md)",
    ):
        runs.append((2, {"MPISCALE_SHARE_GPUS": "1"} if torch.cuda.device_count() == 1 else {}))
    return runs


def on_a_gpu(attrs) -> bool:
    """Whether a results file's ``device`` attribute records GPUs only, each with its UUID."""
    import json

    recorded = str(attrs["device"])
    devices = json.loads(recorded) if recorded.startswith("[") else [recorded]
    return all(d.startswith("cuda:") and (" GPU-" in d or " MIG-" in d) for d in devices)


def real_torch_gpu() -> bool:
    """Whether torch sees a CUDA GPU (the torch jobs' --device cuda); with ``MPISCALE_REQUIRE_GPU=1`` (make
    gpu-check) its absence fails the test instead of skipping it."""
    import torch

    return _required(torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA GPU")


def run_cli(
    ranks: int, *args: object, env: dict | None = None, options: tuple[str, ...] = (), timeout: float = 120
) -> Job:
    """``mpiscale ARGS`` on ``ranks`` ranks to its end (not checked), with a hard timeout."""
    command = [sys.executable, "-m", "mpiscale.cli", *map(str, args)]
    return finish(launch(ranks, command, env=env, options=options), f"mpiscale {' '.join(map(str, args))}", timeout)


def run_python(program: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    """The Python ``program`` (source text) with ``args`` in a process of its own to its end (not checked), its
    output captured, with a hard timeout: for what may crash or change the process's limits."""
    return subprocess.run([sys.executable, "-c", program, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def run_alone(*args: object, timeout: float = 120, cwd: Path | None = None) -> Job:
    """``mpiscale ARGS`` as one plain process (no launcher: a singleton rank, a second faster; a warm start), with a
    hard timeout."""
    process = subprocess.Popen(
        Preloaded.command([sys.executable, "-m", "mpiscale.cli", *map(str, args)]),
        env=WARM_ENVIRONMENT, cwd=cwd or REPO, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    return finish(process, f"mpiscale {' '.join(map(str, args))} alone", timeout)


def cli_rank_pids(marker: str) -> list[int]:
    """The ranks (``python -m mpiscale.cli`` processes) of the job whose command line holds ``marker``."""
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, found):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].decode() == sys.executable and b"mpiscale.cli" in argv:
            pids.append(pid)
    return pids


@contextlib.contextmanager
def held_at_step(
    process: subprocess.Popen, log: Path, marker: str, unit: str, step: int, ranks: int = 2, timeout: float = 60
) -> Iterator[tuple[list[int], int]]:
    """The job writing ``log`` (``ranks`` ranks whose command lines hold ``marker``) run in slices of 50 ms, its
    ranks stopped (SIGSTOP) in between while the log is read, until it shows a progress line of ``unit`` ``step``
    or later ("round 120/719": a line comes at most every ``--progress-every``, so short steps go unnamed). The
    block runs with the ranks stopped there and gets (their pids, the last step the log shows); then they go on.
    However short the steps and however late mpirun passes the ranks' lines on, the job cannot end, or run on far,
    before the block's signals."""
    deadline, pattern = time.monotonic() + timeout, re.compile(rf"^{unit} (\d+)/", re.MULTILINE)
    pids: list[int] = []
    while True:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        pids = pids if len(pids) == ranks else cli_rank_pids(marker)
        if len(pids) == ranks:
            _signal_each(pids, "hold")
            shown = max(map(int, pattern.findall(_settled(log))), default=0)
            if shown >= step:
                break
            _signal_each(pids, "go on")
        time.sleep(0.05)
    try:
        yield pids, shown
    finally:
        _signal_each(pids, "go on")


def _signal_each(pids: list[int], what: str) -> None:
    """Stop ("hold") or continue ("go on") each rank: a warm start's stand-in has its worker stopped (it cannot
    forward SIGSTOP: ``warm_start.HOLD``); a cold rank is stopped itself."""
    for pid in pids:
        with contextlib.suppress(OSError):
            stand_in = str(WARM_START).encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            os.kill(pid, signal.SIGCONT if what == "go on" else signal.SIGTSTP if stand_in else signal.SIGSTOP)


def _settled(log: Path, within: float = 5) -> str:
    """The text of ``log`` once it has not grown for 20 ms (or after ``within`` s: ranks that were not held)."""
    text, deadline = log.read_text(), time.monotonic() + within
    while time.monotonic() < deadline:
        time.sleep(0.02)
        again = log.read_text()
        if again == text:
            break
        text = again
    return text


def interrupt(pids: list[int], way: str) -> None:
    """``way`` "stopped": SIGTERM to every rank of ``pids``, as ``scancel`` sends it; "killed": SIGKILL to one."""
    for pid in pids if way == "stopped" else [max(pids)]:
        os.kill(pid, signal.SIGTERM if way == "stopped" else signal.SIGKILL)


def flip_a_bit(path, name: str, chunk: int) -> None:
    """Damage chunk ``chunk`` of data set ``name`` on disk (a bit flipped in its stored bytes), as a failing disk or
    a bad copy does: a checksummed (fletcher32) chunk then fails its check."""
    import h5py

    with h5py.File(path, "r") as file:
        at = file[name].id.get_chunk_info(chunk).byte_offset + 10
    with open(path, "r+b") as file:
        file.seek(at)
        byte = file.read(1)[0]
        file.seek(at)
        file.write(bytes([byte ^ 0x10]))
