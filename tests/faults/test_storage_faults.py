"""Faults the way they happen on clusters: a full disk or quota, a read-only directory, two jobs on one output.

A small tmpfs stands for a full disk or quota and a read-only tmpfs for a
read-only directory (mounting needs root, as in CI; elsewhere these tests skip
and say so). Every test asserts a bounded exit time, one message and its exit
status, and that nothing written before the fault changed or was left half-done.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import Job, finish, launch, run_cli, run_python

from mpiscale.adapters.planted import write_planted
from mpiscale.dictlearn import load_codes

FEATURES, ROWS = 64, 2000
# 256 atoms of 64 values: a checkpoint holds about 0.8 MiB (the dictionary, A = 256 x 256, B)
SETTINGS = ["--atoms", "256", "--sparsity", "4", "--batch-size", "256", "--progress-every", "0"]


def _mount(target: Path, *options: str) -> None:
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(target)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to stand for a full or read-only disk (needs root): {done.stderr.strip()}")


@pytest.fixture
def disks(tmp_path):
    """mount(name, *options) -> a tmpfs under tmp_path; all are unmounted afterwards."""
    mounted: list[Path] = []

    def mount(name: str, *options: str) -> Path:
        target = tmp_path / name
        _mount(target, *options)
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture
def quota(tmp_path):
    """quota(limit) -> a directory whose quota is ``limit`` ("1M"), on a disk with room: a subvolume of a btrfs image
    with a qgroup limit, whose writes past it fail with EDQUOT as a user's quota does (this kernel has no user quotas;
    the limit binds root too). Unmounted afterwards."""
    image, mounted = tmp_path / "quota.img", tmp_path / "quota"

    def make(limit: str) -> Path:
        mounted.mkdir()
        subprocess.run(["truncate", "-s", "256M", str(image)], check=True)
        steps = [["mkfs.btrfs", "-q", str(image)], ["mount", "-o", "loop", str(image), str(mounted)],
                 ["btrfs", "quota", "enable", str(mounted)], ["btrfs", "subvolume", "create", str(mounted / "home")],
                 ["btrfs", "qgroup", "limit", limit, str(mounted / "home")]]  # fmt: skip
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(
                    f"cannot make a btrfs disk with a quota (needs root and btrfs-progs): {done.stderr.strip()}"
                )
        return mounted / "home"

    yield make
    subprocess.run(["umount", "-l", str(mounted)], capture_output=True)


@pytest.fixture
def user_data(tmp_path) -> str:
    """The signals, written as a user would: plain h5py, on the big disk."""
    path = tmp_path / "signals.h5"
    with h5py.File(path, "w") as file:
        file["X"] = np.random.default_rng(0).standard_normal((ROWS, FEATURES))
    return f"{path}:/X"


def dictlearn(ranks: int, *options: str, timeout: float = 150) -> Job:
    return run_cli(ranks, "dictlearn", *SETTINGS, *options, timeout=timeout)


def outputs(directory: Path) -> list[Path]:
    """The files a job left in ``directory``, but its telemetry log (which records the failure: it stays)."""
    return [p for p in sorted(directory.iterdir()) if not p.name.endswith(".telemetry.jsonl")]


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in outputs(directory) if p.is_file()}


def one_message(job: Job, status: int, *fragments: str, command: str = "dictlearn") -> str:
    """The job's error output holds exactly one report, with ``fragments``, and no traceback."""
    assert job.returncode == status, f"exit status {job.returncode}\n{job.output[-6000:]}"
    errors = job.stderr
    assert "Traceback" not in errors and "MPI_ABORT" not in errors, errors[-6000:]
    assert errors.count(f"mpiscale {command}:") == 1, errors[-6000:]
    for fragment in fragments:
        assert fragment in errors, f"{fragment!r} not in:\n{errors[-6000:]}"
    return errors


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_full_disk_at_a_checkpoint_ends_the_job_cleanly(disks, user_data, ranks):
    """Checkpoints bigger than the free space: one message naming the space needed, exit 1, no hang, no debris."""
    small = disks("small", "size=1m")
    started = time.monotonic()
    job = dictlearn(ranks, "--data", user_data, "--iterations", "40", "--checkpoint-every", "10",
                    "--out", str(small / "r.h5"))  # fmt: skip
    one_message(job, 1, "level 3 needs", "MiB free", "No space left on device", str(small / "r.checkpoints"))
    assert time.monotonic() - started < 120
    leftovers = [p.name for p in small.rglob("*") if p.suffix == ".tmp" or p.name.endswith(".lock") or p.name == "lock"]
    assert not leftovers, leftovers


