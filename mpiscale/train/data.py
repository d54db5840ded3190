"""The trainer's view of its data: checks before any work, the input statistics, a rank's block of rows."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..io import DataFileError, ShardedDataset, read_dataset
from ..ranks import Comm, rank_rows


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

    @property
    def spec(self) -> str:
        """The inputs as dictlearn and collect name them: FILE:/dataset."""
        return f"{self.path}:/{self.inputs}"


def check_labelled(path: str, inputs: str, labels: str, comm: Comm) -> tuple[LabelledData, int, np.ndarray, np.ndarray]:
    """Check ``path``'s inputs and labels (collective); returns (data, classes, feature mean, feature std).

    Inputs must be numbers without NaN or infinity, labels integers >= 0, one
    per input row. Every rank raises the same ``DataFileError``: the checks
    use totals every rank sees. The data's path is kept absolute, so results
    files name it from anywhere.
    """
    from mpi4py import MPI

    with ShardedDataset(path, inputs, comm) as data:
        shape, dtype, image_shape = data.shape, data.dtype, data.image_shape()
    with ShardedDataset(path, labels, comm) as data:
        label_shape, label_dtype = data.shape, data.dtype
    if dtype.kind not in "biuf" or len(shape) < 2:
        raise DataFileError(path, f"inputs must be numbers, one sample per row; got {dtype} of shape {shape}", inputs)
    if label_dtype.kind not in "iu" or len(label_shape) != 1:
        raise DataFileError(
            path, f"labels must be integers, one per sample; got {label_dtype} of shape {label_shape}", labels
        )
    if not shape[0]:
        raise DataFileError(path, "holds no samples", inputs)
    if label_shape[0] != shape[0]:
        raise DataFileError(path, f"{shape[0]} inputs but {label_shape[0]} labels", labels)
    block = read_dataset(path, inputs, comm).reshape(-1, int(np.prod(shape[1:]))).astype(np.float64)
    tags = read_dataset(path, labels, comm).astype(np.int64)
    sums = np.stack([block.sum(axis=0), (block * block).sum(axis=0)])
    comm.Allreduce(MPI.IN_PLACE, sums)
    bad = np.flatnonzero(~np.isfinite(block).all(axis=1))
    first = rank_rows(shape[0], comm.Get_size(), comm.Get_rank())[0]
    first_bad = comm.allreduce(first + int(bad[0]) if len(bad) else shape[0], op=MPI.MIN)
    extremes = np.array([tags.min(initial=2**62), -tags.max(initial=-1)], dtype=np.int64)  # (lowest, -highest)
    comm.Allreduce(MPI.IN_PLACE, extremes, op=MPI.MIN)
    span = np.array([block.min(initial=np.inf), -block.max(initial=-np.inf)])  # of the inputs: (lowest, -highest)
    comm.Allreduce(MPI.IN_PLACE, span, op=MPI.MIN)
    if first_bad < shape[0]:
        raise DataFileError(path, f"sample {first_bad} holds NaN or infinite values; clean the data first", inputs)
    if extremes[0] < 0:
        raise DataFileError(path, f"labels must be 0 or more (class numbers), found {extremes[0]}", labels)
    samples = shape[0]
    mean = sums[0] / samples
    std = np.sqrt(np.maximum(sums[1] / samples - mean * mean, 0.0))
    checked = LabelledData(os.path.abspath(path), inputs, labels, samples, int(np.prod(shape[1:])), image_shape,
                           dtype.kind in "biu", float(span[0]), float(-span[1]))  # fmt: skip
    return checked, int(-extremes[1]) + 1, mean, std


def resident_block(data: LabelledData, comm: Comm, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(inputs as rows of ``dtype``, labels) of this rank's block of the file, read collectively."""
    inputs = read_dataset(data.path, data.inputs, comm).reshape(-1, data.features).astype(dtype)
    return inputs, read_dataset(data.path, data.labels, comm).astype(np.int64)


def check_classes(data: LabelledData, classes: int) -> None:
    """Refuse more classes than training samples: a label of 100000 among 300 rows is a mistake, not a model."""
    if classes > data.samples:
        raise DataFileError(data.path, (
            f"labels go up to {classes - 1}, but there are only {data.samples} training samples: labels are class "
            "numbers 0 .. classes-1 (renumber them, e.g. with numpy.unique(labels, return_inverse=True))"
        ), data.labels)  # fmt: skip
