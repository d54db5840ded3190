"""The data ``mpiscale train`` writes beside its results when no ``--data`` is given.

For the MLP, scikit-learn's bundled handwritten digits: 1,797 images of 8 x 8
pixels (values 0-16) in ten classes, shipped inside scikit-learn, so the job
needs no download; both files record ``patch_shape`` [8, 8] in their config, so
dictlearn and inspect draw rows as images. For the transformer, a synthetic
sequence task (:func:`make_sequences`). Each time the first 80% become the
training file and the rest the held-out file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from ..io import write_dataset
from ..ranks import Comm, rank_rows, size_and_rank

TRAIN_SHARE = 0.8

#: The synthetic sequences: how many, their length, the vocabulary, the classes (the first tokens) and the seed.
SEQUENCES, LENGTH, VOCABULARY, SEQUENCE_CLASSES, SEQUENCE_SEED = 5000, 24, 16, 4, 2026


def bundled_paths(out: str, name: str) -> tuple[str, str]:
    """(training file, held-out file) of the bundled data ``name`` beside the results file ``out``."""
    stem = Path(out).with_suffix("")
    return f"{stem}.{name}.h5", f"{stem}.{name}-validation.h5"


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


def make_sequences() -> tuple[np.ndarray, np.ndarray]:
    """(int32 token rows, int64 labels): which of the class tokens 0 .. 3 a sequence holds most often.

    Each sequence of ``LENGTH`` tokens holds every class token 0 to 3 times and
    its label's token once or twice more than the most frequent other one, at
    random positions; the other positions hold tokens 4 .. 15. The same arrays
    on every call (a fixed seed).
    """
    rng = np.random.default_rng(SEQUENCE_SEED)
    tokens = rng.integers(SEQUENCE_CLASSES, VOCABULARY, size=(SEQUENCES, LENGTH), dtype=np.int32)
    labels = rng.integers(0, SEQUENCE_CLASSES, SEQUENCES)
    counts = rng.integers(0, 4, size=(SEQUENCES, SEQUENCE_CLASSES))
    counts[np.arange(SEQUENCES), labels] = counts.max(axis=1) + rng.integers(1, 3, SEQUENCES)
    places = np.argsort(rng.random((SEQUENCES, LENGTH)), axis=1)
    for row in range(SEQUENCES):
        marks = np.repeat(np.arange(SEQUENCE_CLASSES, dtype=np.int32), counts[row])
        tokens[row, places[row, : len(marks)]] = marks
    return tokens, labels.astype(np.int64)


def write_digits(out: str, comm: Comm) -> tuple[str, str]:
    """Write the digits' two files (collective) and return their paths."""
    inputs, labels = load_digits()
    config = {"source": "sklearn.datasets.load_digits", "patch_shape": [8, 8]}
    return _write(bundled_paths(out, "digits"), inputs, labels, config, comm)


def write_sequences(out: str, comm: Comm) -> tuple[str, str]:
    """Write the synthetic sequences' two files (collective) and return their paths."""
    inputs, labels = make_sequences()
    config = {"source": "mpiscale.train.bundled.make_sequences", "vocabulary": VOCABULARY}
    return _write(bundled_paths(out, "sequences"), inputs, labels, config, comm)


def _write(paths: tuple[str, str], inputs: np.ndarray, labels: np.ndarray, config: dict, comm: Comm):
    """The first ``TRAIN_SHARE`` of the rows into the first file, the rest into the second; each rank its block."""
    cut = int(len(inputs) * TRAIN_SHARE)
    size, rank = size_and_rank(comm)
    for path, (lo, hi) in zip(paths, [(0, cut), (cut, len(inputs))], strict=True):
        start, stop = rank_rows(hi - lo, size, rank)
        rows = slice(lo + start, lo + stop)
        write_dataset(path, {"inputs": inputs[rows], "labels": labels[rows]}, comm, config | {"rows": [lo, hi]})
    return paths
