"""How a gradient bucket travels: as float32, as 16-bit floats, or as PowerSGD's low-rank factors.

Each scheme is a ``Compression``: ``start(bucket)``, called the moment a
bucket's gradients are all in (during backward; it starts the hierarchical
allreduce and returns at once), and ``await finish(bucket)``, which leaves the
average over the ranks in ``bucket.buffer``. Every scheme gives every rank the
very same bits. A user's own scheme (top-k, sign, error feedback of their
choosing) is any class with those two methods, given to
``DataParallel(compression=...)``.

- ``Exact``: float32 sums, divided by the world size at the end.
- ``Narrow("float16" | "bfloat16")``: as PyTorch DDP's fp16/bf16 compression
  hooks: divide first (no overflow), send 16-bit values (half the bytes), add
  them in float32 in rank order and round to 16 bits once per stage
  (``kernels.halves``: Numba encoding and sums, no Python inside MPI).
- ``PowerSGD(rank)``: Vogels et al. 2019, as PyTorch's PowerSGD hook: each
  matrix-shaped gradient ``M`` (n x m) plus its error-feedback residual is
  replaced by ``P Q^T`` with ``P = orth(sum M Q)`` and ``Q = sum M^T P``: two
  allreduces of ``(n + m) r`` values instead of one of ``n m``. Vectors, and
  matrices too small to gain ``min_rate`` times, travel exactly with the
  ``P`` factors. The residual ``M - P Q^T / ranks`` stays on the rank and is
  added next step; ``Q`` is kept as the next step's warm start. The first
  ``start_step`` steps are exact, as the hook's ``start_powerSGD_iter``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

import numpy as np

from ..kernels.halves import SumOfBits, from_bits, to_bits
from ..runtime import ActorSystem, Group


class Bucket(Protocol):
    """What a scheme sees of a bucket: its float32 buffer and its parameters' shapes and offsets."""

    buffer: np.ndarray
    shapes: list[tuple[int, ...]]
    offsets: np.ndarray
    index: int


class Compression(Protocol):
    """A gradient-compression scheme ``DataParallel`` uses: implement both methods to bring your own."""

    def start(self, bucket: Bucket) -> None:
        """The bucket's gradients are all in (called during backward, in autograd's thread, which may be one without
        an event loop): start its communication, return at once."""
        ...

    async def finish(self, bucket: Bucket) -> None:
        """Leave the average of every rank's gradients in ``bucket.buffer``, the same bits on every rank."""
        ...


class Exact:
    """float32 on the wire."""

    def __init__(self, system: ActorSystem | Group) -> None:
        self.system = system
        self._futures: dict[int, Future] = {}

    def start(self, bucket: Bucket) -> None:
        self._futures[bucket.index] = self.system.hierarchy.start_allreduce(bucket.buffer, out=bucket.buffer)

    async def finish(self, bucket: Bucket) -> None:
        await self.system.hierarchy.finish(self._futures.pop(bucket.index))
        bucket.buffer *= 1.0 / self.system.size


class Narrow:
    """16-bit floats on the wire: ``float16`` (IEEE half) or ``bfloat16``."""

    def __init__(self, system: ActorSystem | Group, kind: str) -> None:
        self.system, self.kind, self.sum = system, kind, SumOfBits(kind)
        self._wire: dict[int, tuple[np.ndarray, Future]] = {}

    def start(self, bucket: Bucket) -> None:
        bucket.buffer *= 1.0 / self.system.size  # divided before the sum, so float16's range is not exceeded
        bits = to_bits(bucket.buffer, self.kind)
        future = self.system.hierarchy.start_allreduce(bits, op=self.sum, out=bits)
        self._wire[bucket.index] = (bits, future)

    async def finish(self, bucket: Bucket) -> None:
        bits, future = self._wire.pop(bucket.index)
        await self.system.hierarchy.finish(future)
        from_bits(bits, self.kind, out=bucket.buffer)


class _Matrix:
    """One matrix-shaped gradient under PowerSGD: where it sits in the bucket, its Q and its residual."""

    def __init__(self, start: int, rows: int, columns: int, rank: int, generator: np.random.Generator) -> None:
        self.start, self.rows, self.columns = start, rows, columns
        self.q = generator.standard_normal((columns, rank)).astype(np.float32)  # the same on every rank
        self.residual = np.zeros((rows, columns), np.float32)
        self.average = np.empty((rows, columns), np.float32)  # kept: a fresh matrix a step costs its page faults
        self.p = np.empty((rows, rank), np.float32)

    def view(self, buffer: np.ndarray) -> np.ndarray:
        return buffer[self.start : self.start + self.rows * self.columns].reshape(self.rows, self.columns)


