"""``mpiscale circuits run``: circuits on a data set, batch by batch over the ranks, resumable at the last batch.

What runs is a ``Work``: every circuit of the catalogue (``--all-features``,
:mod:`.features`) or a composition plan compiled over the ranks (``--plan``,
:mod:`.composed`). This module is what both share: the inputs checked, the
output file, the steps, and resuming; :mod:`.work` says what a ``Work`` is.

The inputs are cut into batches of ``batch_size`` rows, numbered globally (the
same batches on any number of ranks); each step runs the work's share of the
pending batches. The output data sets are created whole at the start and
flushed, so later writes change no HDF5 metadata. After a step's rows are
written and flushed, its batches are flagged in ``/done`` and flushed: a run
killed at any point leaves a file whose flagged batches are complete. A stop
(SIGTERM, a stop command) keeps the file as ``OUT.partial``; a failure or a
killed rank leaves ``OUT.tmp``. ``--resume`` reopens either and runs only the
batches not flagged, on any number of ranks.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import h5py
import numpy as np

from ..io import DataFileError, OutputLock, RowWriter, ShardedDataset, split_spec
from ..jobs import (
    Ended,
    OutputAsState,
    Plan,
    Step,
    choose_torch_device,
    claim_outputs,
    earlier_output,
    give_back,
    recorded_devices,
    run_lifecycle,
    setting_differences,
)
from ..kernels.threads import share_cores
from ..ranks import Comm, on_rank_0, ranks_sharing_cores
from ..runtime import ActorSystem
from .config import RESULT_SETTINGS, CircuitsRunConfig
from .data_digests import DIGESTS, DigestingReader, first_changed_batch
from .work import Inputs, Work

FEATURES_FORMAT = "mpiscale.circuit-features/1"
_SAID_FROM = 1 << 30  # bytes of written batches a resume's check reads again beyond which it says so first


async def run_circuits(system: ActorSystem, config: CircuitsRunConfig) -> dict:
    """Run the job on every rank; bad input ends it before any batch, with one message and status 2."""
    return await run_lifecycle(system, "circuits run", lambda: _prepare(system, config))


@dataclass
class _Run(OutputAsState):
    system: ActorSystem
    config: CircuitsRunConfig
    comm: Comm
    work: Work
    inputs: Inputs
    pending: list[int]  # the batches still to run
    done: np.ndarray  # every batch's flag (rank 0 writes them)
    digests: np.ndarray | None  # every written batch's data digest (None: resuming a file of a version without them)
    kept: str | None  # the earlier run's file this one resumes
    results_lock: OutputLock | None
    plan: Plan
    devices: str  # where the models run (jobs.recorded_devices)
    command = "circuits run"
    kept_work = "the batches written so far"

    async def restore(self) -> int:
        await self.work.start()
        if self.kept is not None:
            self.writer = RowWriter.reopen(self.config.out, self.kept, self.comm)
            self.writer.mark(device=self.devices)  # this run's, for the batches it writes
            placed = {name: array for name, array in self.work.replicated().items() if not self.work.what_changed(name)}
            self.writer.write_replicated(placed)  # where this run places the work (batches are global)
            self.say_resumed(self.kept, len(self.done) - len(self.pending), len(self.done), "batches were written")
            return 0
        layout = self.work.layout(self.inputs.samples)
        batches = (len(self.done),)
        layout |= {"sample_ids": ((self.inputs.samples,), np.dtype(np.int64)), "done": (batches, np.dtype(np.int8)),
                   DIGESTS: (batches, np.dtype(np.uint64))}  # fmt: skip
        replicated = self.work.replicated()
        layout |= {name: (array.shape, array.dtype) for name, array in replicated.items()}
        attrs = {"catalogue": os.path.abspath(self.config.catalogue), "plan_sha256": self.work.sha256,
                 "data": f"{self.inputs.path}:/{self.inputs.name}", "batch_size": self.config.batch_size,
                 "device": self.devices}  # fmt: skip
        self.writer = RowWriter(self.config.out, layout, self.comm, self.config.to_dict(), attrs, FEATURES_FORMAT,
                                resumable=True)  # fmt: skip
        assert self.digests is not None, "a new file keeps the digests"
        self.writer.write_replicated(replicated | {"done": self.done, DIGESTS: self.digests})
        self.writer.flush()  # every data set's metadata is on disk: a kill from now on loses no more than a step
        return 0

    async def steps(self, start: int) -> AsyncGenerator[Step, None]:
        per_step = self.work.per_step
        with ShardedDataset(self.inputs.path, self.inputs.name, self.comm) as data:
            reader = DigestingReader(data, self.inputs)
            for step in range(start, self.plan.total):
                batches = self.pending[step * per_step : (step + 1) * per_step]
                writes, failure = await self.work.step(batches, reader, self.inputs)
                problem = DataFileError(self.inputs.path, failure, self.inputs.name) if failure else None
                await self.system.agree(problem, f"step {step + 1}")
                digests = reader.gather(self.comm)  # (rank 0 writes them)
                for name, first, rows in writes:
                    self._writer.write(first, {name: rows})
                self._writer.flush()
                self.done[batches] = 1
                flags = {"done": self.done}
                if self.digests is not None:
                    self.digests[list(digests)] = list(digests.values())
                    flags = {DIGESTS: self.digests} | flags  # written first: a flag without its digest is unchecked
                self._writer.write_replicated(flags)
                self._writer.flush()
                await asyncio.sleep(0)  # a step may compute without awaiting: let the loop take signals now
                samples = sum(hi - lo for lo, hi in map(self.inputs.bounds, batches))
                finished = min(len(self.pending), (step + 1) * per_step)
                yield Step(f"{finished} of {len(self.pending)} batches", samples)

    async def finish(self, ended: Ended) -> dict:
        out = self.config.out
        if ended.done < self.plan.total:
            self.keep_stopped("the batches written")
            return {"samples": self.inputs.samples, "stopped": True}
        self._writer.close()
        if self.system.rank == 0:
            print(f"wrote {out}: {self.work.describe()} on {self.inputs.samples} inputs", flush=True)
        return {"samples": self.inputs.samples, "stopped": False}


def _prepare(system: ActorSystem, config: CircuitsRunConfig) -> _Run:
    import torch
    from mpi4py import MPI

    from .composed import plan_work
    from .features import all_features_work

    comm = MPI.COMM_WORLD
    torch.set_num_threads(share_cores(ranks_sharing_cores(comm)))
    device = choose_torch_device(config.device, comm)
    if config.all_features == bool(config.plan):
        raise ValueError("give --all-features (every circuit of the catalogue, or those --where selects) or --plan "
                         "PLAN.toml (a composition of circuits and ops)")  # fmt: skip
    if not config.catalogue or not config.data:
        raise ValueError("give --catalogue CATALOGUE.h5 and --data FILE.h5:/dataset")
    path, name = split_spec(config.data)
    with ShardedDataset(path, name, comm) as data:
        name, shape, dtype = data.name, data.shape, data.dtype
    if shape[0] == 0:
        raise DataFileError(path, "holds no rows", name)
    width = int(np.prod(shape[1:])) if len(shape) > 1 else 0
    if config.plan:
        work: Work = plan_work(system, config, width, dtype, device)
    else:
        work = all_features_work(system, config, path, name, width, dtype, device)
    lock = claim_outputs(
        config.out, None, [config.catalogue, config.data, config.plan, *work.models], comm, FEATURES_FORMAT
    )
    inputs = Inputs(path, name, shape[0], config.batch_size)
    try:
        batches = -(-shape[0] // config.batch_size)
        # rank 0 judges the earlier run's file; its refusal ends every rank alike
        kept, pending, digests = on_rank_0(comm, lambda: _earlier_run(config, work, shape[0], batches))
        done = np.ones(batches, np.int8)
        done[pending] = 0
        if kept is None:
            digests = np.zeros(batches, np.uint64)  # (a new file keeps them; 0: no batch written)
        elif digests is not None:
            row_bytes = dtype.itemsize * max(width, 1)
            _check_written_data(kept, inputs, [int(b) for b in np.flatnonzero(done)], digests, comm, row_bytes)
    except BaseException:
        give_back(lock)
        raise
    plan = Plan("step", "samples", -(-len(pending) // work.per_step), config.progress_every, saves=True)
    return _Run(system, config, comm, work, inputs, pending, done, digests, kept, lock, plan,
                recorded_devices(device, comm))  # fmt: skip


def _check_written_data(
    kept: str, inputs: Inputs, written: list[int], digests: np.ndarray, comm: Comm, row_bytes: int
) -> None:
    """Refuse a resume on data other than the written batches came from (collective: the ranks share the reading;
    a read of more than ``_SAID_FROM`` bytes is said first, as it may take a while)."""
    total = sum(hi - lo for lo, hi in map(inputs.bounds, written)) * row_bytes
    if total > _SAID_FROM and comm.Get_rank() == 0:
        print(f"mpiscale circuits run: reading the rows of the {len(written):,} batches written ({total / 2**30:.1f} "
              "GiB) again, to check that the data is the one they were computed from", flush=True)  # fmt: skip
    changed = first_changed_batch(inputs, written, digests, comm)
    if changed is not None:
        lo, hi = inputs.bounds(changed)
        raise DataFileError(kept, f"cannot be resumed on this data: rows {lo}..{hi - 1} of {inputs.path}:/"
                                  f"{inputs.name} differ from those its batch {changed} was computed from (the data "
                                  "was written again, or replaced): resume on the data it ran on, or remove it to "
                                  "start over")  # fmt: skip


def _earlier_run(config: CircuitsRunConfig, work: Work, samples: int, batches: int) -> tuple:
    """(the earlier run's file to resume or None, the batches still to run, the written batches' data digests: None
    where there is no such file or it keeps none); refuses what cannot be resumed."""
    kept = earlier_output(config.out)
    if kept is None:
        return None, list(range(batches)), None
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
        replicated = {name: file[name][()] for name in work.replicated()}
        plan_sha256 = str(file.attrs.get("plan_sha256", ""))
        rows = file["sample_ids"].shape[0]
        digests = file[DIGESTS][()] if DIGESTS in file else None  # (files of earlier versions keep none)
    changed = setting_differences(stored, {key: getattr(config, key) for key in RESULT_SETTINGS}, "stopped run")
    for name, now in work.replicated().items():
        why = work.what_changed(name)
        if why and not np.array_equal(replicated[name], now):
            changed.append(f"/{name}: {why}")
    if plan_sha256 != work.sha256:
        changed.append("the plan file changed")
    if rows != samples:
        changed.append(f"the data's rows: {rows} then, {samples} now")
    if changed:
        raise ValueError(f"{kept} cannot be resumed with other settings ({'; '.join(changed)}): run it as it was, "
                         "or remove it to start over")  # fmt: skip
    return kept, [int(b) for b in np.flatnonzero(done == 0)], digests


def _written_batches(path: str) -> np.ndarray | None:
    """The ``done`` flags of an earlier run's file, or None when it has none readable."""
    try:
        with h5py.File(path, "r") as file:
            if file.attrs.get("format") != FEATURES_FORMAT or "done" not in file:
                return None
            return file["done"][()]
    except OSError:
        return None
