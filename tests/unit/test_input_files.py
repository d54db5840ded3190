"""Data as users bring it: HDF5 written by plain h5py in many layouts, globs, lists, .npy (one process)."""

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpiscale.io import BatchReader, DataFileError, ShardedDataset, epoch_order, leading_rows, read_dataset, write_index
from mpiscale.io.reader import epoch_plan

X = np.random.default_rng(5).standard_normal((240, 12))

LAYOUTS = {
    "contiguous": {},
    "chunked": {"chunks": (7, 12)},
    "gzip+shuffle": {"chunks": (32, 12), "compression": "gzip", "shuffle": True},
    "lzf": {"chunks": (50, 6), "compression": "lzf"},
    "float32 big-endian": {"dtype": ">f4"},
    "float16": {"dtype": np.float16},
    "int16": {"dtype": np.int16},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_any_layout_reads_as_written(tmp_path, layout):
    options = dict(LAYOUTS[layout])
    dtype = np.dtype(options.pop("dtype", np.float64))
    values = (X * 100).astype(dtype) if dtype.kind == "i" else X.astype(dtype)
    with h5py.File(tmp_path / "user.h5", "w") as file:
        file.create_dataset("deep/inside/X", data=values, **options)
    with ShardedDataset(tmp_path / "user.h5", "/deep/inside/X") as data:
        # rows come in this machine's byte order, whatever the file's (kernels, MPI and torch take no other)
        assert data.shape == values.shape and data.dtype == values.dtype.newbyteorder("=") and data.dtype.isnative
        assert np.array_equal(data.read(3, 200), values[3:200]) and data.read(3, 200).dtype.isnative
    assert np.array_equal(read_dataset(tmp_path / "user.h5"), values)  # the only data set needs no name


def test_rows_a_writer_never_reached_are_refused_not_read_as_its_fill_value(tmp_path):
    """A user's script that stopped half-way but closed its file (an exception inside ``with h5py.File``): HDF5
    reads the fill value (0) for the chunks never written, and a job learned from rows of zeros without a word."""
    values = np.arange(1000 * 20, dtype=np.float64).reshape(1000, 20) + 1
    with h5py.File(tmp_path / "user.h5", "w") as file:
        half = file.create_dataset("half", (1000, 20), "f8", chunks=(100, 20), fillvalue=-1.0)
        half[:450] = values[:450]  # chunks 0-4 written (the fifth in part), 5-9 never
        file.create_dataset("never", (1000, 20), "f8")  # contiguous, no write at all
        zeros = file.create_dataset("zeros", (1000, 20), "f8", chunks=(100, 20))
        zeros[:] = 0.0  # written, as zeros: taken
    with pytest.raises(DataFileError, match=r"user.h5:/half: 5 of its 10 chunks were never written \(its fill "
                                            r"value, -1.0, would stand for their rows\)"):  # fmt: skip
        ShardedDataset(tmp_path / "user.h5", "half")
    with pytest.raises(DataFileError, match=r"user.h5:/never: was never written \(its fill value, 0.0, would"):
        read_dataset(tmp_path / "user.h5", "never")
    assert not read_dataset(tmp_path / "user.h5", "zeros").any()


def test_rows_may_be_arrays(tmp_path):
    patches = np.arange(5 * 4 * 4, dtype=np.uint8).reshape(5, 4, 4)
    np.save(tmp_path / "patches.npy", patches)
    assert np.array_equal(read_dataset(tmp_path / "patches.npy"), patches)


def test_glob_reads_numbered_files_in_numeric_order(tmp_path):
    for part in (1, 2, 10):  # sorted as text, run-10 would come before run-2
        with h5py.File(tmp_path / f"run-{part}.h5", "w") as file:
            file["X"] = np.full((part, 3), part, dtype=np.float32)
    got = read_dataset(str(tmp_path / "run-*.h5"), "X")
    assert list(got[:, 0]) == [1, 2, 2] + [10] * 10
    with ShardedDataset(str(tmp_path / "run-*.h5"), "X") as data:
        assert [f.rsplit("/", 1)[1] for f in data.files] == ["run-1.h5", "run-2.h5", "run-10.h5"]


def test_a_directory_named_by_a_time_is_a_path_not_a_data_set(tmp_path):
    """``run-12:30/X.npy`` (a colon in a directory's name, as runs named by the time have): with no data set named,
    the whole spec is the path. It was cut at its last colon, and the job said 'run-12: no such file'."""
    from mpiscale.io import split_spec

    run = tmp_path / "run-2026-12-04T12:30"
    run.mkdir()
    np.save(run / "X.npy", X)
    with h5py.File(run / "user.h5", "w") as file:
        file["deep/X"] = X
    assert split_spec(str(run / "X.npy")) == (str(run / "X.npy"), "")
    assert np.array_equal(read_dataset(*split_spec(str(run / "X.npy"))), X)
    assert split_spec(f"{run}/user.h5:/deep/X") == (str(run / "user.h5"), "deep/X")
    assert np.array_equal(read_dataset(*split_spec(f"{run}/user.h5:/deep/X")), X)
    assert split_spec("no/such:dir/file.h5") == ("no/such", "dir/file.h5")  # nothing exists: read as written


def test_list_file_with_relative_paths_and_comments(tmp_path):
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "b.npy", X[100:])
    np.save(tmp_path / "data" / "a.npy", np.asfortranarray(X[:100]))  # Fortran order, as some tools write
    (tmp_path / "data" / "files.txt").write_text("# training split\na.npy\n\nb.npy  # the rest\n")
    assert np.array_equal(read_dataset(str(tmp_path / "data" / "files.txt")), X)
    # as Windows tools write lists: CRLF, and a byte order mark (UTF-8 from Notepad, UTF-16 from PowerShell's ">"),
    # which was read as part of the first path ("\ufeffa.npy: no such file")
    for encoding in ("utf-8-sig", "utf-16"):
        (tmp_path / "data" / "files.txt").write_bytes("a.npy\r\nb.npy\r\n".encode(encoding))
        assert np.array_equal(read_dataset(str(tmp_path / "data" / "files.txt")), X), encoding


