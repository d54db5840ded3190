"""mpiscale train and collect under real mpirun, and the pipeline train -> collect -> dictlearn -> inspect.

Trained weights are compared with a one-rank run of the same job (data-parallel
training must follow one process on the whole batch), activations with the
model run in this process, and the feature catalogue with the digits' labels.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers import (
    REPO,
    SESSION_ENVIRONMENT,
    assert_ok,
    finish,
    flip_a_bit,
    gpu_ranks,
    launch,
    on_a_gpu,
    real_torch_gpu,
    run_mpi,
)

MPISCALE = [sys.executable, "-m", "mpiscale.cli"]


def mpiscale(ranks: int, *args: str, timeout: float = 120, env: dict | None = None):
    process = launch(ranks, [*MPISCALE, *map(str, args)], env=env)
    return finish(process, f"mpiscale {' '.join(map(str, args))} on {ranks} ranks", timeout)


def weights(path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as file:
        return {name: file["model"][name][()] for name in file["model"]}


def test_pipeline_train_collect_dictlearn_inspect(tmp_path):
    """examples/features_of_a_model.sh at 2 ranks: a digit classifier, its hidden layer, a dictionary, each atom's
    top inputs."""
    script = REPO / "examples" / "features_of_a_model.sh"
    process = subprocess.Popen(
        ["bash", str(script), str(tmp_path), "2"],
        env=SESSION_ENVIRONMENT | {"MPISCALE": " ".join(MPISCALE), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    job = finish(process, "examples/features_of_a_model.sh on 2 ranks", timeout=150)
    assert_ok(job)
    model, acts = tmp_path / "model.h5", tmp_path / "activations.h5"
    with h5py.File(model, "r") as file:
        assert file.attrs["format"] == "mpiscale.train-results/1" and file.attrs["world_size"] == 2
        assert file.attrs["device"] == "cpu"  # auto, on a machine without a GPU
        held_out = file["curves/epoch/validation_accuracy"][()]
        assert len(held_out) == 6 and held_out[-1] > 0.85, held_out  # ten classes: chance is 0.1
        assert len(file["curves/step/loss"]) == 6 * (1437 // 64)

    from mpiscale.train.results import load_trained

    net, _ = load_trained(str(model))
    with h5py.File(tmp_path / "model.digits.h5", "r") as file:
        inputs = file["inputs"][()]
    with torch.no_grad():
        expected = net[:3](torch.from_numpy(inputs)).numpy()  # standardize, hidden1, relu1
    with h5py.File(acts, "r") as file:
        assert file.attrs["format"] == "mpiscale.activations/1"
        np.testing.assert_array_equal(file["sample_ids"][()], np.arange(len(inputs)))
        np.testing.assert_allclose(file["relu1"][()], expected, rtol=1e-5, atol=1e-5)
        assert file.attrs["labels"].endswith("model.digits.h5:/labels")

    atoms = [line for line in job.stdout.splitlines() if line.startswith("atom ")]
    assert len(atoms) == 20, job.stdout
    # Hidden units of a digit classifier separate the classes: most atoms' strongest inputs share one label.
    pure = [line for line in atoms if "top labels" in line and " x5" in line.split("top labels")[1].split(":")[0]]
    assert len(pure) >= 10, job.stdout


def test_collect_in_small_rounds_writes_every_layer(tmp_path):
    """Rounds of 100 rows a rank on 3 ranks (the last round's 237 rows split unevenly), two layers: the model's
    outputs, in order; then rounds that leave one rank a round with no rows."""
    model, acts = tmp_path / "model.h5", tmp_path / "acts.h5"
    assert_ok(mpiscale(1, "train", "--epochs", 1, "--hidden", "24,12", "--out", model, "--progress-every", 0))
    job = mpiscale(3, "collect", "--model", model, "--out", acts, "--batch-size", 100, "--layers", "hidden2,relu1")
    assert_ok(job)
    from mpiscale.train.results import load_trained

    net, _ = load_trained(str(model))
    with h5py.File(tmp_path / "model.digits.h5", "r") as file:
        inputs = torch.from_numpy(file["inputs"][()])
    with torch.no_grad(), h5py.File(acts, "r") as file:
        np.testing.assert_allclose(file["relu1"][()], net[:3](inputs).numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(file["hidden2"][()], net[:4](inputs).numpy(), rtol=1e-5, atol=1e-5)
        assert file["hidden2"].shape == (1437, 12)
        assert file.attrs["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")  # --device auto
    # 1,437 rows on 2 ranks in rounds of 718 rows a rank: the second round's one row leaves rank 1 none (a round with
    # no rows ended that rank alone while rank 0 waited in the collective write, forever)
    uneven = tmp_path / "uneven.h5"
    assert_ok(mpiscale(2, "collect", "--model", model, "--out", uneven, "--batch-size", 718, "--layers", "relu1",
                       timeout=60))  # fmt: skip
    with h5py.File(uneven, "r") as file, h5py.File(acts, "r") as reference:
        np.testing.assert_allclose(file["relu1"][()], reference["relu1"][()], rtol=1e-5, atol=1e-5)


#: Three gradient buckets of the 48-wide model (3,610 parameters): the output layer, the hidden biases, its weights.
FOLLOWED = ["--epochs", 2, "--batch-size", 60, "--hidden", "48", "--progress-every", 0, "--bucket-mib", 0.0001,
            "--first-bucket-mib", 0.001]  # fmt: skip


@pytest.fixture(scope="module")
def one_process_model(tmp_path_factory) -> Path:
    """A model of the settings ``FOLLOWED`` trained on one rank, on the CPU (once for every test that only reads it;
    the GPU tests' reference, which auto would train on the GPU)."""
    one = tmp_path_factory.mktemp("one") / "one.h5"
    assert_ok(mpiscale(1, "train", *FOLLOWED, "--device", "cpu", "--out", one))
    return one


@pytest.mark.parametrize("ranks, per_node", [(2, 0), (4, 2)], ids=["2ranks", "4ranks-2nodes"])  # 3: resume, collect
def test_training_follows_one_process(tmp_path, ranks, per_node, one_process_model):
    """Weights after 2 epochs on N ranks (flat or on 2 simulated nodes) equal the one-rank run's within rounding."""
    many = tmp_path / "many.h5"
    env = {"MPISCALE_RANKS_PER_NODE": str(per_node)} if per_node else None
    assert_ok(mpiscale(ranks, "train", *FOLLOWED, "--out", many, env=env))
    reference, result = weights(one_process_model), weights(many)
    assert reference.keys() == result.keys()
    for name in reference:
        np.testing.assert_allclose(result[name], reference[name], rtol=1e-4, atol=1e-5, err_msg=name)
    moved = max(np.abs(reference[k]).max() for k in reference if "hidden" in k)
    assert moved > 0


@pytest.mark.parametrize("ranks, per_node", [(2, 0), (4, 2)], ids=["2ranks", "4ranks-2nodes"])
def test_intra_node_sums_by_torch_follow_one_process(tmp_path, ranks, per_node, one_process_model):
    """--intra-node gloo (the CPU's stand-in for NCCL): gloo inside each node, MPI between the nodes' first ranks;
    the weights of the one-rank run within rounding, on one node and on 2 simulated nodes of 2."""
    out = tmp_path / "gloo.h5"
    env = {"MPISCALE_RANKS_PER_NODE": str(per_node)} if per_node else None
    assert_ok(mpiscale(ranks, "train", *FOLLOWED, "--device", "cpu", "--intra-node", "gloo", "--out", out, env=env))
    reference, result = weights(one_process_model), weights(out)
    for name in reference:
        np.testing.assert_allclose(result[name], reference[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_intra_node_sums_refuse_what_they_cannot_sum(tmp_path):
    """NCCL for host buffers, and compression with either: one line, status 2, nothing written."""
    job = mpiscale(2, "train", *FOLLOWED, "--device", "cpu", "--intra-node", "nccl", "--out", tmp_path / "m.h5")
    assert job.returncode == 2 and job.stderr.count("\n") == 1, job.output[-3000:]
    assert "--intra-node nccl sums buffers in GPU memory, and ranks run on cpu: use --device cuda" in job.stderr
    job = mpiscale(2, "train", *FOLLOWED, "--intra-node", "gloo", "--compression", "fp16", "--out", tmp_path / "m.h5")
    assert job.returncode == 2 and "intra_node nccl or gloo sums float32 gradients" in job.stderr, job.stderr
    assert not (tmp_path / "m.h5").exists()


def test_resume_on_another_world_size(tmp_path, one_process_model):
    """Train 1 epoch on 2 ranks with checkpoints, then resume to 2 epochs on 3: the same as 2 epochs on one rank.

    The last checkpoint is taken at the last step of epoch 1, before that epoch is scored on the held-out data:
    the resumed run scores it first."""
    with h5py.File(one_process_model, "r") as reference_file:
        per_epoch = len(reference_file["curves/step/loss"]) // 2
        reference_accuracy = reference_file["curves/epoch/validation_accuracy"][()]
    resumed = tmp_path / "resumed.h5"
    first = mpiscale(2, "train", *FOLLOWED, "--epochs", 1, "--out", resumed, "--checkpoint-every", per_epoch)
    assert_ok(first)
    again = mpiscale(3, "train", *FOLLOWED, "--out", resumed, "--checkpoint-every", per_epoch, "--resume")
    assert_ok(again)
    assert f"resumed from the checkpoint of step {per_epoch}" in again.stdout
    reference, result = weights(one_process_model), weights(resumed)
    for name in reference:
        np.testing.assert_allclose(result[name], reference[name], rtol=1e-4, atol=1e-5, err_msg=name)
    with h5py.File(resumed, "r") as file:
        assert len(file["curves/step/loss"]) == 2 * per_epoch and list(file["curves/epoch/epoch"]) == [1, 2]
        np.testing.assert_allclose(file["curves/epoch/validation_accuracy"][()], reference_accuracy, atol=0.02)

    refused = mpiscale(1, "train", *FOLLOWED, "--out", resumed, "--checkpoint-every", 10)
    assert refused.returncode == 2 and "pass --resume" in refused.stderr


def as_older_checkpoint(directory: Path, older: Path) -> int:
    """The newest checkpoint of ``directory`` rewritten in ``older`` as versions before the state protocol saved it:
    the settings under "job", the optimizer's settings in the metadata rather than among the arrays."""
    from mpi4py import MPI

    from mpiscale.io import Checkpointer

    with Checkpointer(directory, MPI.COMM_SELF) as today:
        restored = today.load()
    arrays = dict(restored.replicated)
    optimizer = json.loads(arrays.pop("optimizer.settings").tobytes())
    meta = {"job": restored.meta["settings"], "optimizer": optimizer}
    with Checkpointer(older, MPI.COMM_SELF) as then:
        then.save(restored.step, replicated=arrays, meta=meta)
    return restored.step


def test_a_checkpoint_of_an_older_version_resumes_to_the_same_bits(tmp_path):
    """A training checkpoint as older versions wrote it resumes to the very weights today's resumes to (one rank: the
    format is under test, not the world size)."""
    common = ["--hidden", "16", "--progress-every", 0, "--checkpoint-every", 9]
    first = tmp_path / "first.h5"
    assert_ok(mpiscale(1, "train", *common, "--epochs", 1, "--out", first))
    step = as_older_checkpoint(tmp_path / "first.checkpoints", tmp_path / "older")
    runs = {}
    for name, directory in [("today", tmp_path / "first.checkpoints"), ("older", tmp_path / "older")]:
        out = tmp_path / f"{name}.h5"
        job = mpiscale(1, "train", *common, "--epochs", 2, "--out", out, "--checkpoint-dir", directory, "--resume")
        assert_ok(job)
        assert f"resumed from the checkpoint of step {step}" in job.stdout, job.stdout
        runs[name] = weights(out)
    for name, values in runs["today"].items():
        np.testing.assert_array_equal(runs["older"][name], values, err_msg=name)


def user_file(path, inputs, labels) -> str:
    """A training file as a user writes it with plain h5py: uint8 images and int32 labels, chunked and compressed."""
    with h5py.File(path, "w") as file:
        file.create_dataset("images", data=inputs, chunks=True, compression="gzip")
        file.create_dataset("target", data=labels)
    return str(path)


def test_a_matlab_file_trains_with_samples_as_its_columns_and_a_label_column_is_refused_with_the_fix(tmp_path):
    """MATLAB's save -v7.3 writes HDF5 with every array transposed. Inputs kept as MATLAB's columns (5 x 600) and
    labels as a row (1 x 600) are HDF5's 600 rows: they train, and rank 0 says how the inputs were read. Labels kept
    as a column (600 x 1, MATLAB's habit) are HDF5's 1 x 600: refused saying to save them as a row. collect says the
    same of MATLAB inputs, and adds it to its refusal of samples kept as MATLAB's rows (5 x 600 in HDF5)."""
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((600, 5))
    labels = (inputs[:, 0] > 0).astype(np.float64)

    def matlab_file(path, column: bool) -> str:  # (each array as HDF5 holds MATLAB's: transposed)
        with h5py.File(path, "w", userblock_size=512) as file:
            file.create_dataset("inputs", data=inputs).attrs["MATLAB_class"] = np.bytes_("double")
            held = labels.reshape(1, -1) if column else labels.reshape(-1, 1)
            file.create_dataset("labels", data=held).attrs["MATLAB_class"] = np.bytes_("double")
        return str(path)

    out = tmp_path / "m.h5"
    job = mpiscale(2, "train", "--data", matlab_file(tmp_path / "rows.mat", False), "--epochs", 2, "--out", out,
                   "--progress-every", 0)  # fmt: skip
    assert_ok(job)
    assert job.stderr.count("is a MATLAB array (save -v7.3), which HDF5 holds transposed: it is read as 600 samples "
                            "of 5 values, MATLAB's columns of its 5 x 600 array") == 1, job.stderr  # fmt: skip
    job = mpiscale(2, "train", "--data", matlab_file(tmp_path / "column.mat", True), "--out", tmp_path / "n.h5")
    assert job.returncode == 2 and "Traceback" not in job.output, job.output
    assert "got float64 of shape (1, 600) (a MATLAB column, which HDF5 holds transposed: save the labels as a row, " \
           "y = y.')" in job.stderr, job.stderr  # fmt: skip
    job = mpiscale(2, "collect", "--model", out, "--data", f"{tmp_path / 'rows.mat'}:/inputs", "--out",
                   tmp_path / "acts.h5")  # fmt: skip
    assert_ok(job)
    assert job.stderr.count("rows.mat:inputs is a MATLAB array (save -v7.3)") == 1, job.stderr
    with h5py.File(tmp_path / "samples-as-rows.mat", "w", userblock_size=512) as file:  # (MATLAB's 600 x 5)
        file.create_dataset("X", data=inputs.T).attrs["MATLAB_class"] = np.bytes_("double")
    job = mpiscale(2, "collect", "--model", out, "--data", f"{tmp_path / 'samples-as-rows.mat'}:/X", "--out",
                   tmp_path / "acts.h5")  # fmt: skip
    assert job.returncode == 2 and job.stderr.count("\n") == 1, job.output
    assert "the data set holds float64 (5, 600) (" in job.stderr and "if MATLAB's rows are the samples, save the " \
        "array transposed (X = X.') and give that)" in job.stderr  # fmt: skip


def test_users_own_file(tmp_path):
    """Images written by plain h5py (3-D uint8, int32 labels, other data set names) train, and collect reads them."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 600).astype(np.int32)
    images = (rng.random((600, 6, 6)) * 60).astype(np.uint8)
    for label in range(3):  # each class lights its own row of pixels
        images[labels == label, 2 * label, :] += 150
    data = user_file(tmp_path / "mine.h5", images, labels)
    out = tmp_path / "model.h5"
    job = mpiscale(2, "train", "--data", data, "--inputs", "images", "--labels", "target", "--validation", data,
                   "--epochs", 3, "--out", out, "--progress-every", 0)  # fmt: skip
    assert_ok(job)
    with h5py.File(out, "r") as file:
        assert file["curves/epoch/validation_accuracy"][-1] > 0.95
        assert list(file.attrs["image_shape"]) == [6, 6]
    acts = tmp_path / "acts.h5"
    assert_ok(mpiscale(3, "collect", "--model", out, "--data", f"{data}:/images", "--out", acts, "--batch-size", 64))
    with h5py.File(acts, "r") as file:
        assert file["relu1"].shape == (600, 128) and file.attrs["labels"] == ""


@pytest.mark.parametrize("pipeline", [[], ["--stages", 2, "--micro-batches", 2]], ids=["data-parallel", "pipeline"])
def test_an_error_in_one_ranks_step_ends_the_job_with_its_report(tmp_path, pipeline):
    """Rank 1's loss raises in its third step (as a GPU out of memory on one rank does): the step's loop closed its
    reader as the error left it, and that close (collective with MPI-IO) waited for the other rank, which waited in
    the step's allreduce: the job hung with the error unsaid until killed. It ends now with rank 1's report."""
    rng = np.random.default_rng(3)
    data = user_file(tmp_path / "mine.h5", rng.random((600, 5)), rng.integers(0, 2, 600))
    started = time.monotonic()
    job = run_mpi("one_rank_fails.py", 2, "torch.nn.functional", "cross_entropy", "3", "train", "--data", data,
                  "--inputs", "images", "--labels", "target",
                  "--hidden", "8", "--batch-size", "50", "--progress-every", "0", "--out", str(tmp_path / "m.h5"),
                  *map(str, pipeline), timeout=120)  # fmt: skip
    assert job.returncode != 0 and time.monotonic() - started < 60, job.output[-3000:]
    assert "job failed on rank 1 of 2" in job.stderr and "CUDA out of memory (planted on rank 1" in job.stderr
    assert not (tmp_path / "m.h5").exists()


@pytest.mark.parametrize("pipeline", [[], ["--stages", 2, "--micro-batches", 2]], ids=["data-parallel", "pipeline"])
def test_a_diverging_run_ends_at_its_first_loss_that_is_not_finite(tmp_path, pipeline):
    """A learning rate of 1e30 made the loss NaN from step 2 on; the job went on and wrote a model of NaN weights with
    status 0. It ends there now, with one message and status 1, and writes no results."""
    out = tmp_path / "model.h5"
    job = mpiscale(2, "train", "--learning-rate", 1e30, "--epochs", 2, "--hidden", 16, "--progress-every", 0,
                   "--checkpoint-every", 1, "--out", out, *pipeline)  # fmt: skip
    assert job.returncode == 1, job.output[-3000:]
    said = [line for line in job.stderr.splitlines() if line.startswith("mpiscale train:")]
    assert len(said) == 1 and "training diverged" in said[0] and "Lower --learning-rate (1e+30 now)" in said[0], said
    assert re.search(r"the loss is (nan|inf) at step \d+ \(epoch 1\)", said[0]), said
    assert f"remove {tmp_path / 'model.checkpoints'} (its checkpoints keep this rate" in said[0], said
    assert "Traceback" not in job.output and not out.exists()


def test_labels_stored_as_floats_of_whole_numbers_or_a_column_train_as_integers(tmp_path):
    """MATLAB, R and pandas store class numbers as float64: they were refused ("labels must be integers"). A column
    of them (N x 1, as Keras users keep y, and scikit-learn takes) was refused too ("one per sample; got int64 of
    shape (300, 1)"). They train to the very weights of the same labels stored as an integer vector, and score
    the same on held-out data so stored."""
    rng = np.random.default_rng(2)
    images, labels = (rng.random((300, 4, 4)) * 255).astype(np.uint8), rng.integers(0, 3, 300)
    runs = []
    for name, stored in (("int32", labels.astype(np.int32)), ("float64", labels.astype(np.float64)),
                         ("column", labels.reshape(-1, 1))):  # fmt: skip
        data = user_file(tmp_path / f"{name}.h5", images, stored)
        held_out = user_file(tmp_path / f"{name}-held-out.h5", images[:60], stored[:60])
        out = tmp_path / f"{name}-model.h5"
        assert_ok(mpiscale(2, "train", "--data", data, "--inputs", "images", "--labels", "target", "--hidden", 8,
                           "--epochs", 1, "--progress-every", 0, "--validation", held_out, "--out", out))  # fmt: skip
        with h5py.File(out, "r") as file:
            runs.append((weights(out), file["curves"]["epoch"]["validation_loss"][()]))
    for got, held_out_loss in runs[1:]:
        np.testing.assert_array_equal(held_out_loss, runs[0][1])
        for name, values in runs[0][0].items():
            np.testing.assert_array_equal(got[name], values, err_msg=name)


def test_inputs_in_huge_units_train_as_they_do_in_their_own(tmp_path):
    """Inputs past 1e154 (here 2**600 times the same values: float64 holds them) gave an infinite spread: every
    input was standardised to 0 and the model learned from none, without a word. They train to the very weights of
    the same values at unit scale; only the standardisation's statistics differ, by that factor."""
    rng = np.random.default_rng(5)
    images, labels = rng.random((300, 6)), rng.integers(0, 3, 300)
    runs = []
    for name, factor in (("unit", 1.0), ("huge", 2.0**600)):
        data = user_file(tmp_path / f"{name}.h5", images * factor, labels)
        out = tmp_path / f"{name}-model.h5"
        assert_ok(mpiscale(2, "train", "--data", data, "--inputs", "images", "--labels", "target", "--hidden", 8,
                           "--epochs", 1, "--progress-every", 0, "--out", out))  # fmt: skip
        runs.append(weights(out))
    for name, values in runs[0].items():
        factor = 2.0**600 if name.startswith("standardize.") else 1.0
        np.testing.assert_array_equal(runs[1][name], values * factor, err_msg=name)


def two_npy_files(folder: Path, name: str, samples: int, seed: int) -> tuple[Path, Path]:
    """(X.npy, y.npy) as scikit-learn users keep them, and their twin: the same arrays in one archive, NAME.npz."""
    rng = np.random.default_rng(seed)
    inputs, labels = rng.random((samples, 5)), rng.integers(0, 3, samples)
    np.save(folder / f"{name}-X.npy", inputs)
    np.save(folder / f"{name}-y.npy", labels)
    np.savez(folder / f"{name}.npz", inputs=inputs, labels=labels)
    return folder / f"{name}-X.npy", folder / f"{name}-y.npy"


@pytest.mark.parametrize("own, twin", [
    (["--validation", "held-X.npy", "--validation-labels", "held-y.npy"], ["--validation", "held.npz"]),
    (["--stages", 2, "--micro-batches", 2], ["--stages", 2, "--micro-batches", 2]),
    (["--batching", "round-robin"], ["--batching", "round-robin"]),
], ids=["held-out", "pipeline", "round-robin"])  # fmt: skip
def test_labels_in_a_file_of_their_own_train_as_in_the_inputs_file(tmp_path, own, twin):
    """X.npy and y.npy, as scikit-learn users keep them, were refused: a .npy holds one array, and the labels were a
    data set of the inputs' file. ``--labels y.npy`` (or FILE:/DATASET) now names a file of their own: training on
    them gives the very weights (and held-out scores) of the same arrays in one archive, through every reader: the
    batch reader, a pipeline's last stage (labels alone) and the sample reader of round-robin batching."""
    inputs, labels = two_npy_files(tmp_path, "train", 300, 6)
    two_npy_files(tmp_path, "held", 90, 7)
    own, twin = ([tmp_path / str(item) if str(item).endswith((".npy", ".npz")) else item for item in options]
                 for options in (own, twin))  # fmt: skip
    common = ["--hidden", 8, "--epochs", 2, "--batch-size", 32, "--progress-every", 0]
    assert_ok(mpiscale(2, "train", "--data", inputs, "--labels", labels, *own, *common, "--out", tmp_path / "a.h5"))
    assert_ok(mpiscale(2, "train", "--data", tmp_path / "train.npz", *twin, *common, "--out", tmp_path / "b.h5"))
    for name, values in weights(tmp_path / "b.h5").items():
        np.testing.assert_array_equal(weights(tmp_path / "a.h5")[name], values, err_msg=name)
    with h5py.File(tmp_path / "a.h5", "r") as found, h5py.File(tmp_path / "b.h5", "r") as expected:
        assert found.attrs["labels"] == str(labels)  # (the file: collect and inspect read the labels from it)
        accuracy = found["curves/epoch/validation_accuracy"][()]
        assert np.array_equal(accuracy, expected["curves/epoch/validation_accuracy"][()])
        assert len(accuracy) == (2 if "--validation" in own else 0)


def test_an_anndata_file_trains_as_its_dense_twin(tmp_path):
    """Counts kept as AnnData keeps them (a CSR group X with its shape, cell types as a categorical column) were "a
    group, not a dataset": they train, read as dense rows with the column's codes as labels, to the very weights of
    the same arrays in a .npz."""
    import scipy.sparse

    rng = np.random.default_rng(9)
    types = rng.integers(0, 3, 300)
    counts = rng.poisson(0.3, (300, 12)).astype(np.float32)
    counts[np.arange(300), 4 * types] += 5
    matrix = scipy.sparse.csr_matrix(counts)
    with h5py.File(tmp_path / "cells.h5ad", "w") as file:
        group = file.create_group("X")
        group.attrs["encoding-type"], group.attrs["shape"] = "csr_matrix", np.array(matrix.shape)
        group["data"], group["indices"], group["indptr"] = matrix.data, matrix.indices, matrix.indptr
        column = file.create_group("obs/cell_type")
        column.attrs["encoding-type"] = "categorical"
        column["categories"] = np.array(["B", "NK", "T"], dtype=h5py.string_dtype())
        column["codes"] = types.astype(np.int8)
    np.savez(tmp_path / "dense.npz", inputs=counts, labels=types)
    common = ["--hidden", 8, "--epochs", 2, "--progress-every", 0]
    assert_ok(mpiscale(2, "train", "--data", tmp_path / "cells.h5ad", "--inputs", "X", "--labels",
                       "obs/cell_type/codes", *common, "--out", tmp_path / "a.h5"))  # fmt: skip
    assert_ok(mpiscale(2, "train", "--data", tmp_path / "dense.npz", *common, "--out", tmp_path / "b.h5"))
    for name, values in weights(tmp_path / "b.h5").items():
        np.testing.assert_array_equal(weights(tmp_path / "a.h5")[name], values, err_msg=name)


def test_labels_named_as_the_inputs_file_and_data_set_score_held_out_data_by_its_own_labels(tmp_path):
    """``--labels train.npz:/labels`` names the inputs' own file: the held-out data's labels are then its own data set
    of that name, as with ``--labels labels`` (the training file's were taken for them, without a word: 300 held-out
    samples scored against the first 300 training labels)."""
    two_npy_files(tmp_path, "train", 300, 10)
    two_npy_files(tmp_path, "held", 300, 11)
    common = ["--hidden", 8, "--epochs", 2, "--progress-every", 0, "--validation", tmp_path / "held.npz"]
    assert_ok(mpiscale(2, "train", "--data", tmp_path / "train.npz", "--labels", f"{tmp_path / 'train.npz'}:/labels",
                       *common, "--out", tmp_path / "a.h5"))  # fmt: skip
    assert_ok(mpiscale(2, "train", "--data", tmp_path / "train.npz", *common, "--out", tmp_path / "b.h5"))
    with h5py.File(tmp_path / "a.h5", "r") as found, h5py.File(tmp_path / "b.h5", "r") as expected:
        scores = [file["curves/epoch/validation_accuracy"][()] for file in (found, expected)]
    assert len(scores[0]) == 2 and np.array_equal(*scores), scores


def test_labels_of_a_file_of_their_own_are_checked_and_never_written_over(tmp_path):
    """Labels in an HDF5 file of their own (FILE:/DATASET) train; the inputs' .npy alone is refused with both fixes,
    held-out data without its labels (the training labels' file would have scored it), too few labels, class
    names (strings: it said "got <U3 of shape (300,)") and one-hot rows are refused naming the file, and no output
    replaces a labels file."""
    inputs, labels = two_npy_files(tmp_path, "train", 300, 8)
    with h5py.File(tmp_path / "labels.h5", "w") as file:
        file["target"], file["other"] = np.load(labels), np.zeros(300, np.int64)
    np.save(tmp_path / "short-y.npy", np.load(labels)[:250])
    np.save(tmp_path / "names.npy", np.array(["cat", "dog", "emu"])[np.load(labels)])  # (class names, not numbers)
    np.save(tmp_path / "one-hot.npy", np.eye(3, dtype=np.float32)[np.load(labels)])  # (as Keras keeps them)
    common = ["--hidden", 8, "--epochs", 1, "--progress-every", 0]
    assert_ok(mpiscale(2, "train", "--data", inputs, "--labels", f"{tmp_path / 'labels.h5'}:/target", *common,
                       "--out", tmp_path / "m.h5"))  # fmt: skip
    refusals = {
        "alone": ([], "train-X.npy: a .npy file holds one array, and training takes two, the inputs and their "
                      "labels: give the labels' own file, e.g. --labels y.npy, or save both together"),
        "held": (["--labels", labels, "--validation", inputs], f"--labels {labels} is a file of the training "
                 "labels: give the held-out labels too, as --validation-labels FILE"),
        "short": (["--labels", tmp_path / "short-y.npy"], "short-y.npy: 300 inputs but 250 labels"),
        "one-hot": (["--labels", tmp_path / "one-hot.npy"], "got float32 of shape (300, 3) (one-hot rows, as Keras "
                    "keeps them? give each row's class, numpy.argmax(labels, axis=1))"),
        "names": (["--labels", tmp_path / "names.npy"], "names.npy: labels must be class numbers, one per sample; got "
                  "strings (<U3): number the classes, e.g. names, numbers = numpy.unique(labels, return_inverse=True)"),
        "out": (["--labels", labels, "--out", labels], f"the results file {labels} is an input of this job"),
    }  # fmt: skip
    for case, (options, message) in refusals.items():
        job = mpiscale(2, "train", "--data", inputs, "--out", tmp_path / "m.h5", *common, *options)
        assert job.returncode == 2 and job.stderr.count("\n") == 1 and message in job.stderr, (case, job.output)
    assert np.array_equal(np.load(labels), np.load(tmp_path / "train.npz")["labels"])  # (not written over)


def test_a_numpy_archive_trains_to_the_weights_of_its_hdf5_twin(tmp_path):
    """Inputs and labels saved with numpy.savez (rows of one size; token sequences with their starts) were refused
    as "not an HDF5 file". They train to the very weights of the same arrays in an HDF5 file, and collect reads
    them."""
    rng = np.random.default_rng(4)
    images, labels = (rng.random((300, 4, 4)) * 255).astype(np.uint8), rng.integers(0, 3, 300)
    lengths = rng.integers(2, 9, 120)
    tokens = {"values": rng.integers(0, 40, lengths.sum()).astype(np.int32), "target": rng.integers(0, 3, 120),
              "starts": np.concatenate([[0], np.cumsum(lengths)[:-1]])}  # fmt: skip
    np.savez(tmp_path / "mine.npz", images=images, target=labels)
    np.savez(tmp_path / "tokens.npz", **tokens)
    with h5py.File(tmp_path / "tokens.h5", "w") as file:
        for name, values in tokens.items():
            file[name] = values
    fixed = ["--inputs", "images", "--labels", "target", "--hidden", 8]
    ragged = ["--inputs", "values", "--offsets", "starts", "--labels", "target", "--model", "transformer"]
    for data, twin, options in [("mine.npz", user_file(tmp_path / "mine.h5", images, labels), fixed),
                                ("tokens.npz", tmp_path / "tokens.h5", ragged)]:  # fmt: skip
        runs = []
        for source in (tmp_path / data, twin):
            out = tmp_path / f"{os.path.basename(source)}-model.h5"
            assert_ok(mpiscale(2, "train", "--data", source, *options, "--epochs", 1, "--progress-every", 0,
                               "--out", out))  # fmt: skip
            runs.append(weights(out))
        for name, values in runs[1].items():
            np.testing.assert_array_equal(runs[0][name], values, err_msg=f"{data}: {name}")
    collected = mpiscale(2, "collect", "--model", tmp_path / "mine.npz-model.h5", "--layers", "relu1", "--out",
                         tmp_path / "acts.h5")  # fmt: skip
    assert_ok(collected)
    with h5py.File(tmp_path / "acts.h5", "r") as file:
        assert file["relu1"].shape == (300, 8) and file.attrs["inputs"] == f"{tmp_path / 'mine.npz'}:/images"


def test_a_resume_on_inputs_or_labels_written_again_is_refused(tmp_path):
    """One label, or one input value, changed in the middle of a user's file after a run stopped: its resume went on
    training on them without a word; it is refused now, on any number of ranks, and the same values resume."""
    rng = np.random.default_rng(1)
    data = user_file(tmp_path / "mine.h5", (rng.random((300, 4, 4)) * 255).astype(np.uint8), rng.integers(0, 3, 300))
    common = ["train", "--data", data, "--inputs", "images", "--labels", "target", "--hidden", 8, "--progress-every",
              0, "--checkpoint-every", 4, "--out", tmp_path / "model.h5"]  # fmt: skip
    assert_ok(mpiscale(2, *common, "--epochs", 1))
    for name, value in (("target", lambda old: (old + 1) % 3), ("images", lambda old: old ^ 1)):
        with h5py.File(data, "r+") as file:
            before = file[name][150]
            file[name][150] = value(before)
        refused = mpiscale(3, *common, "--epochs", 2, "--resume")
        assert refused.returncode == 2, refused.output[-3000:]
        assert "belongs to another job (data: checkpoint '" in refused.stderr, refused.stderr
        assert "the inputs or labels differ from those the checkpoint trained on" in refused.stderr
        with h5py.File(data, "r+") as file:
            file[name][150] = before
    resumed = mpiscale(3, *common, "--epochs", 2, "--resume")
    assert_ok(resumed)
    assert "resumed from the checkpoint of step" in resumed.stdout


@pytest.mark.parametrize("damaged", ["inputs", "labels", "ragged"])
def test_a_damaged_chunk_in_rank_1s_rows_is_refused_on_every_rank_at_once(tmp_path, damaged):
    """A user's checksummed file (fletcher32, as h5py and netCDF4 users turn on) with a bit flipped in a chunk of
    rank 1's rows: rank 1's check before any step failed alone while rank 0 waited in the check's next collective,
    and the job was aborted after 10 s with a traceback (status 1). Every rank now refuses it in one line."""
    rng = np.random.default_rng(3)
    path = tmp_path / "mine.h5"
    with h5py.File(path, "w") as file:
        checked = {"chunks": (100,), "fletcher32": True}
        if damaged == "ragged":
            lengths = rng.integers(3, 12, 400)
            file.create_dataset("X", data=rng.integers(0, 50, lengths.sum()).astype(np.int32), **checked)
            file["starts"] = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            file["y"] = rng.integers(0, 3, 400)
        else:
            file.create_dataset("X", data=rng.standard_normal((2000, 8)), chunks=(100, 8), fletcher32=True)
            file.create_dataset("y", data=rng.integers(0, 3, 2000), **checked)
    flip_a_bit(path, "y" if damaged == "labels" else "X", 15)  # rows 1500..1599 (tokens, for ragged): rank 1's
    ragged = ["--offsets", "starts", "--model", "transformer"] if damaged == "ragged" else []
    job = mpiscale(2, "train", "--data", path, "--inputs", "X", "--labels", "y", *ragged, "--epochs", 1,
                   "--progress-every", 0, "--out", tmp_path / "model.h5", timeout=60)  # fmt: skip
    assert job.returncode == 2 and "Traceback" not in job.output, job.output[-3000:]
    said = r"mine.h5:/?[Xy]: rows \d+\.\.\d+ cannot be read \(Can't read data \(data error detected by Fletcher32"
    assert re.search(said, job.stderr) and job.stderr.count("mpiscale train:") == 1, job.stderr
    assert not (tmp_path / "model.h5").exists()


def test_readings_of_a_large_mean_and_a_small_spread_keep_their_digits(tmp_path):
    """A sensor's float64 readings of 1e4 +- 1e-3 and int64 Unix seconds +- 30 carry the class. Cast to float32
    before the standardisation, each was left a few levels (float32 steps by 128 at 1.7e9): held-out accuracy
    stayed at 43% of four classes. Standardised in float64 first, as training and collect now do, the model learns
    them, and collect's rows are the float64 model's."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(4000), rng.standard_normal(4000)
    stamps = 1_700_000_000 + np.round(30 * b).astype(np.int64)
    data = tmp_path / "sensors.h5"
    with h5py.File(data, "w") as file:
        file["readings"] = np.stack([1e4 + 1e-3 * a, stamps.astype(np.float64)], axis=1)
        file["labels"] = 2 * (a > 0) + (stamps > 1_700_000_000)
    out = tmp_path / "model.h5"
    job = mpiscale(2, "train", "--data", data, "--inputs", "readings", "--validation", data, "--epochs", 4,
                   "--hidden", 32, "--out", out, "--progress-every", 0)  # fmt: skip
    assert_ok(job)
    with h5py.File(out, "r") as file:
        assert file["curves/epoch/validation_accuracy"][-1] > 0.9, file["curves/epoch/validation_accuracy"][()]
    acts = tmp_path / "acts.h5"
    assert_ok(mpiscale(2, "collect", "--model", out, "--data", f"{data}:/readings", "--out", acts, "--batch-size", 500,
                            "--layers", "hidden1"))  # fmt: skip
    from mpiscale.train.results import load_trained

    net, _ = load_trained(str(out))
    with h5py.File(data, "r") as file, torch.no_grad():
        expected = net[:2](torch.from_numpy(file["readings"][()])).numpy()  # standardize (float64), hidden1
    with h5py.File(acts, "r") as file:
        np.testing.assert_allclose(file["hidden1"][()], expected, rtol=1e-5, atol=1e-5)
        assert len(np.unique(file["hidden1"][:, 0])) > 1000  # thousands of values, not a few levels


@pytest.mark.parametrize(
    "problem, expected",
    [
        ("nan", "sample 317 holds NaN or infinite values"),
        ("fractional labels", "label 7 is 0.5: labels are class numbers, whole numbers 0 or more"),
        ("nan label", "label 9 is nan: labels are class numbers"),
        ("2-D labels", "labels must be class numbers, one per sample; got int64 of shape (600, 2)"),  # (a column is)
        ("no values", "its samples hold no values (shape (600, 3, 0))"),  # it said the file was damaged
        # a table of records (NumPy's, pandas' to_records): it said "got [('x', '<f8'), ...] of shape (600,)"
        (
            "table",
            "inputs must be numbers, one sample per row; got a table (records of the fields x0 (float64), x1 "
            "(float64), x2 (float64), x3 (float64), x4 (float64)), not one array of numbers",
        ),
        ("uint64 label 2**63", f"label 11 is {2**63}: labels are class numbers"),
        ("short labels", "600 inputs but 599 labels"),
        ("negative labels", "label 5 is -1: labels are class numbers, whole numbers 0 or more"),
        ("huge label", "labels go up to 100000, but there are only 600 training samples"),
        ("label 2**40", f"labels go up to {2**40}, but there are only 600 training samples"),
        ("batch", "batch size 1000 exceeds the 600 training samples"),
        ("hidden", "argument --hidden: invalid int value: '8x8'"),
    ],
)
def test_bad_training_input_is_refused(tmp_path, problem, expected):
    rng = np.random.default_rng(1)
    inputs, labels = rng.random((600, 5)), rng.integers(0, 2, 600)
    args = ["--batch-size", 1000 if problem == "batch" else 50, "--hidden", "8x8" if problem == "hidden" else "8"]
    if problem == "nan":
        inputs[317, 2] = np.nan
    if problem in ("fractional labels", "nan label"):
        labels = labels.astype(np.float64)
        labels[7 if problem == "fractional labels" else 9] = 0.5 if problem == "fractional labels" else np.nan
    if problem == "2-D labels":
        labels = np.stack([labels, labels], axis=1)
    if problem == "no values":
        inputs = np.zeros((600, 3, 0))
    if problem == "table":
        inputs = np.rec.fromarrays(inputs.T, names=[f"x{i}" for i in range(5)])
    if problem == "uint64 label 2**63":
        labels = labels.astype(np.uint64)
        labels[11] = 2**63
    if problem == "short labels":
        labels = labels[:-1]
    if problem == "negative labels":
        labels[5] = -1
    if problem == "huge label":
        labels[5] = 100000
    if problem == "label 2**40":
        labels[5] = 2**40
    data = user_file(tmp_path / "bad.h5", inputs, labels)
    job = mpiscale(2, "train", "--data", data, "--inputs", "images", "--labels", "target", *args,
                   "--out", tmp_path / "m.h5")  # fmt: skip
    assert job.returncode == 2, job.output
    assert expected in job.stderr and "Traceback" not in job.output
    assert not (tmp_path / "m.h5").exists()


def test_collect_refuses_unknown_layer_and_wrong_width(tmp_path, one_process_model):
    out = one_process_model
    job = mpiscale(2, "collect", "--model", out, "--layers", "relu7", "--out", tmp_path / "a.h5")
    assert job.returncode == 2 and "has no module relu7" in job.stderr and "relu1" in job.stderr
    wrong = user_file(tmp_path / "wrong.h5", np.zeros((10, 5)), np.zeros(10, np.int64))
    job = mpiscale(2, "collect", "--model", out, "--data", f"{wrong}:/images", "--out", tmp_path / "a.h5")
    assert job.returncode == 2 and "the model takes rows of 64 numbers" in job.stderr
    if not torch.cuda.is_available():
        job = mpiscale(2, "collect", "--model", out, "--out", tmp_path / "a.h5", "--device", "cuda")
        assert job.returncode == 2 and job.stderr.count("\n") == 1, job.output[-3000:]
        assert "choosing the device failed: ranks 0-1: ValueError: --device cuda: torch sees no CUDA GPU" in job.stderr
    assert not (tmp_path / "a.h5").exists()


def test_collect_on_a_real_gpu_gives_the_cpus_rows(tmp_path, one_process_model):
    """--device cuda on one rank, and on 2 ranks sharing the GPU on purpose, against the CPU (skipped without)."""
    if not real_torch_gpu():
        pytest.skip("torch sees no CUDA GPU (make gpu-check runs this where there is one)")
    common = ("collect", "--model", one_process_model, "--layers", "hidden1,relu1")
    assert_ok(mpiscale(1, *common, "--out", tmp_path / "cpu.h5", "--device", "cpu"))
    written = []
    for ranks, env in gpu_ranks():
        if env:  # two ranks on the one GPU: refused unless shared on purpose
            crowded = mpiscale(ranks, *common, "--out", tmp_path / "crowded.h5", "--device", "cuda")
            assert crowded.returncode == 2 and "start one rank per GPU, or set MPISCALE_SHARE_GPUS=1" in crowded.stderr
        assert_ok(mpiscale(ranks, *common, "--out", tmp_path / f"gpu{ranks}.h5", "--device", "cuda", env=env))
        written.append(f"gpu{ranks}.h5")
    with h5py.File(tmp_path / "cpu.h5", "r") as cpu:
        for name in written:
            with h5py.File(tmp_path / name, "r") as gpu:
                assert on_a_gpu(gpu.attrs), gpu.attrs["device"]
                for layer in ("hidden1", "relu1"):
                    np.testing.assert_allclose(gpu[layer][()], cpu[layer][()], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [[], ["--stages", 2]], ids=["data-parallel", "pipeline"])
def test_train_on_cuda_without_a_gpu_is_refused_in_one_line(tmp_path, shape):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    job = mpiscale(2, "train", *FOLLOWED, *shape, "--device", "cuda", "--out", tmp_path / "m.h5")
    assert job.returncode == 2 and job.stderr.count("\n") == 1, job.output[-3000:]
    assert "choosing the device failed: ranks 0-1: ValueError: --device cuda: torch sees no CUDA GPU" in job.stderr
    assert not (tmp_path / "m.h5").exists()


def test_train_on_a_real_gpu_follows_the_cpu_and_resumes_across_devices(tmp_path, one_process_model):
    """--device cuda on one rank, and on 2 ranks (sharing the GPU on purpose where there is one: gradients in three
    buckets, staged through pinned host memory, or summed in device memory by a CUDA-aware MPI), and with
    --intra-node nccl on one rank, against the CPU's one-rank run; the gradient path each run took is the one
    expected; a GPU run's checkpoint resumed on the CPU and a CPU run's on the GPU give the same weights (skipped
    without a GPU; make gpu-check runs it)."""
    if not real_torch_gpu():
        pytest.skip("torch sees no CUDA GPU (make gpu-check runs this where there is one)")
    paths = {1: {"none (one rank)"}, 2: {"staged through pinned host memory, MPI on the host",
                                         "MPI on the gradients' own memory"}}  # fmt: skip
    for ranks, env in gpu_ranks():
        name = f"gpu{ranks}.h5"
        assert_ok(mpiscale(ranks, "train", *FOLLOWED, "--device", "cuda", "--out", tmp_path / name, env=env))
        with h5py.File(tmp_path / name, "r") as file:
            assert on_a_gpu(file.attrs), file.attrs["device"]
            assert file.attrs["gradient_path"] in paths[ranks], file.attrs["gradient_path"]
        reference, result = weights(one_process_model), weights(tmp_path / name)
        for key in reference:
            np.testing.assert_allclose(result[key], reference[key], rtol=1e-3, atol=1e-4, err_msg=f"{name}: {key}")
    nccl = tmp_path / "nccl.h5"  # NCCL takes one rank per GPU: one rank here, its node's sums on the GPU
    assert_ok(mpiscale(1, "train", *FOLLOWED, "--device", "cuda", "--intra-node", "nccl", "--out", nccl))
    reference, result = weights(one_process_model), weights(nccl)
    for key in reference:
        np.testing.assert_allclose(result[key], reference[key], rtol=1e-3, atol=1e-4, err_msg=f"nccl: {key}")
    with h5py.File(one_process_model, "r") as file:
        per_epoch = len(file["curves/step/loss"]) // 2
    for first, then in (("cuda", "cpu"), ("cpu", "cuda")):
        out = tmp_path / f"{first}-then-{then}.h5"
        common = ("train", *FOLLOWED, "--out", out, "--checkpoint-every", per_epoch)
        assert_ok(mpiscale(1, *common, "--epochs", 1, "--device", first))
        assert_ok(mpiscale(1, *common, "--resume", "--device", then))
        reference, result = weights(one_process_model), weights(out)
        for key in reference:
            np.testing.assert_allclose(result[key], reference[key], rtol=1e-3, atol=1e-4, err_msg=f"{out}: {key}")


def test_data_parallel_on_a_real_gpu_overlaps_backward_and_averages_exactly():
    """Two ranks (sharing the GPU on purpose where there is one), backward lengthened on the device, 4 buckets: the
    first bucket's allreduce starts before the GPU has finished backward in every one of 100 back-to-back steps,
    and every average is the host's float32 average of the ranks' gradients, bit for bit (programs/gpu_overlap.py;
    skipped without a GPU; make gpu-check runs it)."""
    if not real_torch_gpu():
        pytest.skip("torch sees no CUDA GPU (make gpu-check runs this where there is one)")
    env = {"MPISCALE_SHARE_GPUS": "1"} if torch.cuda.device_count() == 1 else {}
    job = run_mpi("gpu_overlap.py", 2, "cuda", "100", env=env, timeout=300)
    assert_ok(job)
    assert "gpu overlap ok: 2 ranks on cuda, 4 buckets, 100 steps" in job.stdout, job.output[-3000:]
    print(job.stdout.strip().splitlines()[-1])  # which gradient path ran: staged, or MPI on device memory


def test_collect_refuses_nan_rows_in_a_later_round(tmp_path, one_process_model):
    """A NaN in rank 1's rows of the fourth round: every rank stops with one message naming the sample, status 2, no
    output; the rounds before are kept for --resume once the data is mended."""
    rows = np.random.default_rng(2).random((900, 64)).astype(np.float32)
    rows[777, 5] = np.nan  # rounds of 100 rows a rank: the fourth is rows 600-799, rank 1's 700-799
    data = user_file(tmp_path / "nan.h5", rows, np.zeros(900, np.int64))
    job = mpiscale(2, "collect", "--model", one_process_model, "--data", f"{data}:/images", "--batch-size", 100,
                   "--out", tmp_path / "a.h5", timeout=60)  # fmt: skip
    assert job.returncode == 2, job.output
    assert "round 4 failed: rank 1: " in job.stderr and "sample 777 holds NaN or infinite values" in job.stderr
    assert "Traceback" not in job.output and not (tmp_path / "a.h5").exists()
    with h5py.File(tmp_path / "a.h5.tmp", "r") as kept:
        assert kept.attrs["rows_done"] == 600
    assert "collected so far are kept in " in job.stderr and "with --resume" in job.stderr


def test_collect_refuses_rows_one_rank_cannot_read_in_a_later_round(tmp_path, one_process_model):
    """A checksummed chunk damaged in rank 1's rows of the fourth round: rank 1 raised alone, closed its data set
    (collective with MPI-IO) while rank 0 waited in the round's agreement, and the job hung until it was killed.
    Every rank now stops with one message naming the file and the rows, status 2, no output."""
    with h5py.File(tmp_path / "mine.h5", "w") as file:
        file.create_dataset("images", data=np.random.default_rng(2).random((900, 64)).astype(np.float32),
                            chunks=(50, 64), fletcher32=True)  # fmt: skip
    flip_a_bit(tmp_path / "mine.h5", "images", 14)  # rows 700..749: rank 1's part (700-799) of the fourth round
    job = mpiscale(2, "collect", "--model", one_process_model, "--data", f"{tmp_path / 'mine.h5'}:/images",
                   "--batch-size", 100, "--out", tmp_path / "a.h5", timeout=60)  # fmt: skip
    assert job.returncode == 2, job.output[-3000:]
    assert "round 4 failed: rank 1: " in job.stderr and "rows 700..799 cannot be read" in job.stderr, job.stderr
    assert "Traceback" not in job.output and not (tmp_path / "a.h5").exists()


def test_collect_finds_the_training_data_from_another_directory(tmp_path):
    """A model trained in one directory is collected from another: the results file names its data absolutely;
    an older file naming it relative to where training ran gets a message that says so."""
    trained = tmp_path / "trained"
    trained.mkdir()

    def in_directory(where: Path, *args) -> object:
        process = launch(1, [*MPISCALE, *map(str, args)], cwd=where)
        return finish(process, f"mpiscale {args[0]} in {where.name}", 120)

    assert_ok(
        in_directory(trained, "train", "--epochs", 1, "--hidden", "8", "--out", "model.h5", "--progress-every", 0)
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert_ok(in_directory(elsewhere, "collect", "--model", trained / "model.h5", "--out", "acts.h5"))
    with h5py.File(elsewhere / "acts.h5", "r") as file:
        assert file["relu1"].shape == (1437, 8)
    with h5py.File(trained / "model.h5", "r+") as file:  # as versions before this one wrote it
        file.attrs["data"] = "model.digits.h5:/inputs"
    again = in_directory(elsewhere, "collect", "--model", trained / "model.h5", "--out", "again.h5")
    assert again.returncode == 2, again.output
    assert "names its training data model.digits.h5, a path relative to where training ran" in again.stderr
    assert "pass --data FILE:/dataset" in again.stderr and not (elsewhere / "again.h5").exists()


def test_a_step_every_rank_refuses_ends_the_job_with_one_report(ranks):
    """Every rank raised its own report of the same refusal (issue 59, item 11); now the lowest rank reports."""
    job = run_mpi("refused_step.py", ranks, timeout=90)
    assert job.returncode == 1, job.output[-3000:]
    assert job.stderr.count("mpiscale: job failed on rank") == 1, job.stderr
    assert "job failed on rank 0 of" in job.stderr and "were frozen after DataParallel wrapped" in job.stderr
