"""Circuits to add, from what users have: a dictlearn results file, or their own saved module.

A dictlearn results file names its data (``FILE:/layer``, as ``collect``
writes it), and the activations file names its model: so ``from_dictlearn``
finds the model and the layer by itself, and ``--model``/``--layer`` say them
for activations written some other way. A path a file names relative to where
an earlier job ran is also looked for beside that file. Each atom becomes a
circuit (the model up to the layer, then the projection on the atom), with its
usage and top inputs from the dictionary's own coder over its data.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..dictlearn import RESULTS_FORMAT as DICTLEARN_FORMAT
from ..dictlearn import top_inputs
from ..io import DataFileError, locate, not_numbers, open_file, read_dataset, split_spec
from ..train import RESULTS_FORMAT as TRAIN_FORMAT
from ..train import input_layout
from .prefix import ModelRunner, detect_module, one_line
from .store import CatalogueError, ModelRef, NewCircuits


def from_dictlearn(results: str, model: str = "", layer: str = "", top: int = 5, data: str = "") -> NewCircuits:
    """One circuit per atom of ``results``' dictionary (``top`` 0: no usage and top inputs, no pass over the data)."""
    with open_file(results, (DICTLEARN_FORMAT,)) as file:
        dictionary = file["dictionary"][()]
        spec = data or locate(file.attrs, "data", results)
    activations, dataset = split_spec(spec)
    model = model or _model_of(activations, results)
    with open_file(model, (TRAIN_FORMAT,)) as file:
        inputs, dtype = input_layout(json.loads(file.attrs["model"]))
    reference = ModelRef.of(model, "train", inputs, dtype.name)
    layer = layer or dataset
    runner = ModelRunner(reference, [layer], verify=False)
    width = runner(np.zeros((1, inputs), dtype))[layer].shape[1]
    if width != dictionary.shape[1]:
        raise CatalogueError(results, f"atoms have {dictionary.shape[1]} numbers, but layer {layer!r} of {model} "
                                      f"outputs {width}: give the --layer the dictionary was learned on")  # fmt: skip
    atoms = len(dictionary)
    stem = os.path.splitext(os.path.basename(model))[0]
    batch = NewCircuits(reference, layer, [f"{stem}.{layer}/atom{j:04d}" for j in range(atoms)],
                        dictionary.astype(np.float32), os.path.abspath(results),
                        atom_numbers=np.arange(atoms, dtype=np.int64))  # fmt: skip
    if top > 0:
        entries, _ = top_inputs(results, top, f"{activations}:/{dataset}")
        batch.usage = np.zeros(atoms, np.int64)
        batch.top_inputs = np.full((atoms, top), -1, np.int64)
        batch.top_labels = [[] for _ in range(atoms)]
        for entry in entries:
            batch.usage[entry.atom] = entry.used_by
            batch.top_inputs[entry.atom, : len(entry.ids)] = entry.ids
            if entry.labels is not None:
                batch.top_labels[entry.atom] = [str(label) for label in entry.labels]
    return batch


def from_module(path: str, name: str, inputs: int, input_dtype: str = "float32", atoms: str = "") -> NewCircuits:
    """The circuits of a user's saved module: one per output number, or one per row of the ``atoms`` matrix."""
    if inputs < 1:
        raise ValueError(f"{path}: give --inputs N, the numbers per input row the module takes")
    if not name:
        raise ValueError(f"{path}: give --name, the circuit's name (several outputs are named NAME/0, NAME/1 ...)")
    reference = ModelRef.of(path, detect_module(path), inputs, np.dtype(input_dtype).name)
    try:
        width = ModelRunner(reference, [""], verify=False)(np.zeros((1, inputs), input_dtype))[""].shape[1]
    except DataFileError:
        raise
    except Exception as error:  # the module itself refused the input
        hint = ", export it with a batch dimension of any size (torch.export.Dim('batch', min=1))"
        raise CatalogueError(path, f"did not take a batch of one row of {inputs} {input_dtype} numbers (circuits run "
                                   f"in batches of any size{hint if reference.kind == 'export' else ''}): "
                                   f"{one_line(error)}") from None  # fmt: skip
    projections = read_matrix(atoms) if atoms else np.eye(width, dtype=np.float32)
    if projections.ndim != 2 or projections.shape[1] != width:
        raise CatalogueError(atoms, f"atoms must be a matrix of rows of {width} numbers (the module's output), got "
                                    f"shape {projections.shape}")  # fmt: skip
    count = len(projections)
    names = [name] if count == 1 else [f"{name}/{j}" for j in range(count)]
    numbers = np.full(count, -1, np.int64) if atoms else np.arange(count, dtype=np.int64)
    return NewCircuits(reference, "", names, projections.astype(np.float32), os.path.abspath(path),
                       atom_numbers=numbers)  # fmt: skip


def read_matrix(spec: str) -> np.ndarray:
    """A user's matrix, as float64: ``FILE.npy``, ``FILE.npz:/NAME``, ``FILE.h5:/dataset`` (any writer, virtual
    and compressed ones too), or a file's only array."""
    path, name = split_spec(spec)
    values = read_dataset(path, name)
    if values.dtype.kind not in "biuf":
        raise DataFileError(path, f"holds {not_numbers(values.dtype)}, not numbers", name or None)
    return np.atleast_2d(values).astype(np.float64)


def parse_fields(pairs: list[str], fields_file: str, count: int) -> dict[str, list]:
    """User fields: ``KEY=VALUE`` pairs (numbers where they parse as one) for every circuit, and a JSON file: an
    object (for every circuit) or a list of objects (one per circuit)."""
    fields: dict[str, list] = {}
    if fields_file:
        try:
            with open(fields_file, encoding="utf-8-sig") as stream:  # (a byte order mark too)
                document = json.load(stream)
        except (OSError, ValueError) as error:
            raise DataFileError(fields_file, f"is not a readable JSON file: {error}") from None
        rows = document if isinstance(document, list) else [document] * count
        if len(rows) != count or not all(isinstance(row, dict) for row in rows):
            raise DataFileError(fields_file, f"must hold one object, or a list of {count} objects (one per circuit)")
        keys = sorted({key for row in rows for key in row})
        missing = [key for key in keys if any(key not in row for row in rows)]
        if missing:
            raise DataFileError(fields_file, f"field {missing[0]!r} is missing from some circuits: give it to all")
        fields = {key: [row[key] for row in rows] for key in keys}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key:
            raise ValueError(f"--field {pair!r}: write KEY=VALUE")
        fields[key.strip()] = [_value(value.strip())] * count
    return fields


def _value(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _model_of(activations: str, results: str) -> str:
    """The model the activations file names (found as ``io.locate`` finds recorded paths)."""
    with open_file(activations) as file:
        if not file.attrs.get("model"):
            why = "does not name its model (it was not written by mpiscale collect)"
            raise CatalogueError(results, f"learned from {activations}, which {why}: give --model TRAIN.h5 and --layer")
        return locate(file.attrs, "model", activations)
