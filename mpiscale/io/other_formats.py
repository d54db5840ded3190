"""What a data file that is not HDF5 (nor named as NumPy's) holds, by its first bytes, and the line that makes it an
array the jobs read.

Users arrive with the files their tools write: a CSV, a tensor of ``torch.save``, a
Parquet table, an HDF5 file still gzipped, MATLAB's format before ``-v7.3``. "Not an
HDF5 file" names none of them; this names each, with the conversion.
"""

from __future__ import annotations

import os
import zipfile

_HEAD_BYTES = 4096


def other_format(path: str) -> str | None:
    """What ``path`` holds, in words with the line that converts it, where its first bytes tell a format the jobs
    do not read; None where they tell nothing known."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(_HEAD_BYTES)
    except OSError:
        return None
    npy = os.path.splitext(path)[0] + ".npy"
    if head.startswith(b"\x93NUMPY"):
        return f"a NumPy array (.npy) by its contents, which the jobs know by its name: name it {npy}"
    if head.startswith(b"PK\x03\x04"):
        return _archive(path, npy)
    if head.startswith(b"\x1f\x8b"):
        return f"a gzip-compressed file: decompress it first (gunzip {path})"
    if head.startswith(b"PAR1"):
        return f"a Parquet table: save it as NumPy, numpy.save({npy!r}, pandas.read_parquet({path!r}).to_numpy())"
    if head.startswith((b"CDF\x01", b"CDF\x02", b"CDF\x05")):
        return f"a classic netCDF file (netCDF-4 files are HDF5): convert it, nccopy -k nc4 {path} {npy[:-4]}.nc4"
    if head.startswith(b"MATLAB 5.0 MAT-file"):
        return (f"a MATLAB file of the format before -v7.3: save it again with save('{path}', 'X', '-v7.3'), or "
                f"convert it, numpy.save({npy!r}, scipy.io.loadmat({path!r})['X'])")  # fmt: skip
    if len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5:  # (a pickle's protocol 2 to 5)
        return (f"a Python pickle (pickle, joblib, or an old torch.save): load it and save the array as NumPy, "
                f"numpy.save({npy!r}, array)")  # fmt: skip
    return _text(path, head, npy)


def other_directory(path: str) -> str | None:
    """What a directory given as a data file holds, where its files tell a store the jobs do not read (Zarr, as
    AnnData and xarray write it); None otherwise."""
    if any(os.path.exists(os.path.join(path, marker)) for marker in (".zgroup", ".zarray", "zarr.json")):
        stem = os.path.splitext(os.path.normpath(path))[0]
        return (f"a Zarr store, which the jobs do not read: write it as HDF5, e.g. anndata.read_zarr({path!r})"
                f".write_h5ad('{stem}.h5ad') for AnnData, or its arrays with h5py")  # fmt: skip
    return None


def _archive(path: str, npy: str) -> str:
    """What a ZIP archive holds: a tensor of torch.save, NumPy's arrays, or anything else."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return "a ZIP archive (cut short?)"
    if any(name.endswith("/data.pkl") for name in names):
        return (f"a PyTorch file (torch.save): save the tensor as NumPy, numpy.save({npy!r}, "
                f"torch.load({path!r}).numpy())")  # fmt: skip
    if names and all(name.endswith(".npy") for name in names):
        return f"NumPy arrays (numpy.savez) by its contents, which the jobs know by its name: name it {npy[:-4]}.npz"
    return "a ZIP archive: unpack it"


def _text(path: str, head: bytes, npy: str) -> str | None:
    """A table of numbers as text (CSV, or columns split by tabs or spaces), or None where ``head`` is no text."""
    try:
        text = head.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    lines = text.splitlines()
    if not lines or not all(line.replace("\t", " ").isprintable() for line in lines[:-1]):
        return None
    rows = [line.replace(",", " ").replace("\t", " ").split() for line in lines[:2]]
    header = not all(map(_number, rows[0]))
    if not rows[0] or not all(map(_number, rows[-1] if header else rows[0])):
        return "a text file, which holds no table of numbers in its first lines"
    delimiter = "," if "," in lines[0] else "\\t" if "\t" in lines[0] else None
    options = (f", delimiter='{delimiter}'" if delimiter else "") + (", skiprows=1" if header else "")
    return (f"a text file (a table of numbers as CSV?): save it as NumPy, numpy.save({npy!r}, "
            f"numpy.loadtxt({path!r}{options}))")  # fmt: skip


def _number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True
