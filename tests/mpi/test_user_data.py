"""`mpiscale dictlearn` on data as users bring it: files written by plain h5py (in another process), by
HDF5's C library, as .npy, as many files; and bad input refused with one message and status 2."""

import re
import shutil
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
from helpers import REPO, assert_ok, finish, launch
from test_dictlearn import learned

SETTINGS = ["--atoms", "24", "--sparsity", "3", "--iterations", "40", "--batch-size", "128", "--progress-every", "0"]

# Written by a separate Python process with nothing but h5py and numpy, as a user's pipeline would.
WRITER = textwrap.dedent(
    """
    import sys
    import h5py, hdf5plugin, numpy as np
    out = sys.argv[1]
    i, j = np.meshgrid(np.arange(1200), np.arange(16), indexing="ij")
    X = np.sin(0.37 * i + 1.3 * j) * np.cos(0.011 * i * (j % 5 + 1)) + 0.1 * np.cos(2.1 * i * j)
    with h5py.File(f"{out}/plain.h5", "w") as f:
        f["X"] = X
    with h5py.File(f"{out}/layouts.h5", "w") as f:
        f.create_dataset("chunked/X", data=X, chunks=(100, 16))
        f.create_dataset("gzip/X", data=X, chunks=(64, 8), compression="gzip", shuffle=True)
        f.create_dataset("lzf/X", data=X, chunks=(50, 16), compression="lzf")
        f.create_dataset("plugins/blosc/X", data=X, chunks=(100, 16), **hdf5plugin.Blosc("zstd", 5, 2))  # bitshuffle
        f.create_dataset("plugins/lz4/X", data=X, chunks=(300, 8), **hdf5plugin.LZ4())
        f.create_dataset("big/endian/X", data=X.astype(">f8"))
        f.create_dataset("float32/X", data=X.astype(np.float32))
        f.create_dataset("int16/X", data=np.round(X * 1000).astype(np.int16))
        narrowed = h5py.h5t.STD_I16LE.copy()  # the same values as a C tool keeps 12-bit samples: bits 4..15 of 16
        narrowed.set_precision(12)
        narrowed.set_offset(4)
        f.require_group("int12")
        h5py.h5d.create(f.id, b"int12/X", narrowed, h5py.h5s.create_simple((1200, 16)))
        f["int12/X"][...] = np.round(X * 1000).astype(np.int16)
        f.create_dataset("patches/X", data=X.reshape(1200, 4, 4))
        f.create_dataset("vectors/X", shape=(1200,), dtype=np.dtype((">f8", (16,))))[...] = X  # HDF5 array type
        f.create_dataset("bad/one_d", data=X[:, 0])
        f.create_dataset("bad/strings", data=np.full((40, 3), b"abc"))
        f.create_dataset("bad/compound", data=np.zeros((40, 3), dtype=[("a", "f8"), ("b", "i4")]))
        f.create_dataset("bad/table", data=np.rec.fromarrays([X[:, 0], X[:, 1].astype("f4")], names="depth,t"))
        f.create_dataset("bad/text", data=["a sample's note"] * 40, dtype=h5py.string_dtype())
        f.create_dataset("bad/empty", shape=(0, 16), dtype="f8")
        f.create_dataset("bad/no_features", shape=(1200, 0), dtype="f8")
        f.create_dataset("bad/nan", data=np.where(i == 700, np.nan, X))
    with h5py.File(f"{out}/links.h5", "w") as f:  # links, as users join files without copying them
        f["labels"] = np.arange(1200)  # (first: plain.h5's rows lie at an offset where links.h5 holds other bytes)
        f["soft"] = h5py.SoftLink("/data/X")
        f["data/X"] = X
        f["outside"] = h5py.ExternalLink("plain.h5", "/X")
        f["dangling"] = h5py.ExternalLink("gone.h5", "/X")
        f["elsewhere"] = h5py.ExternalLink("plain.h5", "/nope")
    with h5py.File(f"{out}/checksummed.h5", "w") as f:  # a chunk of it damaged afterwards (a bit flipped on disk)
        f.create_dataset("X", data=X, chunks=(100, 16), fletcher32=True)
        damaged = f["X"].id.get_chunk_info(9).byte_offset + 10
    with open(f"{out}/checksummed.h5", "r+b") as f:
        f.seek(damaged)
        byte = f.read(1)[0]
        f.seek(damaged)
        f.write(bytes([byte ^ 0x10]))
    import os
    os.chdir(out)  # (raw files of external storage are named from the writer's directory: beside the files here)
    with h5py.File("raw.h5", "w") as f:  # the rows in a raw binary file of their own (HDF5's external storage)
        f.create_dataset("X", data=X, external=[("raw.bin", 0, h5py.h5f.UNLIMITED)])
    with h5py.File("rawcut.h5", "w") as f:  # the same, its raw file cut short afterwards
        f.create_dataset("X", data=X, external=[("rawcut.bin", 0, h5py.h5f.UNLIMITED)])
    os.truncate("rawcut.bin", 1000 * 16 * 8 + 5)
    np.save(f"{out}/X.npy", X)
    import scipy.sparse
    cells = scipy.sparse.csr_matrix(X)  # as AnnData keeps a cell x gene matrix in an .h5ad: CSR, big-endian here
    with h5py.File(f"{out}/cells.h5ad", "w") as f:
        group = f.create_group("X")
        group.attrs["encoding-type"], group.attrs["encoding-version"] = "csr_matrix", "0.1.0"
        group.attrs["shape"] = np.array(cells.shape)
        group["data"], group["indices"], group["indptr"] = cells.data.astype(">f8"), cells.indices, cells.indptr
        f.create_group("obs")["cell"] = np.arange(1200)
    scipy.sparse.save_npz(f"{out}/cells.npz", cells)  # SciPy's own archive of it: refused with the conversion
    # as MATLAB's save -v7.3 writes a 16 x 1200 array (signals as columns, as SPAMS takes them): HDF5 after a
    # 512-byte header, each array transposed and marked with its MATLAB class
    with h5py.File(f"{out}/signals.mat", "w", userblock_size=512) as f:
        f.create_dataset("X", data=X).attrs["MATLAB_class"] = np.bytes_("double")
    with open(f"{out}/signals.mat", "r+b") as f:
        f.write(b"MATLAB 7.3 MAT-file, Platform: GLNXA64, Created on: Sat Dec  5 18:00:00 2026 HDF5 schema 1.00 .")
    np.savez(f"{out}/arrays.npz", X=X, t=np.arange(1200.0), scalar=np.float64(3.0))  # numpy's own archive
    np.savez(f"{out}/only.npz", np.asfortranarray(X))  # one array, unnamed (arr_0), in Fortran order
    np.savez_compressed(f"{out}/squeezed.npz", X=X)
    for saved in ("X.npy", "arrays.npz"):  # each saved again and stopped by a full disk: the file ends early
        with open(f"{out}/{saved}", "rb") as whole, open(f"{out}/full-disk-{saved}", "wb") as cut:
            cut.write(whole.read(20000))
    open(f"{out}/nothing.npy", "wb").close()  # a save that never wrote a byte
    for part, (lo, hi) in enumerate([(0, 100), (100, 700), (700, 1200)]):
        with h5py.File(f"{out}/run-{[2, 9, 10][part]}.h5", "w") as f:
            f["sim/X"] = X[lo:hi]
    with open(f"{out}/parts.txt", "w") as f:
        f.write("# the same parts, listed\\nrun-2.h5\\nrun-9.h5\\nrun-10.h5\\n")
    with open(f"{out}/twice.txt", "w") as f:
        f.write("run-2.h5\\nrun-9.h5\\nrun-2.h5\\n")
    # the same parts joined by a virtual data set, as h5py's docs show (sources named beside the file)
    with open(f"{out}/run-10.h5", "rb") as whole, open(f"{out}/cut-10.h5", "wb") as cut:
        cut.write(whole.read(500))  # a copy cut short
    for part, (lo, hi) in enumerate([(0, 100), (100, 700), (700, 1200)]):  # the parts compressed with Zstd
        with h5py.File(f"{out}/zrun-{[2, 9, 10][part]}.h5", "w") as f:
            f.create_dataset("sim/X", data=X[lo:hi], chunks=(50, 16), **hdf5plugin.Zstd())
    layout = h5py.VirtualLayout(shape=(1200, 16), dtype="f8")
    for part, (lo, hi) in zip(["zrun-2.h5", "zrun-9.h5", "zrun-10.h5"], [(0, 100), (100, 700), (700, 1200)]):
        layout[lo:hi] = h5py.VirtualSource(part, "sim/X", shape=(hi - lo, 16))
    with h5py.File(f"{out}/zjoined.h5", "w") as f:
        f.create_virtual_dataset("X", layout)
    for name, last in [("joined", "run-10.h5"), ("broken", "gone-10.h5"), ("damaged", "cut-10.h5")]:
        layout = h5py.VirtualLayout(shape=(1200, 16), dtype="f8")
        for part, (lo, hi) in zip(["run-2.h5", "run-9.h5", last], [(0, 100), (100, 700), (700, 1200)]):
            layout[lo:hi] = h5py.VirtualSource(part, "sim/X", shape=(hi - lo, 16))
        with h5py.File(f"{out}/{name}.h5", "w") as f:
            f.create_virtual_dataset("X", layout)
    """
)

