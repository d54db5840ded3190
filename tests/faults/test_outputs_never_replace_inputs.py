"""A results file that is one of the job's inputs is refused before any work, whatever its spelling; so is one
that exists and is not an earlier run's results of the same job.

The inputs are written the way a user writes them (plain h5py, a list file),
and named again as ``--out`` directly, through a symlink, a ``./`` spelling, a
hard link, or as a file a list names. Every case must exit 2 with one message
and leave the input's bytes as they were.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import assert_ok, run_cli


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A user's training file and held-out file, a list file naming the first, and a model trained on it."""
    folder = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    for name, rows in (("train.h5", 400), ("held_out.h5", 100)):
        with h5py.File(folder / name, "w") as file:
            file["inputs"] = rng.normal(size=(rows, 12)).astype(np.float32)
            file["labels"] = rng.integers(0, 3, rows).astype(np.int32)
    (folder / "files.txt").write_text("train.h5\n")
    trained = run_cli(1, "train", "--data", folder / "train.h5", "--epochs", 1, "--hidden", 8, "--batch-size", 50,
                      "--progress-every", 0, "--out", folder / "model.h5")  # fmt: skip
    assert_ok(trained)
    return folder


def spelled(folder: Path, tmp_path: Path, target: str, how: str) -> Path:
    """``folder/target`` named as ``how`` says, in the test's own directory where a new name is needed."""
    original = folder / target
    if how == "same":
        return original
    if how == "dot":
        return Path(f"{folder}/./{target}")
    link = tmp_path / f"{how}-{target}"
    if how == "symlink":
        link.symlink_to(original)
    else:
        os.link(original, link)
    return link


CASES = {  # name: (job, its options with {folder}, the input --out names, how it is spelled)
    "train-data": ("train", ["--data", "{folder}/train.h5"], "train.h5", "same"),
    "train-data-symlink": ("train", ["--data", "{folder}/train.h5"], "train.h5", "symlink"),
    "train-validation-dot": (
        "train",
        ["--data", "{folder}/train.h5", "--validation", "{folder}/held_out.h5"],
        "held_out.h5",
        "dot",
    ),  # fmt: skip
    "dictlearn-data": (
        "dictlearn",
        ["--data", "{folder}/train.h5:/inputs", "--atoms", "4", "--sparsity", "2"],
        "train.h5",
        "same",
    ),  # fmt: skip
    "dictlearn-listed-file": (
        "dictlearn",
        ["--data", "{folder}/files.txt:/inputs", "--atoms", "4", "--sparsity", "2"],
        "train.h5",
        "hardlink",
    ),  # fmt: skip
    "collect-model": ("collect", ["--model", "{folder}/model.h5"], "model.h5", "same"),
    "collect-data-hardlink": (
        "collect",
        ["--model", "{folder}/model.h5", "--data", "{folder}/train.h5:/inputs"],
        "train.h5",
        "hardlink",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(inputs, tmp_path, case):
    job, options, target, how = CASES[case]
    out = spelled(inputs, tmp_path, target, how)
    before = {path.name: digest(path) for path in inputs.glob("*") if path.suffix in (".h5", ".txt")}
    refused = run_cli(2, job, *[option.format(folder=inputs) for option in options], "--out", out, timeout=60)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert f"mpiscale {job}: the results file {out} is an input of this job" in refused.stderr, refused.stderr
    assert "choose another --out" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    after = {name: digest(inputs / name) for name in before}  # a refused job's telemetry file may join them
    assert after == before
    assert not list(inputs.glob("*.lock")) and not list(tmp_path.glob("*.lock"))


EXISTING = {  # name: (job, its options with {folder}, --out with {folder}, the file refused, what it is said to be)
    "a users file": ("dictlearn", ["--atoms", "4"], "{folder}/held_out.h5", "held_out.h5",
                     "an HDF5 file from elsewhere (no mpiscale format)"),
    "another jobs results": ("dictlearn", ["--atoms", "4"], "{folder}/model.h5", "model.h5",
                             "the results of mpiscale train (mpiscale.train-results/1)"),
    "a text file": ("memstore", ["--records", "100"], "{folder}/files.txt", "files.txt", "not an HDF5 file"),
    "memstores records file": ("memstore", ["--records", "100"], "{folder}/held_out", "held_out.records.h5",
                               "an HDF5 file from elsewhere"),
    "dictlearns synthetic set": ("dictlearn", ["--atoms", "4"], "{folder}/fresh.h5", "fresh.synthetic.h5",
                                 "an HDF5 file from elsewhere"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EXISTING))
def test_an_existing_file_that_is_not_the_jobs_earlier_results_is_refused_and_kept(inputs, tmp_path, case):
    """Every job's --out (and memstore's records, dictlearn's planted set beside it) replaced whatever was there: a
    user's data, another job's results, a text file. Now only an earlier run's results of the same job are."""
    job, options, out, refused_file, said = EXISTING[case]
    folder = tmp_path / "files"
    folder.mkdir()
    for path in inputs.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    for name in ("held_out.records.h5", "fresh.synthetic.h5"):  # a user's files where the job writes beside --out
        (folder / name).write_bytes((inputs / "held_out.h5").read_bytes())
    before = {path.name: digest(path) for path in folder.iterdir()}
    refused = run_cli(2, job, *options, "--iterations", 2, "--progress-every", 0, "--out", out.format(folder=folder),
                      timeout=60)  # fmt: skip
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert f"{folder / refused_file} exists and is {said}" in refused.stderr, refused.stderr
    assert "name another file, or remove it first" in refused.stderr and "Traceback" not in refused.stderr
    assert {path.name: digest(path) for path in folder.iterdir() if path.name in before} == before
    assert not list(folder.glob("*.lock")) and not list(folder.glob("*.tmp"))


def test_a_rerun_replaces_its_own_earlier_results(inputs, tmp_path):
    out = tmp_path / "model.h5"
    out.write_bytes((inputs / "model.h5").read_bytes())  # train's results, of an earlier run
    rerun = run_cli(1, "train", "--data", inputs / "train.h5", "--epochs", 1, "--hidden", 8, "--batch-size", 50,
                    "--seed", 3, "--progress-every", 0, "--out", out)  # fmt: skip
    assert_ok(rerun)
    assert digest(out) != digest(inputs / "model.h5")
