"""What ``circuits run`` runs, as its job and the two kinds of work see it: the inputs cut into batches, the
rows a step writes, and the ``Work`` protocol (every circuit of a catalogue, or a composition plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

Write = tuple[str, int, np.ndarray]  # (data set, first row, rows)


@dataclass(frozen=True)
class Inputs:
    """The data set the work reads, and where the batches are."""

    path: str
    name: str
    samples: int
    batch_size: int

    def bounds(self, batch: int | None) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of ``batch`` (None: an empty range)."""
        if batch is None:
            return 0, 0
        lo = batch * self.batch_size
        return lo, min(lo + self.batch_size, self.samples)


class BatchRows(Protocol):
    """Where a ``Work`` reads its batches' rows (the job keeps each batch's digest as it passes)."""

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (independent I/O)."""
        ...

    def read_collective(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` with collective I/O (every rank calls, with any range)."""
        ...


class Work(Protocol):
    """What runs on the batches: its output data sets, and one step of it on every rank."""

    per_step: int  # batches a step runs (over all ranks)
    models: list[str]  # the model files it reads (never to be an output)
    sha256: str  # of the plan it runs ("" for none): a resumed run must run the same one

    def layout(self, samples: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]: ...

    def replicated(self) -> dict[str, np.ndarray]:
        """Data sets every rank holds alike: what the work is (a resumed run must do the same), and where it runs."""
        ...

    def what_changed(self, name: str) -> str | None:
        """Why a replicated data set of a stopped run may differ from this run's: said as the setting a resumed run
        must keep; None for where the work runs (placement over the ranks), which a resumed run writes anew."""
        ...

    async def start(self) -> None: ...

    async def step(self, batches: list[int], data: BatchRows, inputs: Inputs) -> tuple[list[Write], str | None]:
        """This rank's rows of the step's ``batches`` as writes in an order every rank shares (a rank with no rows
        writes none), and the first failure this rank saw (collective)."""
        ...

    def describe(self) -> str: ...
