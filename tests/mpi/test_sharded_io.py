"""Sharded HDF5 datasets and the batch reader under real MPI jobs."""

import re
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import assert_ok, run_mpi


def test_sharded_datasets_and_reader(ranks, tmp_path):
    job = run_mpi("sharded_io.py", ranks, str(tmp_path))
    assert_ok(job)
    assert f"sharded io ok on {ranks} ranks" in job.stdout


def test_one_ranks_error_inside_a_collective_open_ends_the_job_with_its_report(tmp_path):
    """Rank 1 raises inside ``with ShardedDataset(path, name, comm)`` while rank 0 goes on to a collective read: the
    block's close, collective with MPI-IO, waited for rank 0 forever and the error was never said. The data set is
    left open after such an error now, and the job ends with rank 1's report."""
    with h5py.File(tmp_path / "rows.h5", "w") as file:
        file["X"] = np.arange(32.0).reshape(16, 2)
    started = time.monotonic()
    job = run_mpi("sharded_error.py", 2, str(tmp_path / "rows.h5"), timeout=120)
    assert job.returncode != 0 and time.monotonic() - started < 60, job.output[-3000:]
    assert "job failed on rank 1 of 2" in job.stderr and "planted on rank 1" in job.stderr, job.stderr[-3000:]


def test_a_data_set_only_rank_0_opens_with_the_worlds_comm_ends_the_job_with_a_report(tmp_path):
    """Only rank 0 opens it, passing ``system.world``; the others return from main. Rank 0 waited in the open's
    first collective for ever; it now waits in a barrier the runtime watches, and the job ends naming the line."""
    with h5py.File(tmp_path / "rows.h5", "w") as file:
        file["X"] = np.arange(32.0).reshape(16, 2)
    job = run_mpi("sharded_error.py", 2, str(tmp_path / "rows.h5"), "rank-0-alone", timeout=60,
                  env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})  # fmt: skip
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    said = "CollectiveAbandoned: a collective that not every rank will enter: ShardedDataset #1 on world (blocking "
    assert said in job.stderr and "called at sharded_error.py:" in job.stderr, job.stderr[-3000:]
    assert f"ShardedDataset({tmp_path / 'rows.h5'}): rank 0 has waited 1 s for the other ranks" in job.stderr