def test_a_file_named_twice_is_refused_not_read_twice(tmp_path):
    """A "latest" link kept among numbered runs matched their glob beside its target, and a list naming a file twice
    was taken: those rows were read twice, without a word. Refused, for an index too."""
    for part in range(3):
        np.save(tmp_path / f"run-{part}.npy", X[100 * part : 100 * (part + 1)])
    (tmp_path / "run-latest.npy").symlink_to("run-2.npy")
    said = f"names {tmp_path}/run-2.npy and {tmp_path}/run-latest.npy, one file (a link to the other): its rows would"
    said += " be read twice; name each file once, with a pattern the link does not match"
    with pytest.raises(DataFileError, match=re.escape(said)):
        ShardedDataset(str(tmp_path / "run-*.npy"))
    assert np.array_equal(read_dataset(str(tmp_path / "run-[0-9].npy")), X)
    (tmp_path / "files.txt").write_text("run-0.npy\nrun-1.npy\nrun-0.npy\n")
    with pytest.raises(DataFileError, match="run-0.npy twice: its rows would be read twice; name each file once$"):
        ShardedDataset(str(tmp_path / "files.txt"))
    with pytest.raises(DataFileError, match="one file .a link to the other."):
        ShardedDataset([str(tmp_path / "run-2.npy"), str(tmp_path / "run-latest.npy")])
    shards = []
    for part in range(2):
        with h5py.File(tmp_path / f"part-{part}.h5", "w") as file:
            file["X"] = X[:10]
        shards.append(str(tmp_path / f"part-{part}.h5"))
    with pytest.raises(DataFileError, match="part-1.h5 twice"):
        write_index(str(tmp_path / "index.h5"), [*shards, shards[1]])


def test_index_of_user_files_reads_as_one_array(tmp_path):
    for part, rows in enumerate(np.array_split(X, 3)):
        with h5py.File(tmp_path / f"part{part}.h5", "w") as file:
            file.create_dataset("sim/X", data=rows, chunks=True, compression="gzip")
            file["sim/other"] = np.zeros(len(rows))
    shards = [tmp_path / f"part{part}.h5" for part in range(3)]
    assert write_index(tmp_path / "all.h5", shards, ["/sim/X"]) == {"sim/X": X.shape}
    assert np.array_equal(read_dataset(tmp_path / "all.h5", "/sim/X"), X)
    with h5py.File(tmp_path / "all.h5", "r") as plain:  # a notebook's view, through the virtual data set
        assert np.array_equal(plain["sim/X"][:], X)


