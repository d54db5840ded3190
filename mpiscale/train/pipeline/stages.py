"""Pipeline-parallel training: one stage of the model per rank, micro-batches passed on as raw tensors.

Each rank holds one stage (a module) and a channel (:mod:`mpiscale.runtime.channels`).
A step splits the batch into micro-batches and runs this stage's action list (:mod:`.schedule`,
compiled and checked when the pipeline is made): a forward takes micro-batch
``m``'s activation from the stage before (the first stage its input), runs the
module and sends the output to the stage after (the last stage computes the
loss); a backward takes the gradient of that output from the stage after (the
last stage starts from its loss), runs autograd and sends the input's gradient
to the stage before. Tensors travel as their bytes, unpickled, with a header
that gives their shape and dtype, and land in buffers the receiving stage
posted ahead (one lane for activations, one for gradients); so micro-batches
of different sizes (the last of an epoch, other sequence lengths) need nothing
special, and fewer micro-batches than stages is only a longer bubble. A
gradient whose shape or dtype is not its output's is refused, naming the stage
and micro-batch. A stage about to take its next tensor polls its channel once
(one that has landed is then taken without a wait); one still to come it polls
for briefly before it sleeps (``MPISCALE_VALUE_SPIN_US``). Gradients accumulate in the stage's parameters over the
micro-batches, as in one process that sums the micro-batches' losses; the
caller steps its own optimizer over its own stage.

Whether a gradient comes back is decided by the output alone: an output that
does not require a gradient (a stage without parameters at the front, integer
token ids) is sent as such and the stage before does not wait for one.

With ``replicas=D`` the ``S x D`` ranks run D copies of the pipeline on D
batches: rank ``r`` holds stage ``r // D`` of copy ``r % D`` (the replicas of a
stage are neighbours, so on a cluster they share a node and their reduction
stays there, as in Megatron's ordering). At the start each stage's replicas
take replica 0's parameters and buffers; after each step they average their
gradients with the hierarchical allreduce of a group of their own, one buffer
per dtype (float64 stays float64), as ``DataParallel`` averages over ranks.

A stage computes on its parameters' device (a GPU, under the jobs' device
rule). Messages travel from host memory: what a stage sends is copied off its
GPU, and what it takes is put on its GPU as a leaf of its graph (so its
gradient is kept for the stage before); the inputs and targets of a step, and
the replicas' gradient averages, are moved likewise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import numpy as np
import torch

from ...runtime import ActorSystem, Arrivals, Group
from ..data_parallel import broadcast_module
from ..tensor_channel import channel_array, channel_tensor
from .schedule import BACKWARD, FORWARD, Action, build

Key = tuple[str, int, int]  # (FORWARD for an activation or BACKWARD for a gradient, step, micro-batch)


_FORWARD_LANE, _BACKWARD_LANE = 0, 1  # the channel lanes of activations and of gradients
_NEEDS_GRAD = 1  # a key's flag bit: the activation requires a gradient


@dataclass
class StepStats:
    """What one step of one stage did: the loss (the last stage's sum over micro-batches of this replica's batch,
    else None), seconds of compute, seconds idle waiting for a neighbour (this stage's share of the bubble), the
    most micro-batches whose activations it held at once and their bytes, the first stage's micro-batch sizes,
    and the seconds spent averaging gradients over the replicas."""

    loss: float | None
    compute_s: float
    idle_s: float
    peak_held: int
    peak_held_bytes: int
    micro_batch_sizes: list[int] = field(default_factory=list)
    reduce_s: float = 0.0  # seconds averaging gradients over the stage's replicas


def stage_of(rank: int, replicas: int = 1) -> int:
    """The pipeline stage rank ``rank`` holds when every stage has ``replicas`` replicas."""
    return rank // replicas


class Pipeline:
    """Stage ``stage_of(system.rank, replicas)`` of a model cut into ``system.size // replicas`` stages (make it
    with :meth:`start` on every rank)."""

    def __init__(
        self,
        system: ActorSystem,
        module: torch.nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        micro_batches: int,
        schedule: str,
        name: str,
        replicas: int,
    ) -> None:
        if not isinstance(replicas, int) or replicas < 1 or system.size % replicas:
            raise ValueError(f"replicas must divide the {system.size} ranks, got {replicas!r}")
        self.system, self.module, self.loss_fn = system, module, loss_fn
        #: Where the stage computes: its parameters' device. Messages travel from host memory.
        self.device = next((t.device for t in (*module.parameters(), *module.buffers())), torch.device("cpu"))
        self._on_host = self.device.type == "cpu"  # what arrives is where the stage computes
        self.replicas, self.stages = replicas, system.size // replicas
        self.stage, self.replica = divmod(system.rank, replicas)
        self.micro_batches, self.schedule = micro_batches, schedule
        self.actions: list[Action] = build(schedule, self.stages, micro_batches)[self.stage]
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self._arrivals: Arrivals[Key, torch.Tensor] = Arrivals("pipeline message")
        self._before, self._after = system.rank - replicas, system.rank + replicas
        self._send_to: Callable[..., None] = _not_started  # the channel's send and poll, bound (twice a micro-batch)
        self._poll: Callable[[], object] = _not_started
        self._step = 0
        #: The ranks holding this stage, which average their gradients (None with one replica).
        self.group: Group | None = None

    @classmethod
    async def start(
        cls,
        system: ActorSystem,
        module: torch.nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        micro_batches: int,
        schedule: str = "1f1b",
        name: str = "pipeline",
        replicas: int = 1,
    ) -> Pipeline:
        """Collective: this rank's stage (``module``) of a pipeline of ``system.size // replicas`` stages in rank
        order, each stage on ``replicas`` neighbouring ranks (see :func:`stage_of`); ``loss_fn(output, target)``
        gives the last stage's loss of one micro-batch. The schedule is compiled and checked here, the same on every
        rank; on return the stages' inboxes exist on every rank and a stage's replicas hold replica 0's weights."""
        pipeline = cls(system, module, loss_fn, micro_batches, schedule, name, replicas)
        for rank in range(system.size):
            stage, replica = divmod(rank, replicas)
            copy = f", replica {replica} of {replicas}" if replicas > 1 else ""
            system.roles[rank] = f"{name}: pipeline stage {stage} of {pipeline.stages}{copy}"
        channel = await system.channel(f"{name}.tensors", pipeline._arrived)
        pipeline._send_to, pipeline._poll = channel.send, channel.poll
        if replicas > 1:
            pipeline.group = system.split(pipeline.stage, f"{name}.stage{pipeline.stage}")
            await broadcast_module(pipeline.group.world, module)
        return pipeline

    def split(self, batch: torch.Tensor | Sequence[Any] | None, what: str) -> list[Any]:
        """``batch`` as this pipeline's micro-batches: a tensor is cut along its first axis into parts that differ
        by at most one row; a sequence is taken as the micro-batches themselves (any sizes)."""
        if batch is None:
            raise ValueError(f"stage {self.stage} needs the {what} of the step")
        if isinstance(batch, torch.Tensor):
            if len(batch) < self.micro_batches:
                raise ValueError(
                    f"a batch of {len(batch)} rows cannot make {self.micro_batches} micro-batches: "
                    "give at least as many rows, or fewer micro-batches"
                )
            return list(torch.tensor_split(self._here(batch), self.micro_batches))
        parts = [self._here(part) for part in batch]
        if len(parts) != self.micro_batches:
            raise ValueError(f"the pipeline runs {self.micro_batches} micro-batches, the {what} hold {len(parts)}")
        return parts

    async def step(self, inputs: Any = None, targets: Any = None) -> StepStats:
        """One training step's forward and backward passes on every rank (collective over the stages). The first
        stage needs ``inputs``, the last ``targets`` (a batch tensor, or a sequence of micro-batches); others may
        pass None. Gradients are added to the stage's parameters' ``.grad``."""
        run = _StepRun(self._step, self.split(inputs, "inputs") if self.first else None,
                       self.split(targets, "targets") if self.last else None)  # fmt: skip
        self._step += 1
        for action in self.actions:
            try:  # (no context manager: this runs twice a micro-batch)
                m = action.micro_batch  # (takes in line, no coroutine for each: this runs twice a micro-batch)
                if action.kind == FORWARD:
                    if run.inputs is not None:
                        value = run.inputs[m]
                    elif (value := self._ready((FORWARD, run.step, m))) is None:
                        value = await self._wait_for((FORWARD, run.step, m), run)
                    self._forward(run, m, value)
                else:
                    x, out = run.held.pop(m)
                    value = None  # the last stage starts from its loss; an output without a gradient gets none
                    if out.requires_grad and not self.last:
                        if (value := self._ready((BACKWARD, run.step, m))) is None:
                            value = await self._wait_for((BACKWARD, run.step, m), run)
                    self._backward(run, m, x, out, value)
            except Exception as error:
                self._note(error, action, run.step)
                raise
        self._check_drained(run.step)
        if self.group is not None:
            began = perf_counter()
            await _average_gradients(self.group, self.module)
            run.reduce_s = perf_counter() - began
        sizes = [len(part) for part in run.inputs] if run.inputs is not None else []
        loss = sum_in_order(run.losses) if self.last else None
        peak, peak_bytes = _peaks(self.actions, run.sizes)
        return StepStats(loss, run.compute_s, run.idle_s, peak, peak_bytes, sizes, run.reduce_s)

    async def evaluate(self, inputs: Any, targets: Any, metric: Callable[[Any, Any], Any]) -> Any:
        """Forward passes only, without gradients (collective over the stages, like :meth:`step`): ``inputs`` on
        the first stage cut into the pipeline's micro-batches (any number of rows, none too), ``targets`` likewise
        on the last, which returns the sum of ``metric(output, target)`` over the micro-batches (None elsewhere)."""
        step = self._step
        self._step += 1
        xs = list(torch.tensor_split(self._here(inputs), self.micro_batches)) if self.first else None
        ts = list(torch.tensor_split(self._here(targets), self.micro_batches)) if self.last else None
        total = None
        with torch.no_grad():
            for m in range(self.micro_batches):
                try:
                    x = xs[m] if xs is not None else self._ready((FORWARD, step, m))
                    if x is None:
                        x = await self._wait_for((FORWARD, step, m), None)
                    out = self.module(x)
                    if ts is not None:
                        value = metric(out, ts[m])
                        total = value if total is None else total + value
                    else:
                        self._send(FORWARD, step, m, out, False)
                except Exception as error:
                    self._note(error, Action(FORWARD, m), step)
                    raise
        self._check_drained(step)
        return total

    def _forward(self, run: _StepRun, m: int, x: Any) -> None:
        began = perf_counter()
        out = self.module(x)
        if run.targets is not None:
            out = self.loss_fn(out, run.targets[m])
            run.losses.append(out.detach())  # read once the step is done: reading it here would wait for a GPU
        run.compute_s += perf_counter() - began
        size = x.nbytes if isinstance(x, torch.Tensor) else 0
        if run.targets is None:
            self._send(FORWARD, run.step, m, out, out.requires_grad)
            size += out.nbytes
        run.held[m] = (x if isinstance(x, torch.Tensor) and x.requires_grad else None, out)
        run.sizes[m] = size

    def _backward(self, run: _StepRun, m: int, x: torch.Tensor | None, out: torch.Tensor,
                  grad: torch.Tensor | None) -> None:  # fmt: skip
        if out.requires_grad:
            if grad is not None:
                self._check_gradient(out, grad, run.step, m)
            began = perf_counter()
            out.backward(grad)
            run.compute_s += perf_counter() - began
        if x is not None:
            grad = x.grad
            self._send(BACKWARD, run.step, m, grad if grad is not None else torch.zeros_like(x), False)

    def _send(self, kind: str, step: int, m: int, tensor: torch.Tensor, needs_grad: bool) -> None:
        """An activation to the stage after, or a gradient to the stage before, as raw bytes from host memory."""
        try:
            array, flags = channel_array(tensor)
        except TypeError as error:
            what = "output" if kind == FORWARD else "input gradient"
            raise TypeError(f"pipeline stage {self.stage}: the {what} of micro-batch {m} {error}") from None
        if kind == FORWARD:
            self._send_to(self._after, _FORWARD_LANE, (step, m, (flags | _NEEDS_GRAD) if needs_grad else flags), array)
        else:
            self._send_to(self._before, _BACKWARD_LANE, (step, m, flags), array)

    def _arrived(self, source: int, lane: int, key: tuple[int, int, int], array: np.ndarray) -> None:
        """A neighbour's activation or gradient, kept until the schedule takes it."""
        step, m, flags = key
        tensor = channel_tensor(array, flags)
        if flags & _NEEDS_GRAD:
            tensor.requires_grad_()
        self._arrivals.put((FORWARD if lane == _FORWARD_LANE else BACKWARD, step, m), tensor)

    def _check_gradient(self, out: torch.Tensor, grad: torch.Tensor, step: int, m: int) -> None:
        """Refuse ``grad`` unless it has the shape and dtype of the output it is the gradient of."""
        if grad.shape != out.shape or grad.dtype != out.dtype:
            raise ValueError(f"pipeline stage {self.stage}: the gradient of micro-batch {m} (step {step}) from stage "
                             f"{self.stage + 1} is {tuple(grad.shape)} {grad.dtype}, but its output was "
                             f"{tuple(out.shape)} {out.dtype}")  # fmt: skip

    def _ready(self, key: Key) -> torch.Tensor | None:
        """The activation or gradient of ``key`` on this stage's device if it has arrived (polled once), else None."""
        value = self._arrivals.arrived.pop(key, None)
        if value is None:
            self._poll()  # one that has landed is delivered now: taken without a wait
            value = self._arrivals.arrived.pop(key, None)
            if value is None:
                return None
        return value if self._on_host else self._onto_device(value)

    async def _wait_for(self, key: Key, run: _StepRun | None) -> torch.Tensor:
        """The activation or gradient of ``key``, awaited: the wait counts as waiting on the neighbour that owes it,
        and as idle time of the step ``run`` (if any)."""
        waited = perf_counter()
        value = await self._arrivals.take(key, lambda future: self.system.expect(future, lambda: self._awaited(key)))
        if run is not None:
            run.idle_s += perf_counter() - waited
        return value if self._on_host else self._onto_device(value)

    def _onto_device(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach().to(self.device).requires_grad_(value.requires_grad)  # a leaf here: its .grad is kept

    def _here(self, value: Any) -> Any:
        """A tensor of the step's inputs or targets on this stage's device (anything else as it is)."""
        return value.to(self.device) if isinstance(value, torch.Tensor) else value

    def _awaited(self, key: Key) -> str:
        """What this stage waits for, for the hang watch (made only when it names a wait)."""
        kind, step, m = key
        source = self.stage - 1 if kind == FORWARD else self.stage + 1
        what = "activation" if kind == FORWARD else "gradient"
        return f"pipeline stage {self.stage} for the {what} of micro-batch {m} (step {step}) from stage {source}"

    def _note(self, error: Exception, action: Action, step: int) -> None:
        """Name the stage, action and step on an error from the user's module or loss."""
        error.add_note(f"in pipeline stage {self.stage} of {self.stages}, {action} (step {step})")

    def _check_drained(self, step: int) -> None:
        """Refuse messages of this step or earlier that no action took (the stage before may have begun the next
        step already)."""
        stale = sorted(key for key in self._arrivals.arrived if key[1] <= step)
        if stale:
            raise RuntimeError(f"pipeline stage {self.stage}: step {step} ended with messages no action took: {stale}")


@dataclass
class _StepRun:
    """One step in progress on one stage."""

    step: int
    inputs: list | None  # the micro-batches' inputs (first stage) and targets (last stage)
    targets: list | None
    held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)  # input, output
    sizes: dict[int, int] = field(default_factory=dict)  # each micro-batch's bytes held from forward to backward
    losses: list[torch.Tensor] = field(default_factory=list)  # the last stage's micro-batch losses, detached
    compute_s: float = 0.0
    idle_s: float = 0.0
    reduce_s: float = 0.0


