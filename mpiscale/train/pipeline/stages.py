"""Pipeline-parallel training: one stage of the model per rank, micro-batches passed on as actor messages.

Each rank holds one stage (a module) and an inbox actor. A step splits the
batch into micro-batches and runs this stage's action list (:mod:`.schedule`,
compiled and checked when the pipeline is made): a forward takes micro-batch
``m``'s activation from the stage before (the first stage its input), runs the
module and tells the output to the stage after (the last stage computes the
loss); a backward takes the gradient of that output from the stage after (the
last stage starts from its loss), runs autograd and tells the input's gradient
to the stage before. Tensors travel out of band, with their shape and dtype,
so micro-batches of different sizes (the last of an epoch, other sequence
lengths) need nothing special, and fewer micro-batches than stages is only a
longer bubble. Gradients accumulate in the stage's parameters over the
micro-batches, as in one process that sums the micro-batches' losses; the
caller steps its own optimizer over its own stage.

Whether a gradient comes back is decided by the output alone: an output that
does not require a gradient (a stage without parameters at the front, integer
token ids) is sent as such and the stage before does not wait for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...runtime import Actor, ActorRef, ActorSystem
from .schedule import BACKWARD, FORWARD, Action, build

Key = tuple[str, int, int]  # (FORWARD for an activation or BACKWARD for a gradient, step, micro-batch)


class _Arrivals:
    """Activations and gradients that came from the neighbouring stages, until this stage's schedule takes them."""

    def __init__(self) -> None:
        self.arrived: dict[Key, torch.Tensor] = {}
        self.waiting: dict[Key, asyncio.Future] = {}

    def put(self, key: Key, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"pipeline message {key} carries a {type(tensor).__name__}, not a tensor")
        future = self.waiting.pop(key, None)
        if future is not None:
            future.set_result(tensor)
        elif key in self.arrived:
            raise RuntimeError(f"pipeline message {key} arrived twice")
        else:
            self.arrived[key] = tensor

    async def take(self, key: Key) -> torch.Tensor:
        tensor = self.arrived.pop(key, None)
        if tensor is not None:
            return tensor
        future = self.waiting[key] = asyncio.get_running_loop().create_future()
        return await future


class StageInbox(Actor):
    """The message end of a stage: what the neighbours tell it goes to its :class:`_Arrivals`."""

    def __init__(self, arrivals: _Arrivals) -> None:
        self.arrivals = arrivals

    def activation(self, step: int, micro_batch: int, tensor: torch.Tensor, needs_grad: bool) -> None:
        self.arrivals.put((FORWARD, step, micro_batch), tensor.requires_grad_(needs_grad))

    def gradient(self, step: int, micro_batch: int, tensor: torch.Tensor) -> None:
        self.arrivals.put((BACKWARD, step, micro_batch), tensor)


@dataclass
class StepStats:
    """What one step of one stage did: the loss (the last stage's sum over micro-batches, else None), seconds of
    compute, seconds idle waiting for a neighbour (this stage's share of the bubble), the most micro-batches
    whose activations it held at once, and their bytes."""

    loss: float | None
    compute_s: float
    idle_s: float
    peak_held: int
    peak_held_bytes: int
    micro_batch_sizes: list[int] = field(default_factory=list)


class Pipeline:
    """Stage ``system.rank`` of a model cut into ``system.size`` stages (make it with :meth:`start` on every
    rank)."""

    def __init__(
        self,
        system: ActorSystem,
        module: torch.nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        micro_batches: int,
        schedule: str,
        name: str,
    ) -> None:
        self.system, self.module, self.loss_fn = system, module, loss_fn
        self.stage, self.stages = system.rank, system.size
        self.micro_batches, self.schedule = micro_batches, schedule
        self.actions: list[Action] = build(schedule, self.stages, micro_batches)[self.stage]
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self._arrivals = _Arrivals()
        self._inbox = f"{name}.inbox"
        self._before = ActorRef(self.stage - 1, self._inbox)
        self._after = ActorRef(self.stage + 1, self._inbox)
        self._step = 0

    @classmethod
    async def start(
        cls,
        system: ActorSystem,
        module: torch.nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        micro_batches: int,
        schedule: str = "1f1b",
        name: str = "pipeline",
    ) -> Pipeline:
        """Collective: this rank's stage (``module``) of a pipeline of ``system.size`` stages, rank order;
        ``loss_fn(output, target)`` gives the last stage's loss of one micro-batch. The schedule is compiled and
        checked here, the same on every rank, and the stages' inboxes exist on every rank on return."""
        pipeline = cls(system, module, loss_fn, micro_batches, schedule, name)
        await system.spawn_group(StageInbox, pipeline._arrivals, name=pipeline._inbox)
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
            return list(torch.tensor_split(batch, self.micro_batches))
        parts = list(batch)
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
            with self._noted(action, run.step):
                if action.kind == FORWARD:
                    await self._forward(run, action.micro_batch)
                else:
                    await self._backward(run, action.micro_batch)
        self._check_drained(run.step)
        sizes = [len(part) for part in run.inputs] if run.inputs is not None else []
        return StepStats(run.loss if self.last else None, run.compute_s, run.idle_s, run.peak, run.peak_bytes, sizes)

    async def _forward(self, run: _StepRun, m: int) -> None:
        waited = time.perf_counter()
        x = run.inputs[m] if run.inputs is not None else await self._arrivals.take((FORWARD, run.step, m))
        began = time.perf_counter()
        out = self.module(x)
        if run.targets is not None:
            out = self.loss_fn(out, run.targets[m])
            run.loss += float(out.detach())
        else:
            self._after.tell("activation", run.step, m, out.detach(), out.requires_grad)
        run.compute_s += time.perf_counter() - began
        run.idle_s += began - waited
        size = _nbytes(x) + (0 if run.targets is not None else out.nbytes)
        run.held[m] = (x if isinstance(x, torch.Tensor) and x.requires_grad else None, out, size)
        run.held_bytes += size
        run.peak, run.peak_bytes = max(run.peak, len(run.held)), max(run.peak_bytes, run.held_bytes)

    async def _backward(self, run: _StepRun, m: int) -> None:
        x, out, size = run.held.pop(m)
        run.held_bytes -= size
        if out.requires_grad:
            waited = time.perf_counter()
            grad = None if self.last else await self._arrivals.take((BACKWARD, run.step, m))
            began = time.perf_counter()
            out.backward(grad)
            run.compute_s += time.perf_counter() - began
            run.idle_s += began - waited
        if x is not None:
            self._before.tell("gradient", run.step, m, x.grad if x.grad is not None else torch.zeros_like(x))

    @contextlib.contextmanager
    def _noted(self, action: Action, step: int) -> Iterator[None]:
        """Name the stage, action and step on an error from the user's module or loss."""
        try:
            yield
        except Exception as error:
            error.add_note(f"in pipeline stage {self.stage} of {self.stages}, {action} (step {step})")
            raise

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
    held: dict[int, tuple[torch.Tensor | None, torch.Tensor, int]] = field(default_factory=dict)  # input, output, bytes
    loss: float = 0.0
    compute_s: float = 0.0
    idle_s: float = 0.0
    held_bytes: int = 0
    peak: int = 0
    peak_bytes: int = 0


def _nbytes(value: Any) -> int:
    return value.nbytes if isinstance(value, torch.Tensor) else 0