def test_an_index_never_replaces_a_users_file(tmp_path):
    """An index named as one of its own shards (directly or through a symlink), or as an existing file that is no
    index (a user's HDF5, a .npy), is refused and the file left as it was; an earlier index is written anew."""
    shards = []
    for part, rows in enumerate(np.array_split(X, 2)):
        shards.append(tmp_path / f"part{part}.h5")
        with h5py.File(shards[-1], "w") as file:
            file["X"] = rows
    (tmp_path / "link.h5").symlink_to(shards[1])
    np.save(tmp_path / "mine.npy", X)
    with h5py.File(tmp_path / "mine.h5", "w") as file:
        file["Y"] = X
    for target, message in [(shards[0], "is a file the index would list"), (tmp_path / "link.h5", "would list"),
                            (tmp_path / "mine.npy", "exists and is not an index"),
                            (tmp_path / "mine.h5", "exists and is not an index")]:  # fmt: skip
        before = Path(target).read_bytes()
        with pytest.raises(DataFileError, match=message):
            write_index(target, shards)
        assert Path(target).read_bytes() == before
    write_index(tmp_path / "all.h5", shards[:1])
    assert write_index(tmp_path / "all.h5", shards) == {"X": X.shape}  # re-indexed with both
    assert np.array_equal(read_dataset(tmp_path / "all.h5", "/X"), X)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d.mkdir(), "is a directory"),
        (lambda d: d.write_text(""), "is empty"),
        (lambda d: d.write_bytes(b"x,y\n1,2\n"), "not an HDF5 file"),
    ],
    ids=["directory", "empty", "csv"],
)
def test_what_is_not_hdf5_is_named(tmp_path, make, message):
    make(tmp_path / "data.h5")
    with pytest.raises(DataFileError, match=f"data.h5: {message}"):
        read_dataset(tmp_path / "data.h5", "X")


def _written_by_other_tools(folder: Path) -> dict[str, str]:
    """Files of 20 x 3 numbers as other tools write them (each with the real tool), and what each is said to be."""
    import gzip
    import pickle
    import shutil
    import zipfile

    import scipy.io
    import torch

    X = np.arange(60.0).reshape(20, 3)
    np.savetxt(folder / "plain.csv", X, delimiter=",")
    np.savetxt(folder / "named.csv", X, delimiter=",", header="a,b,c", comments="")
    np.savetxt(folder / "columns.tsv", X, delimiter="\t")
    (folder / "notes.dat").write_text("the data are in runs/\n")
    torch.save(torch.from_numpy(X), folder / "tensor.pt")
    (folder / "array.pkl").write_bytes(pickle.dumps(X))
    np.save(folder / "array.npy", X)
    shutil.copy(folder / "array.npy", folder / "array.bin")
    np.savez(folder / "arrays.npz", X=X)
    shutil.copy(folder / "arrays.npz", folder / "arrays.zip")
    with zipfile.ZipFile(folder / "other.zip", "w") as archive:
        archive.writestr("readme.txt", "hello")
    with h5py.File(folder / "data.h5", "w") as file:
        file["X"] = X
    (folder / "data.h5.gz").write_bytes(gzip.compress((folder / "data.h5").read_bytes()))
    scipy.io.savemat(folder / "old.mat", {"X": X})
    with scipy.io.netcdf_file(folder / "classic.nc", "w") as netcdf:
        netcdf.createDimension("n", 20)
        netcdf.createVariable("X", "d", ("n",))[:] = X[:, 0]
    (folder / "table.parquet").write_bytes(b"PAR1" + bytes(64) + b"PAR1")  # (the format's magic, first and last)
    return {
        "plain.csv": "a text file (a table of numbers as CSV?): save it as NumPy, numpy.save('{d}/plain.npy', "
                     "numpy.loadtxt('{d}/plain.csv', delimiter=','))",
        "named.csv": "numpy.loadtxt('{d}/named.csv', delimiter=',', skiprows=1))",
        "columns.tsv": "numpy.loadtxt('{d}/columns.tsv', delimiter='\\t'))",
        "notes.dat": "a text file, which holds no table of numbers in its first lines",
        "tensor.pt": "a PyTorch file (torch.save): save the tensor as NumPy, numpy.save('{d}/tensor.npy', "
                     "torch.load('{d}/tensor.pt').numpy())",
        "array.pkl": "a Python pickle (pickle, joblib, or an old torch.save)",
        "array.bin": "a NumPy array (.npy) by its contents, which the jobs know by its name: name it {d}/array.npy",
        "arrays.zip": "NumPy arrays (numpy.savez) by its contents, which the jobs know by its name: name it "
                      "{d}/arrays.npz",
        "other.zip": "a ZIP archive: unpack it",
        "data.h5.gz": "a gzip-compressed file: decompress it first (gunzip {d}/data.h5.gz)",
        "old.mat": "a MATLAB file of the format before -v7.3: save it again with save('{d}/old.mat', 'X', '-v7.3')",
        "classic.nc": "a classic netCDF file (netCDF-4 files are HDF5): convert it, nccopy -k nc4 {d}/classic.nc "
                      "{d}/classic.nc4",
        "table.parquet": "a Parquet table: save it as NumPy, numpy.save('{d}/table.npy', "
                         "pandas.read_parquet('{d}/table.parquet').to_numpy())",
    }  # fmt: skip


