"""The job and command registries: every entry names what exists, and the command line, inspect and the docs
follow them."""

from dataclasses import fields, is_dataclass
from importlib import import_module
from inspect import iscoroutinefunction

import h5py
import pytest
from helpers import REPO

from mpiscale.cli import main, parser
from mpiscale.commands import COMMANDS, commands_table
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


def test_the_guide_and_the_readme_hold_the_registry_tables():
    assert jobs_table() in (REPO / "docs" / "guide.md").read_text()
    assert jobs_table(brief=True) in (REPO / "README.md").read_text()


def test_inspect_refuses_a_file_of_no_job_and_a_plot_of_a_job_without_one(tmp_path, capsys):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as file:
        file.attrs["format"] = "someone.else/1"
    assert main(["inspect", str(other)]) == 2
    assert ("is not a results file of dictlearn, encode, train, collect, memstore, compress-adapters or circuits run"
            in capsys.readouterr().err)  # fmt: skip
    store = tmp_path / "store.h5"
    with h5py.File(store, "w") as file:
        file.attrs["format"] = JOBS["memstore"].results_format
    assert main(["inspect", str(store), "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot draws dictlearn, train and compress-adapters results, not memstore's" in capsys.readouterr().err


def _parser_of(words):
    command = parser()
    for word in words:
        command = command._subparsers._group_actions[0].choices[word]  # type: ignore[union-attr]
    return command


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.name)
def test_every_command_has_a_real_handler_and_its_own_options(command):
    module, function = command.handler.split(":")
    assert callable(getattr(import_module(module), function))
    made = _parser_of(command.words)
    flags = {flag for action in made._actions for flag in action.option_strings}
    assert {
        flag for option in command.options + command.one_of for flag in option.flags if flag.startswith("-")
    } <= flags
    if command.name.startswith(
        "bench "
    ):  # each benchmark has its own options: --size-mib only where it means something
        assert ("--size-mib" in flags) == (command.name == "bench checkpoint")
        assert ("--samples" in flags) == (command.name == "bench random")


def test_help_lists_are_made_from_the_registry(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "a job of dictlearn, encode, train, collect, memstore, compress-adapters or circuits run" in shown
    with pytest.raises(SystemExit):
        main(["circuits", "--help"])
    assert "{run,add,search,similar}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0 and capsys.readouterr().out.startswith("mpiscale 0.")


def test_the_guide_holds_the_commands_table():
    assert commands_table() in (REPO / "docs" / "guide.md").read_text()


def test_doctor_names_a_jobs_missing_extra_and_requires_aiomqtt(monkeypatch):
    from mpiscale import doctor

    absent = {"safetensors", "aiomqtt"}
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda module: None if module in absent else real(module))
    text, status = doctor.report(doctor.checks())
    assert status == 1  # aiomqtt is required
    assert "[FAIL] aiomqtt" in text
    line = next(line for line in text.splitlines() if "mpiscale compress-adapters" in line)
    assert line.startswith("[warn]") and "missing safetensors" in line
    assert "pip install '.[adapters,torch]'" in text


@pytest.mark.parametrize("name", list(JOBS))
def test_a_seed_progress_interval_or_path_no_job_can_use_is_refused_where_settings_are_read(name, tmp_path):
    """A seed of -1 ended train and memstore with a traceback and MPI_Abort from deep in their random streams; a
    progress interval of NaN or -1 was taken; an empty results path (an unset variable in a job script) ended
    encode, collect and compress-adapters after all their work, when the output was renamed; an empty data or
    checkpoint path ran the job on its default (generated data, a memstore that is not durable) without a word."""
    from mpiscale.jobs import load_settings

    settings = JOBS[name].load("settings")
    known = {field.name for field in fields(settings)}
    cases = [("seed", -1), ("seed", 2**64), ("progress_every", float("nan")), ("progress_every", -1.0),
             ("out", ""), ("out", "  "), ("data", ""), ("checkpoint_dir", " "), ("local_dir", "")]  # fmt: skip
    for setting, value in [(setting, value) for setting, value in cases if setting in known]:
        with pytest.raises(ValueError, match=f"{setting} must be "):
            load_settings(settings, name, None, {setting: value})
        config = tmp_path / f"{setting}.toml"
        shown = f'"{value}"' if isinstance(value, str) else value if value == value else "nan"
        config.write_text(f"{setting} = {shown}\n")
        with pytest.raises(ValueError, match=f"config file {config}: {setting} must be "):
            load_settings(settings, name, str(config), {})
    if "seed" in known:
        assert load_settings(settings, name, None, {"seed": 2**64 - 1}).seed == 2**64 - 1


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (
            ["bench", "random", "--quick", "--json", "{tmp}/gone/r.json"],
            "the file's directory {tmp}/gone does not exist",
        ),
        (["bench", "random", "--quick", "--json", "{tmp}"], "the file {tmp} is a directory"),
        (["bench", "allreduce", "--quick", "--plot", "{tmp}/p.h5"], "matplotlib draws"),
        (["bench", "allreduce", "--quick", "--plot", "{tmp}/gone/p.png"], "the file's directory {tmp}/gone does not"),
    ],
)
def test_a_bench_refuses_a_record_or_plot_it_could_not_write_before_it_runs(words, said, tmp_path, capsys):
    """A bench ran to its end, then failed writing its JSON into a directory that is not there: the record was lost
    after minutes of work, with a traceback."""
    with pytest.raises(SystemExit) as refused:
        main([word.format(tmp=tmp_path) for word in words])
    assert refused.value.code == 2 and said.format(tmp=tmp_path) in capsys.readouterr().err


