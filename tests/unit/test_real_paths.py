"""The real paths by which the ranks' file calls are told apart: each folder resolved once, the same answer as
``os.path.realpath`` for every way a user may name a file."""

import os

from mpiscale.io.same_calls import real_paths


def test_the_paths_resolved_by_folder_are_those_of_os_path_realpath(tmp_path, monkeypatch):
    """Links to folders and files (chained, relative, broken), dots, parents through a link, a folder that does not
    exist, a trailing slash, a bare name in the working folder."""
    data = tmp_path / "data"
    (data / "deep").mkdir(parents=True)
    (data / "a.h5").write_bytes(b"")
    (tmp_path / "scratch").symlink_to(data)  # a site's $SCRATCH link
    (tmp_path / "again").symlink_to("scratch")  # a link to a link, relative
    (data / "b.h5").symlink_to("a.h5")  # a file that is a link
    (data / "deep" / "up").symlink_to(data)  # a link whose parent is another folder than its name's
    (data / "gone.h5").symlink_to(tmp_path / "nowhere.h5")  # broken
    monkeypatch.chdir(data)
    given = [
        "a.h5", "./a.h5", "b.h5", "gone.h5", "deep/../a.h5", "deep/up/a.h5", "deep/up/../a.h5", "missing/x.h5",
        str(tmp_path / "scratch" / "a.h5"), str(tmp_path / "again" / "b.h5"), str(tmp_path / "again" / "deep" / "."),
        str(tmp_path / "again") + "/", ".", "..", str(tmp_path / "scratch" / "deep" / "up" / ".."),
    ]  # fmt: skip
    assert real_paths(given) == [os.path.realpath(each) for each in given]
    assert real_paths([data / "a.h5"]) == [str(data / "a.h5")]  # (path objects too)