def test_a_zarr_store_is_named_with_the_line_that_writes_it_as_hdf5(tmp_path):
    """A Zarr store (a directory: AnnData's and xarray's other format) was "a directory, not an HDF5 file (give
    FILE.h5:/dataset)"; its marker files (Zarr 2's .zgroup, Zarr 3's zarr.json) name it now. A plain directory is
    said as before."""
    for version, marker in ((2, ".zgroup"), (3, "zarr.json")):
        store = tmp_path / f"cells-{version}.zarr"
        store.mkdir()
        (store / marker).write_text(f'{{"zarr_format": {version}}}')
        with pytest.raises(DataFileError, match=re.escape(
            f"is a directory, not an HDF5 file: a Zarr store, which the jobs do not read: write it as HDF5, e.g. "
            f"anndata.read_zarr('{store}').write_h5ad('{tmp_path}/cells-{version}.h5ad')"
        )):  # fmt: skip
            read_dataset(store, "X")
    with pytest.raises(DataFileError, match=re.escape("is a directory, not an HDF5 file (give FILE.h5:/dataset)")):
        read_dataset(tmp_path, "X")


def test_files_of_other_formats_are_named_with_the_line_that_converts_them(tmp_path):
    """A CSV, a tensor of torch.save, a pickle, a .npy or .npz under another name, a gzipped HDF5 file, MATLAB's
    older format, classic netCDF, Parquet: each was "not an HDF5 file (no HDF5 signature: truncated, or another
    format?)". Each is named now, with the line that makes it an array the jobs read."""
    for name, said in _written_by_other_tools(tmp_path).items():
        with pytest.raises(DataFileError) as refused:
            read_dataset(tmp_path / name, "X")
        assert f"{name}: not an HDF5 file but " in str(refused.value), name
        assert said.format(d=tmp_path) in str(refused.value), (name, str(refused.value))
    np.save(tmp_path / "converted.npy", np.loadtxt(tmp_path / "named.csv", delimiter=",", skiprows=1))  # (as said)
    assert np.array_equal(read_dataset(tmp_path / "converted.npy"), np.arange(60.0).reshape(20, 3))


def _csr_group(path: Path, matrix, **attrs) -> None:
    with h5py.File(path, "w") as file:
        group = file.create_group("X")
        group["data"], group["indices"], group["indptr"] = matrix.data, matrix.indices, matrix.indptr
        for name, value in attrs.items():
            group.attrs[name.replace("_", "-") if name == "encoding_type" else name] = value