def test_a_quota_too_small_for_a_checkpoint_is_said_before_the_save(quota, user_data):
    """The disk has room, the user's quota not: the save is refused before it begins, its level named, the quota
    said, exit 1. Before, free space was all that was asked, and the collective save met the quota midway."""
    home = quota("1M")
    job = dictlearn(2, "--data", user_data, "--iterations", "40", "--checkpoint-every", "10",
                    "--out", str(home / "r.h5"))  # fmt: skip
    one_message(job, 1, "checkpoint step 10", "level 3 needs", f"in {home / 'r.checkpoints'}", "Disk quota exceeded",
                "your quota is full, it seems")  # fmt: skip
    leftovers = [p.name for p in home.rglob("*") if p.suffix == ".tmp" or p.name.endswith(".lock") or p.name == "lock"]
    assert not leftovers, leftovers


def test_a_file_past_the_quota_is_refused_before_its_first_row(quota):
    """A RowWriter whose file does not fit the quota (one process, a data set of 8 MiB): refused as it is made, the
    quota said, nothing left; before, HDF5 met the quota in the write, and its error said only "file write failed"."""
    home = quota("2M")
    program = ("import sys, numpy as np; from mpiscale.io import write_dataset; "
               "write_dataset(sys.argv[1], {'x': np.ones(1 << 20)})")  # fmt: skip
    done = run_python(program, home / "x.h5")
    assert done.returncode != 0 and "Traceback" in done.stderr, done.stderr[-3000:]  # (the WriteError, uncaught)
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("mpiscale.io.errors.WriteError: ") and "the file needs 9.4 MiB in" in said, said
    assert "refused to set it aside (Disk quota exceeded): your quota is full, it seems" in said, said
    assert not list(home.iterdir()), list(home.iterdir())


