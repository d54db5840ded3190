"""The trainer's view of its data: checks before any work, the input statistics, a rank's block of rows."""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass, field

import numpy as np

from ..io import (
    DataFileError,
    Fingerprint,
    RaggedDataset,
    ShardedDataset,
    is_npy,
    is_variable_length,
    not_numbers,
    read_dataset,
    refuse_unreadable,
    same_file,
    split_spec,
)
from ..ranks import Comm, on_rank_0, rank_rows

SCAN_SAMPLES = 4096  # ragged inputs' samples checked at once
DATA_FILE_SUFFIXES = (".npy", ".npz", ".h5", ".hdf5", ".hdf", ".he5", ".mat", ".nc")  # a labels spec naming a file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LabelledData:
    """A checked file of inputs and integer labels."""

    path: str
    inputs: str
    labels: str
    samples: int
    features: int
    patch_shape: list[int] | None  # rows that are images (for the catalogue and plots)
    integers: bool  # the inputs are stored as integers (token ids, for a transformer)
    lowest: float  # the smallest and largest input value
    highest: float
    ragged: bool = False  # sequences of varying length (features: the longest)
    offsets: str = ""  # their index of starts in the flat inputs ("" for a variable-length data set)
    lengths: np.ndarray | None = field(default=None, repr=False, compare=False)  # ragged: each sequence's
    fingerprint: str = ""  # of every input and label (``io.Fingerprint``): a resumed run refuses other data
    label_file: str = ""  # labels in a file of their own (absolute; "" for PATH's), ``labels`` then as given
    label_name: str = ""  # ... and their data set there ("" for the file's only array)

    @property
    def spec(self) -> str:
        """The inputs as dictlearn and collect name them: FILE:/dataset."""
        return f"{self.path}:/{self.inputs}"

    def source(self, key: str) -> tuple[str, str]:
        """(file, data set) of the array a batch holds under ``key`` (the inputs' or the labels' name)."""
        if key == self.labels and self.label_file:
            return self.label_file, self.label_name
        return self.path, key

    @property
    def label_source(self) -> tuple[str, str]:
        """(file, data set) of the labels: PATH's own, or a file of their own."""
        return self.source(self.labels)


def names_a_file(labels: str) -> bool:
    """Whether a labels setting names a file, not a data set of the inputs' file: a path ending as data files do
    (``y.npy``, ``labels.h5:/target``), or one of another ending that exists and is written as a path (with a
    directory, or a data set after a colon). A bare name is a data set's, whatever files lie about: else the default
    ``labels`` would be read from a file of that name that happens to lie in the working directory."""
    file = split_spec(labels)[0]
    if file.lower().endswith(DATA_FILE_SUFFIXES):
        return True
    return (file != labels or os.sep in labels) and os.path.isfile(file)


def check_labelled(path: str, inputs: str, labels: str, comm: Comm) -> tuple[LabelledData, int, np.ndarray, np.ndarray]:
    """Check ``path``'s inputs and labels (collective); returns (data, classes, feature mean, feature std: 0 for
    a feature of one value).

    Inputs must be numbers without NaN or infinity, labels integers >= 0, one
    per input row. Every rank raises the same ``DataFileError``: the checks
    use totals every rank sees. The data's path is kept absolute, so results
    files name it from anywhere.
    """
    from mpi4py import MPI

    labels, label_file, label_name = _labels_of(path, labels, comm)
    with ShardedDataset(path, inputs, comm) as data:
        shape, dtype, image_shape, matlab = data.shape, data.dtype, data.image_shape(), data.matlab_note("samples")
    if matlab and comm.Get_rank() == 0:
        log.warning(matlab)
    if dtype.kind not in "biuf":
        raise DataFileError(path, f"inputs must be numbers, one sample per row; got {not_numbers(dtype)}", inputs)
    if len(shape) < 2:
        raise DataFileError(path, f"inputs must be numbers, one sample per row; got {dtype} of shape {shape}", inputs)
    if not shape[0]:
        raise DataFileError(path, "holds no samples", inputs)
    if not math.prod(shape[1:]):  # (HDF5 failed to read the rows, said as damage)
        raise DataFileError(path, f"its samples hold no values (shape {shape})", inputs)
    tags = _class_numbers(label_file or path, label_name, shape[0], "inputs", comm)
    block = read_dataset(path, inputs, comm).reshape(-1, int(np.prod(shape[1:]))).astype(np.float64)
    first = rank_rows(shape[0], comm.Get_size(), comm.Get_rank())[0]
    fingerprint = Fingerprint()
    fingerprint.add(first, block)
    digest = _digest(comm, fingerprint, first, tags, shape)
    bad = np.flatnonzero(~np.isfinite(block).all(axis=1))
    first_bad = comm.allreduce(first + int(bad[0]) if len(bad) else shape[0], op=MPI.MIN)
    highest_label = comm.allreduce(int(tags.max(initial=-1)), op=MPI.MAX)
    ends = np.stack([block.min(axis=0, initial=np.inf), -block.max(axis=0, initial=-np.inf)])  # each feature's
    comm.Allreduce(MPI.IN_PLACE, ends, op=MPI.MIN)
    if first_bad < shape[0]:
        raise DataFileError(path, f"sample {first_bad} holds NaN or infinite values; clean the data first", inputs)
    samples = shape[0]
    unit = _power_of_two_unit(np.maximum(np.abs(ends[0]), np.abs(ends[1])))
    block /= unit
    sums = block.sum(axis=0)
    comm.Allreduce(MPI.IN_PLACE, sums)
    mean = sums / samples
    block -= mean  # the spread about the mean, in a second pass: E[x^2] - mean^2 cancels for a large mean
    squares = np.einsum("sf,sf->f", block, block)
    comm.Allreduce(MPI.IN_PLACE, squares)
    std = np.where(ends[0] == -ends[1], 0.0, np.sqrt(squares / samples)) * unit  # 0 exactly for a constant feature
    mean *= unit
    lowest, highest = float(ends[0].min(initial=np.inf)), float(-ends[1].min(initial=np.inf))
    checked = LabelledData(os.path.abspath(path), inputs, labels, samples, int(np.prod(shape[1:])), image_shape,
                           dtype.kind in "biu", lowest, highest, fingerprint=digest, label_file=_absolute(label_file),
                           label_name=label_name)  # fmt: skip
    return checked, highest_label + 1, mean, std


