"""The default training data: scikit-learn's bundled handwritten digits, written as sharded HDF5 beside the results.

1,797 images of 8 x 8 pixels (values 0-16) in ten classes, shipped inside
scikit-learn, so the job needs no download. The first 80% become the training
file, the rest the held-out file; both record ``patch_shape`` [8, 8] in their
config, so dictlearn and inspect draw rows as images.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from ..io import write_dataset
from ..ranks import Comm, rank_rows, size_and_rank

TRAIN_SHARE = 0.8


def digits_paths(out: str) -> tuple[str, str]:
    """(training file, held-out file) beside the results file ``out``."""
    stem = Path(out).with_suffix("")
    return f"{stem}.digits.h5", f"{stem}.digits-validation.h5"


def sklearn_digits_file() -> Path | None:
    """Where scikit-learn keeps the digits (found without importing it), or None without scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    folders = spec.submodule_search_locations if spec is not None else None
    return Path(folders[0], "datasets", "data", "digits.csv.gz") if folders else None


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images as rows of 64 float32 values, int64 labels), as ``sklearn.datasets.load_digits`` gives them.

    Read from scikit-learn's own data file without importing scikit-learn,
    which costs every rank a second at start (several when ranks share cores);
    through scikit-learn if that file is not where it has always been.
    """
    path = sklearn_digits_file()
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as through_sklearn

        digits = through_sklearn()
        return digits.data.astype(np.float32), digits.target.astype(np.int64)
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    return np.ascontiguousarray(table[:, :-1]), table[:, -1].astype(np.int64)


def write_digits(out: str, comm: Comm) -> tuple[str, str]:
    """Write both files (collective; each rank writes its block of rows) and return their paths."""
    inputs, labels = load_digits()
    cut = int(len(inputs) * TRAIN_SHARE)
    size, rank = size_and_rank(comm)
    config = {"source": "sklearn.datasets.load_digits", "patch_shape": [8, 8]}
    paths = digits_paths(out)
    for path, (lo, hi) in zip(paths, [(0, cut), (cut, len(inputs))], strict=True):
        start, stop = rank_rows(hi - lo, size, rank)
        rows = slice(lo + start, lo + stop)
        write_dataset(path, {"inputs": inputs[rows], "labels": labels[rows]}, comm, config | {"rows": [lo, hi]})
    return paths
