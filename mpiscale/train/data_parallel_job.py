"""The data-parallel training job (``mpiscale train``): every rank trains on its part of each global batch.

``prepare_data_parallel`` makes the job on every rank (:mod:`.job` runs it). Rank 0's
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

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import numpy as np
import torch

from ..io import Checkpointer, OutputLock, close_after
from ..jobs import (
    Ended,
    HeldOutputs,
    Plan,
    Step,
    agreed_cuda_aware,
    announce,
    choose_torch_device,
    give_back,
    load_state,
    open_checkpointer,
    recorded_devices,
    same_bits_everywhere,
    settings_meta,
    state_arrays,
)
from ..ranks import Comm
from ..runtime import ActorSystem
from .batches import TrainingSteps, as_tensors, open_reader, step_samples
from .compression import scheme
from .config import TrainConfig
from .curves import Curves
from .data import LabelledData
from .data_parallel import DataParallel
from .held_out import HeldOut, batch_budget, score_sums
from .model import input_layout
from .preparation import (
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
from .state import OPTIMIZER_SETTINGS, TrainingState, json_array
from .tensor_sums import DirectSums, NodeSums, TensorSums


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
    device: torch.device  # where the model, its optimizer and the batches live

    def release(self) -> None:
        super().release()
        if self.parallel.tensor_sums is not None:
            self.parallel.tensor_sums.close()

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
        self.model.cpu()  # the results are written from host memory, whatever the device
        weights = [tensor.numpy() for tensor in self.model.state_dict().values()]  # views: written in place
        await same_bits_everywhere(self.system, weights, "weights")
        return await finish_training(self.system, self.config, self.comm, self.data, self.validation, self.spec,
                                     self.model, self.curves, self.threads, ended,
                                     recorded_devices(str(self.device), self.comm),
                                     self.parallel.gradient_path)  # fmt: skip


def prepare_data_parallel(system: ActorSystem, config: TrainConfig) -> _Training:
    """The job checked and ready on every rank: its outputs claimed, data read, model built, checkpoint restored."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD  # checks and file I/O; the gradients go through the runtime's hierarchy
    device = torch.device(choose_torch_device(config.device, comm))
    sums = _tensor_sums(system, config, comm, device)
    results_lock = checkpoints = None
    try:
        threads, results_lock = claim_training_outputs(config, comm)
        data, validation, spec, model = prepare_data(config, comm)
        model.to(device)  # before the optimizer is made: its state lives beside the parameters
        if config.batching != "memory" and config.batch_size < system.size:
            raise ValueError(f"batch size {config.batch_size} leaves ranks without samples: use at least {system.size}")
        schedule = checked_steps(config, data, comm, system.size)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
        curves, start = Curves(), 0
        checkpoints = open_checkpointer(config.checkpoints, comm, config.local_dir, config.shared_every)
        state = TrainingState(model, optimizer, config.checkpoints)
        start = _restore(config, data, spec, checkpoints, state, curves, schedule)
        # sums where the gradients lie take no compression
        compression = None if sums else scheme(system, config.compression, config.powersgd_rank, config.powersgd_start)
        parallel = DataParallel(system, model, bucket_mib=config.bucket_mib, first_bucket_mib=config.first_bucket_mib,
                                compression=compression, tensor_sums=sums)  # fmt: skip
        announce("gradients", parallel.gradient_path)  # telemetry's record of how they are averaged
        plan = training_plan(config, schedule)
        return _Training(
            system, config, comm, data, validation, spec, model, optimizer, parallel, curves, start, checkpoints,
            threads, results_lock, plan, schedule, device,
        )  # fmt: skip
    except BaseException:
        give_back(results_lock, checkpoints)  # the job never started
        if sums is not None:
            sums.close()
        raise


def _tensor_sums(system: ActorSystem, config: TrainConfig, comm: Comm, device: torch.device) -> TensorSums | None:
    """How the buckets are summed where they lie, or None (the host buffers, staged from a GPU) (collective):
    ``--intra-node nccl|gloo``'s groups (refused on every rank alike where a rank's device does not suit the
    backend); else, on GPUs whose MPI takes device buffers (on every rank), MPI on device memory."""
    kinds = {kind.split(":")[0] for kind in comm.allgather(str(device))}
    if config.intra_node == "mpi":
        direct = kinds == {"cuda"} and config.compression == "none" and agreed_cuda_aware(comm, str(device))
        if direct and comm.Get_rank() == 0:
            print("mpiscale train: the MPI library takes device buffers: gradients are summed in GPU memory",
                  flush=True)  # fmt: skip
        return DirectSums(system, device) if direct else None
    wanted = "cuda" if config.intra_node == "nccl" else "cpu"
    if kinds != {wanted}:
        raise ValueError(f"--intra-node {config.intra_node} sums buffers in {'GPU' if wanted == 'cuda' else 'host'} "
                         f"memory, and ranks run on {', '.join(sorted(kinds))}: use --device {wanted}"
                         + (" (or --intra-node nccl on GPUs)" if wanted == "cpu" else ""))  # fmt: skip
    return NodeSums(system, config.intra_node, device)


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
    failure: BaseException | None = None
    try:
        if held_out is not None and len(curves.epochs["epoch"]) < finished_epochs:
            # the checkpoint was taken at the last step of an epoch, before that epoch was scored: score it now
            loss_value, accuracy = await _score(system, model, held_out, job.device)
            curves.record_epoch(epoch=finished_epochs, validation_loss=loss_value, validation_accuracy=accuracy)
        for epoch in range(finished_epochs, config.epochs):
            model.train()
            async for batch in reader.aepoch(epoch, within if epoch == finished_epochs else 0):
                began = time.perf_counter()
                x, y = as_tensors(batch, data, dtype)
                assert x is not None and y is not None  # this reader reads both
                x, y = x.to(job.device), y.to(job.device)
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
                refuse_divergence(totals[0] / samples, step, epoch, config, job.checkpoints)
                now = time.perf_counter()
                curves.record_step(
                    loss=totals[0] / samples, accuracy=totals[1] / samples, time_s=now - clock, comm_wait_s=waited
                )
                phases = {"compute": now - began - waited, "allreduce": waited}
                yield Step(progress_text(epoch, curves), samples, phases)
            if held_out is not None:
                loss_value, accuracy = await _score(system, model, held_out, job.device)
                curves.record_epoch(epoch=epoch + 1, validation_loss=loss_value, validation_accuracy=accuracy)
    except BaseException as error:
        failure = error
        raise
    finally:
        close_after(reader, failure)


async def _score(
    system: ActorSystem, model: torch.nn.Module, held_out: HeldOut, device: torch.device
) -> tuple[float, float]:
    """Mean loss and accuracy on the held-out data (every rank scores its block, batch by batch; one allreduce)."""
    sums = np.zeros(3)
    model.eval()
    with torch.no_grad():
        for inputs, labels in held_out:
            assert inputs is not None and labels is not None  # every rank reads its block
            sums += score_sums(model(inputs.to(device)), labels.to(device))
    await system.world.allreduce(sums, out=sums)
    return sums[0] / sums[2], sums[1] / sums[2]