def is_ragged(path: str, inputs: str, offsets: str) -> bool:
    """Whether the inputs are sequences of varying length: an index of starts given, or a variable-length data set."""
    return bool(offsets) or is_variable_length(path, inputs)


def check_ragged(path: str, inputs: str, offsets: str, labels: str, comm: Comm) -> tuple[LabelledData, int]:
    """Check ragged token sequences and their labels (collective); returns (data, classes).

    The sequences must be integer token ids, none of them empty; labels
    integers >= 0, one per sequence. Each rank checks a block of the
    sequences; every rank raises the same ``DataFileError``.
    """
    from mpi4py import MPI

    labels, label_file, label_name = _labels_of(path, labels, comm)
    with RaggedDataset(path, inputs, offsets, comm) as data:
        lengths, dtype, name = data.lengths, data.dtype, data.name
        if dtype.kind not in "biu" or data.row_shape:
            raise DataFileError(path, (
                f"ragged inputs must be integer token ids, one sequence per sample; got {dtype} values of shape "
                f"{data.row_shape}"
            ), name)  # fmt: skip
        start, stop = rank_rows(len(data), comm.Get_size(), comm.Get_rank())
        starts = np.concatenate([[0], np.cumsum(lengths)])  # each sequence's first token among all tokens
        span = np.array([np.inf, np.inf])  # (lowest, -highest)
        fingerprint = Fingerprint()
        unreadable = None
        for at in range(start, stop, SCAN_SAMPLES):
            try:  # (each rank reads alone: a rank that cannot read its rows goes on to the agreement below)
                values = data.read(np.arange(at, min(stop, at + SCAN_SAMPLES))).values
            except DataFileError as error:
                unreadable = (at, error)
                break
            fingerprint.add(int(starts[at]), values.reshape(-1, 1))
            if len(values):
                span = np.minimum(span, [values.min(), -values.max()])
    refuse_unreadable(comm, unreadable)
    comm.Allreduce(MPI.IN_PLACE, span, op=MPI.MIN)
    if not len(lengths):
        raise DataFileError(path, "holds no sequences", name)
    empty = np.flatnonzero(lengths == 0)
    if len(empty):
        raise DataFileError(path, f"sequence {empty[0]} is empty ({len(empty)} are): drop empty samples", name)
    tags = _class_numbers(label_file or path, label_name, len(lengths), "sequences", comm)
    lengths_digest = hashlib.blake2b(lengths.astype(np.int64).tobytes(), digest_size=12).hexdigest()
    digest = _digest(comm, fingerprint, start, tags, lengths_digest)
    checked = LabelledData(os.path.abspath(path), name, labels, len(lengths), int(lengths.max()), None, True,
                           float(span[0]), float(-span[1]), True, offsets, lengths, digest, _absolute(label_file),
                           label_name)  # fmt: skip
    return checked, comm.allreduce(int(tags.max(initial=-1)), op=MPI.MAX) + 1


def _absolute(path: str) -> str:
    """``path`` absolute (results files name their inputs from anywhere); "" stays "" (none)."""
    return os.path.abspath(path) if path else ""


