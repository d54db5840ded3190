"""``circuits run --all-features``: every circuit of a catalogue (or those ``--where`` selects) on the data.

The circuits are grouped by model, and a model's circuits by layer: each
batch runs each model once, up to its deepest wanted layer (the prefix all its
circuits share, computed once), and each layer's circuits are one matrix
product of its output with their atoms. Each rank runs its own batch of every
step. The output holds ``/features`` (inputs x circuits, float32, columns in
catalogue order), ``/circuits`` (their names) and ``/circuit_rows``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..io import DataFileError, fixed_strings
from ..runtime import ActorSystem
from ..train import rows_refused
from ..words import counted
from .catalogue import Catalogue, LayerCircuits
from .config import CircuitsRunConfig
from .filters import Filter, check_filters, matching, parse_filters
from .prefix import ModelRunner
from .work import BatchRows, Inputs, Write


@dataclass
class Selection:
    """What runs: the circuits' names and catalogue rows, and per model its runner and its layers' circuits."""

    names: list[str]
    rows: np.ndarray
    models: list[tuple[ModelRunner, list[LayerCircuits]]]

    def features(self, inputs: np.ndarray) -> np.ndarray:
        """Every selected circuit on ``inputs`` (rows x circuits): one pass per model, one product per layer."""
        out = np.empty((len(inputs), len(self.names)), np.float32)
        if not len(inputs):
            return out
        for runner, layers in self.models:
            outputs = runner(inputs)
            for chosen in layers:
                chosen.project(outputs[chosen.layer], out)
        return out


def select(catalogue: Catalogue, filters: list[Filter], verify: bool, device: str = "cpu") -> Selection:
    """The circuits ``filters`` select, with their models loaded on ``device`` (``verify``: check each model's
    SHA-256)."""
    check_filters(catalogue, filters)
    rows = np.flatnonzero(matching(catalogue, filters))
    if not len(rows):
        raise DataFileError(catalogue.path, f"no circuit matches {'; '.join(map(str, filters)) or 'anything'}")
    names = list(catalogue.column("name")[rows])
    by_model: dict[int, list[LayerCircuits]] = {}
    for part in catalogue.layers_of(rows):
        by_model.setdefault(part.model, []).append(part)
    models = [(ModelRunner(catalogue.models[index], [c.layer for c in layers], verify, device), layers)
              for index, layers in sorted(by_model.items())]  # fmt: skip
    return Selection(names, rows, models)


def all_features_work(system: ActorSystem, config: CircuitsRunConfig, path: str, name: str, width: int,
                      dtype: np.dtype, device: str = "cpu") -> AllFeatures:  # fmt: skip
    """The work of ``--all-features``: the selection loaded on every rank (its models on ``device``), the data
    checked against its models."""
    with Catalogue(config.catalogue) as catalogue:
        filters = parse_filters([config.where] if config.where else [])  # ("": the default, every circuit)
        selection = select(catalogue, filters, verify=system.rank == 0, device=device)
    layouts = {(runner.model.inputs, runner.model.input_dtype) for runner, _ in selection.models}
    if len(layouts) > 1:
        shown = ", ".join(f"{os.path.basename(r.model.path)} ({r.model.inputs} {r.model.input_dtype})"
                          for r, _ in selection.models)  # fmt: skip
        raise DataFileError(path, f"the selected circuits' models take different inputs: {shown}; select one kind "
                                  "with --where 'model=NAME'")  # fmt: skip
    inputs, wanted = layouts.pop()
    taken = rows_refused(inputs, np.dtype(wanted), width, dtype)
    if taken is not None:
        raise DataFileError(path, f"the circuits' models take rows of {taken}, the data set holds {dtype} rows of "
                                  f"{width}", name)  # fmt: skip
    return AllFeatures(system, selection, inputs)


class AllFeatures:
    """Every selected circuit; each rank runs one batch of each step."""

    sha256 = ""

    def __init__(self, system: ActorSystem, selection: Selection, width: int) -> None:
        self.system, self.selection, self.width = system, selection, width
        self.per_step = system.size
        self.models = [runner.model.path for runner, _ in selection.models]

    def layout(self, samples: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"features": ((samples, len(self.selection.names)), np.dtype(np.float32))}

    def replicated(self) -> dict[str, np.ndarray]:
        return {"circuits": fixed_strings(self.selection.names), "circuit_rows": self.selection.rows}

    def what_changed(self, name: str) -> str | None:
        return "the circuits --where selects in the catalogue changed"

    async def start(self) -> None:
        pass

    async def step(self, batches: list[int], data: BatchRows, inputs: Inputs) -> tuple[list[Write], str | None]:
        rank = self.system.rank
        lo, hi = inputs.bounds(batches[rank] if rank < len(batches) else None)
        features, failure = np.empty((0, len(self.selection.names)), np.float32), None
        try:
            rows = np.asarray(data.read_collective(lo, hi)).reshape(hi - lo, self.width)  # each model takes its type
        except DataFileError as error:  # rows this rank cannot read (a damaged chunk): the step fails on every rank
            return [], error.message  # (nothing is written: the job ends on the failure)
        try:
            values = self.selection.features(rows)
            bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
            if len(bad):
                circuit = self.selection.names[int(np.flatnonzero(~np.isfinite(values[bad[0]]))[0])]
                failure = f"sample {lo + int(bad[0])} gives NaN or infinity in circuit {circuit}: clean the data first"
            else:
                features = values
        except Exception as error:  # the model refused the rows (token ids it does not know, say)
            failure = f"rows {lo}-{hi}: {type(error).__name__}: {error}"
        ids = np.arange(lo, lo + len(features), dtype=np.int64)  # none after a failure: the job ends on it
        return [("features", lo, features), ("sample_ids", lo, ids)], failure

    def describe(self) -> str:
        count, models = len(self.selection.names), len(self.selection.models)
        return f"{count} circuits of {counted(models, 'model')}"