# The same values from HDF5's own C library: big-endian, chunked, shuffled and deflated, in nested groups.
C_WRITER = textwrap.dedent(
    """
    #include <hdf5.h>
    #include <math.h>
    static double x[1200][16];
    static size_t same(unsigned flags, size_t n, const unsigned values[], size_t bytes, size_t *size, void **buffer) {
        return bytes;
    }
    static const H5Z_class2_t codec = {H5Z_CLASS_T_VERS, (H5Z_filter_t)40000, 1, 1, "lab-codec", NULL, NULL, same};
    int main(int argc, char **argv) {
        hsize_t dims[2] = {1200, 16}, chunk[2] = {128, 16};
        for (int i = 0; i < 1200; i++)
            for (int j = 0; j < 16; j++)
                x[i][j] = sin(0.37 * i + 1.3 * j) * cos(0.011 * i * (j % 5 + 1)) + 0.1 * cos(2.1 * i * j);
        hid_t file = H5Fcreate(argv[1], H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
        hid_t links = H5Pcreate(H5P_LINK_CREATE);
        H5Pset_create_intermediate_group(links, 1);
        hid_t space = H5Screate_simple(2, dims, NULL);
        hid_t create = H5Pcreate(H5P_DATASET_CREATE);
        H5Pset_chunk(create, 2, chunk);
        H5Pset_shuffle(create);
        H5Pset_deflate(create, 4);
        hid_t data = H5Dcreate2(file, "/instrument/run1/X", H5T_IEEE_F64BE, space, links, create, H5P_DEFAULT);
        H5Dwrite(data, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, x);
        H5Dclose(data);
        /* a lab's own codec (here it passes the bytes through), registered only in the writer */
        H5Zregister(&codec);
        H5Pset_filter(create, 40000, H5Z_FLAG_OPTIONAL, 0, NULL);
        data = H5Dcreate2(file, "/instrument/run1/coded", H5T_IEEE_F64LE, space, links, create, H5P_DEFAULT);
        H5Dwrite(data, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, x);
        H5Dclose(data); H5Pclose(create); H5Sclose(space); H5Pclose(links); H5Fclose(file);
        return 0;
    }
    """
)


