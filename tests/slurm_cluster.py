"""A real single-node Slurm (slurmctld, slurmd, munge) for the tests: started once per session, torn down after.

Loaded as a pytest plugin by ``tests/conftest.py``; the ``slurm`` fixture is the
running cluster. It needs root and Debian's ``slurmctld slurmd slurm-client munge``
(``launch/setup.sh`` installs them); elsewhere the tests that use it are
skipped with the reason. Teardown stops only the daemons it started, by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

MUNGE_PID = Path("/run/munge/munged.pid")
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


@dataclass
class Job:
    """A job's state as ``scontrol show job`` tells it."""

    id: str
    fields: dict[str, str]

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "")

    @property
    def exit_code(self) -> str:
        return self.fields.get("ExitCode", "")

    @property
    def restarts(self) -> int:
        return int(self.fields.get("Restarts", "0"))


class Controller:
    """A running Slurm, used through its ``SLURM_CONF`` (its logs in ``log/`` beside it)."""

    def __init__(self, conf: Path) -> None:
        self.conf = conf
        self.directory = conf.parent
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------- use
    def run(self, command: list[str], check: bool = True, **options) -> subprocess.CompletedProcess:
        options.setdefault("timeout", 60)
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=check, **options)

    def submit(self, script: Path, *options: str, cwd: Path, env: dict | None = None) -> str:
        """``sbatch --parsable`` from ``cwd``; returns the job id."""
        environment = {**self.env, **(env or {})}
        done = subprocess.run(["sbatch", "--parsable", *options, str(script)], cwd=cwd, env=environment,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        if done.returncode != 0:
            raise SubmitError(done.stderr.strip())
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Job:
        """The job's state; a query slurmctld fails while busy (its RPC timed out under load, exit 1, or scontrol
        itself hung on a connection slurmctld dropped) is asked again for up to 90 s, then fails with what scontrol
        said and the daemons' logs."""
        deadline = time.monotonic() + 90
        while True:
            try:
                shown = self.run(["scontrol", "show", "job", "-o", job_id], check=False, timeout=30)
            except subprocess.TimeoutExpired as hung:
                said = f"no answer in 30 s: {(hung.stderr or b'').decode(errors='replace').strip()}"
            else:
                if shown.returncode == 0:
                    break
                said = shown.stderr.strip()
            if time.monotonic() > deadline:
                pytest.fail(f"scontrol show job {job_id} failed for 90 s: {said}{self.logs()}")
            time.sleep(0.5)
        fields = dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)
        return Job(job_id, fields)

    def wait(self, job_id: str, timeout: float, until=None) -> Job:
        """Poll until the job is in a final state (or ``until(job)``); fail naming the job if it is not in time."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if (until(job) if until is not None else job.state in FINAL_STATES) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        if until is None and job.state not in FINAL_STATES or until is not None and not until(job):
            output = self._stacks_and_output(job) if job.state == "RUNNING" else ""
            self.run(["scancel", job_id], check=False)
            pytest.fail(f"HUNG: Slurm job {job_id} still {job.state} after {timeout}s: {job.fields}{self.logs()}"
                        f"{output}")  # fmt: skip
        return job

    def _stacks_and_output(self, job: Job) -> str:
        """A running job's output, after its steps' processes were sent SIGUSR1 (mpiscale's ranks write every
        thread's stack on it): where its ranks are."""
        self.run(["scancel", "--signal=USR1", job.id], check=False)
        time.sleep(2)
        path = Path(job.fields.get("StdOut", ""))
        if not path.is_file():
            return ""
        return f"\n--- {path.name}, the ranks' stacks at the end ---\n{path.read_text()[-12000:]}"

    def logs(self) -> str:
        """The end of each Slurm daemon's log, for a failure's report."""
        return "".join(
            f"\n--- {path.name} ---\n{path.read_text()[-3000:]}" for path in sorted((self.directory / "log").glob("*"))
        )


class Cluster(Controller):
    """One node (this host, 4 CPUs declared) in partition ``debug``, started and stopped by the tests."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory / "slurm.conf")
        self.host = socket.gethostname().split(".")[0]
        self._pids: list[tuple[str, Path]] = []
        self._munge_started = False

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        self._start_munge()
        for name in ("state", "spool", "log"):
            (self.directory / name).mkdir(exist_ok=True)
        self.conf.write_text(self._config())
        for daemon in ("slurmctld", "slurmd"):
            pid_file = self.directory / f"{daemon}.pid"
            subprocess.run([f"/usr/sbin/{daemon}", "-f", str(self.conf)], env=self.env, check=True, timeout=30)
            self._pids.append((daemon, pid_file))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            shown = self.run(["sinfo", "-h", "-o", "%T"], check=False)
            if shown.stdout.strip() == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm node never became idle: {shown.stdout}{shown.stderr}{self.logs()}")

    def _start_munge(self) -> None:
        if _alive(MUNGE_PID):
            return  # someone else's munged: used, not stopped
        subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", "/run/munge"], check=True)
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, timeout=30)
        self._munge_started = True

    def _config(self) -> str:
        d = self.directory
        return f"""ClusterName=mpiscale-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
MailProg=/bin/true
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=1,sched_min_interval=100000
# A finished job stays visible to scontrol for the test's polling (at 4 s, one test's early job was gone)
MinJobAge=600
EnforcePartLimits=ALL
MpiDefault=none
NodeName={self.host} NodeAddr=127.0.0.1 CPUs=4 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
"""

    # --------------------------------------------------------------- teardown
    def stop(self) -> None:
        self.run(["scancel", "--user=root"], check=False)
        # a job left running (a test that failed half-way) ends before the daemons: its step daemons go with it
        deadline = time.monotonic() + 45  # KillWait (30 s) and some
        while self.run(["squeue", "-h"], check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        self.run(["scontrol", "shutdown"], check=False)
        for _, pid_file in self._pids:
            _wait_gone(pid_file, 20)
        if self._munge_started:
            _wait_gone(MUNGE_PID, 10, signal.SIGTERM)


class SubmitError(RuntimeError):
    """sbatch refused the job; the message is sbatch's."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def _wait_gone(pid_file: Path, timeout: float, send: signal.Signals | None = None) -> None:
    """Wait for the process of ``pid_file`` to end (sending ``send`` first); SIGKILL it after ``timeout``."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    if send is not None:
        _signal(pid, send)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.1)
    _signal(pid, signal.SIGKILL)


def _signal(pid: int, which: signal.Signals) -> None:
    try:
        os.kill(pid, which)
    except OSError:
        pass


def slurm_missing() -> str | None:
    """Why a real Slurm cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons as root"
    for program in ("slurmctld", "slurmd", "munged", "sbatch"):
        if shutil.which(program) is None and not Path(f"/usr/sbin/{program}").exists():
            return f"{program} is not installed (launch/setup.sh installs slurmctld slurmd slurm-client munge)"
    return None


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    reason = slurm_missing()
    if reason is not None:
        pytest.skip(f"no real Slurm here: {reason}")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