def test_an_empty_results_path_is_refused_where_outputs_are_claimed_too():
    """A job made in Python (its settings not read from the command line) is refused at its outputs' check."""
    from mpiscale.jobs.outputs import check_outputs

    for empty in ("", "   "):
        with pytest.raises(ValueError, match="the results file is named by an empty path: name a file"):
            check_outputs(empty, None)


@pytest.mark.parametrize("name", list(JOBS))
def test_a_count_written_as_a_whole_float_is_taken_and_a_fraction_refused(name, tmp_path, capsys):
    """``--samples 1e6`` (as scientists write counts) said "invalid int value: '1e6'", and a settings file's
    ``atoms = 8.0`` "must be int, got 8.0": every job's whole-number settings take them, on the command line, in a
    settings file and in a list (``hidden = [128.0, 64]``); 1.5, 1e400 and NaN stay refused."""
    from mpiscale.jobs import load_settings

    settings = JOBS[name].load("settings")
    defaults = settings()
    counts = [f.name for f in fields(settings) if type(getattr(defaults, f.name)) is int and f.name != "seed"]
    lists = [f.name for f in fields(settings) if type(getattr(defaults, f.name)) is tuple
             and getattr(defaults, f.name) and type(getattr(defaults, f.name)[0]) is int]  # fmt: skip
    if not counts and not lists:
        pytest.skip(f"{name} has no whole-number settings")
    command = parser()
    for setting in counts:
        flag = "--" + setting.replace("_", "-")
        args = command.parse_args([*JOBS[name].name.split(), flag, "2e1"])
        assert getattr(args, setting) == 20 and type(getattr(args, setting)) is int
        for wrong in ("1.5", "1e400", "nan"):
            with pytest.raises(SystemExit):
                command.parse_args([*JOBS[name].name.split(), flag, wrong])
            assert f"argument {flag}: invalid int value: '{wrong}'" in capsys.readouterr().err
        config = tmp_path / f"{setting}.toml"
        default = getattr(defaults, setting)  # (valid with the others' defaults), written as 5.000000e+00
        config.write_text(f"{setting} = {float(default):e}\n")
        taken = getattr(load_settings(settings, name, str(config), {}), setting)
        assert taken == default and type(taken) is int
        config.write_text(f"{setting} = 1.5\n")
        with pytest.raises(ValueError, match=f"{setting} must be int, got 1.5"):
            load_settings(settings, name, str(config), {})
    for setting in lists:
        config = tmp_path / f"{setting}.toml"
        config.write_text(f"{setting} = [128.0, 64]\n")
        assert getattr(load_settings(settings, name, str(config), {}), setting) == (128, 64)
        args = command.parse_args([*JOBS[name].name.split(), "--" + setting.replace("_", "-"), "1.28e2,64"])
        assert getattr(args, setting) == (128, 64)
