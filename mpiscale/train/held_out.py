"""The held-out data, scored after every epoch in batches no larger than training's own.

Each data-parallel replica scores its block of the held-out rows. Scoring the
whole block at once would ask for memory training never needs (a padded
transformer's attention grows with the square of the longest sequence), so
the block is cut into batches of training's budget: ``--batch-tokens`` padded
tokens with memory batching, otherwise a replica's share of ``--batch-size``
samples (ragged sequences: that many of the longest). Sequences are grouped by
length, as memory batching groups them, so little of a batch is padding. The
cut is a function of the lengths alone, so a pipeline's middle stages, which
read no data, run as many batches as the stages around them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..io import DataFileError, Ragged, RaggedDataset, length_batches, read_dataset
from ..ranks import Comm, rank_rows
from .config import TrainConfig
from .data import LabelledData
from .encoder import PAD
from .model import model_rows


def batch_budget(config: TrainConfig, replicas: int, length: int) -> tuple[int, int]:
    """(padded tokens, samples) one replica's batch may hold in training: a scoring batch holds no more. Memory
    batching bounds tokens; count batching a replica's share of the batch, at most ``length`` tokens each."""
    if config.batching == "memory":
        return config.batch_tokens, 0
    share = -(-config.batch_size // replicas)
    return share * length, share


def scoring_batches(data: LabelledData, budget: tuple[int, int], replicas: int, replica: int) -> list[np.ndarray]:
    """The held-out sample ids of ``replica``'s block, cut into scoring batches within ``budget``: ragged sequences
    sorted by length and cut greedily (each batch's ids ascending), rows of one size in runs of the budget's count."""
    start, stop = rank_rows(data.samples, replicas, replica)
    tokens, count = budget
    if data.lengths is None:
        return [np.arange(lo, min(lo + count, stop)) for lo in range(start, stop, count)]
    return [batch + start for batch in length_batches(data.lengths[start:stop], tokens)]


def check_scoring_budget(data: LabelledData, config: TrainConfig) -> None:
    """Refuse held-out sequences longer than memory batching's token budget (a batch holds one at least)."""
    if config.batching != "memory" or data.lengths is None:
        return
    longest = int(np.argmax(data.lengths))
    if data.lengths[longest] > config.batch_tokens:
        raise DataFileError(data.path, (
            f"held-out sample {longest} takes {int(data.lengths[longest]):,} tokens, more than batch_tokens "
            f"({config.batch_tokens:,}): scoring keeps training's budget; raise --batch-tokens to at least "
            f"{int(data.lengths[longest]):,}"
        ), data.inputs)  # fmt: skip


@dataclass
class HeldOut:
    """A replica's scoring batches of the held-out data, with the block's rows where this rank reads them.

    Iterating gives each batch's (inputs, labels) tensors, or (None, None) on a rank that reads no data (a
    pipeline's middle stage), as many times everywhere.
    """

    batches: list[np.ndarray]
    dtype: np.dtype
    first: int = 0  # the block's first sample id
    inputs: Ragged | np.ndarray | None = None  # the block's inputs (ragged: packed), where read
    labels: np.ndarray | None = None

    @classmethod
    def read(cls, data: LabelledData, comm: Comm, budget: tuple[int, int], dtype: np.dtype) -> HeldOut:
        """This rank's block of ``comm`` (one rank per replica), read collectively, and its batches."""
        replicas, replica = comm.Get_size(), comm.Get_rank()
        start, stop = rank_rows(data.samples, replicas, replica)
        labels = read_dataset(*data.label_source, comm).astype(np.int64).reshape(-1)  # (a column too)
        inputs: Ragged | np.ndarray
        if data.lengths is not None:
            with RaggedDataset(data.path, data.inputs, data.offsets, comm) as ragged:
                inputs = ragged.read(np.arange(start, stop))
        else:
            inputs = model_rows(read_dataset(data.path, data.inputs, comm).reshape(-1, data.features), dtype)
        return cls(scoring_batches(data, budget, replicas, replica), dtype, start, inputs, labels)

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        for ids in self.batches:
            if self.inputs is None or self.labels is None:
                yield None, None
                continue
            at = ids - self.first
            if isinstance(self.inputs, Ragged):
                rows = self.inputs.take(at).padded(PAD).astype(self.dtype, copy=False)
            else:
                rows = self.inputs[at]
            yield torch.from_numpy(rows), torch.from_numpy(self.labels[at])


def score_sums(logits: torch.Tensor, target: torch.Tensor) -> np.ndarray:
    """(summed loss, correct, samples) of a scored batch."""
    loss = torch.nn.functional.cross_entropy(logits, target, reduction="sum").item() if len(target) else 0.0
    return np.array([loss, float((logits.argmax(dim=1) == target).sum().item()), float(len(target))])
