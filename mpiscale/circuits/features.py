"""``mpiscale circuits run --all-features``: every circuit of a catalogue on a data set, over the ranks.

The circuits are grouped by model, and a model's circuits by layer: each
batch runs each model once, up to its deepest wanted layer (the shared prefix
of all its circuits computed once), and each layer's circuits are one matrix
product of its output with their atoms. The output is one parallel HDF5 file:
``/features`` (inputs x circuits, float32, columns in catalogue order),
``/circuits`` (their names), ``/circuit_rows`` and ``/sample_ids``.

The inputs are cut into batches of ``batch_size`` rows, numbered globally
(the same batches on any number of ranks); at each step every rank runs one
pending batch and writes it collectively. After a batch is written and
flushed, its flag in ``/done`` is set and flushed: the data sets are created
whole at the start, so later writes change no HDF5 metadata and a run killed
at any point leaves a file whose flagged batches are complete. A stop
(SIGTERM, a stop command) keeps the file as ``OUT.partial``; a kill leaves
``OUT.tmp``. ``--resume`` reopens either and runs only the batches not
flagged, on any number of ranks.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from functools import partial

import h5py
import numpy as np

from ..io import DataFileError, OutputLock, RowWriter, ShardedDataset, WriteError, fixed_strings, split_spec
from ..jobs import (
    Ended,
    HeldOutputs,
    Plan,
    Step,
    announce,
    check_not_an_input,
    check_outputs,
    lock_results,
    run_lifecycle,
)
from ..kernels.threads import share_cores
from ..ranks import AgreedError, Comm, ranks_sharing_cores, run_agreed
from ..runtime import ActorSystem, JobRefused
from .catalogue import Catalogue
from .config import RESULT_SETTINGS, CircuitsRunConfig
from .filters import Filter, check_filters, matching, parse_filters
from .prefix import ModelRunner

FEATURES_FORMAT = "mpiscale.circuit-features/1"


class _BadRows(AgreedError):
    """Some rank's batch holds inputs the circuits cannot take: bad input, found as they are read."""


@dataclass(frozen=True)
class LayerCircuits:
    """The selected circuits of one layer: their atoms (m x width) and their columns in the output."""

    layer: str
    atoms: np.ndarray
    columns: np.ndarray


@dataclass
class Selection:
    """What runs: the circuits' names and catalogue rows, and per model its runner and its layers' circuits."""

    names: list[str]
    rows: np.ndarray
    models: list[tuple[ModelRunner, list[LayerCircuits]]]

    def features(self, inputs: np.ndarray) -> np.ndarray:
        """Every selected circuit on ``inputs`` (rows x circuits): one pass per model, one product per layer."""
        out = np.empty((len(inputs), len(self.names)), np.float32)
        for runner, layers in self.models:
            outputs = runner(inputs) if len(inputs) else {}
            for chosen in layers:
                if len(inputs):
                    out[:, chosen.columns] = outputs[chosen.layer] @ chosen.atoms.T
        return out


def select(catalogue: Catalogue, filters: list[Filter], verify: bool) -> Selection:
    """The circuits ``filters`` select, with their models loaded (``verify``: check each model's SHA-256)."""
    check_filters(catalogue, filters)
    rows = np.flatnonzero(matching(catalogue, filters))
    if not len(rows):
        raise DataFileError(catalogue.path, f"no circuit matches {'; '.join(map(str, filters)) or 'anything'}")
    names = list(catalogue.column("name")[rows])
    by_model: dict[int, list[LayerCircuits]] = {}
    for prefix in catalogue.prefixes:
        circuits = catalogue.prefix_circuits(prefix.index)
        chosen = np.isin(circuits, rows)
        if chosen.any():
            model = catalogue.models.index(prefix.model)
            atoms = catalogue.atoms(prefix.index)[chosen]
            columns = np.searchsorted(rows, circuits[chosen])
            by_model.setdefault(model, []).append(LayerCircuits(prefix.layer, atoms, columns))
    models = [(ModelRunner(catalogue.models[index], [c.layer for c in layers], verify), layers)
              for index, layers in sorted(by_model.items())]  # fmt: skip
    return Selection(names, rows, models)


async def run_circuits(system: ActorSystem, config: CircuitsRunConfig) -> dict:
    """Run the job on every rank; bad input ends it before any batch, with one message and status 2."""
    return await run_lifecycle(system, "circuits run", lambda: _prepare(system, config))


def kept_name(out: str) -> str:
    """Where a stopped run keeps the batches it wrote."""
    return f"{out}.partial"