def sum_in_order(parts: list[torch.Tensor], what: str = "loss") -> float:
    """The sum of the micro-batches' ``what`` (their losses, their hits), each one number, added in order as Python
    numbers: read once a step, so a stage on a GPU waits for its device once, not after every micro-batch's forward."""
    if not parts:
        return 0.0
    values = torch.stack(parts) if len({v.shape for v in parts}) == 1 else torch.cat([v.reshape(-1) for v in parts])
    if values.numel() != len(parts):
        shapes = [tuple(v.shape) for v in parts]
        raise ValueError(f"the {what} of a micro-batch must be one number, got shapes {shapes}")
    return sum(values.reshape(-1).tolist())


def _peaks(actions: list[Action], sizes: dict[int, int]) -> tuple[int, int]:
    """The most micro-batches held at once over a step's ``actions``, and the most bytes (``sizes``: each one's),
    counted once the step is done: a forward holds its micro-batch until its backward (reckoned here, not in the
    loop that runs twice a micro-batch)."""
    held = held_bytes = peak = peak_bytes = 0
    for action in actions:
        if action.kind == FORWARD:
            held += 1
            held_bytes += sizes[action.micro_batch]
            peak, peak_bytes = max(peak, held), max(peak_bytes, held_bytes)
        else:
            held -= 1
            held_bytes -= sizes[action.micro_batch]
    return peak, peak_bytes


