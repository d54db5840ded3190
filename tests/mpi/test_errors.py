"""Remote failures reach the asker; unhandled failures end the whole job quickly."""

import re

import pytest
from helpers import MPIRUN_GRACE, assert_ok, finish, run_mpi, start_mpi


def test_remote_errors_deadlines_supervision(ranks):
    job = run_mpi("errors.py", ranks)
    assert_ok(job)
    assert f"errors ok on {ranks} ranks" in job.stdout


@pytest.mark.parametrize(
    "scenario, failing_rank, context, error",
    [
        ("main-raises", 1, "main raised an exception", "KeyError: 'rank 1 lost its data'"),
        ("restart-limit", 1, "restart limit reached (1 in 60s)", "ValueError: crash in a tell"),
        (
            "unknown-actor",
            1,
            "a tell was addressed to an actor that does not exist",
            "ActorNotFound: no actor 'nobody'",
        ),
        ("no-policy", -1, "it has no restart policy, so the failure escalates", "TypeError"),
        (
            "raises-in-collective-write",
            1,
            "main raised an exception",
            "ZeroDivisionError: rank 1 failed between two collective writes",
        ),
    ],
)
def test_unhandled_failure_ends_the_job(ranks, scenario, failing_rank, context, error, tmp_path):
    job = run_mpi("failures.py", ranks, scenario, str(tmp_path / "rows.h5"), timeout=60)
    failing_rank = failing_rank % ranks
    assert job.returncode != 0
    assert job.elapsed < 30, f"job took {job.elapsed:.1f}s to end"
    assert job.stderr.count("mpiscale: job failed on rank") == 1, job.stderr
    assert f"job failed on rank {failing_rank} of {ranks}" in job.stderr, job.stderr
    assert context in job.stderr, job.stderr
    assert error in job.stderr, job.stderr
    assert "killed by a signal" not in job.stderr, job.stderr  # the others knew the failing rank reported


def test_a_bug_every_rank_meets_is_one_traceback_and_a_line_per_other_rank(ranks):
    """Every rank of the host raises the same KeyError: one full report, and the other ranks that print before the
    abort ends them print one line naming its pid (each printed the whole report: 84 lines from 4 ranks)."""
    job = run_mpi("failures.py", ranks, "every-rank-raises", timeout=60)
    assert job.returncode != 0 and job.elapsed < 30, job.stderr
    assert job.stderr.count("job failed on rank") == 1 and job.stderr.count("Traceback") == 1, job.stderr
    reporter = re.search(r"job failed on rank \d+ of \d+ \(host [^,]+, pid (\d+)\)", job.stderr)
    assert reporter is not None and "KeyError: 'labels'" in job.stderr, job.stderr
    line = (r"mpiscale: rank \d+ of \d+ \(host [^,]+, pid \d+\) failed as pid (\d+) did, whose report above has the "
            r"traceback: main raised an exception: KeyError: 'labels'\n")  # fmt: skip
    others = re.findall(line, job.stderr)
    assert len(others) <= ranks - 1 and set(others) <= {reporter[1]}, job.stderr


@pytest.mark.parametrize("scenario", ["plain-def-main", "plain-def-main-bare"])
def test_a_main_that_is_a_plain_def_is_named_with_the_fix(ranks, scenario):
    """A plain ``def main`` ran, then the runtime awaited its int: "object int can't be used in 'await'
    expression", which said nothing of main. Every rank finds it: one line from rank 0 and status 2, as for any
    refusal (it was a failure report and traceback from each rank)."""
    job = run_mpi("failures.py", ranks, scenario, timeout=60)
    assert job.returncode == 2 and job.elapsed < 30, job.stderr
    said = "run(main) awaits main(system), but plain_main(system) returned int, not an awaitable"
    assert job.stderr.count(said) == 1 and "define it as `async def plain_main(system)`" in job.stderr, job.stderr
    assert "Traceback" not in job.stderr and "job failed on rank" not in job.stderr, job.stderr


def test_a_rank_that_crashes_is_named_with_its_signal_and_a_likely_cause(tmp_path):
    job = run_mpi("failures.py", 2, "segfault", str(tmp_path / "rows.h5"), timeout=60)
    assert job.returncode == 139, job.output[-3000:]
    assert "a rank was killed by SIGSEGV (status 139): a crash in native code" in job.stderr, job.stderr
    assert "out-of-memory" not in job.stderr.split("mpiscale-run:", 1)[1], job.stderr


