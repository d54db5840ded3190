"""A model's and an optimizer's state as flat numpy arrays and JSON, for checkpoints and results files.

Arrays are named ``model.<name>`` (parameters and buffers, as in
``state_dict``) and ``optimizer.<parameter index>.<key>`` (Adam's moments and
step count); the optimizer's hyperparameters and the arrays' shapes travel as
JSON beside them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

#: The array that holds the optimizer's hyperparameters and its arrays' shapes, as UTF-8 JSON.
OPTIMIZER_SETTINGS = "optimizer.settings"


@dataclass
class TrainingState:
    """A model's weights and its optimizer's state: one ``jobs.Stateful`` part of a training checkpoint."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    where: str  # the checkpoints' directory, named in errors

    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays, settings = optimizer_state(self.optimizer)
        return model_arrays(self.model) | arrays | {OPTIMIZER_SETTINGS: json_array(settings)}

    def from_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        load_model_arrays(self.model, arrays, self.where)
        load_optimizer_state(self.optimizer, arrays, json.loads(arrays[OPTIMIZER_SETTINGS].tobytes()))


def json_array(value: object) -> np.ndarray:
    """``value`` as UTF-8 JSON in a uint8 array (settings that travel among a state's arrays)."""
    return np.frombuffer(json.dumps(value).encode(), np.uint8).copy()


def model_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every parameter and buffer, as copies."""
    return {f"model.{name}": tensor.detach().cpu().numpy().copy() for name, tensor in model.state_dict().items()}


def load_model_arrays(model: torch.nn.Module, arrays: Mapping[str, np.ndarray], where: str) -> None:
    """Put ``model.*`` arrays back; a missing or misshapen one is a ValueError naming ``where``."""
    state = model.state_dict()
    for name, tensor in state.items():
        saved = arrays.get(f"model.{name}")
        if saved is None or tuple(saved.shape) != tuple(tensor.shape):
            found = "missing" if saved is None else f"of shape {tuple(saved.shape)}"
            raise ValueError(f"{where}: the weights {name} are {found}, the model needs {tuple(tensor.shape)}")
        state[name] = torch.from_numpy(np.ascontiguousarray(saved))
    model.load_state_dict(state)


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, JSON) of the optimizer: per-parameter tensors as arrays, the rest as JSON."""
    state = optimizer.state_dict()
    arrays, shapes = {}, {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            tensor = torch.as_tensor(value)
            name = f"optimizer.{index}.{key}"
            arrays[name] = tensor.detach().cpu().numpy().reshape(-1).copy()
            shapes[name] = list(tensor.shape)
    return arrays, {"param_groups": state["param_groups"], "shapes": shapes}


def load_optimizer_state(optimizer: torch.optim.Optimizer, arrays: Mapping[str, np.ndarray], meta: dict) -> None:
    """The inverse of ``optimizer_state``."""
    state: dict[int, dict] = {}
    for name, shape in meta["shapes"].items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = torch.from_numpy(arrays[name].copy()).reshape(shape)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
