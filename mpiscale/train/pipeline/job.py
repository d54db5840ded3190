"""The pipeline-parallel training job (``mpiscale train --stages S --micro-batches M``).

The MLP of data-parallel ``train`` is cut into S stages of balanced parameter
count; the ranks are S x D (D replicas of each stage, rank ``r`` holding stage
``r // D``). Each step the first stage's ranks read their replica's part of the
global batch's inputs and the last stage's ranks its labels (the same global
order as data-parallel training), the pipeline runs its schedule over M
micro-batches, the replicas of each stage average their gradients, and every
rank steps Adam over its own stage. The loss is scaled as in data-parallel
training, so a pipeline run follows the one-process run within rounding.

Checkpoints keep the weights and Adam's state by parameter name
(:mod:`.state`): a run resumes on another number of stages, replicas
or micro-batches. The results file is data-parallel training's, written by
rank 0 with the stages' weights gathered there.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.optim import Adam

from ...io import Checkpointer, OutputLock, close_after, raised_together
from ...jobs import (
    Ended,
    HeldOutputs,
    Plan,
    Step,
    choose_torch_device,
    give_back,
    open_checkpointer,
    recorded_devices,
    settings_meta,
    state_arrays,
)
from ...ranks import Comm
from ...runtime import ActorSystem
from ...words import counted
from ..batches import Reader, TrainingSteps, as_tensors, open_reader, step_samples
from ..config import TrainConfig
from ..curves import Curves
from ..data import LabelledData
from ..held_out import HeldOut, batch_budget, score_sums, scoring_batches
from ..model import build_model, input_layout
from ..preparation import (
    checked_steps,
    claim_training_outputs,
    compatibility,
    finish_training,
    prepare_data,
    progress_text,
    refuse_divergence,
    restored_training,
    training_plan,
)
from ..state import load_model_arrays
from .split import split_sequential
from .stages import Pipeline, stage_of, sum_in_order
from .state import INDEX, StageState, restore_rows


@dataclass
class _Edge:
    """What a first or last stage reads: the data sets, over the communicator of that stage's replicas."""

    comm: Comm
    names: list[str]


@dataclass
class _PipelineTraining(HeldOutputs):
    """The job between its checks and its results (a ``jobs.SteppedJob``)."""

    system: ActorSystem
    config: TrainConfig
    comm: Comm
    data: LabelledData
    validation: LabelledData | None
    spec: dict
    stage: torch.nn.Sequential
    optimizer: torch.optim.Optimizer | None  # None on a stage without parameters
    state: StageState
    curves: Curves
    start: int
    edge: _Edge | None
    checkpoints: Checkpointer | None
    threads: int
    results_lock: OutputLock | None
    plan: Plan
    replicas: int
    schedule: TrainingSteps
    device: torch.device  # where this rank's stage computes
    pipeline: Pipeline | None = None
    #: The running step's micro-batches on the last stage: each one's summed loss and hits (tensors on its device, read
    #: once the step is done: reading each at once would wait for a GPU twice a micro-batch), and its rows.
    parts: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] = field(default_factory=lambda: ([], [], []))
    step_samples: int = 1  # samples of the running step over all replicas

    async def restore(self) -> int:
        """The pipeline started (each stage's replicas take replica 0's weights), then the checkpoint's steps."""
        config = self.config
        self.pipeline = await Pipeline.start(
            self.system, self.stage, self._loss, config.micro_batches, config.schedule, "train", self.replicas
        )
        return self.start

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's cross-entropy, scaled as data-parallel training scales it (the global batch's mean once
        the replicas average); its sums and hits are kept for the step's curves."""
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        losses, hits, rows = self.parts
        losses.append(loss.detach())
        hits.append((logits.argmax(dim=1) == labels).sum())
        rows.append(len(labels))
        return loss * (self.replicas / self.step_samples)

    def step_sums(self) -> np.ndarray:
        """This rank's loss, hits and rows of the step just run (zeros but on the last stage), as one process adds
        them: the losses in order as Python floats; the step's parts are then cleared."""
        losses, hits, rows = self.parts
        sums = np.array([sum_in_order(losses), sum_in_order(hits, "hits"), sum(rows)], np.float64)
        for part in self.parts:
            part.clear()
        return sums

    def save(self, done: int) -> None:
        assert self.checkpoints is not None
        sharded, index = self.state.sharded(self.comm)
        meta = settings_meta(compatibility(self.config, self.data, self.spec, self.schedule)) | {INDEX: index}
        self.checkpoints.save(done, sharded=sharded, replicated=state_arrays(self.curves), meta=meta)

    def steps(self, start: int) -> AsyncGenerator[Step, None]:
        return _steps(self, start)

    async def finish(self, ended: Ended) -> dict:
        mine = {name: t.detach().cpu().numpy() for name, t in self.stage.state_dict().items()}
        parts = self.comm.gather(mine if self.system.rank % self.replicas == 0 else {}, root=0)
        model = None
        if parts is not None:
            model = build_model(self.spec)
            load_model_arrays(model, {f"model.{n}": a for part in parts for n, a in part.items()}, "the stages")
        return await finish_training(self.system, self.config, self.comm, self.data, self.validation, self.spec,
                                     model, self.curves, self.threads, ended,
                                     recorded_devices(str(self.device), self.comm))  # fmt: skip