@pytest.mark.parametrize(
    "call, doing, entered",
    [
        ("RowWriter", "make it", "RowWriter #1 on world"),
        ("RowWriter.reopen", "reopen it", "RowWriter.reopen #3 on world"),  # (every rank made and closed the first)
        ("write_dataset", "write it", "write_dataset #1 on world"),
        ("RaggedDataset", "open it", "RaggedDataset #1 on world"),
        ("on_rank_0", "call it", "on_rank_0 #1 on world"),
        ("agree", "agree", "agree #1 on world"),
        ("Checkpointer", "open it", "Checkpointer #1 on world"),
        ("Checkpointer.save", "save it", "Checkpointer.save #1 on checkpoints/"),
        ("Checkpointer.load", "load it", "Checkpointer.load #2 on checkpoints/"),
    ],
)
def test_a_collective_file_call_only_rank_0_makes_ends_the_job_with_a_report(tmp_path, call, doing, entered):
    """Only rank 0 makes the call, given the world's communicator; rank 1 returns from main. Rank 0 waited in the
    call's first collective for ever; it now waits in a barrier the runtime watches, and the job ends naming it
    (a checkpointer's on its own communicator, named for its directory)."""
    job = run_mpi("only_rank_0.py", 2, str(tmp_path), call, timeout=60, env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    said = f"not every rank will enter: {entered} (blocking calls) (rank 0 waits in it; "
    assert said + "rank 1 never will)" in job.stderr, job.stderr[-3000:]
    assert "called at only_rank_0.py:" in job.stderr, job.stderr[-3000:]
    assert re.search(rf"{re.escape(call)}\(.*\): rank 0 has waited 1 s for the other ranks of its communicator to "
                     rf"{doing} too: each rank of the comm given must", job.stderr), job.stderr  # fmt: skip


@pytest.mark.parametrize("call", ["on_rank_0", "agree"])
@pytest.mark.parametrize("mode", ["plain", "plain-dup-again"])
def test_a_call_only_rank_0_makes_in_a_plain_program_ends_the_job_at_once_naming_the_end_it_met(tmp_path, call, mode):
    """The same slip in a plain mpi4py program (no runtime to ask): rank 0 waited in ``ranks.agree``'s allgather for
    ever. Rank 1's program ends with the checked exchange that rank 0's call begins with, on the world's
    communicator and on each other one it made blocking calls on (``plain-dup-again``: a duplicate of the world's
    that every rank made the call on once before): the job ends at once (the collective check left at its 30 s),
    with one report naming rank 0's call and rank 1's end."""
    job = run_mpi("only_rank_0.py", 2, str(tmp_path), call, mode, timeout=60)
    assert job.returncode != 0 and job.elapsed < 20, job.output[-3000:]
    assert re.search(rf"CollectiveMismatch: {call}\(.*\): the ranks of its communicator came to different collective "
                     rf"calls: rank 0: {call}\(.*\), at only_rank_0.py:\d+; rank 1: the end of its program ",
                     job.stderr), job.stderr[-3000:]  # fmt: skip
    assert job.stderr.count("Traceback") == 1 and "rank 0 has waited" not in job.stderr, job.stderr[-3000:]


@pytest.mark.parametrize("call", ["on_rank_0", "agree"])
@pytest.mark.parametrize("check", ["1", "30"])
def test_a_call_on_another_communicator_only_rank_0_makes_ends_the_job_naming_the_rank_that_ended(
    tmp_path, call, check
):
    """The call on a duplicate of the world's communicator that rank 1 never made a blocking call on, so its end's
    exchanges never meet it: rank 0 finds that rank 1 (on its host) ended its program, and ends every rank. It looked
    once it had waited the collective check, 30 s by default; now from 5 s on (or the check, where shorter: the wait
    is said first then)."""
    job = run_mpi("only_rank_0.py", 2, str(tmp_path), call, "plain-dup", timeout=60,
                  env={"MPISCALE_COLLECTIVE_CHECK_S": check})  # fmt: skip
    assert job.returncode != 0 and job.elapsed < 20, job.output[-3000:]
    assert f"rank 1 of the job ended (the program returned) without coming to {call}, which every rank" in job.stderr
    said = re.search(rf"{call}\(.*\): rank 0 has waited {check} s for the other ranks", job.stderr)
    assert bool(said) == (check == "1"), job.stderr[-3000:]


@pytest.mark.parametrize("ranks", [2, 4])
def test_one_file_named_two_ways_by_the_ranks_is_written_and_read_as_one(tmp_path, ranks):
    """Rank 0 names the file relative to the working directory, the others through a link to its directory: each
    call's check took the two names for two objects, and the first write raised CollectiveMismatch on every rank.
    The check now names a file by its real path (the message keeps the path each rank was given)."""
    (tmp_path / "data").mkdir()
    job = run_mpi("spelt_paths.py", ranks, str(tmp_path / "data"), str(tmp_path / "link"), timeout=60)
    assert_ok(job)
    total = sum(2 * 2 * rank for rank in range(ranks))
    assert job.stdout.count(f"read {total:g} as ") == ranks, job.stdout


@pytest.mark.parametrize("ranks, how", [(2, "reopened"), (2, "same"), (4, "reopened")])
def test_a_growing_data_set_cut_back_keeps_what_is_written_past_the_cut(tmp_path, ranks, how):
    """A resumed encode cuts its growing data sets back to its predecessor's last mark, then writes past the cut.
    With the data set kept open across calls, HDF5 kept the chunk of the cut in its cache, dirty, while the writes
    went past it to the file; the next flush wrote it back over them: the first round's 40 values read 0."""
    job = run_mpi("shrunk_writer.py", ranks, str(tmp_path), how, timeout=60)
    assert_ok(job)
    assert "560 values, 0 differ" in job.stdout, job.output[-3000:]


def test_grow_refuses_a_negative_count_and_a_data_set_not_made_growing_on_every_rank_and_the_writer_goes_on(tmp_path):
    """A negative count raised h5py's OverflowError ("can't convert negative value to hsize_t"), naming neither the
    writer nor the data set; each is now refused on every rank, before the file changes, and the writer goes on."""
    job = run_mpi("shrunk_writer.py", 2, str(tmp_path), "refused", timeout=60)
    assert_ok(job)
    out = tmp_path / "out.h5"
    for rank in (0, 1):
        for said in (f"ValueError: grow: x of {out} to -1 rows: a count of rows is a whole number >= 0",
                     f"ValueError: grow: x of {out} to 2.5 rows: a count of rows is a whole number >= 0",
                     f"TypeError: grow: fixed of {out} was not made growing (RowWriter's growing=)"):  # fmt: skip
            assert f"rank {rank}: {said}" in job.stdout, job.stdout
    assert "560 values, 0 differ" in job.stdout, job.output[-3000:]


_EACH_RANK_MUST = "each rank of the comm given must make the same calls on it in the same order"


@pytest.mark.parametrize("how", ["plain", "run"])
@pytest.mark.parametrize(
    "call, made, skipped, hint",
    [
        ("write", "RowWriter({out}): the ranks made different calls on it: rank 0: write(X), its call 2 on it, at "
         "skipped_call.py:{line}; rank 1: close, its call 2 on it, at skipped_call.py:", "writer.write(",
         "(a rank without rows in a round writes empty arrays)"),
        ("read", "ShardedDataset({data}): the ranks made different calls on it: rank 0: read_collective, its call 2 "
         "on it, at skipped_call.py:{line}; rank 1: close, its call 2 on it, at skipped_call.py:", "read_collective(",
         "(a rank without rows in a round reads an empty range: read_collective(n, n))"),
    ],
)  # fmt: skip
def test_a_round_that_one_rank_skips_ends_every_rank_naming_each_ranks_call(tmp_path, how, call, made, skipped, hint):
    """Rank 1 has no rows in the second round and skips its call (``if len(mine):``), then closes: its close met rank
    0's second call, and both waited for ever (each test hung). Each call on a writer or a data set read
    collectively now starts with an exchange of the ranks' calls: every rank raises one CollectiveMismatch naming
    each rank's call and line, under mpiscale.run and in a plain mpi4py program, and no output is left."""
    job = run_mpi("skipped_call.py", 2, str(tmp_path), call, how, timeout=60, env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    line = _line_of("skipped_call.py", skipped)
    said = made.format(out=tmp_path / "out.h5", data=tmp_path / "in.h5", line=line)
    assert f"CollectiveMismatch: {said}" in job.stderr, job.stderr[-3000:]
    assert f"; {_EACH_RANK_MUST} {hint}" in job.stderr, job.stderr[-3000:]
    assert not (tmp_path / "out.h5").exists() and not (tmp_path / "out.h5.tmp").exists()


def test_a_round_that_three_of_4_ranks_skip_ends_every_rank_naming_each_ranks_call(tmp_path):
    """On 4 ranks, ranks 1-3 have no rows in the second round and skip their write: one report, the ranks that made
    the same call named together."""
    job = run_mpi("skipped_call.py", 4, str(tmp_path), "write", "run", timeout=60)
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    said = (f"RowWriter({tmp_path / 'out.h5'}): the ranks made different calls on it: rank 0: write(X), its call 2 on "
            f"it, at skipped_call.py:{_line_of('skipped_call.py', 'writer.write(')}; ranks 1-3: close, its call 2 on "
            "it, at skipped_call.py:")  # fmt: skip
    assert said in job.stderr and job.stderr.count("job failed on rank") == 1, job.stderr[-3000:]
    assert not (tmp_path / "out.h5").exists() and not (tmp_path / "out.h5.tmp").exists()


def test_a_rank_that_returns_with_its_writer_unclosed_ends_the_plain_job_naming_it(tmp_path):
    """Rank 1 returns from its program after the first round, its RowWriter neither closed nor in a ``with``: as the
    writer was freed, its file's close (collective) waited for rank 0, and rank 0 in its next write for rank 1, for
    ever. An unclosed writer is kept now, and closed at the process's end as every rank comes: that close meets
    rank 0's write, and each rank names the other's call."""
    job = run_mpi("skipped_call.py", 2, str(tmp_path), "ended", "plain", timeout=60,
                  env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})  # fmt: skip
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    said = (f"CollectiveMismatch: RowWriter({tmp_path / 'out.h5'}): the ranks made different calls on it: rank 0: "
            f"write(X), its call 2 on it, at skipped_call.py:{_line_of('skipped_call.py', 'np.zeros((hi - lo')}; "
            "rank 1: close, its call 2 on it, at the program's end (it never closed the writer)")  # fmt: skip
    assert said in job.stderr, job.stderr[-3000:]
    assert not (tmp_path / "out.h5").exists() and not (tmp_path / "out.h5.tmp").exists()


def test_a_rank_that_returns_from_main_with_its_writer_unclosed_ends_the_job_with_a_report(tmp_path):
    """The same under mpiscale.run: rank 0's write waits in an exchange the runtime watches, and the job ends with
    its report naming the write and the line of rank 1's last."""
    job = run_mpi("skipped_call.py", 2, str(tmp_path), "ended", "run", timeout=60,
                  env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})  # fmt: skip
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    said = "a collective that not every rank will enter: RowWriter.write #3 on world (blocking calls) (rank 0 waits "
    assert said + "in it; rank 1 never will)" in job.stderr, job.stderr[-3000:]
    assert "the last: RowWriter.write #2, called at skipped_call.py:" in job.stderr, job.stderr[-3000:]