def test_a_rank_killed_between_small_allreduces_is_named_and_the_job_ends(tmp_path):
    """Rank 0 in a loop of 4 KiB allreduces (the world's and the hierarchical one's, each a check and a swap tested
    in place) while rank 1 SIGKILLs itself between two of them: rank 0 waits in a call that never ends, and the
    job ends naming rank 1 (within mpirun's grace: the suite's runs take none, and a loaded run once ended first)."""
    job = run_mpi("failures.py", 2, "killed-in-small-allreduces", str(tmp_path / "rows.h5"), timeout=60,
                  env=MPIRUN_GRACE)  # fmt: skip
    assert job.returncode == 137 and "rank 1 kills itself" in job.stdout, job.output[-3000:]
    assert job.elapsed < 30, f"job took {job.elapsed:.1f}s to end"
    assert re.search(r"^mpiscale: rank 1 \(pid \d+\) on host \S+ ended while the job ran \(killed by a signal",
                     job.stderr, re.M), job.stderr  # fmt: skip


def test_a_killed_rank_is_named_even_when_no_other_rank_of_its_host_can_run(tmp_path):
    """Rank 1 SIGKILLed while rank 0's Python is held (native code keeping the GIL): rank 0 never runs again before
    mpirun kills it 2 s later, and the job used to end with no word of which rank died (a loaded suite run, where
    the survivor was held or starved through mpirun's one second of grace; 2026-12-01). The host's death watch, a
    process of its own, names rank 1 the moment it dies."""
    job = run_mpi("failures.py", 2, "killed-beside-a-held-rank", str(tmp_path / "rows.h5"), timeout=60,
                  env=MPIRUN_GRACE)  # fmt: skip
    assert job.returncode == 137 and "rank 1 kills itself" in job.stdout, job.output[-3000:]
    assert job.stderr.count("ended while the job ran") == 1, job.stderr
    assert re.search(r"^mpiscale: rank 1 \(pid \d+\) on host \S+ ended while the job ran \(killed by a signal",
                     job.stderr, re.M), job.stderr  # fmt: skip


CHECK_S = 1.0  # MPISCALE_COLLECTIVE_CHECK_S in these runs: a report within about twice that


@pytest.mark.parametrize(
    "scenario, header, lines",
    [
        (
            "left-main",
            "allreduce #2 on world (rank{s} {waiters} wait{one} in it; rank {last} never will)",
            ["waits in allreduce #2 on world for", "called at abandoned.py:20",
             "left main (returned) after 1 collective on world; the last: barrier #1, called at abandoned.py:16"],
        ),
        (
            "left-main-hierarchical",
            "allreduce #1 on world (hierarchical) (rank{s} {waiters} wait{one} in it; rank {last} never will)",
            ["waits in allreduce #1 on world (hierarchical) for", "called at abandoned.py:23",
             "left main (returned) after 0 collectives on world (hierarchical)"],
        ),
    ],
)  # fmt: skip
def test_a_collective_a_rank_left_main_without_ends_the_job_with_one_report(ranks, scenario, header, lines, tmp_path):
    """With ``mpiscale.run``'s telemetry on: its own collectives (start, end) never shift the job's numbers."""
    env = {"MPISCALE_COLLECTIVE_CHECK_S": str(CHECK_S), "MPISCALE_TELEMETRY": "1"}
    job = finish(start_mpi("abandoned.py", ranks, scenario, env=env, cwd=tmp_path), f"abandoned.py {scenario}", 60)
    assert (tmp_path / "abandoned.telemetry.jsonl").exists()
    assert job.returncode != 0, job.output
    assert job.elapsed < 20, f"job took {job.elapsed:.1f}s to end"
    last = ranks - 1
    waiters = ", ".join(map(str, range(last)))
    expected = header.format(s="" if last == 1 else "s", waiters=waiters, one="s" if last == 1 else "", last=last)
    assert job.stderr.count("CollectiveAbandoned: a collective that not every rank will enter") == 1, job.stderr
    assert f"not every rank will enter: {expected}" in job.stderr, job.stderr
    assert "job failed on rank 0 of" in job.stderr, job.stderr  # the lowest waiting rank reports
    for rank in range(last):
        assert f"rank {rank} (host " in job.stderr, job.stderr
    for line in lines:
        assert line in job.stderr, job.stderr


