"""LoRA adapters as PEFT saves them: finding them, checking they belong together, reading one layer group.

An adapter is a directory with ``adapter_config.json`` and
``adapter_model.safetensors`` (what ``PeftModel.save_pretrained`` writes), or
``adapter_model.bin`` as PEFT saved it before (:mod:`.weights` reads either).
Its tensors are ``<module>.lora_A.weight`` (r x in) and
``<module>.lora_B.weight`` (out x r) for every adapted module; a module is
a *layer group*. Only the file headers are read to check adapters against
each other; a group's matrices are read when that group is compressed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MpiscaleError
from ..io import is_list_file, listed_paths, natural_key
from .weights import FLOAT_TYPES, WeightsError, header, read_tensors, weights_file

CONFIG = "adapter_config.json"
_A, _B = ".lora_A.weight", ".lora_B.weight"
_SUFFIXES = {"A": _A, "B": _B}


class AdapterError(MpiscaleError, ValueError):
    """An adapter that cannot be read, or does not match the others: bad input (exit status 2)."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(f"{path}: {problem}")

    def __reduce__(self):  # an error travels between ranks like any value
        return type(self), (self.path, self.problem)


@dataclass(frozen=True)
class Module:
    """One adapted module: where its two matrices are, and their shapes."""

    name: str  # the tensors' common prefix, e.g. base_model.model.model.layers.0.self_attn.q_proj
    inputs: int  # A is rank x inputs
    outputs: int  # B is outputs x rank