def test_a_data_set_being_read_keeps_a_users_writer_out_of_its_file_until_closed(tmp_path):
    """HDF5 refuses to open a file for writing while a reader holds it open; the job's MPI-IO reads took no lock, so
    a user's h5py program wrote into the file the ranks were reading. Now it is refused while they read ("unable
    to lock file"), and writes once they have closed it."""
    with h5py.File(tmp_path / "in.h5", "w") as file:  # (plain h5py, as a user writes one)
        file["X"] = np.arange(8.0).reshape(4, 2)
    job = run_mpi("held_input.py", 2, str(tmp_path / "in.h5"), timeout=90)
    assert_ok(job)
    assert "while read: the write was refused (locked)" in job.stdout, job.output[-3000:]
    assert "once closed: the write ended 0" in job.stdout and "rank 1 read 5" in job.stdout, job.output[-3000:]
    with h5py.File(tmp_path / "in.h5", "r") as file:
        assert file["Y"][()].tolist() == [1.0]


@pytest.mark.parametrize(("ranks", "how"), [(1, "run"), (1, "plain"), (2, "run")])
def test_files_a_left_running_thread_holds_are_closed_before_mpi_ends_and_the_refusal_keeps_its_status(
    tmp_path, ranks, how
):
    """The program refuses its job with a kept writer and a user's data set held by a daemon thread, which outlives
    the interpreter's end: a one-rank job's files were closed by HDF5 after MPI was finalized, and Open MPI's abort
    ("MPI_Barrier ... called after MPI_FINALIZE") turned status 2 into 1. Now every rank ends 2, and the rows stay in
    the temporary file for a resumed run."""
    with h5py.File(tmp_path / "in.h5", "w") as file:  # (plain h5py, as a user writes one)
        file["X"] = np.arange(8.0).reshape(4, 2)
    job = run_mpi("held_at_end.py", ranks, str(tmp_path), how, timeout=60)
    assert job.returncode == 2 and "MPI_FINALIZE" not in job.output, job.output[-3000:]
    assert job.stdout.count("refused with a thread holding the files") == ranks, job.output[-3000:]
    with h5py.File(tmp_path / "out.h5.tmp", "r") as kept:
        np.testing.assert_array_equal(kept["X"][()], np.arange(2.0 * ranks).reshape(ranks, 2))
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("how", ["plain", "run"])
def test_writers_every_rank_leaves_unclosed_are_closed_at_the_end_with_their_rows_kept(tmp_path, how):
    """Every rank leaves two writers unclosed, one over a communicator it freed: kept from the garbage collector, they
    are closed as the processes end, in the same order on every rank; the job ends 0, rank 0 says where each
    writer's rows are, and the temporary files hold them (never put in place unfinished)."""
    job = run_mpi("skipped_call.py", 2, str(tmp_path), "unclosed", how, timeout=60)
    assert_ok(job)
    for name in ("out.h5", "part.h5"):
        said = f"RowWriter({tmp_path / name}) was never closed: what was written stays in {tmp_path / name}.tmp"
        assert said in job.stderr and not (tmp_path / name).exists(), job.stderr[-3000:]
        with h5py.File(tmp_path / f"{name}.tmp", "r") as file:
            assert np.array_equal(file["X"][:], np.repeat([0.0, 0.0, 1.0, 1.0], 2).reshape(4, 2))


@pytest.mark.parametrize("call", ["write", "read", "ended"])
def test_rounds_where_ranks_without_rows_pass_empty_ranges_complete_on_4_ranks(tmp_path, call):
    """The same programs with every call made (a rank without rows passes an empty range): on 4 ranks, three of
    which have no rows in the second round, the file holds every row and the reads every row once."""
    job = run_mpi("skipped_call.py", 4, str(tmp_path), call, "run", "fixed", timeout=60)
    assert_ok(job)
    if call == "read":
        sums = [float(found) for found in re.findall(r"rank \d read (\d+)", job.stdout)]
        assert len(sums) == 8 and sum(sums) == np.arange(10.0).sum(), job.stdout
    else:
        with h5py.File(tmp_path / "out.h5", "r") as file:
            expected = np.arange(10.0).reshape(5, 2) if call == "write" else np.zeros((5, 2))
            assert np.array_equal(file["X"][:], expected)


def _line_of(program: str, text: str) -> int:
    """The number of the first line of a test program that holds ``text``."""
    lines = (Path(__file__).parent / "programs" / program).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)
