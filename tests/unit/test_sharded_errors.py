"""Bad dataset files get an error naming the file and dataset (one process, serial h5py)."""

import h5py
import numpy as np
import pytest

from mpiscale.io import BatchReader, DataFileError, ShardedDataset, read_dataset, write_dataset, write_index


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.h5"
    write_dataset(path, {"x": np.arange(12, dtype=np.float32).reshape(6, 2), "y": np.arange(5)})
    return path


def test_serial_round_trip(good):
    assert np.array_equal(read_dataset(good, "x"), np.arange(12, dtype=np.float32).reshape(6, 2))
    with ShardedDataset(good, "x") as data:
        assert data.shape == (6, 2) and np.array_equal(data.read(2, 4), [[4, 5], [6, 7]])
        with pytest.raises(IndexError, match="good.h5:x"):
            data.read(4, 9)


def test_missing_file(tmp_path):
    with pytest.raises(DataFileError, match="nope.h5: no such file"):
        ShardedDataset(tmp_path / "nope.h5", "x")


@pytest.mark.parametrize("spec", ["~/runs/x.h5", "~/runs/x.npy", "$SCRATCH/x.h5", "${SCRATCH}/run-*.h5"])
def test_a_path_holding_what_only_a_shell_expands_is_said_to(spec, tmp_path, monkeypatch):
    """A settings file's ``data = "~/runs/x.h5"`` (or ``--data=~/x``, single quotes) reached the job as written, and
    was refused as "no such file" (or no match), which looks false to a user who sees the file in their home."""
    from mpiscale.jobs import check_outputs

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataFileError, match=r"(no such file|no files match this pattern) \(a shell expands a ~"):
        ShardedDataset(spec, "" if spec.endswith(".npy") else "x")
    with pytest.raises(ValueError, match="does not exist \\(a shell expands a ~"):
        check_outputs(spec.replace("x.", "out."), None)
    with pytest.raises(DataFileError, match="nope.h5: no such file$"):
        ShardedDataset("nope.h5", "x")


def test_missing_dataset(good):
    listing = r"\(datasets: x \(6, 2\) float32, y \(5,\) int64\)"
    with pytest.raises(DataFileError, match=r"good.h5:z: no dataset 'z' " + listing):
        ShardedDataset(good, "z")


def test_wrong_dtype_and_shape(good):
    with pytest.raises(DataFileError, match="good.h5:x: dtype is float32, expected float64"):
        read_dataset(good, "x", dtype=np.float64)
    with pytest.raises(DataFileError, match=r"good.h5:x: rows have shape \(2,\), expected \(3,\)"):
        read_dataset(good, "x", row_shape=(3,))


def test_a_file_from_elsewhere_is_input(tmp_path):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as file:
        file["x"] = np.arange(3.0)
        file.attrs["format"] = "somebody-else/2"
    assert np.array_equal(read_dataset(path, "x"), [0, 1, 2])
    assert np.array_equal(read_dataset(path), [0, 1, 2])  # the only data set


def test_truncated_file(good):
    size = good.stat().st_size
    with open(good, "r+b") as file:
        file.truncate(size // 2)
    with pytest.raises(DataFileError, match="good.h5: not a readable HDF5 file"):
        read_dataset(good, "x")
    with open(good, "r+b") as file:
        file.write(b"garbage!")  # the signature is gone
    with pytest.raises(DataFileError, match="good.h5: not an HDF5 file"):
        read_dataset(good, "x")


def test_index_of_shards(tmp_path, good):
    other = tmp_path / "other.h5"
    write_dataset(other, {"x": np.full((2, 2), -1, np.float32), "y": np.arange(2)})
    index = tmp_path / "index.h5"
    assert write_index(index, [good, other])["x"] == (8, 2)
    with ShardedDataset(index, "x") as data:
        assert np.array_equal(data.read(5, 7), [[10, 11], [-1, -1]])
    with pytest.raises(ValueError, match="differ in length"):
        BatchReader(index, ["x", "y"], 2)
    other.unlink()
    with pytest.raises(DataFileError, match="other.h5: no such file"):
        ShardedDataset(index, "x")


def test_index_refuses_mismatched_shards(tmp_path, good):
    odd = tmp_path / "odd.h5"
    write_dataset(odd, {"x": np.zeros((2, 3), np.float32), "y": np.arange(2)})
    with pytest.raises(DataFileError, match=r"odd.h5:x: rows of float32\(3,\) differ from the first shard's"):
        write_index(tmp_path / "index.h5", [good, odd])
    # a str for a list: its letters were taken as files ("g: no such file") and as data sets
    with pytest.raises(TypeError, match=r"shards is a list of files, got the str '.*good.h5': give \["):
        write_index(tmp_path / "index.h5", str(good))
    with pytest.raises(TypeError, match=r"names is a list of data set names, got the str 'x': give \['x'\]"):
        write_index(tmp_path / "index.h5", [good], "x")


def test_files_of_either_byte_order_are_one_data_set_read_in_this_machines_order(tmp_path):
    """A big-endian tool's HDF5 and .npy beside little-endian files: they were refused as rows of different dtypes
    (``>f4`` against ``float32``), by a glob, an index and a dtype asked for. Now every read, by byte range or
    through HDF5, gives this machine's order (kernels, MPI and torch take no other), and plain h5py reads the index."""
    values = np.arange(30, dtype=np.float32).reshape(10, 3) / 7
    with h5py.File(tmp_path / "a-big.h5", "w") as file:
        file["x"] = values[:4].astype(">f4")
    with h5py.File(tmp_path / "b-little.h5", "w") as file:
        file["x"] = values[4:8]
    np.save(tmp_path / "c-big.npy", values[8:].astype(">f4"))
    listed = tmp_path / "files.txt"
    listed.write_text("".join(f"{tmp_path / name}\n" for name in ("a-big.h5", "b-little.h5", "c-big.npy")))
    with ShardedDataset(listed, "x", dtype=np.float32) as data:
        assert data.dtype == np.float32 and data.dtype.isnative
        assert np.array_equal(data.read(0, 10), values) and np.array_equal(data.read(2, 9), values[2:9])
    assert np.array_equal(read_dataset(tmp_path / "a-big.h5", "x", dtype=np.float32), values[:4])
    index = tmp_path / "index.h5"
    write_index(index, [tmp_path / "a-big.h5", tmp_path / "b-little.h5"])
    with h5py.File(index, "r") as plain:
        assert plain["x"].dtype == np.float32 and np.array_equal(plain["x"][()], values[:8])
    with ShardedDataset(index, "x") as data:
        assert np.array_equal(data.read(1, 7), values[1:7])


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"names": "xy"}, TypeError, r"names is a list of data set names, got the str 'xy': give \['xy'\]"),
        ({"names": []}, ValueError, "names is empty"),
        ({"shuffle_window": 0}, ValueError, "shuffle_window is a number of rows, at least 1"),
        ({"shuffle_window": -3}, ValueError, "shuffle_window is a number of rows, at least 1"),
    ],
)
def test_a_batch_reader_refuses_names_and_windows_that_mean_nothing(tmp_path, arguments, error, message):
    """A str of names was read as its letters (``"xy"`` batched x and y); a window of 0 or -3 rows became the batch
    size without a word."""
    write_dataset(tmp_path / "xy.h5", {"x": np.zeros((4, 2)), "y": np.arange(4), "xy": np.ones(4)})
    with pytest.raises(error, match=message):
        BatchReader(tmp_path / "xy.h5", **{"names": ["x"], "batch_size": 2, "shuffle": True} | arguments)
