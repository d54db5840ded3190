"""The model ``mpiscale train`` fits: a multilayer perceptron whose shape is a small JSON-able dict.

The inputs are standardised inside the model (the training set's mean and
scale are buffers), so a saved model takes raw rows, in training and in
``mpiscale collect`` alike. Modules are named ``hidden1``, ``relu1``, ...,
``output``: the names ``collect --layers`` takes.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch


class Standardize(torch.nn.Module):
    """``(x - mean) / scale``, with the statistics as buffers (saved and broadcast with the weights)."""

    mean: torch.Tensor
    scale: torch.Tensor

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("scale", torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.scale


def build_mlp(spec: dict) -> torch.nn.Sequential:
    """The MLP of ``spec``: ``{"inputs": F, "hidden": [H1, ...], "classes": C}``."""
    layers: OrderedDict[str, torch.nn.Module] = OrderedDict(standardize=Standardize(spec["inputs"]))
    width = spec["inputs"]
    for index, hidden in enumerate(spec["hidden"], 1):
        layers[f"hidden{index}"] = torch.nn.Linear(width, hidden)
        layers[f"relu{index}"] = torch.nn.ReLU()
        width = hidden
    layers["output"] = torch.nn.Linear(width, spec["classes"])
    return torch.nn.Sequential(layers)


def set_standardization(model: torch.nn.Sequential, mean: np.ndarray, std: np.ndarray) -> None:
    """Store the training set's feature means and spreads (constant features keep scale 1)."""
    standardize = standardizer(model)
    with torch.no_grad():
        standardize.mean.copy_(torch.from_numpy(mean.astype(np.float32)))
        standardize.scale.copy_(torch.from_numpy(np.where(std > 1e-8, std, 1.0).astype(np.float32)))


def standardizer(model: torch.nn.Module) -> Standardize:
    """The model's input standardisation (its first module)."""
    module = model.get_submodule("standardize")
    assert isinstance(module, Standardize)
    return module


def module_names(model: torch.nn.Module) -> list[str]:
    """The names of the modules whose outputs can be collected."""
    return [name for name, _ in model.named_modules() if name]