@dataclass
class _Run(HeldOutputs):
    system: ActorSystem
    config: CircuitsRunConfig
    comm: Comm
    selection: Selection
    data: tuple[str, str]  # (file, data set)
    samples: int
    inputs: int  # numbers per input row
    dtype: np.dtype
    pending: list[int]  # the batches still to run
    kept: str | None  # the earlier run's file this one resumes
    results_lock: OutputLock | None
    plan: Plan
    checkpoints: None = None  # the output file is the job's only state
    writer: RowWriter | None = field(default=None, repr=False)

    @property
    def batches(self) -> int:
        return -(-self.samples // self.config.batch_size)

    async def restore(self) -> int:
        if self.kept is not None:
            self.writer = RowWriter.reopen(self.config.out, self.kept, self.comm)
            done = self.batches - len(self.pending)
            if self.system.rank == 0:
                print(f"mpiscale circuits run: resumed from {self.kept}: {done} of {self.batches} batches were "
                      "written", flush=True)  # fmt: skip
            announce("resumed", f"from {self.kept} after {done} batches")
            return 0
        selection, count = self.selection, len(self.selection.names)
        layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            "features": ((self.samples, count), np.dtype(np.float32)),
            "sample_ids": ((self.samples,), np.dtype(np.int64)),
            "done": ((self.batches,), np.dtype(np.int8)),
            "circuits": ((count,), fixed_strings(selection.names).dtype),
            "circuit_rows": ((count,), np.dtype(np.int64)),
        }
        attrs = {"catalogue": os.path.abspath(self.config.catalogue), "data": f"{self.data[0]}:/{self.data[1]}",
                 "batch_size": self.config.batch_size}  # fmt: skip
        try:
            self.writer = RowWriter(self.config.out, layout, self.comm, self.config.to_dict(), attrs, FEATURES_FORMAT)
            self.writer.write_replicated({"circuits": fixed_strings(selection.names), "circuit_rows": selection.rows})
            self.writer.write_replicated({"done": np.zeros(self.batches, np.int8)})
            self.writer.flush()  # every data set's metadata is on disk: a kill from now on loses no more than a batch
        except WriteError as error:
            raise JobRefused(f"mpiscale circuits run: {error}", status=1) from None
        return 0

    async def steps(self, start: int) -> AsyncGenerator[Step, None]:
        size, rank, batch = self.system.size, self.system.rank, self.config.batch_size
        path, name = self.data
        with ShardedDataset(path, name, self.comm) as data:
            for step in range(start, self.plan.total):
                index = step * size + rank
                mine = self.pending[index] if index < len(self.pending) else None
                lo = mine * batch if mine is not None else 0
                hi = min(lo + batch, self.samples) if mine is not None else 0
                rows = np.asarray(data.read_collective(lo, hi), self.dtype).reshape(hi - lo, self.inputs)
                values: dict[str, np.ndarray] = {}
                run_agreed(self.comm, f"batch {step + 1}", partial(self._compute, rows, lo, values), _BadRows)
                try:
                    self._writer.write(lo, {"features": values["features"],
                                            "sample_ids": np.arange(lo, hi, dtype=np.int64)})  # fmt: skip
                    self._writer.flush()
                    flag = np.ones(1 if mine is not None else 0, np.int8)
                    self._writer.write(mine if mine is not None else 0, {"done": flag})
                    self._writer.flush()
                except WriteError as error:
                    raise JobRefused(f"mpiscale circuits run: {error}", status=1) from None
                await asyncio.sleep(0)  # a batch computes without awaiting: let the loop take signals now
                written = min(len(self.pending), (step + 1) * size) - step * size
                yield Step(f"{min((step + 1) * size, len(self.pending))} of {len(self.pending)} batches",
                           written * batch)  # fmt: skip

    def _compute(self, rows: np.ndarray, first: int, into: dict[str, np.ndarray]) -> None:
        features = self.selection.features(rows)
        bad = np.flatnonzero(~np.isfinite(features).all(axis=1))
        if len(bad):
            circuit = self.selection.names[int(np.flatnonzero(~np.isfinite(features[bad[0]]))[0])]
            why = f"sample {first + int(bad[0])} gives NaN or infinity in circuit {circuit}: clean the data first"
            raise DataFileError(self.data[0], why, self.data[1])
        into["features"] = features

    def save(self, done: int) -> None:
        self._writer.flush()  # every written batch is in the file already

    async def finish(self, ended: Ended) -> dict:
        out, count = self.config.out, len(self.selection.names)
        try:
            if ended.done < self.plan.total:
                kept = kept_name(out)
                self._writer.close(kept)
                if self.system.rank == 0:
                    print(f"mpiscale circuits run: kept the batches written in {kept}; run the same command with "
                          "--resume (on any number of ranks) to finish", flush=True)  # fmt: skip
                return {"circuits": count, "samples": self.samples, "stopped": True}
            self._writer.close()
        except WriteError as error:
            raise JobRefused(f"mpiscale circuits run: {error}", status=1) from None
        if self.system.rank == 0:
            models = len(self.selection.models)
            print(f"wrote {out}: {count} circuits of {models} model{'s' * (models > 1)} on {self.samples} inputs "
                  f"(/features {self.samples} x {count})", flush=True)  # fmt: skip
        return {"circuits": count, "samples": self.samples, "stopped": False}

    def release(self) -> None:
        super().release()
        if self.writer is not None and self.writer.file is not None and self.system.rank == 0:
            # A failure mid-run, maybe a dead rank: closing the file is collective and could wait for it forever.
            # The flagged batches are complete on disk, so the file stays for --resume.
            print(f"mpiscale circuits run: the batches written so far are kept in {self.writer.temporary}; run the "
                  "same command with --resume to finish", file=sys.stderr, flush=True)  # fmt: skip

    @property
    def _writer(self) -> RowWriter:
        assert self.writer is not None, "the output is opened by restore"
        return self.writer


