"""The host's death watch, on real processes: it names a process that ends unannounced, once, and nothing else."""

import os
import signal
import subprocess
import sys
import time

import pytest

from mpiscale.runtime import death_watch
from mpiscale.runtime.death_watch import DeathWatch, alive, spawn_watch

# a stand-in rank: says what its argument says to the watch (through the rank's own side), then waits to be ended
RANK = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("death_watch", sys.argv[5])  # standard library only: no package import
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
DeathWatch = module.DeathWatch
rank, address, pid, word = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
watch = DeathWatch(rank, chr(0) + address, pid)  # an abstract name: no null byte in a command line
if word == "role":
    watch.role(rank, "pipeline stage 1 of 2")
elif word == "planned":
    watch.planned(rank, "killed by a rehearsal")
elif word != "nothing":
    getattr(watch, word)()
print("told", flush=True)
time.sleep(60)
"""


@pytest.fixture
def ranks():
    """Start stand-in ranks, each with its word to the watch, under one watch (its stderr the test's): the watch, the
    ranks, and the last rank's side of the watch; kill what is left at the end."""
    started = []

    def start(*words: str) -> tuple[subprocess.Popen, list[subprocess.Popen], DeathWatch]:
        sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in words]
        started.extend(sleepers)
        address, pid, watch = spawn_watch({rank: p.pid for rank, p in enumerate(sleepers)}, "h1")
        started.append(watch)
        told = []
        for rank, (word, sleeper) in enumerate(zip(words, sleepers)):
            command = [sys.executable, "-c", RANK, str(rank), address[1:], str(pid), word, death_watch.__file__]
            teller = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            started.append(teller)
            assert teller.stdout.readline() == "told\n"
            told.append(sleeper)
        return watch, told, DeathWatch(len(words) - 1, address, pid)  # the last rank's side, for a word later

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def ended(watch: subprocess.Popen | None, *sleepers: subprocess.Popen) -> None:
    """Kill ``sleepers``; then wait for ``watch``, which ends once every process it watches has."""
    for sleeper in sleepers:
        sleeper.kill()
        sleeper.wait()
    if watch is not None:
        watch.wait(10)


def ignoring(pid: int, signum: int, timeout: float = 30) -> None:
    """Wait until process ``pid`` ignores ``signum`` (its ``SigIgn`` mask), as the watch does once it has started
    (a fixed sleep was too short on a loaded host)."""
    deadline = time.monotonic() + timeout
    while True:
        fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
        if int(fields["SigIgn"], 16) >> (signum - 1) & 1:
            return
        assert time.monotonic() < deadline, f"process {pid} never ignored signal {signum}"
        time.sleep(0.01)


def seen(capfd, text: str, timeout: float = 30) -> str:
    """What the watch has said by the time it said ``text``: it has then taken what came before."""
    said, deadline = "", time.monotonic() + timeout
    while text not in said:
        assert time.monotonic() < deadline, f"the watch never said {text!r}: {said!r}"
        time.sleep(0.02)
        said += capfd.readouterr().err
    return said


def test_a_process_that_ends_unannounced_is_named_once_with_its_role(ranks, capfd):
    """Ranks 1 and 2 die unannounced, then rank 0, which said its end was no death: one line, naming the first
    deaths (the watch once closed fds numbered as the ranks that died, its stderr among them, and said nothing)."""
    watch, (first, second, third), _ = ranks("done", "role", "nothing")
    ended(watch, second, third, first)
    said = capfd.readouterr().err.splitlines()
    assert said == [
        f"mpiscale: rank 1 (pid {second.pid}, pipeline stage 1 of 2) on host h1 ended while the job ran (killed by "
        "a signal, or failed: the job's output says which); the job cannot go on"
    ] or said == [  # both unannounced deaths seen in one look
        f"mpiscale: rank 1 (pid {second.pid}, pipeline stage 1 of 2), rank 2 (pid {third.pid}) on host h1 ended "
        "while the job ran (killed by a signal, or failed: the job's output says which); the job cannot go on"
    ], said


@pytest.mark.parametrize("word", ["done", "close", "over", "planned"])
def test_a_process_that_said_its_end_is_no_death_is_not_named(ranks, capfd, word):
    """``done`` (its main ended, a stop began), ``close`` (its run ended), ``over`` (the job ends for a reason
    said already) and a planned death (the dying rank says so itself) leave the watch silent."""
    watch, (only, other), _ = ranks(word, "done")
    ended(watch, only, other)
    assert watch.returncode == 0 and capfd.readouterr().err == ""


def test_the_watch_ignores_the_launchers_signals_and_outlives_none_of_its_ranks(ranks, capfd):
    watch, (first, second), _ = ranks("done", "done")
    ignoring(watch.pid, signal.SIGTERM)  # its first moments, before it ignores them, are the rank's start-up
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        watch.send_signal(signum)
    time.sleep(0.3)
    assert watch.poll() is None
    ended(None, first)
    time.sleep(0.3)
    assert watch.poll() is None  # one rank still runs
    ended(watch, second)
    assert watch.returncode == 0 and capfd.readouterr().err == ""


def test_a_rank_without_a_watch_tells_nothing_and_is_not_active():
    watch = DeathWatch(3)
    watch.done()
    watch.over()
    assert not watch.active and alive(os.getpid())


def test_a_rank_still_running_after_a_death_is_named_as_held_and_killed(ranks, capfd):
    """Rank 0 dies unannounced; rank 1 neither ends nor ends the job (its Python held by a parallel HDF5 call that
    waits for rank 0, where srun kills it only KillWait, 30 s, later; or its launcher never ends the job): HELD_S
    after the death the watch names it and kills it."""
    watch, (first, second), _ = ranks("nothing", "nothing")
    ended(None, first)
    died = time.monotonic()
    assert second.wait(death_watch.HELD_S + 10) == -signal.SIGKILL
    assert death_watch.HELD_S - 0.5 < time.monotonic() - died < death_watch.HELD_S + 3
    watch.wait(10)
    assert capfd.readouterr().err.splitlines() == [
        f"mpiscale: rank 0 (pid {first.pid}) on host h1 ended while the job ran (killed by a signal, or failed: the "
        "job's output says which); the job cannot go on",
        f"mpiscale: rank 1 (pid {second.pid}) on host h1 still ran 5 s after that death, held (native code such as a "
        "parallel HDF5 call that waits for the dead rank keeps its Python from running) or never told to end by its "
        "launcher: killed",
    ]


def test_a_rank_that_took_the_death_is_not_named_as_held_but_ends_all_the_same(ranks, capfd):
    """Rank 1 took rank 0's death (``over``: it ends the job, its telemetry told) but is still there HELD_S later:
    killed without a line of its own. A rank whose watch says nothing of a death, its end no death, is left to end."""
    watch, (first, second), last = ranks("nothing", "nothing")
    ended(None, first)
    said = seen(capfd, "ended while the job ran")  # the death seen first (a watch slow to run takes a word first)
    last.over()
    assert second.wait(death_watch.HELD_S + 10) == -signal.SIGKILL
    watch.wait(10)
    assert (said + capfd.readouterr().err).count("mpiscale: ") == 1
    quiet, (dying, staying), _ = ranks("done", "nothing")
    ended(None, dying)
    time.sleep(death_watch.HELD_S + 1)
    assert staying.poll() is None and quiet.poll() is None and capfd.readouterr().err == ""
    ended(quiet, staying)
