"""A pipeline's weights and Adam state in a checkpoint, by name, so a run resumes on other stages or replicas.

Every stage's replica 0 packs its arrays (``state_dict`` entries, then per
parameter Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``, all under the whole
model's names) into bytes: its rows of two sharded byte arrays,
``pipeline.model`` and ``pipeline.optimizer`` (the other replicas give no
rows). Stages are consecutive runs of the model in rank order, so the bytes lie
in model order, and any new cut of the model finds each stage's arrays in one
contiguous range of each. The index (name, dtype, shape, byte offset) travels
in the checkpoint's metadata; a resumed rank reads only its range.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ...io import Checkpointer, Restored
from ..state import load_model_arrays

MODEL, OPTIMIZER = "pipeline.model", "pipeline.optimizer"
INDEX = "pipeline_index"  # the key of the index in the checkpoint's metadata
_ADAM = ("exp_avg", "exp_avg_sq", "step")

Entry = tuple[str, str, list[int], int]  # name, dtype, shape, byte offset in the whole array
#: What a first read of a checkpoint takes of these arrays: nothing (a rank's range comes from the index it holds).
NO_ROWS = {MODEL: (0, 0), OPTIMIZER: (0, 0)}


def _model_arrays(module: torch.nn.Module) -> list[tuple[str, np.ndarray]]:
    return [(name, tensor.detach().cpu().numpy()) for name, tensor in module.state_dict().items()]


def _optimizer_arrays(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, np.ndarray]]:
    arrays: list[tuple[str, np.ndarray]] = []
    if optimizer is None:
        return arrays
    for name, param in module.named_parameters():
        state = optimizer.state.get(param, {})
        for key in _ADAM:
            if key in state:
                arrays.append((f"{name}.{key}", torch.as_tensor(state[key]).detach().cpu().numpy()))
    return arrays


def _pack(arrays: list[tuple[str, np.ndarray]]) -> tuple[np.ndarray, list[Entry]]:
    """The arrays' bytes end to end, and (name, dtype, shape, offset) for each."""
    entries: list[Entry] = []
    parts, offset = [], 0
    for name, array in arrays:
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        entries.append((name, array.dtype.str, list(array.shape), offset))
        parts.append(flat)
        offset += flat.nbytes
    packed = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return packed, entries


@dataclass
class StageState:
    """One rank's stage and optimizer, saved and restored by name (every rank of the pipeline makes one)."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None  # None on a stage without parameters
    saves: bool  # this rank writes its stage (replica 0); the other replicas give no rows

    def sharded(self, comm) -> tuple[dict[str, np.ndarray], dict]:
        """(sharded arrays for ``Checkpointer.save``, the index for its metadata); collective over ``comm``."""
        arrays: dict[str, np.ndarray] = {}
        index: dict[str, list[Entry]] = {}
        for key, found in ((MODEL, _model_arrays(self.module)),
                           (OPTIMIZER, _optimizer_arrays(self.module, self.optimizer))):  # fmt: skip
            packed, entries = _pack(found if self.saves else [])
            start, index[key] = 0, []
            for size, part in comm.allgather((packed.nbytes, entries)):  # each rank's bytes follow the one before's
                index[key] += [(name, dtype, shape, start + offset) for name, dtype, shape, offset in part]
                start += size
            arrays[key] = packed
        return arrays, index

    def rows(self, index: dict) -> dict[str, tuple[int, int]]:
        """The byte range of each sharded array that holds this stage's entries (empty where it has none)."""
        parameters = [name for name, _ in self.module.named_parameters()]
        wanted = {MODEL: set(self.module.state_dict()), OPTIMIZER: {f"{n}.{key}" for n in parameters for key in _ADAM}}
        ranges = {}
        for key, names in wanted.items():
            spans = [(offset, offset + _nbytes(dtype, shape)) for name, dtype, shape, offset in index[key]
                     if name in names]  # fmt: skip
            ranges[key] = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, 0)
        return ranges

    def load(self, restored: Restored, where: str) -> None:
        """Take this stage's weights and Adam state from ``restored`` (loaded with :meth:`rows`)."""
        index = restored.meta[INDEX]
        model = _unpack(restored, MODEL, index[MODEL])
        load_model_arrays(self.module, {f"model.{name}": array for name, array in model.items()}, where)
        if self.optimizer is None:
            return
        moments = _unpack(restored, OPTIMIZER, index[OPTIMIZER])
        optimizer_state = {}
        for position, (name, _) in enumerate(self.module.named_parameters()):
            entries = {key: torch.from_numpy(moments[f"{name}.{key}"]) for key in _ADAM
                       if f"{name}.{key}" in moments}  # fmt: skip
            if entries:
                optimizer_state[position] = entries
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": optimizer_state, "param_groups": groups})


def _nbytes(dtype: str, shape: Iterable[int]) -> int:
    return int(np.dtype(dtype).itemsize * np.prod(list(shape), dtype=np.int64))


def _unpack(restored: Restored, key: str, index: list[Entry]) -> dict[str, np.ndarray]:
    """The entries that lie whole within this rank's rows of sharded array ``key`` (aligned copies)."""
    start, stop = restored.rows[key]
    data = restored.sharded[key]
    arrays = {}
    for name, dtype, shape, offset in index:
        size = _nbytes(dtype, shape)
        if start <= offset and offset + size <= stop:
            arrays[name] = data[offset - start : offset - start + size].copy().view(np.dtype(dtype)).reshape(shape)
    return arrays


def restore_rows(checkpoints: Checkpointer, restored: Restored, state: StageState) -> Restored:
    """``restored`` (read with :data:`NO_ROWS`) read again with this rank's own rows of the pipeline's arrays
    (collective)."""
    again = checkpoints.load(restored.step, rows=state.rows(restored.meta[INDEX]))
    assert again is not None  # the step was just read
    return again
