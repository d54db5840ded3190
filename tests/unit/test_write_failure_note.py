"""io.space.write_failure_note: what a failed write's line adds to HDF5's "file write failed", which never says why."""

import resource

import pytest

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
