"""The simple ops a plan's nodes may apply: each a function of the node's input arrays (rows x width, float32)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial, reduce

import numpy as np

Op = Callable[[list[np.ndarray]], np.ndarray]


def linear(weights: np.ndarray, bias: np.ndarray | None, inputs: list[np.ndarray]) -> np.ndarray:
    out = inputs[0] @ weights.T
    return out + bias if bias is not None else out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (0.5 * (np.tanh(0.5 * x) + 1)).astype(np.float32)  # no overflow for large |x|


ELEMENTWISE: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "relu": lambda x, _: np.maximum(x, 0),
    "tanh": lambda x, _: np.tanh(x),
    "sigmoid": lambda x, _: _sigmoid(x),
    "scale": lambda x, factor: x * np.float32(factor),
}


def elementwise(name: str, factor: float, inputs: list[np.ndarray]) -> np.ndarray:
    return ELEMENTWISE[name](inputs[0], factor)


def combining(name: str) -> Op:
    """add, subtract, multiply (element by element) and concat (side by side) of the inputs."""
    if name == "concat":
        return partial(np.concatenate, axis=1)
    function = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply}[name]
    return lambda inputs: reduce(function, inputs)


def row_sum(inputs: list[np.ndarray]) -> np.ndarray:
    return inputs[0].sum(axis=1, keepdims=True)
