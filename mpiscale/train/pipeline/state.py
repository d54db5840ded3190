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

MODEL, OPTIMIZER = "pipeline.model", "pipeline.optimizer"
INDEX = "pipeline_index"  # the key of the index in the checkpoint's metadata
_ADAM = ("exp_avg", "exp_avg_sq", "step")

Entry = tuple[str, str, list[int], int]  # name, dtype, shape, byte offset in the whole array


def _model_arrays(module: torch.nn.Module) -> list[tuple[str, np.ndarray]]:
    return [(name, tensor.detach().numpy()) for name, tensor in module.state_dict().items()]


def _optimizer_arrays(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, np.ndarray]]:
    arrays: list[tuple[str, np.ndarray]] = []
    if optimizer is None:
        return arrays
    for name, param in module.named_parameters():
        state = optimizer.state.get(param, {})
        for key in _ADAM:
            if key in state:
                arrays.append((f"{name}.{key}", torch.as_tensor(state[key]).detach().numpy()))
    return arrays


def _pack(arrays: list[tuple[str, np.ndarray]]) -> tuple[np.ndarray, list[tuple[str, str, list[int], int]]]:
    """The arrays' bytes end to end, and (name, dtype, shape, offset) for each."""
    entries, parts, offset = [], [], 0
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
        arrays, index = {}, {}
        for key, found in ((MODEL, _model_arrays(self.module)),
                           (OPTIMIZER, _optimizer_arrays(self.module, self.optimizer))):  # fmt: skip
            packed, entries = _pack(found if self.saves else [])
            sizes = comm.allgather(packed.nbytes)
            start = sum(sizes[: comm.Get_rank()])
            everyone = comm.allgather([(n, d, s, start + o) for n, d, s, o in entries])
            arrays[key], index[key] = packed, [entry for part in everyone for entry in part]
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
        state = self.module.state_dict()
        for name, tensor in state.items():
            saved = model.get(name)
            if saved is None or tuple(saved.shape) != tuple(tensor.shape):
                found = "missing" if saved is None else f"of shape {tuple(saved.shape)}"
                raise ValueError(f"{where}: the weights {name} are {found}, the model needs {tuple(tensor.shape)}")
            state[name] = torch.from_numpy(saved.copy())
        self.module.load_state_dict(state)
        if self.optimizer is None:
            return
        moments = _unpack(restored, OPTIMIZER, index[OPTIMIZER])
        optimizer_state = {}
        for position, (name, _) in enumerate(self.module.named_parameters()):
            entries = {key: torch.from_numpy(moments[f"{name}.{key}"].copy()) for key in _ADAM
                       if f"{name}.{key}" in moments}  # fmt: skip
            if entries:
                optimizer_state[position] = entries
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": optimizer_state, "param_groups": groups})


def _nbytes(dtype: str, shape: Iterable[int]) -> int:
    return int(np.dtype(dtype).itemsize * np.prod(list(shape), dtype=np.int64))


def _unpack(restored: Restored, key: str, index: list[Entry]) -> dict[str, np.ndarray]:
    """The entries that lie whole within this rank's rows of sharded array ``key``."""
    start, stop = restored.rows[key]
    data = restored.sharded[key]
    arrays = {}
    for name, dtype, shape, offset in index:
        size = _nbytes(dtype, shape)
        if start <= offset and offset + size <= stop:
            arrays[name] = data[offset - start : offset - start + size].view(np.dtype(dtype)).reshape(shape)
    return arrays


def restore_rows(checkpoints: Checkpointer, restored: Restored, state: StageState) -> Restored:
    """``restored`` read again with this rank's own rows of the pipeline's arrays (collective)."""
    return checkpoints.load(restored.step, rows=state.rows(restored.meta[INDEX]))  # type: ignore[return-value]