def _not_started(*_: object) -> None:
    raise RuntimeError("make a pipeline with Pipeline.start")


async def _average_gradients(group: Group, module: torch.nn.Module) -> None:
    """Every trainable parameter's gradient averaged over ``group`` (collective over it): one allreduce per dtype;
    a parameter no replica gave a gradient keeps none, one that only some did counts as zero on the others."""
    params = [p for p in module.parameters() if p.requires_grad]
    had = np.array([p.grad is not None for p in params], np.int32)
    await group.world.allreduce(had, op="max", out=had)
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for param, given in zip(params, had):
        if given:
            by_dtype.setdefault(param.dtype, []).append(param)
    with torch.no_grad():
        for dtype in sorted(by_dtype, key=str):  # the same order on every replica
            members = by_dtype[dtype]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in members])
            host = flat.cpu()  # the same memory on the CPU; a copy from a GPU, and back after
            buffer = host.numpy()
            await group.hierarchy.allreduce(buffer, out=buffer)
            if host is not flat:
                flat.copy_(host)
            flat /= group.size
            offset = 0
            for param in members:
                average = flat[offset : offset + param.numel()].view_as(param)
                if param.grad is None:
                    param.grad = average.clone()
                else:
                    param.grad.copy_(average)
                offset += param.numel()
