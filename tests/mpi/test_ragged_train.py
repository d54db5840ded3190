"""Training and collecting on token sequences of varying length, written the ways users write them, under real mpirun.

Memory batching (a token budget) cuts the same batches at every world size; a
step is one batch per replica. So a pipeline of two stages (one replica)
follows one data-parallel process batch for batch, on either file layout; a
sequential batch split over four ranks follows one process; and collect's
row for a sequence is the model's answer for that sequence alone, whatever
the padding of its batch.
"""

import json
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from helpers import REPO, assert_ok, run_alone
from test_train import mpiscale, weights

from mpiscale.train.results import load_trained

SEQUENCES = 400
# Adam turns float32 rounding in gradients that are zero in exact arithmetic (the attention's key bias) into
# full-size steps on any change of summation order (see test_pipeline_train's transformer test): weights agree to
# 1e-3 after 50 steps (measured: 1.5e-4), the step losses closely.
TOLERANCE = 1e-3


def assert_same_training(one, other) -> None:
    expected, got = weights(one), weights(other)
    assert got.keys() == expected.keys()
    assert max(np.abs(got[name] - expected[name]).max() for name in expected) < TOLERANCE
    with h5py.File(one) as a, h5py.File(other) as b:
        np.testing.assert_allclose(b["curves/step/loss"][()], a["curves/step/loss"][()], rtol=2e-4)


