"""The default training data: scikit-learn's bundled handwritten digits, written as sharded HDF5 beside the results.

1,797 images of 8 x 8 pixels (values 0-16) in ten classes, shipped inside
scikit-learn, so the job needs no download. The first 80% become the training
file, the rest the held-out file; both record ``patch_shape`` [8, 8] in their
config, so dictlearn and inspect draw rows as images.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..io import write_dataset
from ..ranks import Comm, rank_rows, size_and_rank

TRAIN_SHARE = 0.8


def digits_paths(out: str) -> tuple[str, str]:
    """(training file, held-out file) beside the results file ``out``."""
    stem = Path(out).with_suffix("")
    return f"{stem}.digits.h5", f"{stem}.digits-validation.h5"


def write_digits(out: str, comm: Comm) -> tuple[str, str]:
    """Write both files (collective; each rank writes its block of rows) and return their paths."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    inputs = digits.images.reshape(len(digits.images), -1).astype(np.float32)
    labels = digits.target.astype(np.int64)
    cut = int(len(inputs) * TRAIN_SHARE)
    size, rank = size_and_rank(comm)
    config = {"source": "sklearn.datasets.load_digits", "patch_shape": [8, 8]}
    paths = digits_paths(out)
    for path, (lo, hi) in zip(paths, [(0, cut), (cut, len(inputs))], strict=True):
        start, stop = rank_rows(hi - lo, size, rank)
        rows = slice(lo + start, lo + stop)
        write_dataset(path, {"inputs": inputs[rows], "labels": labels[rows]}, comm, config | {"rows": [lo, hi]})
    return paths