class PowerSGD:
    """Rank-``rank`` PowerSGD with error feedback, after ``start_step`` exact steps."""

    def __init__(
        self, system: ActorSystem | Group, rank: int = 4, start_step: int = 10, min_rate: float = 2.0, seed: int = 0
    ) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be at least 1, got {rank}")
        self.system, self.rank, self.start_step, self.min_rate, self.seed = system, rank, start_step, min_rate, seed
        self.exact = Exact(system)
        self._layout: dict[int, tuple[list[_Matrix], np.ndarray]] = {}
        self._pending: dict[int, tuple[np.ndarray, Future]] = {}
        self._steps: dict[int, int] = {}

    def _plan(self, bucket: Bucket) -> tuple[list[_Matrix], np.ndarray]:
        """The bucket's compressed matrices, and the indices of the values that travel exactly."""
        if bucket.index not in self._layout:
            generator = np.random.default_rng([self.seed, bucket.index])
            matrices, exact = [], []
            for position, shape in enumerate(bucket.shapes):
                start, stop = int(bucket.offsets[position]), int(bucket.offsets[position + 1])
                rows, columns = (shape[0], (stop - start) // shape[0]) if len(shape) >= 2 else (1, stop - start)
                rank = min(self.rank, rows, columns)
                if len(shape) >= 2 and rows * columns >= self.min_rate * (rows + columns) * rank:
                    matrices.append(_Matrix(start, rows, columns, rank, generator))
                else:
                    exact.append(np.arange(start, stop))
            self._layout[bucket.index] = (matrices, np.concatenate(exact) if exact else np.empty(0, np.int64))
        return self._layout[bucket.index]

    def start(self, bucket: Bucket) -> None:
        step = self._steps.get(bucket.index, 0)
        self._steps[bucket.index] = step + 1
        if step < self.start_step:
            self.exact.start(bucket)
            return
        matrices, exact = self._plan(bucket)
        parts = [bucket.buffer[exact]]
        for matrix in matrices:
            gradient = matrix.view(bucket.buffer)
            gradient += matrix.residual  # error feedback: what earlier steps' approximations missed
            np.matmul(gradient, matrix.q, out=matrix.p)
            parts.append(matrix.p.reshape(-1))
        wire = np.concatenate(parts)
        self._pending[bucket.index] = (wire, self.system.hierarchy.start_allreduce(wire, out=wire))

    async def finish(self, bucket: Bucket) -> None:
        if bucket.index not in self._pending:
            await self.exact.finish(bucket)
            return
        matrices, exact = self._layout[bucket.index]
        wire, future = self._pending.pop(bucket.index)
        await self.system.hierarchy.finish(future)
        scale = 1.0 / self.system.size
        bucket.buffer[exact] = wire[: len(exact)] * scale
        offset = len(exact)
        q_parts = []
        for matrix in matrices:
            count = matrix.p.size
            p = wire[offset : offset + count].reshape(matrix.p.shape)
            offset += count
            matrix.p = np.linalg.qr(p)[0].astype(np.float32)  # the same bits on every rank: p is
            q_parts.append((matrix.view(bucket.buffer).T @ matrix.p).reshape(-1))
        if not matrices:
            return
        qs = np.concatenate(q_parts)
        await self.system.hierarchy.allreduce(qs, out=qs)
        offset = 0
        for matrix in matrices:
            matrix.q = qs[offset : offset + matrix.q.size].reshape(matrix.q.shape).copy()
            offset += matrix.q.size
            gradient = matrix.view(bucket.buffer)
            np.matmul(matrix.p * np.float32(scale), matrix.q.T, out=matrix.average)  # (the scale on the thin factor)
            np.subtract(gradient, matrix.average, out=matrix.residual)
            np.copyto(gradient, matrix.average)


def scheme(system: ActorSystem | Group, name: str, powersgd_rank: int = 4, powersgd_start: int = 10) -> Compression:
    """The scheme a trainer's ``compression`` setting names: none, fp16, bf16 or powersgd."""
    if name == "none":
        return Exact(system)
    if name in ("fp16", "bf16"):
        return Narrow(system, {"fp16": "float16", "bf16": "bfloat16"}[name])
    if name == "powersgd":
        return PowerSGD(system, powersgd_rank, powersgd_start)
    raise ValueError(f"unknown compression {name!r}: use none, fp16, bf16 or powersgd")
