"""What a failed write says: io.space.write_failure_note, added to HDF5's "file write failed", which never says why;
a results file or an append the system refused (io.write_file, one process's) and a checkpoint shard past the file
size limit: the system's error, nothing left behind, the process alive."""

import errno
import os
import resource

import h5py
import numpy as np
import pytest
from helpers import run_python

from mpiscale.io import WriteError, write_dataset, write_file
from mpiscale.io.checkpoint.files import read_shard, write_shard
from mpiscale.io.space import write_failure_note

FAILED = "Unable to set dataset extent (file write failed)"


@pytest.fixture
def file_size_limit():
    """set(bytes): this process's soft file size limit (``ulimit -f``) for the test, restored afterwards."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)

    def set_limit(limit: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))

    yield set_limit
    resource.setrlimit(resource.RLIMIT_FSIZE, before)


def test_a_failed_write_on_a_disk_with_room_names_a_quota_and_how_to_see_it(tmp_path, file_size_limit):
    file_size_limit(resource.RLIM_INFINITY)
    note = write_failure_note(tmp_path, FAILED)
    assert (
        note.startswith(f" ({tmp_path} has ") and " GiB free, so a quota is full, it seems, or the disk failed" in note
    )
    assert note.endswith(f"`quota -s`, or `lfs quota -h -u $USER {tmp_path}` on Lustre, shows your quotas)"), note


def test_a_failed_write_under_a_file_size_limit_names_the_limit(tmp_path, file_size_limit):
    file_size_limit(1 << 40)  # (finite, and far from anything this process writes meanwhile)
    assert write_failure_note(tmp_path, FAILED) == (
        f" ({tmp_path} has room, but this process may write files of at most 1048576.0 MiB: its file size limit, "
        "ulimit -f, stopped the write, it seems)"
    )


def test_an_error_that_is_no_failed_write_gets_nothing_on_a_disk_with_room(tmp_path):
    assert write_failure_note(tmp_path, "Unable to create dataset (name already exists)") == ""
    assert write_failure_note(tmp_path / "gone", FAILED) == ""  # (its directory cannot be asked: nothing to add)


def test_hdf5s_record_of_a_refused_write_comes_back_as_the_systems_reason(tmp_path):
    """h5py's error for a write the system refused (the sec2 driver: a file on a file system that cannot set room
    aside, where HDF5 meets a quota itself) holds HDF5's whole record of the call on two lines (time, descriptor,
    buffer address, "bytes actually written = 18446744073709551615"); what a job says is the system's reason. A
    process of its own: HDF5 crashes at the end of a process whose file it could not write."""
    program = ("import os, resource, sys, numpy as np, h5py; from mpiscale.io.errors import plain_write_error\n"
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
               "file = h5py.File(sys.argv[1], 'w')\n"
               "try:\n    file.create_dataset('x', data=np.ones((256, 1024)))\n    file.flush()\n"
               "except OSError as error:\n    print(repr(str(error)))\n"
               "    print(plain_write_error(error), flush=True)\n"
               "os._exit(0)")  # fmt: skip
    done = run_python(program, tmp_path / "x.h5")
    record, plain = done.stdout.splitlines()
    assert "file write failed: time = " in record and "buf = 0x" in record, done.stdout
    assert plain == "[Errno 27] File too large (HDF5: Can't write data, file write failed)", done.stdout


def test_a_results_file_past_the_file_size_limit_is_the_systems_error_and_leaves_nothing(tmp_path, file_size_limit):
    """h5py's error held HDF5's whole record of the call on two lines ("time = ...", "buf = 0x...", "bytes actually
    written = 18446744073709551615"); closing the file then raised a RuntimeError in its place, and the process
    crashed (SIGSEGV) at its end, in HDF5's close of that file. The file is made in memory now: this test's process
    would not outlive it otherwise."""
    out = tmp_path / "results.h5"
    file_size_limit(1 << 20)
    with pytest.raises(OSError) as raised:
        write_file(out, lambda file: file.create_dataset("x", data=np.ones(1 << 18)))
    file_size_limit(resource.RLIM_INFINITY)
    assert raised.value.errno == errno.EFBIG and str(raised.value) == "[Errno 27] File too large", raised.value
    assert os.listdir(tmp_path) == []  # (its temporary file removed)
    with pytest.raises(ZeroDivisionError):  # the caller's own error: nothing reached the disk
        write_file(out, lambda file: file.create_dataset("x", data=np.ones(8)) and 1 / 0)
    assert os.listdir(tmp_path) == []
    write_file(out, lambda file: file.create_dataset("x", data=np.arange(1 << 18)))
    with h5py.File(out, "r") as file:  # (a file of the disk, as any reader opens it)
        assert file.driver == "sec2" and file["x"][-1] == (1 << 18) - 1


def test_a_shard_past_the_file_size_limit_is_refused_before_its_arrays_and_leaves_nothing(tmp_path, file_size_limit):
    """A level-1 shard is written by HDF5 on the disk (too large to be made in memory): its room is set aside as the
    file is made, and a file past the limit is refused there, naming it. Before, HDF5's refused write crashed the
    process at its end. The room a written shard left unused is given back."""
    path = tmp_path / "shard.h5"
    file_size_limit(1 << 20)
    with pytest.raises(OSError) as raised:
        write_shard(path, 1, 0, 1, {"x": np.ones(1 << 18)})
    file_size_limit(resource.RLIM_INFINITY)
    assert raised.value.errno == errno.EFBIG, raised.value
    assert "this process may write files of at most 1.0 MiB (its file size limit, ulimit -f)" in str(raised.value)
    assert os.listdir(tmp_path) == []
    write_shard(path, 1, 0, 1, {"x": np.arange(1 << 18), "y": np.ones((3, 2))})
    assert (read_shard(str(path), ["x"])["x"] == np.arange(1 << 18)).all()
    written = os.stat(path)
    assert written.st_blocks * 512 < written.st_size + (64 << 10), written  # (not the room set aside)


def test_an_append_that_fails_leaves_the_file_it_started_from_as_it_was(tmp_path, file_size_limit):
    """write_file(..., start_from=): the new file begins as the old one's copy, in memory; a refused write of it
    leaves the old one alone, and what ``write`` returns comes back."""
    path = tmp_path / "grows.h5"
    write_file(path, lambda file: file.create_dataset("x", data=np.arange(10), maxshape=(None,)))
    before = path.read_bytes()

    def append(file: h5py.File, rows: int) -> int:
        file["x"].resize((10 + rows,))
        file["x"][10:] = 7
        return file["x"].shape[0]

    file_size_limit(1 << 20)
    with pytest.raises(OSError, match="File too large"):
        write_file(path, lambda file: append(file, 1 << 18), start_from=path)
    file_size_limit(resource.RLIM_INFINITY)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["grows.h5"]
    assert write_file(path, lambda file: append(file, 5), start_from=path) == 15
    with h5py.File(path, "r") as file:
        assert list(file["x"][()]) == [*range(10), *[7] * 5]


def test_a_data_set_past_the_file_size_limit_is_refused_before_its_first_row(tmp_path, file_size_limit):
    """A RowWriter's data sets made with their shape have their room set aside as the file is made: one past the
    limit is refused there, naming it, before any row is written (their write failed in HDF5)."""
    file_size_limit(1 << 20)
    with pytest.raises(WriteError) as raised:
        write_dataset(tmp_path / "x.h5", {"x": np.ones(1 << 18)})
    file_size_limit(resource.RLIM_INFINITY)
    assert "File too large: " in str(raised.value) and "would need 2.1 MiB, and this process may write files of " \
        "at most 1.0 MiB (its file size limit, ulimit -f)" in str(raised.value), raised.value  # fmt: skip
    assert os.listdir(tmp_path) == []
