"""The models ``mpiscale train`` fits, each described by a small JSON-able dict (its ``spec``).

The default is a multilayer perceptron over rows of numbers. Its inputs are
standardised inside the model (the training set's mean and scale are
buffers), so a saved model takes raw rows, in training and in ``mpiscale
collect`` alike. Modules are named ``hidden1``, ``relu1``, ..., ``output``:
the names ``collect --layers`` takes. A spec of kind ``transformer`` is the
encoder of :mod:`.encoder`, over rows of integer tokens. Specs without a kind
(results files of earlier versions) are MLPs.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..errors import MpiscaleError, refuse_a_str
from .encoder import PAD, build_encoder


class Standardize(torch.nn.Module):
    """``(x - mean) / scale`` as float32, with the statistics as float64 buffers (saved and broadcast with the
    weights). Float64 rows are standardised in float64: a feature of a large mean and a small spread (a reading of
    1e4 +- 1e-3) keeps its digits, where a cast to float32 first would leave it a few levels."""

    mean: torch.Tensor
    scale: torch.Tensor

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features, dtype=torch.float64))
        self.register_buffer("scale", torch.ones(features, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        standardized = (x - self.mean.to(x.dtype)) / self.scale.to(x.dtype)
        return standardized.to(torch.float32)


TRANSFORMER = "transformer"


def build_model(spec: dict) -> torch.nn.Sequential:
    """The untrained model of ``spec`` (its weights drawn from torch's generator)."""
    return build_encoder(spec) if spec.get("kind") == TRANSFORMER else build_mlp(spec)


def input_layout(spec: dict) -> tuple[int, np.dtype]:
    """(numbers per input row, the numpy type the model takes them as): floats for the MLP, token ids otherwise."""
    if spec.get("kind") == TRANSFORMER:
        return spec["length"], np.dtype(np.int64)
    return spec["inputs"], np.dtype(np.float32)


def model_rows(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``rows`` as the type ``dtype`` a model takes them as (``input_layout``), but kept float64 where float32 would
    round them (float64 data, integers past 2**24): the MLP standardises them before anything rounds them."""
    kept = dtype == np.float32 and not np.can_cast(rows.dtype, np.float32)
    return np.asarray(rows, np.float64 if kept else dtype)


def rows_refused(inputs: int, wanted: np.dtype, width: int, dtype: np.dtype) -> str | None:
    """What a model that takes rows of ``inputs`` numbers of type ``wanted`` takes ("64 numbers", "16 integer token
    ids") when data rows of ``width`` numbers of ``dtype`` are not that; None when they are."""
    kinds, what = ("biu", "integer token ids") if np.dtype(wanted).kind == "i" else ("biuf", "numbers")
    return None if dtype.kind in kinds and width == inputs else f"{inputs} {what}"


def first_bad_row(spec: dict, rows: np.ndarray) -> tuple[int, str] | None:
    """(index, what is wrong) of the first of ``rows`` the model cannot take, or None: NaN or infinity for the MLP,
    token ids outside its vocabulary for the transformer (a ragged one's rows padded with ``encoder.PAD``)."""
    if spec.get("kind") == TRANSFORMER:
        outside = (rows < 0) | (rows >= spec["vocab"])
        if spec.get("ragged"):
            outside &= rows != PAD
        bad = np.flatnonzero(outside.any(axis=1))
        why = f"holds token ids outside 0 .. {spec['vocab'] - 1}, the model's vocabulary"
    else:
        bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))
        why = "holds NaN or infinite values; clean the data first"
    return (int(bad[0]), why) if len(bad) else None


def describe(spec: dict) -> str:
    """The model in a few words, for reports."""
    if spec.get("kind") == TRANSFORMER:
        tokens = f"sequences of up to {spec['length']}" if spec.get("ragged") else f"{spec['length']}"
        return (
            f"transformer encoder of {spec['layers']} layers (width {spec['width']}, {spec['heads']} heads) over "
            f"{tokens} tokens of {spec['vocab']} -> {spec['classes']} classes"
        )
    return f"MLP {spec['inputs']} -> {' -> '.join(map(str, spec['hidden']))} -> {spec['classes']} classes"


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
    """Store the training set's feature means and spreads: a feature of one value (``std`` 0) keeps scale 1, and
    any other is scaled whatever its units (a floor of 1e-8 once left features of 1e-9 as they were: ignored)."""
    standardize = standardizer(model)
    scale = np.where(std > 0, np.maximum(std, np.finfo(np.float32).tiny), 1.0)  # nonzero in float32
    with torch.no_grad():
        standardize.mean.copy_(torch.from_numpy(np.asarray(mean, np.float64)))
        standardize.scale.copy_(torch.from_numpy(np.asarray(scale, np.float64)))


def standardizer(model: torch.nn.Module) -> Standardize:
    """The model's input standardisation (its first module)."""
    module = model.get_submodule("standardize")
    assert isinstance(module, Standardize)
    return module


class _Reached(MpiscaleError):
    """Raised by the last wanted module's hook: the pass has everything it needs."""


def layer_outputs(model: torch.nn.Module, layers: list[str], inputs: torch.Tensor) -> dict[str, np.ndarray]:
    """The named modules' outputs for ``inputs`` (float32 host copies, one row per input, on whichever device the
    model and ``inputs`` are). Forward hooks capture them, and the pass stops once the last of them has run: the
    modules after it are never computed."""
    refuse_a_str(layers, "layers", "module names")
    known = dict(model.named_modules())
    unknown = [name for name in layers if name not in known or not name]
    if unknown:
        raise ValueError(f"the model has no module {unknown[0]!r}; its modules: {', '.join(module_names(model))}")
    captured: dict[str, np.ndarray] = {}
    hooks = []
    for name in layers:

        def keep(module, args, output, name=name) -> None:
            captured[name] = output.detach().reshape(len(inputs), -1).cpu().numpy().astype(np.float32, copy=True)
            if len(captured) == len(layers):
                raise _Reached

        hooks.append(model.get_submodule(name).register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(inputs)
    except _Reached:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def module_names(model: torch.nn.Module) -> list[str]:
    """The names of the modules whose outputs can be collected."""
    return [name for name, _ in model.named_modules() if name]