@dataclass(frozen=True)
class Adapter:
    """An adapter's settings and the shapes of its matrices (its header only)."""

    name: str
    path: str  # the directory, absolute
    config: dict  # adapter_config.json as saved
    rank: int
    modules: tuple[Module, ...]

    @property
    def weights(self) -> str:
        return weights_file(self.path)

    def read(self, module: Module, sides: str = "AB") -> list[np.ndarray]:
        """The matrices of ``module`` named by ``sides`` (``"AB"``, ``"A"`` or ``"B"``), in float64 whatever type
        the file stores."""
        keys = [module.name + _SUFFIXES[side] for side in sides]
        try:
            matrices = read_tensors(self.weights, keys)
        except (WeightsError, KeyError) as error:
            raise AdapterError(self.weights, f"cannot read {module.name}: {error}") from None
        if not all(np.isfinite(matrix).all() for matrix in matrices):
            raise AdapterError(self.weights, f"{module.name} holds NaN or infinite values")
        return matrices

    def checksum(self) -> str:
        """SHA-256 of the weights file (recorded in the output, so a result names exactly what it compressed)."""
        digest = hashlib.sha256()
        with open(self.weights, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()


def find_adapters(spec: str) -> list[str]:
    """Adapter directories, in a stable order: ``spec`` is an adapter directory, a directory of them, a glob of
    them, or a text file listing one per line (.txt, .lst or .list, as ``--data`` takes them: relative to the file,
    ``#`` starts a comment)."""
    if is_list_file(spec):
        return listed_paths(spec)
    if os.path.isdir(spec):
        if _holds_config(spec):
            return [spec]
        candidates = [str(path) for path in Path(spec).iterdir() if path.is_dir()]
        where = f"no adapter directories (with {CONFIG}) in it"
    else:
        candidates = glob.glob(spec)
        where = "no adapter directories match this pattern"
    found = sorted((path for path in candidates if _holds_config(path)), key=natural_key)
    if not found:
        raise AdapterError(spec, where)
    return found


def _holds_config(directory: str) -> bool:
    """Whether ``directory`` is an adapter's; a config that is a link nothing can follow is refused, not skipped
    (an adapter left out of the compression without a word)."""
    config = os.path.join(directory, CONFIG)
    if os.path.isfile(config):
        return True
    if os.path.islink(config):
        try:
            os.stat(config)
        except OSError as error:  # ELOOP, or a target that is gone
            raise AdapterError(config, f"is a link that cannot be followed ({error.strerror})") from None
        raise AdapterError(config, "is a link to something that is not a file")
    return False


def adapter_names(paths: list[str]) -> list[str]:
    """Each adapter's name: its directory's, or where directories share a name (``runs/*/adapter``), the part of
    the paths that differs (``r0``, ``r1``; several directories joined by ``-``)."""
    parts = [Path(os.path.abspath(path)).parts for path in paths]
    if len({p[-1] for p in parts}) == len(parts):
        return [p[-1] for p in parts]
    shortest = min(len(p) for p in parts)
    prefix = 0
    while prefix < shortest - 1 and len({p[prefix] for p in parts}) == 1:
        prefix += 1
    suffix = 0
    while prefix + suffix < shortest - 1 and len({p[-1 - suffix] for p in parts}) == 1:
        suffix += 1
    return ["-".join(p[prefix : len(p) - suffix]) for p in parts]


def open_adapter(path: str, name: str | None = None) -> Adapter:
    """The adapter in directory ``path`` (named ``name``, by default its directory's), its settings and tensor
    names checked (of a safetensors file, nothing but the header read)."""
    if not os.path.isfile(os.path.join(path, CONFIG)):
        raise AdapterError(path, f"no {CONFIG}: not a PEFT adapter directory")
    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8-sig") as stream:  # (a byte order mark too)
            config = json.load(stream)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(os.path.join(path, CONFIG), f"cannot read it: {error}") from None
    _check_config(path, config)
    weights = weights_file(path)
    try:
        shapes, types = header(weights)
    except WeightsError as error:
        raise AdapterError(weights, str(error)) from None
    odd = sorted(key for key, kind in types.items() if kind not in FLOAT_TYPES)
    if odd:
        raise AdapterError(weights, (
            f"{odd[0]} holds {types[odd[0]]} numbers{f' (and {len(odd) - 1} more tensors)' if len(odd) > 1 else ''}: "
            f"LoRA weights are floating point ({', '.join(FLOAT_TYPES)})"
        ))  # fmt: skip
    rank = int(config["r"])
    modules = _modules(weights, shapes, rank)
    return Adapter(name or Path(path).name, os.path.abspath(path), config, rank, modules)


def _check_config(path: str, config: dict) -> None:
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise AdapterError(path, f"a {kind or 'non-PEFT'} adapter: only LoRA adapters can be compressed")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterError(path, f"its rank r is {config.get('r')!r}, not a positive integer")
    if config.get("use_dora"):
        raise AdapterError(path, "a DoRA adapter: its magnitude vectors are not compressed (only plain LoRA)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(path, f"{key} gives modules their own rank or alpha: only one rank per adapter")


def _modules(weights: str, shapes: dict[str, tuple], rank: int) -> tuple[Module, ...]:
    """The adapted modules of a weights file's tensor shapes; every tensor must be a LoRA A or B of rank ``rank``."""
    names = sorted({key[: -len(_A)] for key in shapes if key.endswith(_A)}, key=natural_key)
    known = {name + suffix for name in names for suffix in (_A, _B)}
    other = sorted(set(shapes) - known)
    if other:
        raise AdapterError(weights, (
            f"holds {other[0]}{f' and {len(other) - 1} more' if len(other) > 1 else ''}, which is neither a LoRA A "
            "nor its B (modules_to_save, biases or embeddings are not compressed)"
        ))  # fmt: skip
    if not names:
        raise AdapterError(weights, "holds no LoRA matrices")
    modules = []
    for name in names:
        a, b = shapes[name + _A], shapes.get(name + _B)
        if b is None:
            raise AdapterError(weights, f"{name} has lora_A but no lora_B")
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise AdapterError(weights, f"{name}: A is {a} and B is {b}, not (r, in) and (out, r) with r = {rank}")
        modules.append(Module(name, int(a[1]), int(b[0])))
    return tuple(modules)


def check_alike(adapter: Adapter, reference: Adapter) -> None:
    """Refuse ``adapter`` unless it adapts the same modules of the same base model, with the same rank and shapes."""
    mine, theirs = adapter.config, reference.config
    where = f"than {reference.path}"
    for key, what in (("base_model_name_or_path", "base model"), ("target_modules", "target modules")):
        if _comparable(mine.get(key)) != _comparable(theirs.get(key)):
            raise AdapterError(
                adapter.path, f"{what} {mine.get(key)!r}, not {theirs.get(key)!r} as in {reference.path}"
            )
    if adapter.rank != reference.rank:
        raise AdapterError(adapter.path, f"rank {adapter.rank}, another {where} (rank {reference.rank})")
    if adapter.modules != reference.modules:
        missing = {m.name for m in reference.modules} ^ {m.name for m in adapter.modules}
        detail = f"{sorted(missing)[0]} is in one only" if missing else "a module's shape differs"
        raise AdapterError(adapter.path, f"other modules or shapes {where}: {detail}")


def _comparable(value: object) -> object:
    return sorted(value) if isinstance(value, list) else value


def write_adapter(directory: Path, tensors: dict[str, np.ndarray], settings: dict) -> Path:
    """``directory`` with adapter_model.safetensors holding ``tensors`` and adapter_config.json holding ``settings``."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)  # never into an existing directory: it may hold another adapter
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return directory