def test_a_collective_the_ranks_call_differently_ends_the_job_naming_both_operations():
    # Unchecked, Open MPI pairs rank 0's barrier with the others' allreduce on 1 and 3; rank 2 is left waiting.
    env = {"MPISCALE_COLLECTIVE_CHECK_S": str(CHECK_S), "MPISCALE_CHECK_COLLECTIVES": "0"}
    job = run_mpi("abandoned.py", 4, "other-operation", env=env, timeout=60)
    assert job.returncode != 0, job.output
    assert job.elapsed < 20, f"job took {job.elapsed:.1f}s to end"
    assert job.stderr.count("CollectiveAbandoned: a collective that not every rank will enter") == 1, job.stderr
    assert re.search(r"rank 0 \(host [^)]*\): waits in barrier #2 on world", job.stderr), job.stderr
    assert re.search(r"rank 2 \(host [^)]*\): waits in allreduce #2 on world", job.stderr), job.stderr
    assert "job failed on rank 0 of 4" in job.stderr, job.stderr


@pytest.mark.parametrize(
    "scenario, culprit",
    [
        ("two-communicators", r"rank 1 \(host [^)]*\): is not in a collective on world \(hierarchical\) \(0 "
                              r"collectives started on it\); it waits in allreduce #2 on world for [0-9.]+ s, called "
                              r"at abandoned.py:33"),
        ("world-against-node-barrier", r"rank 1 \(host [^)]*\): is not in a collective on world \(1 collective "
                                       r"started on it\); it waits in barrier #1 on node"),
        ("blocking-on-two-communicators", r"rank 1 \(host [^)]*\): is not in a collective on world \(blocking "
                                          r"calls\) \(0 collectives started on it\); it waits in one of two #1 on a "
                                          r"communicator \(blocking calls\) for [0-9.]+ s, called at abandoned.py:\d+"),
    ],
)  # fmt: skip
def test_collectives_on_two_communicators_that_wait_for_each_other_end_in_one_report(scenario, culprit):
    """Rank 0 in the hierarchical allreduce while rank 1 is in the world's (or a world barrier against a node
    barrier): each waits for the other, and the job hung without a word until the test's timeout. The same with
    both in blocking calls that hold their loops (a copy of the world's communicator, on which rank 0 makes no call):
    neither answered the other's question, nor counted a communicator it had made no call on as not entered."""
    job = run_mpi("abandoned.py", 2, scenario, env={"MPISCALE_COLLECTIVE_CHECK_S": str(CHECK_S)}, timeout=60)
    assert job.returncode != 0, job.output
    assert job.elapsed < 20, f"job took {job.elapsed:.1f}s to end"
    assert job.stderr.count("CollectiveAbandoned: a collective that not every rank will enter") == 1, job.stderr
    assert re.search(culprit, job.stderr), job.stderr


def test_blocking_calls_on_two_unnamed_communicators_are_logged_apart():
    """Rank 0 meets rank 1 in a blocking barrier, then rank 2, late, on another unnamed communicator. Both barriers
    went into one log named for the first pair, so rank 0's wait for rank 2 asked rank 1, which had left main: the
    job ended with a report of a collective abandoned that rank 2 was coming to."""
    job = run_mpi("abandoned.py", 3, "blocking-on-two-pairs", env={"MPISCALE_COLLECTIVE_CHECK_S": str(CHECK_S)},
                  timeout=60)  # fmt: skip
    assert_ok(job)
    assert "two pairs ok" in job.stdout and "CollectiveAbandoned" not in job.stderr, job.output[-3000:]


@pytest.mark.parametrize(
    "scenario, calls",
    [
        ("agree-against-allreduce", ["rank 0: agree() at abandoned.py:", "rank 1: allreduce(float64(4,) sum) at"]),
        ("barrier-against-lookup", ["rank 0: barrier() at abandoned.py:", "rank 1: agree() at "]),
    ],
)  # fmt: skip
def test_ranks_in_different_collectives_end_with_one_report_of_every_call(scenario, calls):
    """Every collective, an agreement and a barrier too, first exchanges its name and arguments: two ranks in
    different ones end the job with the one CollectiveMismatch naming each rank's call, never one's bytes read as
    the other's (an agreement once read a signature as message lengths and asked for 5.9 EiB)."""
    job = run_mpi("abandoned.py", 2, scenario, env={"MPISCALE_COLLECTIVE_CHECK_S": str(CHECK_S)}, timeout=60)
    assert job.returncode == 1, job.output
    assert job.elapsed < 20, f"job took {job.elapsed:.1f}s to end"
    assert job.stderr.count("CollectiveMismatch: collective #2 on world: the ranks called different") == 1, job.stderr
    assert "job failed on rank 0 of 2" in job.stderr, job.stderr
    for call in calls:
        assert call in job.stderr, job.stderr
    assert "MemoryError" not in job.stderr and "MPI_ERR" not in job.stderr, job.stderr