def test_a_sparse_matrix_in_hdf5_reads_as_its_dense_rows_and_a_damaged_one_is_refused(tmp_path):
    """A CSR matrix as AnnData and mpiscale encode keep it (a group of data, indices and indptr with its shape) was
    "a group, not a dataset"; its rows read as the dense rows, by any block, empty rows and a repeated entry (which
    adds up, as SciPy's sum) included. A CSC matrix, a missing shape, parts that disagree and an index past the shape
    are refused."""
    import scipy.sparse

    dense = np.zeros((30, 7), np.float32)
    dense[::3, ::2] = np.arange(1, 41, dtype=np.float32).reshape(10, 4)  # (rows 1, 2, 4, ... empty)
    canonical = scipy.sparse.csr_matrix(dense)
    data, indices = np.r_[canonical.data, 1.5].astype(np.float32), np.r_[canonical.indices, 2]  # (row 27 twice)
    indptr = canonical.indptr + (np.arange(31) > 27)
    repeated = scipy.sparse.csr_matrix((data, indices, indptr), shape=(30, 7))
    assert not repeated.has_canonical_format
    _csr_group(tmp_path / "cells.h5ad", repeated, encoding_type="csr_matrix", shape=(30, 7))
    expected = repeated.toarray()
    assert expected[27, 2] == dense[27, 2] + 1.5
    assert np.array_equal(read_dataset(tmp_path / "cells.h5ad", "X"), expected)
    with pytest.raises(DataFileError, match=r"holds 3 data sets; name one .* sparse matrices, read as rows: X\)"):
        read_dataset(tmp_path / "cells.h5ad")  # (named by its group, not by one of its parts)
    with ShardedDataset(tmp_path / "cells.h5ad", "/X") as rows:
        assert rows.shape == (30, 7) and rows.dtype == np.float32
        for lo, hi in [(0, 1), (1, 3), (5, 29), (29, 30), (4, 4)]:
            assert np.array_equal(rows.read(lo, hi), expected[lo:hi]), (lo, hi)
    refused = {
        "csc.h5": (scipy.sparse.csc_matrix(dense), {"encoding_type": "csc_matrix", "shape": (30, 7)},
                   "is a sparse matrix kept by columns (CSC)"),
        "shapeless.h5": (scipy.sparse.csr_matrix(dense), {}, "without its shape: give the group an attribute shape"),
        "short.h5": (scipy.sparse.csr_matrix(dense), {"shape": (31, 7)}, "whose indptr holds 31 values (rows + 1 = "
                     "32)"),
        "narrow.h5": (scipy.sparse.csr_matrix(dense), {"shape": (30, 5)}, "name column 6, past the 5 columns"),
    }  # fmt: skip
    for name, (matrix, attrs, message) in refused.items():
        _csr_group(tmp_path / name, matrix, **attrs)
        with pytest.raises(DataFileError, match=re.escape(message)):
            read_dataset(tmp_path / name, "X")


def test_sparse_matrices_of_many_files_read_as_one_by_a_glob_and_an_index_of_them_is_refused(tmp_path):
    """Two .h5ad files of one gene set read as one matrix through a glob; an index of them (which joined each part
    file after file: an indptr of both, each from 0) is refused, pointing to the glob."""
    import scipy.sparse

    parts = [scipy.sparse.random(n, 6, density=0.3, format="csr", random_state=n, dtype=np.float32) for n in (7, 5)]
    for number, part in enumerate(parts, 1):
        _csr_group(tmp_path / f"cells-{number}.h5ad", part, encoding_type="csr_matrix", shape=part.shape)
    joined = scipy.sparse.vstack(parts).toarray()
    assert np.array_equal(read_dataset(tmp_path / "cells-*.h5ad", "X"), joined)
    for names in (None, ["/X"]):
        with pytest.raises(DataFileError, match="is a sparse matrix .* which an index cannot join"):
            write_index(tmp_path / "index.h5", [tmp_path / "cells-1.h5ad", tmp_path / "cells-2.h5ad"], names)
    assert not (tmp_path / "index.h5").exists()


def test_a_categorical_column_named_as_its_group_points_to_its_codes(tmp_path):
    """AnnData keeps a categorical column (cell types, say) as a group of its categories and its codes: named as the
    group, it was "a group, not a dataset"; it now says where its class numbers are, which read as labels."""
    with h5py.File(tmp_path / "cells.h5ad", "w") as file:
        column = file.create_group("obs/cell_type")
        column.attrs["encoding-type"] = "categorical"
        column["categories"] = np.array(["B", "NK", "T"], dtype=h5py.string_dtype())
        column["codes"] = np.array([0, 2, 1, 2], np.int8)
    with pytest.raises(DataFileError, match="a categorical column .*: its class numbers are obs/cell_type/codes"):
        read_dataset(tmp_path / "cells.h5ad", "/obs/cell_type")
    assert read_dataset(tmp_path / "cells.h5ad", "/obs/cell_type/codes").tolist() == [0, 2, 1, 2]