def dictlearn(ranks: int, out, *options: str, timeout: float = 120, env: dict | None = None):
    command = [sys.executable, "-m", "mpiscale.cli", "dictlearn", "--out", str(out), *SETTINGS, *options]
    return finish(launch(ranks, command, env=env), f"dictlearn {' '.join(options)} on {ranks} ranks", timeout)


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("user")
    subprocess.run([sys.executable, "-c", WRITER, str(directory)], check=True, timeout=60)
    indexed = subprocess.run(
        [sys.executable, "-m", "mpiscale.cli", "index", str(directory / "index.h5"), str(directory / "run-*.h5")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert indexed.returncode == 0 and "3 files as one data set: /sim/X (1200, 16)" in indexed.stdout, indexed
    compiler = shutil.which("h5pcc")
    if compiler:
        (directory / "writer.c").write_text(C_WRITER)
        subprocess.run([compiler, "-o", "writer", "writer.c", "-lm"], cwd=directory, check=True, timeout=120)
        subprocess.run([str(directory / "writer"), str(directory / "from_c.h5")], check=True, timeout=30)
    return directory


@pytest.fixture(scope="module")
def reference(user_files, tmp_path_factory):
    """The dictionary learned on 2 ranks from the plain contiguous float64 file."""
    out = tmp_path_factory.mktemp("ref") / "plain.h5"
    assert_ok(dictlearn(2, out, "--data", f"{user_files}/plain.h5:/X"))
    with h5py.File(out, "r") as file:
        error = file["metrics"]["error"][()]
        assert error[-5:].mean() < 0.9 * error[:3].mean(), error  # it learns
        assert file.attrs["data"] == f"{user_files}/plain.h5:/X"
    return learned(out)


@pytest.mark.parametrize(
    ("ranks", "spec", "options"),
    [
        (1, "plain.h5", []),
        (4, "plain.h5:/X", []),
        (2, "plain.h5:/X", ["--in-memory", "no"]),
        (2, "layouts.h5:/chunked/X", []),
        (2, "layouts.h5:/gzip/X", []),
        (4, "layouts.h5:/lzf/X", []),
        (2, "layouts.h5:/plugins/blosc/X", []),  # hdf5plugin's filters (a traceback naming a plugin directory)
        (4, "layouts.h5:/plugins/lz4/X", ["--in-memory", "no"]),
        (2, "layouts.h5:/big/endian/X", ["--in-memory", "no"]),
        (2, "layouts.h5:/patches/X", []),
        (2, "layouts.h5:/vectors/X", []),  # "a 1-D array of 1200 values is not a set of signals"
        (4, "layouts.h5:/vectors/X", ["--in-memory", "no"]),
        (2, "X.npy", []),
        (2, "cells.h5ad:/X", []),  # "is a group, not a dataset (datasets in it: data, indices, indptr)"
        (4, "cells.h5ad:/X", ["--in-memory", "no"]),
        (2, "arrays.npz:/X", []),  # it said "not an HDF5 file"
        (4, "only.npz", ["--in-memory", "no"]),
        (4, "run-*.h5:/sim/X", []),
        (2, "parts.txt:/sim/X", ["--in-memory", "no"]),
        (2, "index.h5:/sim/X", []),
        (2, "joined.h5:/X", []),  # HDF5 reads no virtual data set through MPI-IO: it ended the job
        (2, "zjoined.h5:/X", ["--in-memory", "no"]),  # (its sources need hdf5plugin's Zstd)
        (4, "joined.h5:/X", ["--in-memory", "no"]),
        (2, "from_c.h5:/instrument/run1/X", []),
        (2, "links.h5:/soft", []),
        (2, "links.h5:/outside", ["--in-memory", "no"]),
        (2, "links.h5:/outside", []),  # its rows were read at their offset in links.h5: other bytes, without a word
    ],
)
def test_the_same_values_learn_the_same_dictionary_whatever_the_file(
    tmp_path, user_files, reference, ranks, spec, options
):
    if spec.startswith("from_c") and not (user_files / "from_c.h5").exists():
        pytest.skip("h5pcc (HDF5's compiler wrapper) is not installed")
    out = tmp_path / "results.h5"
    assert_ok(dictlearn(ranks, out, "--data", f"{user_files}/{spec}", *options))
    assert np.abs(learned(out) - reference).max() < 1e-9
    if "patches" in spec:
        with h5py.File(out, "r") as file:
            assert list(file.attrs["patch_shape"]) == [4, 4]


def test_a_matlab_array_is_read_as_its_columns_and_said_so(tmp_path, user_files, reference):
    """A MATLAB -v7.3 file is HDF5 with every array transposed: signals kept as MATLAB's columns (SPAMS's layout)
    are HDF5's rows, read right; a user whose MATLAB rows are the signals would have had MATLAB's columns learned
    without a word. Now rank 0 says how the array is read, and how to give its rows instead."""
    job = dictlearn(2, tmp_path / "results.h5", "--data", f"{user_files}/signals.mat:/X")
    assert_ok(job)
    assert np.abs(learned(tmp_path / "results.h5") - reference).max() < 1e-9
    said = "signals.mat:X is a MATLAB array (save -v7.3), which HDF5 holds transposed: it is read as 1200 signals of "
    assert job.stderr.count(said + "16 values, MATLAB's columns of its 16 x 1200 array") == 1, job.stderr[-3000:]


@pytest.mark.parametrize("dataset", ["float32/X", "int16/X"])
def test_narrow_types_learn(tmp_path, user_files, dataset):
    out = tmp_path / "results.h5"
    assert_ok(dictlearn(2, out, "--data", f"{user_files}/layouts.h5:/{dataset}"))
    with h5py.File(out, "r") as file:
        error = file["metrics"]["error"][()]
        assert error[-5:].mean() < 0.9 * error[:3].mean(), error


def test_an_integer_type_its_writer_narrowed_is_read_as_its_values(tmp_path, user_files):
    """12-bit integers at bit 4 of 16 (as a C tool keeps a detector's samples) were read as their raw bytes, each
    value 16 times too large, without a word, where a rank reads its rows alone (here, read ahead as it learns):
    they learn what the same values stored as plain int16 learn, to the objective (a dictionary's atoms are the
    same at any scale)."""
    alone = ["--in-memory", "no"]
    assert_ok(dictlearn(2, tmp_path / "plain.h5", "--data", f"{user_files}/layouts.h5:/int16/X", *alone))
    assert_ok(dictlearn(2, tmp_path / "narrowed.h5", "--data", f"{user_files}/layouts.h5:/int12/X", *alone))
    objectives = []
    for out in ("plain.h5", "narrowed.h5"):
        with h5py.File(tmp_path / out, "r") as file:
            objectives.append(file["metrics"]["objective"][()])  # (the atoms alone are the same at any scale)
    assert np.abs(learned(tmp_path / "narrowed.h5") - learned(tmp_path / "plain.h5")).max() < 1e-9
    np.testing.assert_allclose(objectives[1], objectives[0], rtol=1e-9)


@pytest.mark.parametrize(
    ("ranks", "spec", "message"),
    [
        (2, "layouts.h5:/nowhere/X", "layouts.h5:nowhere/X: no group 'nowhere'"),
        (2, "layouts.h5:/gzip", "layouts.h5:gzip: is a group, not a dataset (datasets in it: X (1200, 16) float64)"),
        (2, "layouts.h5:/bad/one_d", "a 1-D array of 1200 values is not a set of signals"),
        (4, "layouts.h5:/bad/strings", "signals must be numbers, got byte strings (|S3)"),
        (2, "layouts.h5:/bad/compound", "got a table (records of the fields a (float64), b (int32)), not one array"),
        # a table as NumPy or pandas records write it: it said "a 1-D array of 1200 values is not a set of signals"
        (
            2,
            "layouts.h5:/bad/table",
            "fields depth (float64), t (float32)), not one array of numbers: store its "
            "number fields as one array, e.g. numpy.lib.recfunctions.structured_to_",
        ),
        (2, "layouts.h5:/bad/text", "signals must be numbers, got strings (of variable length)"),
        (2, "layouts.h5:/bad/empty", "holds no signals (shape (0, 16))"),
        (2, "layouts.h5:/bad/no_features", "holds no signals (shape (1200, 0))"),  # "was never written"
        (1, "layouts.h5:/bad/nan", "signal 700 holds NaN or infinite values"),
        (2, "layouts.h5", "holds 19 data sets; name one as"),
        (4, ".", "is a directory, not an HDF5 file"),
        (
            2,
            "cells.npz",
            "cells.npz: is a SciPy sparse matrix (scipy.sparse.save_npz), not arrays of rows: save it as CSR in HDF5",
        ),  # (it said "holds 5 arrays; name one")
        (2, "parts.txt:/X", "run-2.h5:X: no dataset 'X' (datasets: sim/X (100, 16) float64)"),
        (2, "missing-*.h5:/X", "missing-*.h5: no files match this pattern"),
        (2, "twice.txt:/sim/X", "run-2.h5 twice: its rows would be read twice; name each file once"),  # (they were)
        (2, "WRITER.c:/X", "no such file"),
        (2, "broken.h5:/X", "maps rows to gone-10.h5, which is not there: HDF5 would give its fill value"),
        (2, "damaged.h5:/X", "maps rows to cut-10.h5, which is no readable HDF5 file"),
        (2, "links.h5:/dangling", "is a link to gone.h5:/X, a file that is not there"),  # it said "no dataset"
        (2, "links.h5:/elsewhere", "is a link to plain.h5:/nope, a data set that file does not hold"),
        (2, "arrays.npz", "holds 3 arrays; name one as"),
        (2, "arrays.npz:/Y", "holds no array 'Y' (arrays: X, scalar, t)"),
        (2, "arrays.npz:/scalar", "holds a single value, not rows"),
        (4, "squeezed.npz:/X", "stores 'X' compressed (numpy.savez_compressed): each rank would inflate all of it"),
        # it said "not a readable .npy file: mmap length is greater than file size"
        (
            2,
            "full-disk-X.npy",
            "is cut short: its header gives an array of shape (1200, 16) float64 (153,600 bytes), "
            "and the file holds 19,872 of them (a copy or a save that did not finish, or a full",
        ),
        (
            2,
            "full-disk-arrays.npz:/X",
            "(it begins as one but has no index, which a ZIP archive keeps at its end: cut "
            "short?): File is not a zip file",
        ),  # (that alone, it said)
        (4, "nothing.npy", "nothing.npy: is empty"),  # "EOF: reading magic string, expected 8 bytes got 0"
    ],
)
def test_bad_input_ends_every_rank_with_one_message_and_status_2(tmp_path, user_files, ranks, spec, message):
    job = dictlearn(ranks, tmp_path / "results.h5", "--data", f"{user_files}/{spec}")
    assert job.returncode == 2, job.output[-3000:]
    assert message in job.stderr, job.stderr[-3000:]
    assert job.stderr.count("mpiscale dictlearn:") == 1, job.stderr[-3000:]
    for noise in ("Traceback", "MPI_ABORT", "ORTE_ERROR_LOG", "SIGTERM", "non-zero", "-----"):
        assert noise not in job.output, job.output[-3000:]
    assert not (tmp_path / "results.h5").exists()


# A fresh process in which hdf5plugin is not installed (an import of it fails, as where nobody installed it).
WITHOUT_PLUGINS = textwrap.dedent(
    """
    import sys
    sys.modules["hdf5plugin"] = None
    from mpiscale.io import DataFileError, ShardedDataset
    try:
        ShardedDataset(sys.argv[1], "plugins/blosc/X")
    except DataFileError as error:
        print(error)
    """
)


def test_a_filter_nothing_here_decodes_is_refused_before_any_read(tmp_path, user_files):
    """Compressed data HDF5 cannot decode ended every rank in a traceback naming a plugin directory, at the first
    read. Without hdf5plugin a Blosc file is refused, naming the filter and the fix; a lab's own codec (HDF5's C
    library, the filter registered in the writer only), which hdf5plugin does not decode either, on 2 ranks."""
    hidden = subprocess.run([sys.executable, "-c", WITHOUT_PLUGINS, f"{user_files}/layouts.h5"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert "plugins/blosc/X: is compressed with HDF5 filter 32001 (blosc), which this HDF5 cannot decode: pip " \
        "install hdf5plugin" in hidden.stdout, hidden  # fmt: skip
    if not (user_files / "from_c.h5").exists():
        pytest.skip("h5pcc (HDF5's compiler wrapper) is not installed")
    job = dictlearn(2, tmp_path / "results.h5", "--data", f"{user_files}/from_c.h5:/instrument/run1/coded")
    assert job.returncode == 2 and job.stderr.count("mpiscale dictlearn:") == 1, job.output[-3000:]
    assert "is compressed with HDF5 filter 40000 (lab-codec), which neither this HDF5 nor hdf5plugin decodes: set " \
        "HDF5_PLUGIN_PATH" in job.stderr, job.stderr  # fmt: skip
    assert "Traceback" not in job.output and not (tmp_path / "results.h5").exists()


def test_a_damaged_chunk_ends_the_job_naming_the_file_and_its_rows(tmp_path, user_files):
    """A bit flipped in a checksummed chunk ended the job with HDF5's bare OSError ("Can't read data (data error
    detected by Fletcher32 checksum)") in a traceback, naming neither the file nor the rows. The scan before any work
    finds it, and every rank refuses the job with one line naming both."""
    job = dictlearn(2, tmp_path / "results.h5", "--data", f"{user_files}/checksummed.h5:/X")
    assert job.returncode == 2 and job.stderr.count("mpiscale dictlearn:") == 1, job.output[-3000:]
    assert "Traceback" not in job.output
    said = r"checksummed.h5:/?X: rows \d+\.\.\d+ cannot be read \(Can't read data \(data error detected by Fletcher32"
    assert re.search(said + r" checksum\)\): the file is damaged there", job.stderr), job.stderr[-3000:]
    assert not (tmp_path / "results.h5").exists()


# A user's program still writing its file: half its rows written and flushed, the file held open until told to go on.
STILL_WRITING = textwrap.dedent(
    """
    import sys
    import h5py, numpy as np
    X = np.random.default_rng(4).standard_normal((1200, 16))
    with h5py.File(sys.argv[1], "w") as f:
        d = f.create_dataset("X", shape=X.shape, dtype=X.dtype)
        d[:600] = X[:600]
        f.flush()
        print("half written", flush=True)
        sys.stdin.readline()
        d[600:] = X[600:]
    print("closed", flush=True)
    """
)


def test_a_file_another_program_still_writes_is_refused_naming_it_and_read_once_closed(tmp_path):
    """A user's h5py program holds its file open for writing (HDF5's lock), half its rows written: MPI-IO takes no
    lock, and the job learned from the 600 rows and 600 of the fill value without a word. Every rank now refuses it
    with one line naming the file and the writer's process; with HDF5's locking turned off (``HDF5_USE_FILE_LOCKING``)
    it reads it, and once the writer has closed it, the job runs as it is."""
    held = tmp_path / "held.h5"
    writer = subprocess.Popen([sys.executable, "-c", STILL_WRITING, str(held)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert writer.stdout.readline() == "half written\n"
        job = dictlearn(2, tmp_path / "results.h5", "--data", f"{held}:/X")
        said = f"{held}: is open for writing by process {writer.pid} (python"
        assert job.returncode == 2 and said in job.stderr, job.output[-3000:]
        assert job.stderr.count("mpiscale dictlearn:") == 1 and "Traceback" not in job.output, job.output[-3000:]
        assert not (tmp_path / "results.h5").exists()
        anyway = dictlearn(2, tmp_path / "anyway.h5", "--data", f"{held}:/X", env={"HDF5_USE_FILE_LOCKING": "FALSE"})
        assert_ok(anyway)  # (HDF5's own setting turns its locks off: the user's choice, the check goes with them)
        writer.stdin.write("go on\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "closed\n"
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert_ok(dictlearn(2, tmp_path / "results.h5", "--data", f"{held}:/X"))


def test_rows_kept_in_raw_files_beside_are_found_where_hdf5_is_told_to_look_or_refused(tmp_path, user_files, reference):
    """HDF5 looks for a data set's raw files (external storage) from the current directory. A job started elsewhere
    than the data ended in a traceback saying the file was damaged; it is refused with the two ways to run it, and
    with HDF5_EXTFILE_PREFIX='${ORIGIN}' learns what it learns from the plain file. A raw file cut short was read
    with zeros for its missing rows, without a word; it is refused naming the first of them."""
    assert not (REPO / "raw.bin").exists()
    job = dictlearn(2, tmp_path / "results.h5", "--data", f"{user_files}/raw.h5:/X")
    assert job.returncode == 2 and job.stderr.count("mpiscale dictlearn:") == 1, job.output[-3000:]
    assert f"keeps its rows in the raw file raw.bin (external storage), which HDF5 looks for from the current " \
        f"directory, {REPO} and does not find there; it is beside the HDF5 file: start the job in " \
        f"{user_files}, or set HDF5_EXTFILE_PREFIX='${{ORIGIN}}'" in job.stderr, job.stderr  # fmt: skip
    beside = {"HDF5_EXTFILE_PREFIX": "${ORIGIN}"}
    assert_ok(dictlearn(2, tmp_path / "results.h5", "--data", f"{user_files}/raw.h5:/X", env=beside))
    assert np.abs(learned(tmp_path / "results.h5") - reference).max() < 1e-9
    job = dictlearn(2, tmp_path / "cut.h5", "--data", f"{user_files}/rawcut.h5:/X", env=beside)
    assert job.returncode == 2 and not (tmp_path / "cut.h5").exists(), job.output[-3000:]
    said = "storage), which holds 128005 of them: HDF5 would read zeros for the rows from 1000 on"
    assert f"keeps 153600 bytes of its rows in the raw file {user_files}/rawcut.bin from byte 0 (external {said}" \
        in job.stderr, job.stderr  # fmt: skip