def test_a_hierarchical_allreduce_of_other_shapes_ends_with_one_report_of_every_call(ranks):
    """Every rank raised its own report (70 lines on 2 ranks), without call sites; now one, the lowest rank's."""
    job = run_mpi("abandoned.py", ranks, "hierarchical-shapes", timeout=60)
    assert job.returncode == 1, job.output
    assert job.stderr.count("mpiscale: job failed on rank") == 1, job.stderr
    assert f"job failed on rank 0 of {ranks}" in job.stderr, job.stderr
    assert "CollectiveMismatch: allreduce #1 on world (hierarchical): the ranks passed different" in job.stderr
    first = "rank 0" if ranks == 2 else "ranks 0-2"
    assert f"{first}: allreduce(float64(4,) sum) at abandoned.py:" in job.stderr, job.stderr
    assert f"rank {ranks - 1}: allreduce(float64(5,) sum) at abandoned.py:" in job.stderr, job.stderr


@pytest.mark.parametrize("scenario, said", [("slow-rank", "slow rank ok"), ("slow-leaves-late", "late finish ok")])
def test_a_rank_that_is_only_late_is_never_reported(ranks, scenario, said):
    job = run_mpi("abandoned.py", ranks, scenario, env={"MPISCALE_COLLECTIVE_CHECK_S": str(CHECK_S)}, timeout=60)
    assert_ok(job)
    assert f"{said} on {ranks} ranks" in job.stdout
    assert "CollectiveAbandoned" not in job.stderr, job.stderr


@pytest.mark.parametrize("how", ["blocking", "awaited"])
def test_reports_of_a_part_of_the_ranks_name_the_jobs_ranks(how, tmp_path):
    """An agreement that failed on world rank 3, made by ranks 2 and 3 alone, said "rank 1: bad input": its place in
    the part, which every other line of the job names by its world rank. The agreements and the reports of calls
    that differ now name the job's ranks (a plain program's blocking calls and a ``system.split`` group's), and so
    does a wait said after the collective check."""
    job = run_mpi("part_reports.py", 4, how, str(tmp_path), env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})
    assert_ok(job)
    if how == "blocking":  # (the wait said by the rank that waits: rank 2, not "rank 0")
        assert "agree(checking): rank 2 has waited 1 s for the other ranks" in job.stderr, job.stderr
        for rank, other in ((2, 3), (3, 2)):
            assert (
                f"rank {rank} raised ValueError: write_dataset {tmp_path / 'rows.h5'}: rank {other} passes arrays "
                f"X: {'float32' if other == 3 else 'float64'} rows of (3,) but rank {rank} passes" in job.stdout
            ), job.stdout
            assert f"ranks differing from this one: [{other}])" in job.stdout, job.stdout
    failed = "RuntimeError" if how == "awaited" else "AgreedError"
    for rank in range(4):
        assert f"rank {rank} raised {failed}: checking failed: rank {rank | 1}: bad input\n" in job.stdout, job.stdout
    for rank in (2, 3):
        said = re.search(rf"rank {rank} raised CollectiveMismatch: .*", job.stdout)
        assert said and re.search(r": rank 2: \w+\(.*\),? at part_reports.py:\d+; rank 3: \w+\(.*\),? at part_reports"
                                  r".py:\d+", said[0]), job.stdout  # fmt: skip
    if how == "awaited":
        for rank in range(4):
            pair = rank - rank % 2
            assert re.search(rf"rank {rank} raised CollectiveMismatch: allreduce #\d+ on pairs \(hierarchical\): .*: "
                             rf"rank {pair}: allreduce\(float64\(4,\) sum\) at part_reports.py:\d+; rank {pair + 1}: "
                             rf"allreduce\(float64\(5,\) sum\)", job.stdout), job.stdout  # fmt: skip