def prepare_pipeline(system: ActorSystem, config: TrainConfig) -> _PipelineTraining:
    """The checked job of this rank: its stage, optimizer, data reader's communicator and restored state."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    device = torch.device(choose_torch_device(config.device, comm))
    threads, results_lock = claim_training_outputs(config, comm)
    checkpoints, edge = None, None
    try:
        replicas = _replicas(system.size, config)
        data, validation, spec, model = prepare_data(config, comm)
        schedule = checked_steps(config, data, comm, replicas)
        if schedule.smallest < config.micro_batches:
            raise ValueError(_too_few_for_micro_batches(config, replicas, schedule.smallest))
        children = len(model)
        if config.stages > children:
            raise ValueError(f"the model has {children} modules, too few for {config.stages} stages")
        index = stage_of(system.rank, replicas)
        stage = split_sequential(model, config.stages)[index].to(device)  # before its optimizer is made
        params = list(stage.parameters())
        optimizer = Adam(params, lr=config.learning_rate, weight_decay=config.weight_decay) if params else None
        state = StageState(stage, optimizer, saves=system.rank % replicas == 0)
        edge = _edge(comm, data, index, config.stages)
        curves = Curves()
        checkpoints = open_checkpointer(config.checkpoints, comm, config.local_dir, config.shared_every)
        start = _restore(config, data, spec, checkpoints, state, curves, schedule)
        plan = training_plan(config, schedule)
        return _PipelineTraining(
            system, config, comm, data, validation, spec, stage, optimizer, state, curves, start, edge, checkpoints,
            threads, results_lock, plan, replicas, schedule, device,
        )  # fmt: skip
    except BaseException:
        give_back(results_lock, checkpoints)
        if edge is not None:
            edge.comm.Free()
        raise


def _too_few_for_micro_batches(config: TrainConfig, replicas: int, smallest: int) -> str:
    if config.batching == "memory":
        return (
            f"batching memory with {config.batch_tokens} tokens makes a batch of {smallest} sequences, too few to "
            f"cut into {config.micro_batches} micro-batches: raise --batch-tokens or lower --micro-batches"
        )
    return (
        f"a batch of {config.batch_size} over {replicas} replicas leaves {smallest} samples to cut into "
        f"{config.micro_batches} micro-batches: use a batch of at least {replicas * config.micro_batches}"
    )


def _replicas(size: int, config: TrainConfig) -> int:
    if size % config.stages:
        raise ValueError(
            f"{counted(size, 'rank')} cannot hold {config.stages} stages: run on a multiple of {config.stages} ranks "
            "(stages x replicas)"
        )
    return size // config.stages


def _edge(comm: Comm, data: LabelledData, stage: int, stages: int) -> _Edge | None:
    """The first stage's ranks read inputs, the last stage's labels (one stage: both), each over their own
    communicator (collective over ``comm``); None on middle stages."""
    from mpi4py import MPI

    names = ([data.inputs] if stage == 0 else []) + ([data.labels] if stage == stages - 1 else [])
    color = MPI.UNDEFINED if not names else 0 if stage == 0 else 1
    split = comm.Split(color, comm.Get_rank())
    return _Edge(split, names) if names else None


def _restore(config, data, spec, checkpoints, state: StageState, curves: Curves, schedule: TrainingSteps) -> int:
    """The steps of the checkpoint a resumed run continues (0: none), this stage's part loaded into ``state``."""
    restored = restored_training(config, data, spec, checkpoints, True, schedule)
    if restored is None:
        return 0
    restored = restore_rows(checkpoints, restored, state)
    state.load(restored, config.checkpoints)
    curves.from_arrays(restored.replicated)
    if checkpoints.rank == 0:
        print(f"resumed from the checkpoint of step {restored.step} in {config.checkpoints}", flush=True)
    return restored.step


