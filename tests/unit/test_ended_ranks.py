"""The count of a job's ranks on a host that decides when its last rank removes the marks of their ends."""

import os

import pytest

from mpiscale import ended_ranks


@pytest.mark.parametrize(
    "variables, expected",
    [
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4),
        ({"MPI_LOCALNRANKS": "3"}, 3),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, 1),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "1"}, 2),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "4"}, None),  # (no such node: never removed)
        ({"SLURM_STEP_TASKS_PER_NODE": "two", "SLURM_NODEID": "0"}, None),
        ({}, None),
    ],
)
def test_the_ranks_on_a_host_are_what_the_launcher_says_or_unknown(monkeypatch, variables, expected):
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    counted = ended_ranks._ranks_on_host()
    assert counted == expected if expected is not None else counted > 1 << 40


def test_slurm_counts_of_tasks_per_node_expand():
    assert ended_ranks.slurm_tasks_per_node("4") == [4]
    assert ended_ranks.slurm_tasks_per_node("2(x3),1,5(x2)") == [2, 2, 2, 1, 5, 5]


def test_one_pass_sweeps_earlier_jobs_old_marks_and_lists_the_jobs_own(tmp_path):
    """The end's one pass over the host's folder: another job's mark older than the keeping time goes, a young one
    stays, and this job's (however old) are listed and left; files of other kinds are not touched."""
    from mpiscale.host_markers import remove_old

    names = ["mpiscale-ended-old-0", "mpiscale-ended-young-0", "mpiscale-ended-mine-0", "mpiscale-ended-mine-1",
             "mpiscale-failure-old-0", "unrelated"]  # fmt: skip
    for name in names:
        (tmp_path / name).write_text("")
    for name in ("mpiscale-ended-old-0", "mpiscale-ended-mine-1", "mpiscale-failure-old-0", "unrelated"):
        os.utime(tmp_path / name, (1, 1))  # (1970)
    found = remove_old(str(tmp_path), "mpiscale-ended-", 600.0, "mpiscale-ended-mine-")
    assert sorted(found) == ["mpiscale-ended-mine-0", "mpiscale-ended-mine-1"]
    assert sorted(os.listdir(tmp_path)) == sorted(set(names) - {"mpiscale-ended-old-0"})
