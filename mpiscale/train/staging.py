"""Gradient buckets between the device that computes them and the host memory that MPI reduces.

``DataParallel`` reduces each bucket's float32 buffer in host memory (the
runtime's hierarchical allreduce, and the compression schemes, work on numpy
buffers). Its parameters live on one device; an adaptor moves their gradients:

- ``HostGradients`` (parameters on the CPU): a gradient is copied straight
  into the bucket's buffer, which is ready at once.
- ``DeviceGradients`` (parameters on a CUDA GPU): a gradient is copied into the
  bucket's flat device buffer as backward produces it; once the bucket is
  complete, one device-to-host copy into a pinned host buffer is queued on a
  stream of its own, so it overlaps the rest of backward. Its reduction starts
  once that copy is done: a thread of the adaptor waits for each copy and then
  calls ``DataParallel`` back (autograd queues the whole backward long before
  the GPU has run it, so no later gradient would be there to ask), and the averages go back to the
  device from the pinned buffer in one copy per bucket, into the bucket's own
  device buffer, without blocking the host. Never a blocking ``.cpu()`` per
  bucket. Where the buckets are summed in device memory (``staged=False``:
  ``DataParallel(tensor_sums=...)``) no pinned memory is taken.

The scheduling (which bucket is copied, which may start) is ``DataParallel``'s
and the same for both, so the CPU tests cover all but the copies themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch


class Staged(Protocol):
    """What the adaptors see of a bucket."""

    buffer: np.ndarray  # float32, host memory: what MPI reduces
    offsets: np.ndarray
    staging: Any  # the adaptor's own state for this bucket

    def view(self, index: int) -> np.ndarray:
        """Parameter ``index``'s part of ``buffer``."""
        ...


class HostGradients:
    """Parameters on the CPU: the bucket's buffer is the gradients' only copy."""

    def buffer(self, size: int) -> tuple[np.ndarray, Any]:
        """A bucket's host buffer of ``size`` float32 values, and the adaptor's state for it."""
        return np.zeros(size, np.float32), None

    def take(self, bucket: Staged, position: int, grad: torch.Tensor | None) -> None:
        """Parameter ``position``'s gradient (None: zeros) into the bucket."""
        bucket.view(position)[:] = 0.0 if grad is None else grad.detach().numpy().reshape(-1)

    def send(self, bucket: Staged, arrived: Callable[[], None]) -> None:
        """The bucket is complete: start bringing it to its host buffer, and call ``arrived`` once it is there
        (unless it is there at once: ``arrived(bucket)`` says so)."""

    def arrived(self, bucket: Staged, wait: bool) -> bool:
        """Whether the bucket's host buffer holds its gradients (``wait``: once it does)."""
        return True

    def back(self, bucket: Staged) -> None:
        """The bucket's averages are in its host buffer: bring them to where the parameters live."""

    def average(self, bucket: Staged, position: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Parameter ``position``'s averaged gradient, where the parameter lives (after ``back``)."""
        return torch.from_numpy(bucket.view(position)).reshape(shape)

    def flat(self, bucket: Staged) -> torch.Tensor:
        """The bucket's gradients as one tensor where the parameters live (``--intra-node``: summed there)."""
        return torch.from_numpy(bucket.buffer)


class DeviceGradients(HostGradients):
    """Parameters on a CUDA device: gradients gathered on the device, staged through pinned host memory."""

    def __init__(self, device: torch.device, staged: bool = True) -> None:
        self.device, self.staged = device, staged
        self.copies = torch.cuda.Stream(device=device)
        # waits for each copy in turn, on the parameters' GPU (a new thread's is GPU 0)
        self._waiter = ThreadPoolExecutor(1, "mpiscale-staging", torch.cuda.set_device, (device,))

    def buffer(self, size: int) -> tuple[np.ndarray, Any]:
        flat = torch.zeros(size, dtype=torch.float32, device=self.device)
        if not self.staged:  # summed where it lies: no host copy, so no pinned memory
            return np.empty(0, np.float32), {"pinned": None, "flat": flat, "copied": None}
        pinned = torch.zeros(size, dtype=torch.float32, pin_memory=True)
        return pinned.numpy(), {"pinned": pinned, "flat": flat, "copied": None}

    def take(self, bucket: Staged, position: int, grad: torch.Tensor | None) -> None:
        view = bucket.staging["flat"][int(bucket.offsets[position]) : int(bucket.offsets[position + 1])]
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad.detach().reshape(-1))

    def send(self, bucket: Staged, arrived: Callable[[], None]) -> None:
        state = bucket.staging
        self.copies.wait_stream(torch.cuda.current_stream(self.device))  # the gradients written, the averages read
        with torch.cuda.stream(self.copies):
            state["pinned"].copy_(state["flat"], non_blocking=True)
            state["copied"] = copied = torch.cuda.Event()
            copied.record(self.copies)
        self._waiter.submit(_after, copied.synchronize, arrived)

    def arrived(self, bucket: Staged, wait: bool) -> bool:
        copied = bucket.staging["copied"]
        if copied is None:
            return True
        if wait:
            copied.synchronize()
        return bool(copied.query())

    def back(self, bucket: Staged) -> None:
        state = bucket.staging
        state["flat"].copy_(state["pinned"], non_blocking=True)  # one copy a bucket, from pinned memory

    def average(self, bucket: Staged, position: int, shape: tuple[int, ...]) -> torch.Tensor:
        return self.flat(bucket)[int(bucket.offsets[position]) : int(bucket.offsets[position + 1])].view(shape)

    def flat(self, bucket: Staged) -> torch.Tensor:
        return bucket.staging["flat"]


def _after(wait: Callable[[], object], then: Callable[[], None]) -> None:
    wait()
    then()


def gradients_for(device: torch.device, staged: bool = True) -> HostGradients:
    """The adaptor for parameters on ``device``; ``staged``: their buckets are summed in host memory."""
    return DeviceGradients(device, staged) if device.type == "cuda" else HostGradients()