@pytest.mark.parametrize("kind", ["shard", "catalogue"])
def test_a_file_one_process_writes_past_its_quota_is_refused_and_the_process_lives(quota, kind):
    """A level-1 checkpoint shard, or circuits added to a catalogue, too large for the quota with no check before
    (one that filled since, or a file system that cannot set room aside): the system's error, the process goes on,
    the first file whole, nothing else left. Before, HDF5 met the quota inside the write, raised from the close,
    and the process crashed at its end (SIGSEGV), its temporary file left."""
    home = quota("4M")
    program = Path(__file__).parent / "programs" / "past_quota.py"
    done = subprocess.run([sys.executable, str(program), kind, str(home)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "refused: [Errno 122] " in done.stdout and "Disk quota exceeded" in done.stdout, done.stdout
    if kind == "shard":  # the room is asked before the arrays are written
        assert " MiB, which the file system refused to set aside (Disk quota exceeded): your quota is full" in (
            done.stdout), done.stdout  # fmt: skip
    assert done.stdout.strip().endswith(f"left: {kind}.h5"), done.stdout


@pytest.mark.parametrize("made", ["shaped", "growing"])
def test_a_disk_another_job_fills_while_a_file_is_written_stops_that_jobs_write(disks, made):
    """A RowWriter's file (2 MiB, 2 ranks) has its room set aside as it is made, or as its data set grows: a disk
    another process fills before the rows come stops that process, and the rows are all written. Before, the room
    was asked and given back at once (and a growing data set's never asked), and the rows' write met the full disk,
    hours into a long job. (A btrfs quota does not hold room set aside: btrfs asks its quota again for a write into
    it; ext4's and XFS's quotas charge it once, when set aside.)"""
    small = disks("small", "size=4m")
    program = Path(__file__).parent / "programs" / "filled_meanwhile.py"
    command = [sys.executable, str(program), str(small / "x.h5"), str(small / "other.bin"), made]
    job = finish(launch(2, command), "fill", 60)
    assert job.returncode == 0, job.output[-6000:]
    assert "the other job's write: [Errno 28] No space left on device" in job.stdout, job.stdout
    assert "the rows are written and the file in place" in job.stdout, job.output[-6000:]
    assert sorted(path.name for path in small.iterdir()) == ["other.bin", "x.h5"]


def test_a_full_node_disk_under_the_memory_stores_log_ends_the_job_in_one_line_and_the_same_command_goes_on(
    disks, tmp_path
):
    """The memory store's write-ahead log on a node-local disk that fills: each rank whose log the disk refuses says
    so in one line naming it, status 1. Before, the OSError ended the job in a traceback (the runtime's report of an
    uncaught error). With room made, the same command runs to its end."""
    local = disks("local", "size=2m")
    command = ["memstore", "--records", "200000", "--iterations", "200", "--checkpoint-every", "50",
               "--checkpoint-dir", tmp_path / "checkpoints", "--local-dir", local, "--out", tmp_path / "store.h5",
               "--progress-every", "0"]  # fmt: skip
    job = run_cli(2, *command)
    said = [line for line in job.stderr.splitlines() if line.startswith("mpiscale")]
    assert job.returncode == 1 and "Traceback" not in job.stderr and said, job.output[-6000:]
    assert all(f"the memory store's log {local}/" in line and "could not be written (No space left on device): the "
               "checkpoints and the commits logged before are intact" in line for line in said), said  # fmt: skip
    subprocess.run(["mount", "-o", "remount,size=64m", str(local)], check=True)  # the user makes room
    again = run_cli(2, *command)
    assert again.returncode == 0 and f"wrote {tmp_path / 'store.h5'}" in again.stdout, again.output[-6000:]


def test_a_full_disk_while_writing_the_planted_data_set(disks):
    """The synthetic data set does not fit: one message with the errno, exit 1, its temporary file removed."""
    small = disks("small", "size=256k")
    job = dictlearn(2, "--samples", "20000", "--features", "64", "--iterations", "5", "--out", str(small / "r.h5"))
    one_message(job, 1, "r.synthetic.h5", "No space left on device")
    assert not outputs(small), outputs(small)


def test_a_full_disk_for_the_results_keeps_the_dictionary_in_the_last_checkpoint(disks, tmp_path, user_data):
    """The results file does not fit: the message says where the learned dictionary is; --resume then writes it."""
    results = disks("results", "size=64k")
    command = ["--data", user_data, "--iterations", "30", "--checkpoint-every", "20",
               "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(results / "r.h5")]  # fmt: skip
    job = dictlearn(2, *command)
    one_message(job, 1, "could not write", "MiB)", "the checkpoint of iteration 30", "--resume")
    assert not outputs(results), outputs(results)  # no half-written results.h5.tmp
    subprocess.run(["mount", "-o", "remount,size=16m", str(results)], check=True)  # the user makes room
    resumed = dictlearn(2, *command, "--resume")
    assert resumed.returncode == 0, resumed.output[-6000:]
    assert "resumed from the checkpoint of iteration 30" in resumed.stdout
    with h5py.File(results / "r.h5", "r") as file:
        assert file.attrs["iterations"] == 30 and file["dictionary"].shape == (256, FEATURES)


def test_a_full_disk_for_the_memory_stores_results_ends_the_job_cleanly(disks):
    """The records file fits, the results (every iteration's top 1,000) do not: one message, exit 1 on every rank,
    no half-written results file left behind."""
    small = disks("small", "size=2m")
    job = run_cli(2, "memstore", "--records", "2000", "--iterations", "300", "--top", "1000", "--progress-every", "0",
                  "--out", small / "m.h5")  # fmt: skip
    one_message(job, 1, "could not write", str(small / "m.h5"), "No space left on device", command="memstore")
    assert [p.name for p in outputs(small)] == ["m.records.h5"]


def signals_and_atoms(folder: Path) -> list:
    """20,000 signals of 64 values (plain h5py) and 128 unit atoms (.npy): encode's command, whose codes (sparsity 8,
    1.3 MB of values) outgrow a 3 MiB disk in their last rounds (their second 1 MiB chunk of values)."""
    rng = np.random.default_rng(0)
    atoms = rng.standard_normal((128, 64))
    np.save(folder / "atoms.npy", atoms / np.linalg.norm(atoms, axis=1, keepdims=True))
    with h5py.File(folder / "signals.h5", "w") as file:
        file["X"] = rng.standard_normal((20000, 64))
    return ["encode", "--dictionary", folder / "atoms.npy", "--data", f"{folder / 'signals.h5'}:/X", "--sparsity", "8",
            "--batch-size", "500", "--progress-every", "0"]  # fmt: skip


def large_adapters(folder: Path) -> list:
    """6 planted adapters of 12 layer groups of 2048 x 2048: compress-adapters' command, whose file (1.3 MB) outgrows
    a 1152 KiB disk in its last group."""
    modules = tuple(f"base_model.model.model.layers.{i}.self_attn.{p}_proj" for i in range(6) for p in "qv")
    write_planted(folder / "adapters", 6, 4, inputs=2048, outputs=2048, modules=modules)
    return ["compress-adapters", "--adapters", folder / "adapters", "--components", "6", "--method", "randomized"]


def same_codes(got: Path, expected: Path) -> None:
    codes, whole = load_codes(str(got)), load_codes(str(expected))
    assert np.array_equal(codes.indptr, whole.indptr) and np.array_equal(codes.indices, whole.indices)
    assert np.abs(codes.data - whole.data).max() < 1e-12


def same_compression(got: Path, expected: Path) -> None:
    with h5py.File(got, "r") as file, h5py.File(expected, "r") as whole:
        np.testing.assert_allclose(file["adapters/error"][()], whole["adapters/error"][()], rtol=1e-4, atol=1e-8)
        for group in whole["groups"]:
            for side in "AB":
                name = f"groups/{group}/{side}/explained"
                np.testing.assert_allclose(file[name][()], whole[name][()], rtol=1e-6)


@pytest.mark.parametrize(
    "inputs, disk, mark, unit, same",
    [(signals_and_atoms, "3m", "rows_done", "signals were coded", same_codes),
     (large_adapters, "1152k", "groups_done", "layer groups were done", same_compression)],
    ids=["encode", "compress-adapters"],
)  # fmt: skip
def test_a_full_disk_mid_run_ends_the_job_keeping_what_was_marked_for_resume(disks, tmp_path, inputs, disk, mark,
                                                                               unit, same):  # fmt: skip
    """The output outgrows its disk in its last steps: the job ends with status 1 saying the disk is full, and
    OUT.tmp keeps the steps marked done. Before: encode's two ranks spun for good, one in HDF5's allocation of a
    chunk, which had failed on the other, and that one in the agreement on it; compress-adapters, where every rank
    saw its write fail, removed OUT.tmp and the groups done with it. The user makes room, and --resume ends as one
    uninterrupted run."""
    common = inputs(tmp_path)
    small = disks("out", f"size={disk}")
    out, kept = small / "c.h5", small / "c.h5.tmp"
    started = time.monotonic()
    job = run_cli(2, *common, "--out", out, env={"MPISCALE_COLLECTIVE_CHECK_S": "5"}, timeout=60)
    assert job.returncode == 1 and time.monotonic() - started < 45, job.output[-3000:]
    assert "No space left on device" in job.stderr and f"kept in {kept}" in job.stderr, job.stderr[-3000:]
    assert "Traceback" not in job.stderr and "Segmentation" not in job.output, job.output[-3000:]
    assert kept.exists() and not out.exists(), job.output[-3000:]
    with h5py.File(kept, "r") as file:
        done = int(file.attrs[mark])
    assert done > 0, done
    subprocess.run(["mount", "-o", "remount,size=16m", str(small)], check=True)  # the user makes room
    resumed = run_cli(1, *common, "--out", out, "--resume")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"resumed from {kept}: {done:,} of " in resumed.stdout and unit in resumed.stdout, resumed.stdout
    whole = run_cli(1, *common, "--out", tmp_path / "whole.h5")
    assert whole.returncode == 0, whole.output[-3000:]
    same(out, tmp_path / "whole.h5")
    assert not kept.exists()


def test_a_read_only_checkpoint_directory_is_refused_before_any_work(disks, tmp_path, user_data):
    read_only = disks("ro", "ro", "size=1m")
    job = dictlearn(2, "--data", user_data, "--iterations", "20", "--checkpoint-every", "10",
                    "--checkpoint-dir", str(read_only / "ckpt"), "--out", str(tmp_path / "r.h5"))  # fmt: skip
    one_message(job, 2, "checkpoint directory", "read-only")
    assert not (tmp_path / "r.h5").exists()


def test_a_second_job_on_the_same_outputs_is_refused_and_the_first_is_untouched(tmp_path, user_data):
    out = tmp_path / "r.h5"
    options = ["--data", user_data, "--iterations", "4000", "--checkpoint-every", "500", "--out", str(out)]
    first = launch(2, [sys.executable, "-m", "mpiscale.cli", "dictlearn", *SETTINGS, *options])
    deadline = time.monotonic() + 60
    while not (tmp_path / "r.checkpoints" / "lock").exists():
        assert first.poll() is None and time.monotonic() < deadline, "the first job never took its locks"
        time.sleep(0.05)
    second = dictlearn(2, *options)
    one_message(second, 2, "is in use by another job", "pid ")
    done = finish(first, "the first job", 150)
    assert done.returncode == 0, done.output[-6000:]
    with h5py.File(out, "r") as file:
        assert file.attrs["iterations"] == 4000
    assert not (tmp_path / "r.h5.lock").exists() and not (tmp_path / "r.checkpoints" / "lock").exists()


def test_a_lock_left_by_a_dead_job_is_taken_over_with_a_warning(tmp_path, user_data):
    out = tmp_path / "r.h5"
    Path(f"{out}.lock").write_text('{"job": "1234", "host": "gone", "pid": 99999, "since": "2026-01-01T00:00:00"}')
    job = dictlearn(2, "--data", user_data, "--iterations", "20", "--out", str(out))
    assert job.returncode == 0, job.output[-6000:]
    assert "taking over the lock of a job that ended without releasing it (job 1234 on gone" in job.stderr
    assert out.exists() and not Path(f"{out}.lock").exists()


def test_resume_with_fewer_iterations_than_the_checkpoint_is_refused(tmp_path, user_data):
    options = ["--data", user_data, "--checkpoint-every", "10", "--out", str(tmp_path / "r.h5")]
    assert dictlearn(2, *options, "--iterations", "20").returncode == 0
    before = digests(tmp_path / "r.checkpoints")
    job = dictlearn(2, *options, "--iterations", "10", "--resume")
    one_message(job, 2, "at iteration 20, past --iterations 10", "give --iterations 20 or more")
    assert digests(tmp_path / "r.checkpoints") == before


@pytest.mark.parametrize("room", ["as it comes", "held"])
def test_the_checkpointer_from_python_refuses_a_save_that_cannot_fit(disks, room):
    """The same guarantee without the CLI: every rank raises CheckpointError, earlier checkpoints intact. ``held``:
    rank 0 holds the room it sets aside for a second; rank 1, looking at the free space meanwhile, saw it taken and
    refused step 1, which fits (once in a full run of the suite, 2026-12-08): now one rank judges a directory."""
    small = disks("small", "size=4m")
    program = Path(__file__).parent / "programs" / "checkpoint_full.py"
    held = ["held"] if room == "held" else []
    job = finish(launch(2, [sys.executable, str(program), str(small / "ckpt"), *held]), "checkpoint_full", 120)
    assert job.returncode == 0, job.output[-6000:]
    assert job.stdout.count("refused:") == 2 and "level 3 needs" in job.stdout, job.output[-6000:]
    assert "restored step 1 intact" in job.stdout
    assert os.listdir(small / "ckpt") and not [p for p in (small / "ckpt").iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_writer_from_python_that_fills_the_disk_ends_the_job_in_one_line(disks, ranks):
    """A data set grown past the disk ends the job, status 1, the full disk said once with what the file needs and
    the disk has, the temporary file removed. Before, the writer closed the file HDF5 could not write, and HDF5
    crashed there (SIGSEGV), the file left behind; then the rows' write failed, "file write failed" in HDF5's words."""
    small = disks("small", "size=3m")
    program = Path(__file__).parent / "programs" / "rows_full.py"
    job = finish(launch(ranks, [sys.executable, str(program), str(small / "x.h5")]), "rows_full", 60)
    assert job.returncode == 1, job.output[-6000:]
    said = [line for line in job.stderr.splitlines() if line.startswith("mpiscale")]
    assert len(said) == 1 and "RoomRefused: [Errno 28] " in said[0], job.stderr[-6000:]
    assert "x.h5.tmp needs 4.1 MiB, which the file system refused to set aside (No space left on device): the disk " \
        "is full, it seems (" in said[0] and said[0].endswith(" MiB free); free space or give another directory"), (
        said[0])  # fmt: skip
    assert "Segmentation" not in job.output and not os.listdir(small), (job.output[-3000:], os.listdir(small))


def test_a_data_set_grown_past_the_file_size_limit_on_a_disk_with_room_is_refused_naming_it(tmp_path):
    """The grown rows' room is set aside as they are grown: past the limit (``ulimit -f``), the grow is refused in
    one line naming it and the sizes. Before, HDF5 said only "file write failed" at the rows' write."""
    program = Path(__file__).parent / "programs" / "rows_full.py"
    job = finish(launch(2, [sys.executable, str(program), str(tmp_path / "x.h5"), str(3 << 20)]), "rows_full", 60)
    assert job.returncode == 1, job.output[-6000:]
    said = [line for line in job.stderr.splitlines() if line.startswith("mpiscale")]
    assert len(said) == 1 and "RoomRefused: [Errno 27] File too large: " in said[0], job.stderr[-6000:]
    assert "x.h5.tmp would need 4.1 MiB, and this process may write files of at most 3.0 MiB (its file size limit, " \
           "ulimit -f)" in said[0], said[0]  # fmt: skip
    assert not os.listdir(tmp_path), os.listdir(tmp_path)


def test_a_one_process_data_set_grown_past_the_file_size_limit_ends_it_in_one_line(tmp_path):
    """A growing data set of a RowWriter without a communicator (HDF5's sec2 driver), past the limit: refused as it
    grows, in one line, nothing left. Before, HDF5 met the limit in the rows' write, and h5py's error held HDF5's
    record of the call on two lines ("time = ...", "buf = 0x...": see test_write_failure_note for that error)."""
    program = ("import resource, sys, numpy as np; from mpi4py import MPI; from mpiscale.io import RowWriter; "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY)); "
               "writer = RowWriter(sys.argv[1], {'x': ((0, 1024), np.float64)}, growing=('x',)); "
               "[(writer.grow({'x': 64 * step}), writer.write(64 * (step - 1), {'x': np.ones((64, 1024))})) "
               "for step in range(1, 100)]")  # fmt: skip
    done = run_python(program, tmp_path / "x.h5")
    said = [line for line in done.stderr.splitlines() if line.startswith("mpiscale")]
    assert done.returncode != 0 and len(said) == 1, done.stderr[-3000:]
    assert "RoomRefused: [Errno 27] File too large: " in said[0] and "x.h5.tmp would need 1.1 MiB, and this process " \
        "may write files of at most 1.0 MiB (its file size limit, ulimit -f)" in said[0], said[0]  # fmt: skip
    assert done.returncode == 1 and "buf = " not in done.stderr, done.stderr[-3000:]
    assert not os.listdir(tmp_path), os.listdir(tmp_path)


@pytest.mark.parametrize("phase", ["restore", "step", "finish"])
def test_a_file_a_job_cannot_make_ends_it_in_one_line_in_any_phase(disks, phase):
    """A job of a user's own under run_lifecycle, no handler of its own: a file too large for the disk, made in its
    restore, a step or its finish (``WriteError`` on every rank), ends it with status 1 and one line naming the full
    disk, its lock released and an output already open kept for --resume (said once: the program's end, which
    closes it, said it too). Before, each of the project's jobs caught
    the error itself (15 handlers), and one made outside them ended the job in a traceback from every rank."""
    small = disks("small", "size=4m")
    out = small / "rows.h5"
    program = Path(__file__).parent / "programs" / "job_full.py"
    job = finish(launch(2, [sys.executable, str(program), str(out), phase]), f"job_full {phase}", 60)
    assert job.returncode == 1 and "Traceback" not in job.output, job.output[-6000:]
    said = [line for line in job.stderr.splitlines() if line.startswith("mpiscale")]
    failed = [line for line in said if line.startswith(f"mpiscale rows: writing {out}.{phase}.h5 failed: ")]
    assert len(failed) == 1 and "No space left on device" in failed[0], job.stderr[-6000:]
    left = sorted(path.name for path in small.iterdir())
    if phase == "restore":  # before the output was opened: nothing to keep
        assert said == failed and left == [], (said, left)
    else:
        kept = f"mpiscale rows: the rows written so far are kept in {out}.tmp; run the same command with --resume to "
        kept += "finish"
        assert sorted(said) == sorted([*failed, kept]) and left == ["rows.h5.tmp"], (said, left)  # (and no more)


@pytest.mark.parametrize(("ranks", "victim"), [(2, 0), (4, 3)])
def test_a_quota_hit_by_one_rank_inside_collective_io_ends_the_job(tmp_path, ranks, victim):
    """The other ranks would wait in MPI-IO forever: the save's deadline ends the job, step 1 stays loadable."""
    from mpi4py import MPI

    from mpiscale.io import Checkpointer

    program = Path(__file__).parent / "programs" / "checkpoint_quota.py"
    started = time.monotonic()
    job = finish(launch(ranks, [sys.executable, str(program), str(tmp_path / "ckpt"), str(victim)]), "quota", 120)
    assert job.returncode != 0 and time.monotonic() - started < 90, job.output[-6000:]
    assert "did not finish within its 10 s" in job.stderr and "File too large" in job.stderr, job.stderr[-6000:]
    assert "saved past the quota" not in job.stdout
    holder = json.loads((tmp_path / "ckpt" / "lock").read_text())["pid"]
    deadline = time.monotonic() + 30
    while Path(f"/proc/{holder}").exists():  # MPI_Abort has killed rank 0; the kernel may still be reaping it
        assert time.monotonic() < deadline, f"rank 0 (pid {holder}) outlived the aborted job by 30 s"
        time.sleep(0.1)
    with Checkpointer(tmp_path / "ckpt", MPI.COMM_SELF, background=False) as checkpoints:
        restored = checkpoints.load()
    assert restored.step == 1 and (restored.sharded["x"] == np.repeat(np.arange(ranks), 100)[:, None]).all()
    assert not list((tmp_path / "ckpt").glob("*.tmp")), "a dead job's temporary files are cleared on the next open"
