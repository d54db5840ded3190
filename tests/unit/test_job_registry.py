"""The job registry: every entry names what exists, and the command line, inspect and the docs follow it."""

from dataclasses import fields, is_dataclass
from importlib import import_module
from inspect import iscoroutinefunction

import h5py
import pytest
from helpers import REPO

from mpiscale.cli import main, parser
from mpiscale.jobs.registry import JOBS, job_of_results, jobs_table


@pytest.mark.parametrize("name", list(JOBS))
def test_each_entry_names_real_settings_an_entry_point_a_report_and_a_template(name):
    job = JOBS[name]
    settings = job.load("settings")
    assert is_dataclass(settings) and all("help" in field.metadata for field in fields(settings))
    assert iscoroutinefunction(job.load("entry"))
    assert (REPO / job.sbatch).is_file()
    assert job_of_results(job.results_format) is job
    if job.report is not None:
        report = import_module(job.report)
        assert callable(report.summarize) and callable(getattr(report, "plot", None)) == job.plots
    assert "out" in {field.name for field in fields(settings)}, "every job writes the file --out names"


def test_each_job_is_a_sub_command_with_its_settings_as_options():
    for name, job in JOBS.items():
        command = parser()
        for word in name.split():  # "circuits run": the sub-command run of circuits
            command = command._subparsers._group_actions[0].choices[word]  # type: ignore[union-attr]
        options = {action.dest for action in command._actions}
        assert {field.name for field in fields(job.load("settings"))} <= options
        assert command.description.startswith(job.description)


def test_the_guide_holds_the_registry_table():
    assert jobs_table() in (REPO / "docs" / "guide.md").read_text()


def test_inspect_refuses_a_file_of_no_job_and_a_plot_of_a_job_without_one(tmp_path, capsys):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as file:
        file.attrs["format"] = "someone.else/1"
    assert main(["inspect", str(other)]) == 2
    assert "is not a results file of dictlearn, train, memstore or compress-adapters" in capsys.readouterr().err
    store = tmp_path / "store.h5"
    with h5py.File(store, "w") as file:
        file.attrs["format"] = JOBS["memstore"].results_format
    assert main(["inspect", str(store), "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot draws dictlearn, train and compress-adapters results, not memstore's" in capsys.readouterr().err
