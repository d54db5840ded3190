"""The data-parallel training job (``mpiscale train``): every rank trains on its part of each global batch.

``train(system, config)`` runs on every rank inside ``mpiscale.run``. Rank 0's
initial weights are broadcast; each step a rank reads its part of the global
mini-batch (``BatchReader``: the same global order whatever the number of
ranks), runs forward and backward, and ``DataParallel`` averages the gradients
bucket by bucket while backward goes on; every rank then takes the same Adam
step. The loss is scaled so that the averaged gradient is that of the whole
global batch, so a run on any number of ranks follows the one-process run
within floating-point rounding. Checkpoints hold the weights, Adam's state
and the curves, all replicated, so a resumed run may use another number of
ranks.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..io import (
    Checkpointer,
    CheckpointError,
    DataFileError,
    OutputLock,
    Restored,
)
from ..jobs import (
    Ended,
    HeldOutputs,
    Plan,
    Step,
    check_not_an_input,
    check_outputs,
    close_checkpointer,
    load_state,
    lock_results,
    restore_compatible,
    run_lifecycle,
    same_bits_everywhere,
    settings_meta,
    state_arrays,
    write_results,
)
from ..kernels.threads import share_cores
from ..ranks import Comm, ranks_sharing_cores
from ..runtime import ActorSystem
from .batches import TrainingSteps, as_tensors, open_reader, step_samples, training_steps, uses_samples
from .bundled import write_digits, write_sequences
from .compression import scheme
from .config import TrainConfig
from .curves import Curves
from .data import LabelledData, check_classes, check_labelled, check_ragged, is_ragged
from .data_parallel import DataParallel
from .held_out import HeldOut, batch_budget, check_scoring_budget, score_sums
from .model import TRANSFORMER, build_model, input_layout, set_standardization
from .pipeline.state import INDEX as PIPELINE_INDEX
from .pipeline.state import NO_ROWS
from .results import TrainResults, write
from .state import OPTIMIZER_SETTINGS, TrainingState, json_array

log = logging.getLogger(__name__)

#: Settings a checkpoint must share with the run that resumes it.
COMPATIBLE = ("hidden", "batch_size", "seed", "learning_rate", "weight_decay")


async def train(system: ActorSystem, config: TrainConfig) -> dict:
    """Run the job on every rank; returns a summary (the same on every rank).

    Bad input (data, settings, output paths, checkpoints, another job on the
    same outputs) ends the job before the first step with one message and exit
    status 2, agreed by every rank; a checkpoint or results file that cannot be
    written ends it with status 1.
    """
    if config.pipelined:
        from .pipelined import prepare_pipeline

        return await run_lifecycle(system, "train", lambda: prepare_pipeline(system, config))
    return await run_lifecycle(system, "train", lambda: _prepare(system, config))


@dataclass
class _Training(HeldOutputs):
    """The job between its checks and its results (a ``jobs.SteppedJob``)."""

    system: ActorSystem
    config: TrainConfig
    comm: Comm
    data: LabelledData
    validation: LabelledData | None
    spec: dict
    model: torch.nn.Sequential
    optimizer: torch.optim.Optimizer
    parallel: DataParallel
    curves: Curves
    start: int
    checkpoints: Checkpointer | None
    threads: int
    results_lock: OutputLock | None
    plan: Plan
    schedule: TrainingSteps

    async def restore(self) -> int:
        """Rank 0's weights everywhere (a fresh run's initial ones), then the steps the checkpoint holds."""
        await self.parallel.broadcast_parameters()
        return self.start

    def save(self, done: int) -> None:
        assert self.checkpoints is not None
        state = TrainingState(self.model, self.optimizer, self.config.checkpoints)
        meta = settings_meta(compatibility(self.config, self.data, self.spec, self.schedule))
        self.checkpoints.save(done, replicated=state_arrays(state, self.curves), meta=meta)

    def steps(self, start: int) -> AsyncGenerator[Step, None]:
        return _steps(self, start)

    async def finish(self, ended: Ended) -> dict:
        weights = [tensor.numpy() for tensor in self.model.state_dict().values()]  # views: written in place
        await same_bits_everywhere(self.system, weights, "weights")
        return await finish_training(self.system, self.config, self.comm, self.data, self.validation, self.spec,
                                     self.model, self.curves, self.threads, ended)  # fmt: skip


async def finish_training(
    system: ActorSystem,
    config: TrainConfig,
    comm: Comm,
    data: LabelledData,
    validation: LabelledData | None,
    spec: dict,
    model: torch.nn.Module | None,
    curves: Curves,
    threads: int,
    ended: Ended,
) -> dict:
    """Rank 0 writes the results file of ``model`` (the whole model there; None elsewhere), every rank agrees; the
    summary every rank returns."""
    hosts = sorted(set(comm.allgather(socket.gethostname())))
    score = ""
    if curves.epochs["validation_accuracy"]:
        score = f"; held-out accuracy {curves.epochs['validation_accuracy'][-1]:.1%}"
    done = f"wrote {config.out}: {ended.done} steps on {system.size} ranks{score}"
    failed = f"mpiscale train: could not write {config.out}: {{}}".format
    if model is not None:
        results = TrainResults(config, data, validation, spec, model, curves, system.size, hosts, threads)
        writer = partial(write, results=results)
    await write_results(system, config.out, writer if model is not None else _nothing, done, failed)
    loss = curves.steps["loss"][-1] if curves.done else None
    return {"steps": ended.done, "loss": loss, "score": score}


def _nothing(file) -> None:
    raise AssertionError("only rank 0 writes the results file")


def _prepare(system: ActorSystem, config: TrainConfig) -> _Training:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD  # checks and file I/O; the gradients go through the runtime's hierarchy
    threads, results_lock = claim_outputs(config, comm)
    checkpoints = None
    try:
        data, validation, spec, model = prepare_data(config, comm)
        if config.batching != "memory" and config.batch_size < system.size:
            raise ValueError(f"batch size {config.batch_size} leaves ranks without samples: use at least {system.size}")
        schedule = checked_steps(config, data, comm, system.size)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
        curves, start = Curves(), 0
        checkpoints = Checkpointer(config.checkpoints, comm, keep=2)
        state = TrainingState(model, optimizer, config.checkpoints)
        start = _restore(config, data, spec, checkpoints, state, curves, schedule)
        compression = scheme(system, config.compression, config.powersgd_rank, config.powersgd_start)
        parallel = DataParallel(system, model, bucket_mib=config.bucket_mib, compression=compression)
        plan = training_plan(config, schedule)
        return _Training(
            system, config, comm, data, validation, spec, model, optimizer, parallel, curves, start, checkpoints,
            threads, results_lock, plan, schedule,
        )  # fmt: skip
    except BaseException:
        close_checkpointer(checkpoints)  # its lock too: the job never started
        if results_lock is not None:
            results_lock.release()
        raise


def claim_outputs(config: TrainConfig, comm: Comm) -> tuple[int, OutputLock | None]:
    """(torch threads per rank, now set; the results file's lock): the outputs checked, none of them an input, and
    locked against a second job (collective)."""
    threads = share_cores(ranks_sharing_cores(comm))
    torch.set_num_threads(threads)
    check_outputs(config.out, config.checkpoints)  # always open: a stop checkpoints without periodic ones too
    check_not_an_input(config.out, [spec for spec in (config.data, config.validation) if spec], comm)
    return threads, lock_results(config.out, comm)


def checked_steps(config: TrainConfig, data: LabelledData, comm: Comm, replicas: int) -> TrainingSteps:
    """The steps of every epoch for ``replicas`` replicas, refused when an epoch makes none (collective)."""
    schedule = training_steps(config, data, comm, replicas)
    if not min(schedule.per_epoch):
        raise ValueError(
            f"batching {config.batching} with {config.batch_tokens} tokens makes fewer batches an epoch than the "
            f"{replicas} replicas of a step: lower --batch-tokens"
        )
    return schedule


def training_plan(config: TrainConfig, schedule: TrainingSteps) -> Plan:
    """How the lifecycle counts, shows and saves the steps of a training run."""
    return Plan("step", "samples", schedule.total, config.progress_every, config.checkpoint_every, True,
                checkpoint_at_end=config.checkpoint_every > 0)  # fmt: skip


def prepare_data(
    config: TrainConfig, comm: Comm
) -> tuple[LabelledData, LabelledData | None, dict, torch.nn.Sequential]:
    """(training data, held-out data or None, the model's spec, the initial model), the data checked, also against
    the model and the batch size; the weights drawn from the seed (collective)."""
    transformer = config.model == TRANSFORMER
    if config.data:
        train_path, validation_path = config.data, config.validation
    else:
        train_path, validation_path = (write_sequences if transformer else write_digits)(config.out, comm)
    if is_ragged(train_path, config.inputs, config.offsets):
        return _prepare_ragged(config, comm, train_path, validation_path)
    if config.batching == "memory":
        raise DataFileError(train_path, (
            "batching memory bounds batches by tokens: it takes ragged inputs (give --offsets, or a variable-length "
            "data set); batch rows of one size with --batch-size"
        ), config.inputs)  # fmt: skip
    data, classes, mean, std = check_labelled(train_path, config.inputs, config.labels, comm)
    validation = None
    if validation_path:
        validation, held_out_classes, _, _ = check_labelled(validation_path, config.inputs, config.labels, comm)
        if validation.features != data.features:
            raise DataFileError(
                validation_path, f"rows of {validation.features} values, the training rows have {data.features}"
            )
        classes = _with_held_out(validation_path, classes, held_out_classes)
    check_classes(data, classes)
    if config.batch_size > data.samples:
        raise ValueError(f"batch size {config.batch_size} exceeds the {data.samples} training samples")
    torch.manual_seed(config.seed)
    if transformer:
        spec = _transformer_spec(config, data, validation, classes, data.features)
        return data, validation, spec, build_model(spec)
    spec = {"inputs": data.features, "hidden": config.widths, "classes": classes}
    model = build_model(spec)
    set_standardization(model, mean, std)
    return data, validation, spec, model


def _prepare_ragged(
    config: TrainConfig, comm: Comm, train_path: str, validation_path: str
) -> tuple[LabelledData, LabelledData | None, dict, torch.nn.Sequential]:
    """``prepare_data`` for token sequences of varying length (the transformer, padded and masked)."""
    if config.model != TRANSFORMER:
        raise DataFileError(train_path, (
            "the inputs are sequences of varying length: they need --model transformer (an MLP takes rows of one "
            "size)"
        ), config.inputs)  # fmt: skip
    data, classes = check_ragged(train_path, config.inputs, config.offsets, config.labels, comm)
    validation = None
    if validation_path:
        validation, held_out_classes = check_ragged(validation_path, config.inputs, config.offsets, config.labels,
                                                    comm)  # fmt: skip
        classes = _with_held_out(validation_path, classes, held_out_classes)
        check_scoring_budget(validation, config)
    check_classes(data, classes)
    if config.batching != "memory" and config.batch_size > data.samples:
        raise ValueError(f"batch size {config.batch_size} exceeds the {data.samples} training samples")
    torch.manual_seed(config.seed)
    longest = max(data.features, validation.features if validation is not None else 0)
    spec = _transformer_spec(config, data, validation, classes, longest, ragged=True)
    return data, validation, spec, build_model(spec)


def _with_held_out(validation_path: str, classes: int, held_out_classes: int) -> int:
    if held_out_classes > classes:
        log.warning("%s has labels up to %d, unseen in training", validation_path, held_out_classes - 1)
    return max(classes, held_out_classes)


def _transformer_spec(
    config: TrainConfig, data: LabelledData, validation: LabelledData | None, classes: int, length: int,
    ragged: bool = False,
) -> dict:  # fmt: skip
    spec = {"kind": TRANSFORMER, "vocab": _vocabulary(data, validation), "length": length, "width": config.width,
            "heads": config.heads, "layers": config.encoder_layers, "classes": classes}  # fmt: skip
    return spec | {"ragged": True} if ragged else spec


#: The largest vocabulary a transformer takes: token ids beyond it are a mistake (ids not renumbered), not a model.
MAX_VOCABULARY = 1 << 24


def _vocabulary(data: LabelledData, validation: LabelledData | None) -> int:
    """One more than the largest token id of both files, which must hold integers 0 .. MAX_VOCABULARY - 1."""
    for checked in (data, validation):
        if checked is None:
            continue
        if not checked.integers:
            raise DataFileError(checked.path, (
                "the transformer takes integer token ids, one sequence per row; these inputs are not integers "
                "(use --model mlp for rows of numbers)"
            ), checked.inputs)  # fmt: skip
        if checked.lowest < 0 or checked.highest >= MAX_VOCABULARY:
            raise DataFileError(checked.path, (
                f"token ids must lie in 0 .. {MAX_VOCABULARY - 1}, found {checked.lowest:.0f} .. {checked.highest:.0f} "
                "(renumber them, e.g. with numpy.unique(tokens, return_inverse=True))"
            ), checked.inputs)  # fmt: skip
    return int(max(data.highest, validation.highest if validation is not None else 0)) + 1


def compatibility(config: TrainConfig, data: LabelledData, spec: dict, schedule: TrainingSteps) -> dict:
    """The settings a checkpoint must share with the run that resumes it: the batching too where it is not the
    fixed rows' sequential one (so checkpoints of earlier versions still match), and with memory batching the
    replicas (a step is one batch per replica: on other replicas, step N is elsewhere in the data)."""
    settings = {name: getattr(config, name) for name in COMPATIBLE} | {"samples": data.samples, "spec": spec}
    if uses_samples(config, data):
        settings |= {"batching": config.batching, "batch_tokens": config.batch_tokens}
    if config.batching == "memory":
        settings["replicas"] = schedule.replicas
    return settings


def restored_training(
    config: TrainConfig, data: LabelledData, spec: dict, checkpoints: Checkpointer, pipelined: bool,
    schedule: TrainingSteps,
) -> Restored | None:  # fmt: skip
    """The checkpoint a resumed run continues (None: none, or not resuming), refused unless it is within the run's
    steps, of the same kind of training (data-parallel, or pipeline: ``pipelined``) and of the same settings."""
    total = schedule.total

    def usable(restored: Restored) -> None:
        if restored.step > total:
            raise CheckpointError(
                f"the newest checkpoint in {config.checkpoints} is at step {restored.step}, past the {total} steps of "
                f"{config.epochs} epochs: give more --epochs to continue it"
            )
        if pipelined and PIPELINE_INDEX not in restored.meta:
            raise CheckpointError(
                f"the checkpoint in {config.checkpoints} is of data-parallel training (no --stages or "
                "--micro-batches): resume it without them"
            )
        if not pipelined and PIPELINE_INDEX in restored.meta:
            raise CheckpointError(
                f"the checkpoint in {config.checkpoints} is of pipeline training: resume it with --stages or "
                "--micro-batches (any: --micro-batches 2 alone trains as one stage)"
            )

    expected = compatibility(config, data, spec, schedule)
    rows = NO_ROWS if pipelined else None  # a pipeline rank's range comes from the checkpoint's index
    why = {"replicas": (
        "with --batching memory a step is one batch per data-parallel replica, so on another number of replicas "
        "the checkpoint's step lies elsewhere in the data: resume on the replicas it was saved with (ranks, or "
        "ranks / --stages), or start afresh with another --checkpoint-dir"
    )}  # fmt: skip
    restored = restore_compatible(checkpoints, config.resume, config.checkpoints, expected, "step", usable, rows, why)
    if restored is None and config.resume and checkpoints.rank == 0:
        log.warning("--resume: no checkpoint in %s, starting from the beginning", config.checkpoints)
    return restored


def _restore(config, data, spec, checkpoints, state: TrainingState, curves: Curves, schedule: TrainingSteps) -> int:
    """The steps of the checkpoint a resumed run continues (0: none), its state loaded into ``state`` and ``curves``."""
    restored = restored_training(config, data, spec, checkpoints, False, schedule)
    if restored is None:
        return 0
    arrays = dict(restored.replicated)
    if OPTIMIZER_SETTINGS not in arrays:  # checkpoints before the optimizer's settings travelled among its arrays
        arrays[OPTIMIZER_SETTINGS] = json_array(restored.meta["optimizer"])
    load_state(arrays, state, curves)
    if checkpoints.rank == 0:
        print(f"resumed from the checkpoint of step {restored.step} in {config.checkpoints}", flush=True)
    return restored.step


async def _steps(job: _Training, start: int) -> AsyncGenerator[Step, None]:
    """The steps from ``start``, one ``Step`` after each; the held-out score after each epoch."""
    system, config = job.system, job.config
    data, model, optimizer, parallel, curves = job.data, job.model, job.optimizer, job.parallel, job.curves
    reader = open_reader(config, data, job.comm, [data.inputs, data.labels])
    dtype = input_layout(job.spec)[1]
    budget = batch_budget(config, system.size, job.spec.get("length", 1))
    held_out = HeldOut.read(job.validation, job.comm, budget, dtype) if job.validation is not None else None
    totals = np.zeros(2)
    step = start
    clock = time.perf_counter() - curves.elapsed
    finished_epochs, within = job.schedule.locate(start)
    try:
        if held_out is not None and len(curves.epochs["epoch"]) < finished_epochs:
            # the checkpoint was taken at the last step of an epoch, before that epoch was scored: score it now
            loss_value, accuracy = await _score(system, model, held_out)
            curves.record_epoch(epoch=finished_epochs, validation_loss=loss_value, validation_accuracy=accuracy)
        for epoch in range(finished_epochs, config.epochs):
            model.train()
            async for batch in reader.aepoch(epoch, within if epoch == finished_epochs else 0):
                began = time.perf_counter()
                x, y = as_tensors(batch, data, dtype)
                assert x is not None and y is not None  # this reader reads both
                samples = step_samples(reader, config, epoch, batch.step)
                optimizer.zero_grad()
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
                (loss * (system.size / samples)).backward()  # the averaged gradient is the global batch's mean
                waiting = time.perf_counter()
                await parallel.synchronize()
                waited = time.perf_counter() - waiting
                optimizer.step()
                totals[:] = loss.item(), (logits.argmax(dim=1) == y).sum().item()
                await system.world.allreduce(totals, out=totals)
                step += 1
                now = time.perf_counter()
                curves.record_step(
                    loss=totals[0] / samples, accuracy=totals[1] / samples, time_s=now - clock, comm_wait_s=waited
                )
                phases = {"compute": now - began - waited, "allreduce": waited}
                yield Step(progress_text(epoch, curves), samples, phases)
            if held_out is not None:
                loss_value, accuracy = await _score(system, model, held_out)
                curves.record_epoch(epoch=epoch + 1, validation_loss=loss_value, validation_accuracy=accuracy)
    finally:
        reader.close()


def progress_text(epoch: int, curves: Curves) -> str:
    recent = slice(-20, None)
    time_s = np.diff([0.0, *curves.steps["time_s"]])[recent]
    share = sum(curves.steps["comm_wait_s"][recent]) / max(float(np.sum(time_s)), 1e-9)
    held_out = curves.epochs["validation_accuracy"]
    score = f"  held-out {held_out[-1]:.1%}" if held_out else ""
    return (
        f"epoch {epoch + 1}  loss {np.mean(curves.steps['loss'][recent]):.4f}  "
        f"accuracy {np.mean(curves.steps['accuracy'][recent]):.1%}{score}  comm wait {share:.0%}"
    )


async def _score(system: ActorSystem, model: torch.nn.Module, held_out: HeldOut) -> tuple[float, float]:
    """Mean loss and accuracy on the held-out data (every rank scores its block, batch by batch; one allreduce)."""
    sums = np.zeros(3)
    model.eval()
    with torch.no_grad():
        for inputs, labels in held_out:
            assert inputs is not None and labels is not None  # every rank reads its block
            sums += score_sums(model(inputs), labels)
    await system.world.allreduce(sums, out=sums)
    return sums[0] / sums[2], sums[1] / sums[2]
