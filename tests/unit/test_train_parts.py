"""The parts of train and collect that need no MPI: settings, model state round trips, the top inputs of atoms."""

import argparse

import h5py
import numpy as np
import pytest
import torch

from mpiscale.dictlearn import format_top_inputs, top_inputs
from mpiscale.dictlearn.config import EncodeConfig
from mpiscale.jobs import add_options, load_settings
from mpiscale.train import bundled
from mpiscale.train.config import CollectConfig, TrainConfig
from mpiscale.train.data import names_a_file
from mpiscale.train.model import build_mlp
from mpiscale.train.state import load_model_arrays, load_optimizer_state, model_arrays, optimizer_state


def test_train_settings_from_a_table_and_the_command_line(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[train]\nhidden = "32,16"\nepochs = 3\nlearning_rate = 1\n')
    config = load_settings(TrainConfig, "train", str(path), {"epochs": 7, "seed": None})
    assert config.widths == [32, 16] and config.epochs == 7 and config.learning_rate == 1.0
    with pytest.raises(ValueError, match="unknown settings \\['layers'\\]"):
        path.write_text('layers = "relu1"\n')
        load_settings(TrainConfig, "train", str(path), {})
    with pytest.raises(ValueError, match="validation needs DATA"):
        TrainConfig(validation="held-out.h5")
    with pytest.raises(ValueError, match="layers must name at least one module"):
        CollectConfig(layers=(" ",))
    for absurd in (-1.0, float("nan"), float("inf")):  # (as --mark-every parses them)
        with pytest.raises(ValueError, match=f"mark_every must be a number of seconds, 0 or more, got {absurd}"):
            CollectConfig(mark_every=absurd)
        with pytest.raises(ValueError, match=f"mark_every must be a number of seconds, 0 or more, got {absurd}"):
            EncodeConfig(mark_every=absurd)
    assert CollectConfig(mark_every=0).mark_every == 0 and EncodeConfig().mark_every == 0.25


def test_labels_name_a_file_by_its_ending_or_as_a_path_and_a_bare_name_is_a_data_set(tmp_path, monkeypatch):
    """``--labels y.npy`` (or FILE:/DATASET) names a file of their own; a bare name is a data set of the inputs'
    file even where a file of that name lies in the working directory (the default ``labels`` would have read it)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "labels").write_text("a file that happens to be here")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "classes.dat").write_text("")
    files = ["y.npy", "Y.NPZ", "labels.h5:/target", "elsewhere/y.hdf5", "runs/classes.dat", "./labels", "labels:/y"]
    for spec in files:
        assert names_a_file(spec), spec
    for spec in ["labels", "target", "group/labels", "runs/missing.dat"]:
        assert not names_a_file(spec), spec
    with pytest.raises(ValueError, match="validation_labels are the labels of VALIDATION"):
        TrainConfig(data="X.npy", labels="y.npy", validation_labels="held-y.npy")


def test_list_and_boolean_settings_are_typed_and_can_be_undone(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("hidden = [32, 16]\nresume = true\n")
    parser = argparse.ArgumentParser()
    add_options(parser, TrainConfig)
    args = vars(parser.parse_args(["--hidden", "8", "4,2", "--no-resume"]))
    from_file = load_settings(TrainConfig, "train", str(path), {})
    assert from_file.hidden == (32, 16) and from_file.resume is True
    given = load_settings(TrainConfig, "train", str(path), args)
    assert given.hidden == (8, 4, 2) and given.resume is False
    assert load_settings(TrainConfig, "train", str(path), vars(parser.parse_args(["--hidden"]))).hidden == ()
    path.write_text('hidden = [32, "16"]\n')
    with pytest.raises(ValueError, match="hidden must be a list of int, got \\[32, '16'\\]"):
        load_settings(TrainConfig, "train", str(path), {})
    with pytest.raises(SystemExit):
        parser.parse_args(["--hidden", "8x8"])


@pytest.mark.parametrize(
    "settings, message",
    [({"stages": 2, "compression": "bf16"}, "compression applies to data-parallel training only"),
     ({"stages": 0}, "stages must be at least 1, got 0"),
     ({"micro_batches": 0}, "micro_batches must be at least 1, got 0"),
     ({"stages": 2, "schedule": "zb"}, "schedule must be one of 1f1b, gpipe, got 'zb'"),
     ({"model": "cnn"}, "model must be one of mlp, transformer, got 'cnn'"),
     ({"model": "transformer", "width": 30, "heads": 4}, "width must be a multiple of heads, got width 30 and 4 heads"),
     ({"encoder_layers": 0}, "encoder_layers must be at least 1, got 0")],
)  # fmt: skip
def test_bad_pipeline_and_model_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)
    assert TrainConfig(micro_batches=4).pipelined and not TrainConfig().pipelined


def test_adam_state_survives_a_round_trip():
    """Save after 3 steps, load into a fresh model and optimizer: the next step is the same to the bit."""
    torch.manual_seed(0)
    spec = {"inputs": 6, "hidden": [5], "classes": 3}
    model = build_mlp(spec)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(20, 6), torch.randint(0, 3, (20,))

    def step(net, opt):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    for _ in range(3):
        step(model, optimizer)
    arrays, meta = optimizer_state(optimizer)
    saved = model_arrays(model) | arrays
    copy = build_mlp(spec)
    copy_optimizer = torch.optim.Adam(copy.parameters(), lr=0.5)
    load_model_arrays(copy, saved, "test")
    load_optimizer_state(copy_optimizer, saved, meta)
    step(model, optimizer)
    step(copy, copy_optimizer)
    for name, value in model_arrays(model).items():
        np.testing.assert_array_equal(model_arrays(copy)[name], value, err_msg=name)
    with pytest.raises(ValueError, match=r"weights standardize.mean are of shape \(6,\), the model needs \(7,\)"):
        load_model_arrays(build_mlp({"inputs": 7, "hidden": [5], "classes": 3}), saved, "the checkpoint")


def test_catalogue_finds_the_samples_built_from_each_atom(tmp_path):
    """Rows built from one known atom each, with labels: each atom's strongest samples are its own rows."""
    rng = np.random.default_rng(3)
    atoms, features, per_atom = 4, 12, 30
    dictionary = np.linalg.qr(rng.standard_normal((features, atoms)))[0].T  # orthonormal atoms
    owner = np.repeat(np.arange(atoms), per_atom)
    strength = rng.uniform(1, 2, len(owner))
    strength[[7, 40, 75, 100]] = 10.0  # the strongest row of each atom
    rows = strength[:, None] * dictionary[owner] + 0.01 * rng.standard_normal((len(owner), features))
    ids = np.arange(len(owner)) + 1000  # the rows' numbers in some larger data set
    data = tmp_path / "acts.h5"
    with h5py.File(data, "w") as file:
        file["relu1"], file["sample_ids"], file["labels"] = rows, ids, owner * 10
        file.attrs["labels"] = f"{tmp_path / 'labels.h5'}:/labels"
    with h5py.File(tmp_path / "labels.h5", "w") as file:
        file["labels"] = np.arange(2000) % 7  # labels of the larger data set, by sample id
    results = tmp_path / "dl.h5"
    with h5py.File(results, "w") as file:
        file["dictionary"] = dictionary
        file.attrs["format"] = "mpiscale.dictlearn-results/1"
        file.attrs["config"] = '{"coder": "omp", "sparsity": 1, "alpha": 0.1}'
        file.attrs["data"] = f"{data}:/relu1"
    entries, samples = top_inputs(str(results), top=3)
    assert samples == len(rows) and len(entries) == atoms
    for entry in entries:
        assert entry.used_by == per_atom
        assert entry.ids[0] == 1000 + [7, 40, 75, 100][entry.atom]
        assert all((sample - 1000) // per_atom == entry.atom for sample in entry.ids)
        np.testing.assert_array_equal(entry.labels, entry.ids % 7)
    text = format_top_inputs(entries, samples, most=2)
    assert text.count("\natom ") == 2 and "2 more atoms" in text


@pytest.mark.parametrize("where", ["scikit-learn's file", "through scikit-learn"])
def test_the_bundled_digits_are_scikit_learns(where, monkeypatch, tmp_path):
    """Read from scikit-learn's data file (no import of it), or through it when that file is elsewhere: the same."""
    from sklearn.datasets import load_digits as reference

    if where == "through scikit-learn":
        monkeypatch.setattr(bundled, "sklearn_digits_file", lambda: tmp_path / "moved.csv.gz")
    inputs, labels = bundled.load_digits()
    expected = reference()
    assert inputs.dtype == np.float32 and inputs.flags.c_contiguous and labels.dtype == np.int64
    np.testing.assert_array_equal(inputs, expected.data.astype(np.float32))
    np.testing.assert_array_equal(labels, expected.target)


def test_the_bundled_sequences_are_labelled_by_their_most_frequent_class_token():
    """The transformer's default task: every label is the strict majority among the class tokens, classes balanced,
    the same arrays on every call."""
    tokens, labels = bundled.make_sequences()
    counts = np.stack([(tokens == token).sum(axis=1) for token in range(bundled.SEQUENCE_CLASSES)], axis=1)
    ordered = np.sort(counts, axis=1)
    assert (ordered[:, -1] > ordered[:, -2]).all()
    np.testing.assert_array_equal(counts.argmax(axis=1), labels)
    assert tokens.min() == 0 and tokens.max() == bundled.VOCABULARY - 1
    assert np.bincount(labels).min() > 0.2 * len(labels)
    np.testing.assert_array_equal(bundled.make_sequences()[0], tokens)


def test_the_ddp_bench_hidden_share_is_clipped_to_what_it_can_mean():
    from mpiscale.bench.ddp import _hidden_share

    assert _hidden_share(step=1.5, compute=1.0, communication=1.0) == 0.5
    assert _hidden_share(step=0.8, compute=1.0, communication=1.0) == 1.0  # noise: faster than compute alone
    assert _hidden_share(step=2.5, compute=1.0, communication=1.0) == 0.0  # noise: slower than no overlap
    assert _hidden_share(step=1.0, compute=1.0, communication=0.0) == 0.0


def test_features_are_standardised_whatever_their_units(tmp_path):
    """A user's inputs as h5py writes them: a feature in small units (1e-9, which a fixed floor of 1e-8 once left
    unscaled, so the model all but ignored it), one of one value (scale 1), and one of a large mean and small spread
    (whose E[x^2] - mean^2 cancelled). Each feature's spread is numpy's, and the model divides by it."""
    from mpi4py import MPI

    from mpiscale.train.data import check_labelled
    from mpiscale.train.model import set_standardization, standardizer

    rng = np.random.default_rng(0)
    samples = 5000
    inputs = np.stack([1e-9 * rng.standard_normal(samples), np.full(samples, 5.0),
                       1e6 + 0.1 * rng.standard_normal(samples), rng.standard_normal(samples)], axis=1)  # fmt: skip
    path = tmp_path / "mine.h5"
    with h5py.File(path, "w") as file:
        file["x"] = inputs
        file["y"] = rng.integers(0, 3, samples)
    data, classes, mean, std = check_labelled(str(path), "x", "y", MPI.COMM_SELF)
    assert classes == 3 and (data.lowest, data.highest) == (inputs.min(), inputs.max())
    np.testing.assert_allclose(mean, inputs.mean(axis=0), rtol=1e-12)
    assert std[1] == 0.0
    np.testing.assert_allclose(std[[0, 2, 3]], inputs.std(axis=0)[[0, 2, 3]], rtol=1e-9)
    model = build_mlp({"inputs": 4, "hidden": [3], "classes": 3})
    set_standardization(model, mean, std)
    scale = standardizer(model).scale.numpy()
    assert scale[1] == 1.0 and np.allclose(scale[[0, 2, 3]], std[[0, 2, 3]], rtol=1e-6)


def test_rows_float32_would_round_reach_the_model_in_float64_and_the_rest_as_before():
    """float64 data and integers past 2**24 are standardised in float64 (the model's buffers are float64); rows
    float32 holds exactly go in as float32, standardised with the float32 statistics as before."""
    from mpiscale.train.model import input_layout, model_rows, set_standardization, standardizer

    spec = {"inputs": 2, "hidden": [3], "classes": 2}
    wanted = input_layout(spec)[1]
    for dtype, kept in [(np.float64, np.float64), (np.int64, np.float64), (np.int32, np.float64),
                        (np.float32, np.float32), (np.float16, np.float32), (np.uint8, np.float32)]:  # fmt: skip
        assert model_rows(np.zeros((1, 2), dtype), wanted).dtype == kept, dtype
    model = build_mlp(spec)
    mean, std = np.array([1e4, 1_700_000_000.0]), np.array([1e-3, 30.0])
    set_standardization(model, mean, std)
    rows = np.array([[1e4 + 1e-3, 1_700_000_017.0], [1e4 - 2e-3, 1_699_999_990.0]])
    standardized = standardizer(model)(torch.from_numpy(model_rows(rows, wanted)))
    assert standardized.dtype == torch.float32
    np.testing.assert_allclose(standardized.numpy(), (rows - mean) / std, rtol=1e-6)  # via float32: both seconds 0
    small = np.array([[3.5, 250.0]], np.float32)
    old_way = (torch.from_numpy(small) - torch.from_numpy(mean.astype(np.float32))) / torch.from_numpy(
        std.astype(np.float32)
    )
    assert torch.equal(standardizer(model)(torch.from_numpy(model_rows(small, wanted))), old_way)


def test_layer_outputs_refuses_unknown_names_before_it_hooks_the_model():
    """A bad second name once left the first one's hook on the model (a host copy of that layer's output at every
    forward pass after), with torch's AttributeError; a str was read as its letters."""
    from mpiscale.train.model import layer_outputs

    model = build_mlp({"inputs": 3, "hidden": [4], "classes": 2})
    rows = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="no module 'nope'; its modules: standardize, hidden1, relu1, output"):
        layer_outputs(model, ["relu1", "nope"], rows)
    with pytest.raises(TypeError, match=r"got the str 'output': give \['output'\]"):
        layer_outputs(model, "output", rows)
    assert not any(module._forward_hooks for module in model.modules())  # no hook left behind
    assert layer_outputs(model, ["relu1"], rows)["relu1"].shape == (2, 4)