def write_tokens(path, samples: int = SEQUENCES) -> list[np.ndarray]:
    """The sequences of examples/ragged_tokens.py (int32 values with N starts, int16 variable-length rows, run as a
    user runs it), and the same tokens as int64 values with N+1 boundaries (plain h5py)."""
    done = subprocess.run([sys.executable, str(REPO / "examples" / "ragged_tokens.py"), str(path), "--sequences",
                           str(samples)], capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert f"wrote {path}: {samples} sequences of 4-48 tokens" in done.stdout
    with h5py.File(path, "a") as file:
        rows = [np.asarray(row, np.int64) for row in file["sequences"]]
        file["tokens64"] = np.concatenate(rows)
        file["edges"] = np.cumsum([0] + [len(row) for row in rows])
    return rows


SETTINGS = ["--model", "transformer", "--width", "16", "--heads", "2", "--encoder-layers", "1", "--epochs", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ragged")
    rows = write_tokens(folder / "tokens.h5")
    return folder, rows


def test_memory_batches_train_the_same_as_a_pipeline_and_collect_reads_one_row_per_sequence(data, tmp_path):
    folder, rows = data
    memory = ["--batching", "memory", "--batch-tokens", "600"]
    one = run_alone("train", *SETTINGS, *memory, "--data", folder / "tokens.h5", "--inputs", "values", "--offsets",
                   "starts", "--out", tmp_path / "one.h5", "--checkpoint-every", "10")  # fmt: skip
    assert_ok(one)
    piped = mpiscale(2, "train", *SETTINGS, *memory, "--data", folder / "tokens.h5", "--inputs", "sequences",
                     "--stages", "2", "--micro-batches", "2", "--out", tmp_path / "piped.h5")  # fmt: skip
    assert_ok(piped)
    assert_same_training(tmp_path / "one.h5", tmp_path / "piped.h5")
    with h5py.File(tmp_path / "one.h5") as file:
        steps = int(file.attrs["steps"])
        assert json_spec(file)["ragged"] and json_spec(file)["length"] == max(len(r) for r in rows)
    assert f"{steps} steps on 2 ranks" in piped.stdout and steps >= SEQUENCES * 26 // 600  # 26: the mean length

    collected = mpiscale(2, "collect", "--model", tmp_path / "one.h5", "--layers", "pool,output", "--batch-size",
                         "37", "--out", tmp_path / "act.h5")  # fmt: skip
    assert_ok(collected)
    model, _ = load_trained(str(tmp_path / "one.h5"))
    with h5py.File(tmp_path / "act.h5") as file:
        assert file["pool"].shape == (SEQUENCES, 16) and file["output"].shape == (SEQUENCES, 4)
        for sample in (0, 1, 200, SEQUENCES - 1):
            with torch.no_grad():
                alone = model(torch.from_numpy(rows[sample][None].astype(np.int64)))[0].numpy()
            np.testing.assert_allclose(file["output"][sample], alone, atol=1e-5)

    resumed = mpiscale(2, "train", *SETTINGS, *memory, "--data", folder / "tokens.h5", "--inputs", "values",
                       "--offsets", "starts", "--checkpoint-dir", tmp_path / "one.checkpoints", "--resume", "--out",
                       tmp_path / "again.h5")  # fmt: skip
    assert resumed.returncode == 2
    assert (
        "belongs to another job (replicas: checkpoint 1, now 2 (with --batching memory a step is one batch per "
        "data-parallel replica"
        in resumed.stderr
        and "resume on the replicas it was saved with" in resumed.stderr
    )
    changed = tmp_path / "tokens.h5"  # one token of a sequence in the middle written again
    shutil.copyfile(folder / "tokens.h5", changed)
    with h5py.File(changed, "r+") as file:
        middle = int(file["starts"][SEQUENCES // 2]) + 1
        file["values"][middle] = (file["values"][middle] + 1) % 50
    resumed = run_alone("train", *SETTINGS, *memory, "--data", changed, "--inputs", "values", "--offsets", "starts",
                        "--checkpoint-dir", tmp_path / "one.checkpoints", "--resume", "--out",
                        tmp_path / "again.h5")  # fmt: skip
    assert resumed.returncode == 2, resumed.output[-3000:]
    assert "belongs to another job (data: checkpoint '" in resumed.stderr, resumed.stderr


def json_spec(file) -> dict:
    return json.loads(file.attrs["model"])


def test_held_out_and_collected_sequences_keep_to_trainings_memory_budget(data, tmp_path):
    """A held-out set with one sequence of 3,000 tokens among short ones: scored as one padded block it asked for
    tens of GB; scored, and collected, in batches of the token budget grouped by length it takes what training
    does. A budget below that sequence is refused before any step, and collect refuses a sequence longer than the
    model's positions, both naming it, on 2 ranks."""
    folder, rows = data
    held = [rows[j][: 4 + j % 40] for j in range(200)]
    held[57] = np.arange(3000) % 16
    with h5py.File(tmp_path / "held.h5", "w") as file:
        file["values"] = np.concatenate(held).astype(np.int32)
        file["starts"] = np.cumsum([0] + [len(row) for row in held[:-1]])
        file["labels"] = np.arange(200) % 4
    common = [*SETTINGS, "--data", folder / "tokens.h5", "--inputs", "values", "--offsets", "starts", "--validation",
              tmp_path / "held.h5", "--batching", "memory"]  # fmt: skip
    refused = mpiscale(2, "train", *common, "--batch-tokens", "600", "--out", tmp_path / "no.h5")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.output[-3000:]
    assert "held-out sample 57 takes 3,000 tokens, more than batch_tokens (600)" in refused.stderr
    trained = mpiscale(2, "train", *common, "--batch-tokens", "3000", "--out", tmp_path / "m.h5")
    assert_ok(trained)
    assert "held-out accuracy" in trained.stdout
    collected = mpiscale(2, "collect", "--model", tmp_path / "m.h5", "--data", f"{tmp_path / 'held.h5'}:/values",
                         "--offsets", "starts", "--layers", "output", "--out", tmp_path / "act.h5")  # fmt: skip
    assert_ok(collected)  # one round of 100 sequences a rank, run in batches of up to 3,000 padded tokens
    model, _ = load_trained(str(tmp_path / "m.h5"))
    with h5py.File(tmp_path / "act.h5") as file, torch.no_grad():
        for sample in (0, 56, 57, 199):
            alone = model(torch.from_numpy(np.asarray(held[sample], np.int64)[None]))[0].numpy()
            np.testing.assert_allclose(file["output"][sample], alone, atol=1e-5)
    with h5py.File(tmp_path / "longer.h5", "w") as file:
        file.create_dataset("seq", (3,), dtype=h5py.vlen_dtype(np.int64))
        file["seq"][0], file["seq"][1], file["seq"][2] = np.arange(5), np.arange(3500) % 16, np.arange(7)
    longer = mpiscale(2, "collect", "--model", tmp_path / "m.h5", "--data", f"{tmp_path / 'longer.h5'}:/seq",
                      "--layers", "pool", "--out", tmp_path / "no.h5")  # fmt: skip
    assert longer.returncode == 2 and longer.stderr.count("\n") == 1, longer.output[-3000:]
    assert "sample 1 holds 3,500 tokens, more than the model's 3,000 positions" in longer.stderr
    assert not (tmp_path / "no.h5").exists()


def test_sequential_batches_of_sequences_over_4_ranks_follow_one_process(data, tmp_path):
    folder, _ = data
    common = [*SETTINGS, "--batching", "round-robin", "--batch-size", "32", "--data", folder / "tokens.h5",
              "--inputs", "tokens64", "--offsets", "/edges"]  # fmt: skip
    assert_ok(run_alone("train", *common, "--out", tmp_path / "one.h5", "--progress-every", "0"))
    assert_ok(mpiscale(4, "train", *common, "--out", tmp_path / "four.h5"))
    assert_same_training(tmp_path / "one.h5", tmp_path / "four.h5")


@pytest.mark.parametrize(
    "options, message",
    [
        (["--inputs", "values", "--offsets", "starts", "--batching", "memory", "--batch-tokens", "40"],
         "sample [0-9]+ takes 4[1-8] tokens, more than batch_tokens \\(40\\): .* raise batch_tokens"),
        (["--inputs", "sequences", "--model", "mlp"], "sequences of varying length: they need --model transformer"),
        (["--inputs", "labels", "--batching", "memory", "--batch-tokens", "100"],
         "batching memory bounds batches by tokens: it takes ragged inputs"),
        (["--inputs", "values", "--offsets", "starts", "--batching", "adaptive"], "would not be repeatable"),
        (["--inputs", "values", "--offsets", "labels"], "offsets must (not decrease|begin at 0)"),
        (["--inputs", "values", "--offsets", "starts", "--batching", "round-robin", "--prefetch-mib", "0.001"],
         "prefetch_bytes 1,048 .* cannot hold the next batch .* the largest a rank gets in epoch 1"),
    ],
    ids=["budget-below-a-sequence", "mlp", "memory-on-fixed-rows", "adaptive", "labels-as-offsets", "prefetch"],
)  # fmt: skip
def test_bad_ragged_settings_are_refused_before_any_step(data, tmp_path, options, message):
    folder, _ = data
    job = run_alone("train", "--data", folder / "tokens.h5", *SETTINGS[:2], *options, "--out", tmp_path / "m.h5")
    assert job.returncode == 2, job.output
    assert re.search(message, job.stderr), job.stderr
    assert not (tmp_path / "m.h5").exists()


def test_an_empty_sequence_is_refused_naming_it(tmp_path):
    path = tmp_path / "tokens.h5"
    with h5py.File(path, "w") as file:
        file["values"] = np.arange(40) % 16
        file["starts"] = [0, 10, 20, 20, 30]  # sequence 2 is empty
        file["labels"] = np.zeros(5, np.int64)
    job = run_alone("train", *SETTINGS, "--data", path, "--inputs", "values", "--offsets", "starts", "--batch-size",
                    "2", "--out", tmp_path / "m.h5")  # fmt: skip
    assert job.returncode == 2 and "sequence 2 is empty" in job.stderr, job.output


def test_a_damaged_variable_length_data_set_is_refused_naming_its_rows(tmp_path):
    """A variable-length data set keeps its rows in HDF5's global heap, where no checksum guards them: a heap whose
    bytes a bad copy changed ended both ranks in HDF5's bare "OSError: Can't read data (bad global heap collection
    signature)" and a traceback. It is one line now, naming the file, the data set and the rows."""
    rng = np.random.default_rng(3)
    path = tmp_path / "tokens.h5"
    with h5py.File(path, "w") as file:  # (as h5py users write sequences of varying length)
        rows = file.create_dataset("tokens", (300,), dtype=h5py.vlen_dtype(np.int32))
        rows[:] = np.array([rng.integers(0, 16, rng.integers(3, 12)).astype(np.int32) for _ in range(300)], object)
        file["labels"] = rng.integers(0, 3, 300)
    stored = bytearray(path.read_bytes())
    heap = stored.find(b"GCOL")  # (the heap collection's signature)
    stored[heap : heap + 4] = b"XXXX"
    path.write_bytes(bytes(stored))
    job = mpiscale(2, "train", "--data", path, "--inputs", "tokens", "--model", "transformer", "--out",
                   tmp_path / "m.h5")  # fmt: skip
    assert job.returncode == 2 and job.stderr.count("\n") == 1, job.output[-3000:]
    said = (
        r"tokens.h5:tokens: rows 0\.\.\d+ cannot be read \(Can't read data \(bad global heap collection signature\)\)"
    )
    assert re.search(said + ": the file is damaged there, or its disk failed", job.stderr), job.stderr