def _labels_of(path: str, labels: str, comm: Comm) -> tuple[str, str, str]:
    """(the key a batch holds the labels under, their own file or "", their data set) of the labels setting
    ``labels`` for the inputs in ``path`` (collective; rank 0 looks at the files): a data set of ``path``, keyed by
    its name, or, where ``labels`` names a file (``names_a_file``), that file's (its data set "" for its only
    array), keyed by the setting as given. A ``.npy`` of inputs holds no labels, and is refused without a file of
    them."""

    def look() -> tuple[str, str]:
        if not names_a_file(labels):
            return "", labels
        file, name = split_spec(labels)
        return ("", name) if same_file(file, path) else (file, name)

    label_file, label_name = on_rank_0(comm, look)
    if label_file:
        return labels, label_file, label_name
    if is_npy(path):  # (the labels were then taken from the inputs' own array: "labels must be class numbers ...")
        raise DataFileError(path, (
            "a .npy file holds one array, and training takes two, the inputs and their labels: give the labels' own "
            "file, e.g. --labels y.npy, or save both together, numpy.savez('train.npz', inputs=X, labels=y), and "
            "give --data train.npz"
        ))  # fmt: skip
    return label_name, "", label_name


def _power_of_two_unit(largest: np.ndarray) -> np.ndarray:
    """Each feature's unit for its sums: the power of two at its largest magnitude. Dividing by it is exact, so the
    statistics are those of the values as they are, bit for bit, while no square overflows float64 (for values past
    1e154 the spread came out infinite: every input standardised to 0, and the model learned from none of them)."""
    return np.ldexp(1.0, np.frexp(largest)[1])


def _class_numbers(path: str, labels: str, samples: int, what: str, comm: Comm) -> np.ndarray:
    """This rank's block of the labels as int64 (collective): one per sample, whole numbers 0 or more, in a vector
    or a column (N x 1, as scikit-learn takes them too). Floats of whole numbers are taken (MATLAB, R and pandas
    store labels so); any other value is refused, naming the first."""
    with ShardedDataset(path, labels, comm) as data:
        shape, dtype, matlab = data.shape, data.dtype, data.from_matlab
    if dtype.kind in "SUO":  # (class names: numbered as scikit-learn's LabelEncoder numbers them)
        raise DataFileError(path, (
            f"labels must be class numbers, one per sample; got {not_numbers(dtype)}: number the classes, e.g. "
            "names, numbers = numpy.unique(labels, return_inverse=True), and give the numbers (names[k] is class k)"
        ), labels)  # fmt: skip
    if dtype.kind not in "biuf" or len(shape) != 1 and shape[1:] != (1,):
        hint = ""
        if matlab and shape[0] == 1:
            hint = " (a MATLAB column, which HDF5 holds transposed: save the labels as a row, y = y.')"
        elif len(shape) == 2 and shape[0] == samples:
            hint = " (one-hot rows, as Keras keeps them? give each row's class, numpy.argmax(labels, axis=1))"
        raise DataFileError(path, f"labels must be class numbers, one per sample; got {dtype} of shape {shape}{hint}",
                            labels)  # fmt: skip
    if shape[0] != samples:
        raise DataFileError(path, f"{samples} {what} but {shape[0]} labels", labels)
    values = read_dataset(path, labels, comm).reshape(-1)
    wrong = values < 0
    if dtype.kind == "f":  # (not finite, a fraction, or past float64's whole numbers)
        wrong |= ~np.isfinite(values) | (values != np.round(values)) | (values >= 2**53)
    elif dtype.kind == "u":  # (past int64, where they would turn negative)
        wrong |= values > np.iinfo(np.int64).max
    first = rank_rows(samples, comm.Get_size(), comm.Get_rank())[0]
    found = np.flatnonzero(wrong)
    index, value = min(comm.allgather((first + int(found[0]), values[found[0]].item()) if len(found) else (samples, 0)))
    if index < samples:
        fix = "renumber them, e.g. with numpy.unique(labels, return_inverse=True)"
        raise DataFileError(
            path, f"label {index} is {value}: labels are class numbers, whole numbers 0 or more ({fix})", labels
        )
    return values.astype(np.int64)


def _digest(comm: Comm, inputs: Fingerprint, first_label: int, labels: np.ndarray, shape: object) -> str:
    """The digest of the inputs (this rank's rows, already added), of the labels (this rank's, from row
    ``first_label`` on) and of ``shape`` (collective)."""
    tags = Fingerprint()
    tags.add(first_label, labels.reshape(-1, 1))
    return inputs.digest(comm, tags.digest(comm), shape)


def check_classes(data: LabelledData, classes: int) -> None:
    """Refuse more classes than training samples: a label of 100000 among 300 rows is a mistake, not a model."""
    if classes > data.samples:
        file, name = data.label_source
        raise DataFileError(file, (
            f"labels go up to {classes - 1}, but there are only {data.samples} training samples: labels are class "
            "numbers 0 .. classes-1 (renumber them, e.g. with numpy.unique(labels, return_inverse=True))"
        ), name or None)  # fmt: skip
