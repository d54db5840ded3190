"""An adapter's weights file, in either format PEFT saves: ``adapter_model.safetensors`` (since PEFT 0.6) or
``adapter_model.bin`` (PyTorch's pickle: PEFT before 0.6, or ``save_pretrained(..., safe_serialization=False)``;
most adapters on the Hub from 2023 are so). The same tensor names, the same read.

A safetensors file is read in parts (its header, then one group's tensors); a pickle only whole, with
``torch.load(weights_only=True)``, which unpickles tensors and plain containers and nothing that runs code.
"""

from __future__ import annotations

import functools
import os
import zipfile

import numpy as np

from ..errors import MpiscaleError

SAFETENSORS, PICKLED = "adapter_model.safetensors", "adapter_model.bin"
FLOAT_TYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the types an adapter's weights may have


class WeightsError(MpiscaleError):
    """A weights file that cannot be read (the caller names the adapter, as an AdapterError)."""


def weights_file(directory: str) -> str:
    """The weights file of the adapter in ``directory``: its safetensors file, else its pickle when only that is
    there (a missing one is said by the read)."""
    safe = os.path.join(directory, SAFETENSORS)
    pickled = os.path.join(directory, PICKLED)
    return pickled if not os.path.lexists(safe) and os.path.lexists(pickled) else safe


def header(weights: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Each tensor's shape and type (safetensors' names: F32, BF16, ...) in ``weights``."""
    if weights.endswith(PICKLED):
        tensors = _unpickled(weights)
        return {key: tuple(t.shape) for key, t in tensors.items()}, {key: _type(t) for key, t in tensors.items()}
    from safetensors import SafetensorError, safe_open

    try:
        os.stat(weights)  # says what is wrong with the path itself (a symlink loop, a dangling link, no such file)
        with safe_open(weights, framework="numpy") as file:  # the header only: shapes and types, no tensor read
            slices = {key: file.get_slice(key) for key in file.keys()}
            return {key: tuple(s.get_shape()) for key, s in slices.items()}, {
                k: s.get_dtype() for k, s in slices.items()
            }
    except (OSError, SafetensorError) as error:  # missing, truncated or not a safetensors file
        raise WeightsError(f"cannot read it: {_reason(error)}") from None


def read_tensors(weights: str, keys: list[str]) -> list[np.ndarray]:
    """The tensors ``keys`` of ``weights`` in float64, whatever type the file stores: numpy reads a safetensors
    file's float16/32/64, torch its bfloat16 (numpy has no such type) and any pickle, so most runs never import
    torch."""
    if weights.endswith(PICKLED):
        tensors, torch = _unpickled(weights), _torch("is a PyTorch pickle")
        return [tensors[key].to(torch.float64, copy=True).numpy() for key in keys]  # (never the kept tensor's)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(weights, framework="numpy") as file:
            if all(file.get_slice(key).get_dtype() != "BF16" for key in keys):
                return [file.get_tensor(key).astype(np.float64) for key in keys]
        torch = _torch("holds bfloat16 tensors, which numpy lacks")
        with safe_open(weights, framework="pt") as file:
            return [file.get_tensor(key).to(torch.float64).numpy() for key in keys]
    except (OSError, SafetensorError) as error:
        raise WeightsError(str(error)) from None


def _unpickled(weights: str) -> dict:
    """The tensors of a PyTorch pickle, by name (on the CPU): unpickled once per version of the file (its inode,
    time and size), since a job reads an adapter many times (its check, then each group's sides and loadings), and
    each full load cost as much as the whole file (an adapter of 128 modules took 8-9 s of loads for one job's
    reads of it; see ``_loaded``)."""
    torch = _torch("is a PyTorch pickle")
    try:
        found = os.stat(weights)
    except OSError as error:
        raise WeightsError(f"cannot read it: {_reason(error)}") from None
    tensors = _loaded(weights, found.st_ino, found.st_mtime_ns, found.st_size)
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise WeightsError(f"holds a {type(tensors).__name__}, not tensors by name (a state dict)")
    return tensors


@functools.cache
def _loaded(weights: str, *version: int) -> object:
    """``weights`` as ``torch.load(weights_only=True)`` gives it; a ZIP-format file (any torch since 1.6, so any
    PEFT's) memory-mapped, so the tensors' bytes stay in the file (the page cache) and are read when a group asks
    for them. ``version`` keys the cache: a file written again is loaded again."""
    import pickle

    import torch

    try:
        return torch.load(weights, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(weights))
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:  # missing, cut short, not a pickle
        raise WeightsError(f"cannot read it: {_reason(error)}") from None


def _torch(what: str):
    """The torch module, or a WeightsError saying that the file ``what`` and torch reads it (the adapters extra
    brings safetensors alone)."""
    try:
        import torch
    except ImportError:
        raise WeightsError(f"{what}; only torch reads it here: pip install torch, or save the adapter again as "
                           "float32 safetensors (PeftModel.save_pretrained's default)") from None  # fmt: skip
    return torch


def _type(tensor) -> str:
    """A torch tensor's type in safetensors' names (F32, BF16, ...; an integer's too, for the refusal)."""
    name = str(tensor.dtype).removeprefix("torch.")
    names = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
    return names.get(name, name.upper())


def _reason(error: BaseException) -> str:
    """What an OSError says of a path (its strerror, not the repr of its arguments), else the error's text."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error).splitlines()[0] if str(error) else type(error).__name__