def test_files_that_disagree_or_do_not_exist(tmp_path):
    np.save(tmp_path / "a.npy", X)
    np.save(tmp_path / "b.npy", X[:, :5])
    with pytest.raises(DataFileError, match=r"b.npy: rows of float64\(5,\) differ from those of .*a.npy"):
        read_dataset(str(tmp_path / "*.npy"))
    with pytest.raises(DataFileError, match="no files match this pattern"):
        read_dataset(str(tmp_path / "nothing-*.h5"), "X")
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(DataFileError, match="empty.txt: the list of files is empty"):
        read_dataset(str(tmp_path / "empty.txt"), "X")
    with h5py.File(tmp_path / "two.h5", "w") as file:
        file["a"], file["b"] = X, X
    with pytest.raises(DataFileError, match=r"holds 2 data sets; name one as .*two.h5:/NAME"):
        read_dataset(tmp_path / "two.h5")
    with pytest.raises(DataFileError, match="not a readable .npy file"):
        (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
        read_dataset(tmp_path / "bad.npy")


def test_arrays_of_a_numpy_archive_read_as_written(tmp_path):
    """numpy.savez's archives (each array an uncompressed .npy member): any array by name, the only one without,
    in any order or byte order, parts as one data set; a damaged archive and bad names are refused."""
    np.savez(tmp_path / "mine.npz", X=X, fortran=np.asfortranarray(X), swapped=X.astype(">f4"), ids=np.arange(240))
    assert np.array_equal(read_dataset(tmp_path / "mine.npz", "/X"), X)
    assert np.array_equal(read_dataset(tmp_path / "mine.npz", "fortran"), X)
    swapped = read_dataset(tmp_path / "mine.npz", "swapped")
    assert swapped.dtype == np.float32 and swapped.dtype.isnative and np.array_equal(swapped, X.astype(np.float32))
    with ShardedDataset(tmp_path / "mine.npz", "ids") as data:
        assert data.name == "ids" and data.shape == (240,) and np.array_equal(data.read(7, 9), [7, 8])
    for part, (lo, hi) in enumerate([(0, 100), (100, 240)]):
        np.savez(tmp_path / f"part-{part}.npz", X[lo:hi])  # one array each: its name needs no saying
    with ShardedDataset(str(tmp_path / "part-*.npz")) as data:
        assert data.name == "arr_0" and np.array_equal(data.read(0, 240), X)
    with pytest.raises(DataFileError, match=r"mine.npz: holds 4 arrays; name one as .*mine.npz:/NAME \(arrays: X, "):
        read_dataset(tmp_path / "mine.npz")
    with pytest.raises(DataFileError, match=r"holds no array 'Y' \(arrays: X, fortran, ids, swapped\)"):
        read_dataset(tmp_path / "mine.npz", "Y")
    rows = np.array([np.arange(3), np.arange(5)], dtype=object)  # sequences of varying length, as users keep them
    np.save(tmp_path / "rows.npy", rows, allow_pickle=True)
    np.savez(tmp_path / "rows.npz", seqs=rows)
    for path, name in [("rows.npy", ""), ("rows.npz", "seqs")]:
        with pytest.raises(DataFileError, match=r"as Python objects .* --inputs values --offsets starts"):
            read_dataset(tmp_path / path, name)
    (tmp_path / "cut.npz").write_bytes((tmp_path / "mine.npz").read_bytes()[:500])
    with pytest.raises(DataFileError, match="cut.npz: not a readable .npz archive"):
        read_dataset(tmp_path / "cut.npz", "X")


@pytest.mark.parametrize("window", [None, 64, 10, 1])
def test_epoch_plan_is_a_permutation_read_window_by_window(window):
    samples = 1000
    plan = epoch_plan(samples, 3, 7, True, window)
    assert np.array_equal(np.sort(plan.order), np.arange(samples))
    assert plan.window_starts[-1] == samples
    for index, blocks in enumerate(plan.windows):  # each window's positions hold exactly its blocks' rows
        rows = plan.order[plan.window_starts[index] : plan.window_starts[index + 1]]
        assert set(np.unique(rows // plan.rows_per_block)) == set(blocks)
    if window is None:
        assert len(plan.windows) == 1
    else:
        assert len(plan.windows) == -(-samples // (plan.rows_per_block * 8))
        assert not np.array_equal(plan.order, epoch_order(samples, 4, 7, True, window))


def test_small_data_is_shuffled_whole_whatever_the_window():
    assert np.array_equal(epoch_order(50, 1, 2, True, None), epoch_order(50, 1, 2, True, 50))
    assert np.array_equal(epoch_order(50, 1, 2, False, 8), np.arange(50))
    assert len(epoch_order(0, 0, 0, True)) == 0 and len(epoch_order(0, 0, 0, False, 8)) == 0  # no rows, no order


@pytest.mark.parametrize("window", [None, 40])
def test_streaming_gives_the_batches_of_memory(tmp_path, window):
    with h5py.File(tmp_path / "user.h5", "w") as file:
        file.create_dataset("X", data=X, chunks=(16, 12), compression="gzip")
        file["y"] = np.arange(len(X))
    batches = {}
    for in_memory in (True, False):
        with BatchReader(tmp_path / "user.h5", ["X", "y"], 32, shuffle=True, seed=3, shuffle_window=window,
                         in_memory=in_memory) as reader:  # fmt: skip
            assert reader.in_memory is in_memory
            batches[in_memory] = [b for epoch in (0, 1) for b in reader.epoch(epoch)]
    for kept, streamed in zip(batches[True], batches[False]):
        assert np.array_equal(kept.ids, streamed.ids) and np.array_equal(kept.data["y"], kept.ids)
        assert np.array_equal(kept.data["X"], streamed.data["X"]) and np.array_equal(streamed.data["X"], X[kept.ids])
    assert len(batches[True]) == 2 * 8


@pytest.mark.parametrize("in_memory", [True, False])
def test_arrays_of_other_files_batch_as_those_of_one(tmp_path, in_memory):
    """Inputs in an HDF5 file and labels in a .npy of their own (``sources``) give the very batches of both in one
    file; a key that is also a name is refused."""
    X = np.arange(200 * 3, dtype=np.float32).reshape(200, 3)
    with h5py.File(tmp_path / "both.h5", "w") as file:
        file["X"], file["y"] = X, np.arange(len(X)) % 7
    with h5py.File(tmp_path / "inputs.h5", "w") as file:
        file["X"] = X
    np.save(tmp_path / "y.npy", np.arange(len(X)) % 7)
    options = dict(shuffle=True, seed=1, shuffle_window=64, in_memory=in_memory)
    with BatchReader(tmp_path / "both.h5", ["X", "y"], 32, **options) as reader:
        expected = list(reader.epoch(1))
    with BatchReader(tmp_path / "inputs.h5", ["X"], 32, sources={"labels": (tmp_path / "y.npy", "")},
                     **options) as reader:  # fmt: skip
        found = list(reader.epoch(1))
    assert len(found) == len(expected) == 7
    for batch, twin in zip(found, expected):
        assert np.array_equal(batch.ids, twin.ids) and np.array_equal(batch.data["X"], twin.data["X"])
        assert np.array_equal(batch.data["labels"], twin.data["y"])
    with BatchReader(tmp_path / "inputs.h5", [], 32, sources={"labels": (tmp_path / "y.npy", "")}) as reader:
        assert list(next(iter(reader.epoch(0))).data) == ["labels"]  # (a pipeline's last stage reads labels alone)
    with pytest.raises(ValueError, match=r"sources' keys \['X'\] are also names"):
        BatchReader(tmp_path / "inputs.h5", ["X"], 32, sources={"X": (tmp_path / "y.npy", "")})
    np.save(tmp_path / "short.npy", np.arange(150))
    with pytest.raises(ValueError, match=r"arrays differ in length: X \(.*inputs.h5:X\) 200, labels \(.*short.npy:\) "
                                         r"150; a batch needs equal row counts"):  # fmt: skip
        BatchReader(tmp_path / "inputs.h5", ["X"], 32, sources={"labels": (tmp_path / "short.npy", "")})


def test_a_report_reads_the_first_rows_within_its_budget(tmp_path):
    """leading_rows: 10 rows of 4 float64 (32 bytes each) give 3 within 100 bytes, one within a budget smaller than
    a row, all within a large one, none of an empty data set."""
    with h5py.File(tmp_path / "r.h5", "w") as file:
        file["X"] = np.arange(40.0).reshape(10, 4)
        file.create_dataset("empty", shape=(0, 4), dtype="f8")
        np.testing.assert_array_equal(leading_rows(file["X"], 100), np.arange(12.0).reshape(3, 4))
        assert len(leading_rows(file["X"], 1)) == 1 and len(leading_rows(file["X"])) == 10
        assert leading_rows(file["empty"]).shape == (0, 4)


def test_a_file_this_program_still_holds_open_for_writing_is_refused_naming_it(tmp_path):
    """HDF5 locks a file it writes; reading it meanwhile (through MPI-IO, which takes no lock) could see rows half
    written, so the open is refused, naming the holder; once closed, it reads."""
    with h5py.File(tmp_path / "held.h5", "w") as file:
        file["X"] = X
        file.flush()
        with pytest.raises(DataFileError, match=r"held.h5: is open for writing by this process \(\d+\) \(HDF5's lock"):
            ShardedDataset(tmp_path / "held.h5", "X")
    with ShardedDataset(tmp_path / "held.h5", "X") as data:
        assert np.array_equal(data.read(0, len(X)), X)


@contextlib.contextmanager
def held_by_another_program(path: Path, making: bool) -> Iterator[subprocess.Popen]:
    """A user's h5py program in another process holding ``path`` open for writing (``making``: it makes the file,
    a data set X in it) until the block ends."""
    opening = "f = h5py.File(sys.argv[1], 'w'); f['X'] = [[1.0]]" if making else "f = h5py.File(sys.argv[1], 'a')"
    code = f"import h5py, sys; {opening}; print(1, flush=True); input()"
    writer = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert writer.stdout.readline() == "1\n"
        yield writer
    finally:
        writer.kill()
        writer.wait(timeout=30)


def test_a_file_another_program_holds_open_for_writing_is_refused_naming_its_process(tmp_path):
    """The holder named by its process id and name (the kernel's list of locks), as a user finds it in ``ps``."""
    with held_by_another_program(tmp_path / "held.h5", making=True) as writer:
        with pytest.raises(DataFileError, match=rf"is open for writing by process {writer.pid} \(python"):
            ShardedDataset(tmp_path / "held.h5", "X")


def test_locks_held_at_once_are_capped_and_every_file_is_still_checked(tmp_path, monkeypatch):
    """Each lock held is a descriptor beside the file's own: past ``MOST_HELD`` a file is checked as it opens but not
    held, so that a data set of many files does not halve the files a process may open; all let go at the close."""
    from mpiscale.io import write_lock

    monkeypatch.setattr(write_lock, "MOST_HELD", 2)
    for index in range(4):
        with h5py.File(tmp_path / f"run-{index}.h5", "w") as file:
            file["X"] = np.full((3, 2), float(index))
    before = len(os.listdir("/proc/self/fd"))
    with ShardedDataset(f"{tmp_path}/run-*.h5", "X") as data:
        assert len(os.listdir("/proc/self/fd")) - before == 4 + 2  # (HDF5's descriptor of each file, 2 locks)
        assert data.read(0, 12)[:, 0].tolist() == [0.0] * 3 + [1.0] * 3 + [2.0] * 3 + [3.0] * 3
    assert len(os.listdir("/proc/self/fd")) == before and write_lock._held == 0
    with held_by_another_program(tmp_path / "run-3.h5", making=False) as writer:
        with pytest.raises(DataFileError, match=rf"run-3.h5: is open for writing by process {writer.pid}"):
            ShardedDataset(f"{tmp_path}/run-*.h5", "X")  # (the fourth file, past the locks held: checked all the same)
    assert write_lock._held == 0
