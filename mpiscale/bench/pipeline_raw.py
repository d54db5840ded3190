"""``bench pipeline``'s hand-written peer: the same stages and schedule in raw mpi4py and torch, and nothing else.

The pipeline a user could write by hand for one fixed model, and the floor of a Python pipeline on the machine:
every receive of a step is posted before the step starts, into a buffer of the one shape it can have; each wait
blocks in MPI (which polls without sleeping); a tensor is made straight from its buffer and sent from its own memory.
It leaves out what the runtime adds: shapes that vary, refusals that name the stage and micro-batch, an error that
ends the job, the hang watch, and a loop that serves other work while a stage waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..ranks import Comm
from ..train.pipeline.schedule import BACKWARD, FORWARD, build


class RawPipeline:
    """Stage ``comm.rank`` of ``comm.size`` (``module``) on a duplicate of ``comm``, for ``micro_batches`` of
    ``shape`` (float32 activations) in ``schedule``'s order; free it with :meth:`close`."""

    def __init__(self, comm: Comm, module: Any, loss_fn: Callable, micro_batches: int, schedule: str,
                 shape: tuple[int, ...]) -> None:  # fmt: skip
        self.comm = comm.Dup()
        self.module, self.loss_fn = module, loss_fn
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        self.actions = build(schedule, size, micro_batches)[rank]
        self.before = rank - 1 if rank > 0 else None
        self.after = rank + 1 if rank < size - 1 else None
        #: Each receive of a step, by (kind, micro-batch): its peer, its tag and the buffer it lands in, made once (a
        #: step has waited for all of them, and sent all it sends, before the next one posts them again).
        self.receives = {
            (kind, m): (peer, 2 * m + (1 if kind == BACKWARD else 0), np.empty(shape, np.float32))
            for kind, peer in ((FORWARD, self.before), (BACKWARD, self.after))
            if peer is not None
            for m in range(micro_batches)
        }

    def step(self, torch: Any, inputs: list | None, targets: list | None) -> float:
        """One step's forward and backward passes (collective over the stages; the first passes its micro-batches'
        inputs, the last their targets); gradients add to the module's. Returns the seconds of compute. Micro-batch
        ``m``'s activation travels on tag ``2m``, its gradient on ``2m + 1``."""
        comm, compute = self.comm, 0.0
        received = {key: (comm.Irecv(buffer, peer, tag), buffer) for key, (peer, tag, buffer) in self.receives.items()}
        held: dict[int, tuple[Any, Any]] = {}
        sends = []
        for action in self.actions:
            m = action.micro_batch
            if action.kind == FORWARD:
                x = inputs[m] if inputs is not None else self._take(torch, received[(FORWARD, m)]).requires_grad_()
                began = time.perf_counter()
                out = self.module(x)
                if targets is not None:
                    out = self.loss_fn(out, targets[m])
                compute += time.perf_counter() - began
                if self.after is not None:
                    sent = out.detach().numpy()
                    sends.append((comm.Isend(sent, self.after, 2 * m), sent))
                held[m] = (x, out)
            else:
                x, out = held.pop(m)
                grad = None if self.after is None else self._take(torch, received[(BACKWARD, m)])
                began = time.perf_counter()
                out.backward(grad)
                compute += time.perf_counter() - began
                if self.before is not None:
                    sent = x.grad.numpy()
                    sends.append((comm.Isend(sent, self.before, 2 * m + 1), sent))
        for request, _ in sends:
            request.Wait()
        return compute

    @staticmethod
    def _take(torch: Any, posted: tuple[Any, np.ndarray]) -> Any:
        request, buffer = posted
        request.Wait()
        return torch.from_numpy(buffer)

    def close(self) -> None:
        self.comm.Free()
