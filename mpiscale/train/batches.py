"""Where a training step's samples come from: the reader for the data and batching asked, and the steps it makes.

Fixed rows batched ``sequential``ly keep the fixed-row reader (``BatchReader``);
ragged sequences, and any other batching, go through ``SampleReader``. With
``memory`` batching (a token budget) the batches, and so the steps of an
epoch, depend on the epoch: ``TrainingSteps`` counts them up front (a pure
function of the data, the seed and the settings, computed on every rank
alike) and finds the epoch and step a global step falls in.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from ..io import Batching, BatchReader, Ragged, RaggedDataset, SampleReader, ShardedDataset
from ..ranks import Comm
from .config import TrainConfig
from .data import LabelledData
from .encoder import PAD
from .model import model_rows

Reader = BatchReader | SampleReader


def batching(config: TrainConfig) -> Batching:
    """The batching of ``config`` (every global batch split over the replicas; the last partial one dropped)."""
    return Batching(
        config.batching, batch_size=config.batch_size, batch_tokens=config.batch_tokens,
        prefetch_bytes=int(config.prefetch_mib * 2**20), drop_last=True,
    )  # fmt: skip


def uses_samples(config: TrainConfig, data: LabelledData) -> bool:
    """Whether the run reads through ``SampleReader`` (ragged inputs, or batching other than sequential)."""
    return data.ragged or config.batching != "sequential"


def open_reader(config: TrainConfig, data: LabelledData, comm: Comm, read: list[str]) -> Reader:
    """This rank's reader of the arrays ``read`` (of the inputs and labels), over ``comm`` (collective)."""
    if not uses_samples(config, data):
        own = [key for key in read if data.source(key)[0] == data.path]
        others = {key: data.source(key) for key in read if key not in own}  # (labels in a file of their own)
        return BatchReader(data.path, own, config.batch_size, comm, shuffle=True, seed=config.seed, drop_last=True,
                           sources=others)  # fmt: skip
    inputs: RaggedDataset | ShardedDataset = (
        RaggedDataset(data.path, data.inputs, data.offsets, comm) if data.ragged else ShardedDataset(data.path,
                                                                                                     data.inputs)
    )  # fmt: skip
    arrays = {data.inputs: inputs, data.labels: ShardedDataset(*data.label_source)}
    return SampleReader(arrays, batching(config), comm, shuffle=True, seed=config.seed, read=read)


@dataclass(frozen=True)
class TrainingSteps:
    """Global steps per epoch, and their running total."""

    per_epoch: list[int]
    smallest: int  # the fewest samples of a replica's batch
    replicas: int  # the data-parallel replicas a step has one batch of

    @property
    def total(self) -> int:
        return sum(self.per_epoch)

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within it) of global step ``step`` (past the end: (epochs, 0))."""
        ends = list(accumulate(self.per_epoch))
        epoch = bisect.bisect_right(ends, step)
        return epoch, step - (ends[epoch - 1] if epoch else 0)


def training_steps(config: TrainConfig, data: LabelledData, comm: Comm, replicas: int) -> TrainingSteps:
    """The steps of every epoch for ``replicas`` data-parallel replicas (the same on every rank; collective)."""
    if not uses_samples(config, data):
        return TrainingSteps(
            [data.samples // config.batch_size] * config.epochs, config.batch_size // replicas, replicas
        )
    with open_reader(config, data, comm, []) as reader:
        assert isinstance(reader, SampleReader)
        plans = [reader.plan(epoch, replicas) for epoch in range(config.epochs)]
        reader.check_read_ahead(plans)  # refused now, not when an epoch starts
    return TrainingSteps([plan.steps for plan in plans], min(plan.smallest() for plan in plans), replicas)


def step_samples(reader: Reader, config: TrainConfig, epoch: int, step: int) -> int:
    """Samples of global step ``step`` of ``epoch`` over all replicas (the divisor of the step's mean loss)."""
    if isinstance(reader, SampleReader):
        return reader.plan(epoch).step_samples(step)
    return config.batch_size


def as_tensors(batch, data: LabelledData, dtype: np.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(inputs, labels) of a batch, each None where the batch lacks it; ragged inputs padded with ``PAD``."""
    inputs = labels = None
    if data.inputs in batch.data:
        rows = batch.data[data.inputs]
        if isinstance(rows, Ragged):
            inputs = torch.from_numpy(rows.padded(PAD).astype(dtype, copy=False))
        else:
            inputs = torch.from_numpy(model_rows(np.asarray(rows), dtype).reshape(len(batch.ids), -1))
    if data.labels in batch.data:
        labels = torch.from_numpy(np.asarray(batch.data[data.labels], np.int64).reshape(-1))  # (a column too)
    return inputs, labels