async def _steps(job: _PipelineTraining, start: int) -> AsyncGenerator[Step, None]:
    """The steps from ``start``, one ``Step`` after each; the held-out score after each epoch."""
    system, config, pipeline, edge = job.system, job.config, job.pipeline, job.edge
    assert pipeline is not None
    data, curves, optimizer = job.data, job.curves, job.optimizer
    reader = open_reader(config, data, edge.comm, edge.names) if edge is not None else None
    dtype = input_layout(job.spec)[1]
    held_out = _held_out(job, dtype)
    totals = np.zeros(3)
    step = start
    clock = time.perf_counter() - curves.elapsed
    finished_epochs, within = job.schedule.locate(start)
    failure: BaseException | None = None
    try:
        if job.validation is not None and len(curves.epochs["epoch"]) < finished_epochs:
            await _score(job, held_out, finished_epochs)  # the checkpoint came before its epoch was scored
        for epoch in range(finished_epochs, config.epochs):
            job.stage.train()
            skip = within if epoch == finished_epochs else 0
            async for at, batch in _batches(reader, epoch, skip, job.schedule.per_epoch[epoch]):
                inputs, labels = as_tensors(batch, data, dtype) if batch is not None else (None, None)
                job.step_samples = step_samples(reader, config, epoch, at) if reader is not None else 1
                began = time.perf_counter()
                job.stage.zero_grad()
                stats = await pipeline.step(inputs, labels)
                if optimizer is not None:
                    optimizer.step()
                await system.world.allreduce(job.step_sums(), out=totals)
                step += 1
                refuse_divergence(totals[0] / totals[2], step, epoch, config, job.checkpoints)
                now = time.perf_counter()
                curves.record_step(loss=totals[0] / totals[2], accuracy=totals[1] / totals[2], time_s=now - clock,
                                   comm_wait_s=stats.idle_s + stats.reduce_s)  # fmt: skip
                phases = {"compute": stats.compute_s, "idle": stats.idle_s, "reduce": stats.reduce_s,
                          "other": now - began - stats.compute_s - stats.idle_s - stats.reduce_s}  # fmt: skip
                yield Step(progress_text(epoch, curves), int(totals[2]), phases)
            if job.validation is not None:
                await _score(job, held_out, epoch + 1)
    except BaseException as error:
        failure = error
        raise
    finally:
        if reader is not None:
            close_after(reader, failure)
        if edge is not None and raised_together(failure):  # (freeing it may wait for the others)
            edge.comm.Free()


async def _batches(reader: Reader | None, epoch: int, skip: int, per_epoch: int) -> AsyncGenerator:
    """(step, batch) of the reader's batches of ``epoch`` after the first ``skip``; on a middle stage, Nones."""
    if reader is not None:
        async for batch in reader.aepoch(epoch, skip):
            yield batch.step, batch
    else:
        for at in range(skip, per_epoch):
            yield at, None


def _held_out(job: _PipelineTraining, dtype: np.dtype) -> HeldOut | None:
    """This replica's scoring batches of the held-out data: read on a first or last stage, counted on the others
    (every stage of a replica runs as many)."""
    if job.validation is None:
        return None
    budget = batch_budget(job.config, job.replicas, job.spec.get("length", 1))
    if job.edge is not None:
        return HeldOut.read(job.validation, job.edge.comm, budget, dtype)
    replica = job.system.rank % job.replicas
    return HeldOut(scoring_batches(job.validation, budget, job.replicas, replica), dtype)


async def _score(job: _PipelineTraining, held_out: HeldOut | None, epoch: int) -> None:
    """The held-out loss and accuracy through the pipeline (every replica its block, batch by batch; one
    allreduce)."""
    assert job.pipeline is not None and held_out is not None
    job.stage.eval()
    sums = np.zeros(3)
    for inputs, labels in held_out:
        scored = await job.pipeline.evaluate(inputs, labels, score_sums)
        if job.pipeline.last:
            sums += scored
    await job.system.world.allreduce(sums, out=sums)
    job.curves.record_epoch(epoch=epoch, validation_loss=sums[0] / sums[2], validation_accuracy=sums[1] / sums[2])