def _prepare(system: ActorSystem, config: CircuitsRunConfig) -> _Run:
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(share_cores(ranks_sharing_cores(comm)))
    if not config.all_features:
        raise ValueError("give --all-features (every circuit of the catalogue, or those --where selects)")
    if not config.catalogue or not config.data:
        raise ValueError("give --catalogue CATALOGUE.h5 and --data FILE.h5:/dataset")
    filters = parse_filters([config.where])
    with Catalogue(config.catalogue) as catalogue:
        selection = select(catalogue, filters, verify=system.rank == 0)
        model_files = [model.path for model in catalogue.models]
    path, name = split_spec(config.data)
    with ShardedDataset(path, name, comm) as data:
        name, shape, dtype = data.name, data.shape, data.dtype
    inputs, wanted = _input_layout(selection, path)
    features = int(np.prod(shape[1:])) if len(shape) > 1 else 0
    kinds, what = ("biu", "integer token ids") if wanted.kind == "i" else ("biuf", "numbers")
    if dtype.kind not in kinds or features != inputs:
        raise DataFileError(path, f"the circuits' models take rows of {inputs} {what}, the data set holds {dtype} "
                                  f"{shape}", name)  # fmt: skip
    if shape[0] == 0:
        raise DataFileError(path, "holds no rows", name)
    check_outputs(config.out, None)
    check_not_an_input(config.out, [config.catalogue, config.data, *model_files], comm)
    lock = lock_results(config.out, comm)
    try:
        batches = -(-shape[0] // config.batch_size)
        found = _earlier_run(config, selection, shape[0], batches) if system.rank == 0 else None
        kept, pending = comm.bcast(found, root=0)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    total = -(-len(pending) // system.size)
    plan = Plan("step", "samples", total, config.progress_every, saves=True)
    return _Run(system, config, comm, selection, (path, name), shape[0], inputs, wanted, pending, kept, lock, plan)


def _input_layout(selection: Selection, path: str) -> tuple[int, np.dtype]:
    """(numbers per row, type) every selected circuit's model takes; refused when the models differ."""
    layouts = {(runner.model.inputs, runner.model.input_dtype) for runner, _ in selection.models}
    if len(layouts) > 1:
        shown = ", ".join(f"{os.path.basename(r.model.path)} ({r.model.inputs} {r.model.input_dtype})"
                          for r, _ in selection.models)  # fmt: skip
        raise DataFileError(path, f"the selected circuits' models take different inputs: {shown}; select one kind "
                                  "with --where 'model=NAME'")  # fmt: skip
    inputs, dtype = layouts.pop()
    return inputs, np.dtype(dtype)


def _earlier_run(config: CircuitsRunConfig, selection: Selection, samples: int, batches: int) -> tuple:
    """(the earlier run's file to resume or None, the batches still to run); refuses what cannot be resumed."""
    partial_file, killed = kept_name(config.out), f"{config.out}.tmp"
    kept = partial_file if os.path.exists(partial_file) else killed if os.path.exists(killed) else None
    if kept is None:
        return None, list(range(batches))
    done = _written_batches(kept)
    if not config.resume:
        raise ValueError(f"{kept} holds {int(done.sum()) if done is not None else 'some'} written batches of an "
                         "earlier run: pass --resume to finish it (on any number of ranks), or remove it to start "
                         "over")  # fmt: skip
    if done is None:
        raise DataFileError(kept, "cannot be resumed: it was cut off before its data sets were complete; remove it "
                                  "and run again")  # fmt: skip
    with h5py.File(kept, "r") as file:
        stored = json.loads(file.attrs["config"])
        names = [value.decode() for value in file["circuits"][()]]
        shape = file["features"].shape
    changed = [f"{key}: stopped run {stored.get(key)!r}, now {getattr(config, key)!r}"
               for key in RESULT_SETTINGS if stored.get(key) != getattr(config, key)]  # fmt: skip
    if names != selection.names:
        changed.append(f"the circuits: {len(names)} then, {len(selection.names)} now (the catalogue changed)")
    if shape[0] != samples:
        changed.append(f"the data's rows: {shape[0]} then, {samples} now")
    if changed:
        raise ValueError(f"{kept} cannot be resumed with other settings ({'; '.join(changed)}): run it as it was, "
                         "or remove it to start over")  # fmt: skip
    return kept, [int(b) for b in np.flatnonzero(done == 0)]


def _written_batches(path: str) -> np.ndarray | None:
    """The ``done`` flags of an earlier run's file, or None when it has none readable."""
    try:
        with h5py.File(path, "r") as file:
            if file.attrs.get("format") != FEATURES_FORMAT or "done" not in file:
                return None
            return file["done"][()]
    except OSError:
        return None
