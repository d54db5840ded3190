"""Idle CPU, diagnostics on SIGUSR1, SIGTERM shutdown, draining at exit, > 2 GiB messages."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import assert_ok, ended_within, finish, run_mpi, start_mpi


def test_idle_rank_does_not_spin(ranks):
    job = run_mpi("idle.py", ranks)
    assert_ok(job)
    assert "idle ok" in job.stdout, job.stdout


def test_a_job_past_its_timeout_is_reported_hung_with_every_ranks_diagnostics_and_nothing_left(tmp_path):
    """The suite's own guard (helpers.finish): a job still running at its timeout is asked for diagnostics, killed
    and named. The launcher's mpirun runs in a session of its own; the guard once killed only the launcher's process
    group, the ranks kept the job's output open, and its wait hung until pytest's timeout with no word from them."""
    with pytest.raises(pytest.fail.Exception) as failed:
        run_mpi("signals.py", 2, "usr1", str(tmp_path), timeout=15)  # holds an ask until a file that never comes
    assert "HUNG: signals.py usr1" in str(failed.value) and "mpiscale diagnostics: rank 1 of 2" in str(failed.value)
    for rank in range(2):
        pid = int((tmp_path / f"rank{rank}.pid").read_text())
        assert ended_within(pid, 30), f"rank {rank} (pid {pid}) outlived its killed job"


def test_run_returns_after_in_flight_messages_are_handled(ranks):
    job = run_mpi("drain.py", ranks)
    assert_ok(job)
    assert job.stdout.count("drained") == ranks


def _wait_for_pids(folder: Path, ranks: int, process: subprocess.Popen, timeout: float = 60) -> list[int]:
    """The ranks' pids, once each has written its own; if they do not within ``timeout``, the job is killed (its ranks
    left running had loaded the machine for the rest of the suite) and the test fails with its output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [folder / f"rank{r}.pid" for r in range(ranks)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    stdout, stderr = process.communicate()
    pytest.fail(
        f"ranks did not start within {timeout}s\n--- stdout ---\n{(stdout or '')[-3000:]}\n--- stderr ---\n"
        f"{(stderr or '')[-6000:]}"
    )


def _wait_for_text(path: Path, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text()
        if text in content:
            return content
        time.sleep(0.05)
    pytest.fail(f"{text!r} did not appear within {timeout}s:\n{path.read_text()[-5000:]}")


def _left_in_session(session: int) -> list[str]:
    """The processes still running in the launcher's session (it was started as the session's leader); ended ones
    not yet collected by init (zombies) are gone already."""
    table = subprocess.run(["ps", "-e", "-o", "sid=,stat=,args="], capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 2) for line in table.splitlines()]
    return [row[2] for row in rows if len(row) == 3 and int(row[0]) == session and not row[1].startswith("Z")]


def test_sigusr1_prints_diagnostics_and_the_job_goes_on(ranks, tmp_path):
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        process = start_mpi("signals.py", ranks, "usr1", str(tmp_path), stderr=stderr)
        pids = _wait_for_pids(tmp_path, ranks, process)
        time.sleep(0.3)  # let the holds start
        os.kill(pids[1], signal.SIGUSR1)
        text = _wait_for_text(err, "asyncio tasks:")
        (tmp_path / "release").touch()
        job = finish(process, "signals.py usr1", timeout=60)
    assert_ok(job)
    assert "released ok" in job.stdout
    assert f"mpiscale diagnostics: rank 1 of {ranks}" in text
    assert "pending asks:" in text and "'hold'" in text  # rank 1's own pending ask
    assert "actor 'holder' (Holder): mailbox 0, handling 'hold'" in text
    assert "pending MPI requests:" in text
    assert "Stack for <Task" in text  # asyncio task stacks
    assert "Current thread" in text or "Thread 0x" in text  # C-level stacks, even if the loop were stuck


@pytest.mark.parametrize(
    "who, signum", [("all", signal.SIGTERM), ("one", signal.SIGTERM), ("all", signal.SIGINT)], ids=str
)
def test_signal_drains_and_exits_nonzero(ranks, tmp_path, who, signum):
    process = start_mpi("signals.py", ranks, "term", str(tmp_path))
    pids = _wait_for_pids(tmp_path, ranks, process)
    time.sleep(0.5)
    start = time.monotonic()
    for pid in pids if who == "all" else pids[-1:]:
        os.kill(pid, signum)
    job = finish(process, f"signals.py term ({who}, {signum.name})", timeout=60)
    assert job.returncode != 0
    assert time.monotonic() - start < 20
    target = ranks - 1
    assert f"mpiscale: rank {target}: {signum.name} received, draining and shutting down" in job.stderr, job.stderr
    assert f"mpiscale: rank {target}: shutdown drained" in job.stderr, job.stderr
    if who == "all":
        assert job.stderr.count(f"{signum.name} received") == ranks
        assert f"exit status {128 + signum}" in job.stderr


def test_a_stop_while_the_ranks_start_ends_the_job_before_its_first_step_with_one_line_and_143(tmp_path):
    """SIGTERM to the launcher (SIGUSR2 to the ranks) while they still import: before, SIGUSR2's default action
    killed them without a word (status 140, or 0 or 1 under load)."""
    process = start_mpi("stops.py", 2, "startup", str(tmp_path), cold=True)  # start-up as a user's: its imports too
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all((tmp_path / f"rank{r}.started").exists() for r in range(2)):
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    job = finish(process, "stops.py startup", timeout=60)
    assert job.returncode == 143, job.output[-3000:]
    assert "stopped on request (a stop command or SIGTERM) before the first step; nothing to checkpoint" in job.stdout
    assert "step 1" not in job.stdout, job.output[-3000:]


@pytest.mark.parametrize("after_s", [0.01, 0.05])
def test_a_stop_the_moment_the_job_is_launched_ends_it_with_one_line_and_143(tmp_path, after_s):
    """SIGTERM to the launcher 10 or 50 ms after it started: before, mpirun passed SIGUSR2 on to ranks that did not
    hold it yet (its default action: status 140, no word), or to none yet (the stop was lost until the launcher's own
    timer). Now the launcher passes it on once every rank holds stops. One that came before the launcher had set its
    handlers ended it at once with no word (status -15: 50 ms on a loaded host in a suite run of 2026-12-04); the
    launcher now keeps such a stop from its first lines and passes it on once the job has started."""
    process = start_mpi("stops.py", 2, "startup", str(tmp_path), cold=True)
    time.sleep(after_s)
    process.send_signal(signal.SIGTERM)
    job = finish(process, "stops.py startup", timeout=90)
    assert job.returncode == 143, job.output[-3000:]
    assert "stopped on request (a stop command or SIGTERM) before the first step" in job.stdout, job.output[-3000:]


@pytest.mark.parametrize("who", ["process group", "every process"])
def test_a_stop_sent_to_every_process_of_the_job_is_obeyed_with_143(tmp_path, who):
    """As timeout(1) signals the launcher's process group (which reached mpirun, whose own SIGTERM ended the job
    with 1 and killed the ranks a second later), and Slurm's cancel every process of the job: there the launcher
    gives mpirun half of Slurm's KillWait before it kills the ranks (5 s here), and takes the ranks' own status
    over mpirun's 1."""
    log = tmp_path / "steps.log"
    env = {"OMPI_MCA_odls_base_sigkill_timeout": "5"} if who == "every process" else {}
    with open(log, "w") as stdout:
        process = start_mpi("stops.py", 2, "long-steps", str(tmp_path), env=env, stdout=stdout)
        _wait_for_text(log, "step 2", timeout=60)
        if who == "process group":
            os.killpg(process.pid, signal.SIGTERM)
        else:
            table = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
            for pid in {process.pid, *map(int, table.split())}:
                os.kill(pid, signal.SIGTERM)
        job = finish(process, "stops.py long-steps", timeout=60)
    said = log.read_text()
    assert job.returncode == 143, said[-3000:] + job.stderr[-3000:]
    assert re.search(r"stopped on request \(a stop command or SIGTERM\) after step \d+", said), said[-3000:]


def test_a_stop_during_a_long_step_is_obeyed_at_that_steps_end(tmp_path):
    """Steps of 0.6 s that never await: the request is noted as the signal comes, and with steps this long the
    ranks agree on it at the end of that very step (not two steps later)."""
    log = tmp_path / "steps.log"
    with open(log, "w") as stdout:
        process = start_mpi("stops.py", 2, "long-steps", str(tmp_path), stdout=stdout)
        _wait_for_text(log, "step 2", timeout=60)
        process.send_signal(signal.SIGTERM)
        job = finish(process, "stops.py long-steps", timeout=60)
    said = log.read_text()
    assert job.returncode == 143, said[-3000:] + job.stderr[-3000:]
    assert _left_in_session(process.pid) == []  # the launcher's stop timer went with the job (its sleep was left)
    stopped = re.search(r"stopped on request \(a stop command or SIGTERM\) after step (\d+)", said)
    assert stopped and int(stopped[1]) <= 3, said[-3000:]  # step 3 was running when the signal came


def test_stuck_ranks_cannot_keep_a_job_the_launcher_was_told_to_stop_alive(tmp_path):
    """SIGTERM to the launcher reaches the ranks as SIGUSR2 (a stop after the step, not mpirun's SIGKILL a second
    later); ranks that never handle it (their event loops are blocked) are ended by mpirun once the ranks' grace
    and drain (1 s each here) and 5 s more are over."""
    env = {"MPISCALE_STOP_GRACE_S": "1", "MPISCALE_SHUTDOWN_TIMEOUT_S": "1"}
    process = start_mpi("signals.py", 2, "stuck", str(tmp_path), env=env)
    _wait_for_pids(tmp_path, 2, process)
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    job = finish(process, "signals.py stuck", timeout=60)
    took = time.monotonic() - start
    assert job.returncode != 0 and 6.5 < took < 20, (took, job.returncode, job.output[-3000:])


def test_message_over_2_gib():
    job = run_mpi("huge.py", 2, timeout=180)
    assert_ok(job)
    assert f"huge ok: {2**31 + 4099} bytes" in job.stdout


def test_a_job_whose_ranks_all_end_normally_leaves_no_marker_of_their_ends(ranks):
    """Each rank of a launcher's job marks its normal end on its host, for a rank waiting in a blocking call to see
    that another will never come; the host's last rank to end removes the job's markers. Each rank's end also meets
    the others' on the communicators it made blocking calls on, and leaves out the one freed."""
    job = run_mpi("ends_normally.py", ranks)
    assert_ok(job)
    where, prefix, communicators = job.stdout.split()
    assert communicators == "2", job.stdout
    assert not [name for name in os.listdir(where) if name.startswith(prefix)], os.listdir(where)
