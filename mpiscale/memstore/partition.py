"""One rank's partition of the memory store: contiguous float32 columns, the id column, and the id index.

Records live in rows ``0 .. len - 1``; the arrays grow by doubling, the index
is rebuilt at twice the size when it would pass half full, and a delete
compacts the rows and rebuilds the index. Nothing depends on the rows' order:
ties in rankings are broken by id, and sums are exact.

With ``device="cuda"``, a partition of at least ``device_threshold`` records
decays, reinforces and runs the iteration's pass on the GPU, its columns kept
there between iterations (``DeviceMirror``); smaller ones stay on the CPU,
where launching kernels would cost more than the work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..kernels.memstore import (
    PassOutput,
    add_to_index,
    apply_deltas,
    build_index,
    combine_by_row,
    decay,
    find_rows,
    fused_pass,
    gather_rows,
)

if TYPE_CHECKING:
    from .mirror import DeviceMirror

BASE_COLUMNS = ("strength", "quality", "touched")
#: Each column's type: float32, but ``touched``, the iteration that last reinforced a record, is an integer (a
#: float32 counts iterations exactly only up to 2**24).
TOUCHED_TYPE = np.dtype(np.int64)


def _column_type(name: str) -> np.dtype:
    return TOUCHED_TYPE if name == "touched" else np.dtype(np.float32)


#: Records below which a partition stays on the CPU even with a GPU.
DEVICE_THRESHOLD = 1 << 16


def _capacity_for(records: int) -> int:
    """Index slots: a power of two at least twice the records."""
    return 1 << max(4, int(2 * max(records, 1) - 1).bit_length())


class Partition:
    """The records this rank owns. ``extra`` names user-defined float32 columns; ``touched`` is int64."""

    def __init__(self, extra: tuple[str, ...] = (), device: str = "cpu", device_threshold: int = DEVICE_THRESHOLD):
        self.names = (*BASE_COLUMNS, *extra)
        self._float_names = tuple(name for name in self.names if name != "touched")
        self._float_places = np.array([self.names.index(name) for name in self._float_names], np.int64)
        self._touched_place = self.names.index("touched")
        self.size = 0
        self._ids = np.empty(16, np.int64)
        self._columns = {name: np.empty(16, _column_type(name)) for name in self.names}
        self._slots = build_index(self._ids[:0], 16)
        self._mirror: DeviceMirror | None = None
        if device == "cuda":  # imported here: numba.cuda costs every rank of a CPU job 30 ms of its start
            from .mirror import DeviceMirror

            self._mirror = DeviceMirror()
        self.device_threshold = device_threshold

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self.size]

    def column(self, name: str) -> np.ndarray:
        """A live view of ``name``'s values, row by row (up to date with the GPU's copy, if there is one)."""
        if name == "strength" and self._mirror is not None:
            self._mirror.refresh(self._columns["strength"][: self.size])
        return self._columns[name][: self.size]

    @property
    def on_device(self) -> bool:
        """Whether the iteration's kernels run on the GPU."""
        return self._mirror is not None and self.size >= self.device_threshold

    def _device_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._columns["strength"][: self.size], self._columns["quality"][: self.size], self.ids

    def _leave_device(self) -> None:
        """The rows are about to change: the host gets the GPU's strength, and the GPU's copies go."""
        if self._mirror is not None:
            self._mirror.drop(self._columns["strength"][: self.size])

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id, -1 where it is not stored."""
        return find_rows(self._slots, self._ids[: self.size], np.ascontiguousarray(ids, np.int64))

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, one row of every column per id: NaN where not found) for ``ids``; float64, which holds the float32
        columns and the integer ``touched`` exactly."""
        rows = self.rows_of(ids)
        table = np.empty((len(rows), len(self.names)), np.float64)
        floats = tuple(self.column(name) for name in self._float_names)
        gather_rows(rows, floats, self._float_places, self.column("touched"), self._touched_place, table)
        return rows >= 0, table

    def upsert(self, ids: np.ndarray, values: dict[str, np.ndarray]) -> int:
        """Store records (ids unique); existing ones are overwritten. Returns how many were new."""
        self._leave_device()
        rows = self.rows_of(ids)
        new = rows < 0
        added = int(new.sum())
        if added:
            start = self.size
            self._reserve(start + added)
            rows[new] = np.arange(start, start + added)
            self._ids[start : start + added] = ids[new]
            self.size += added
            if 2 * self.size > self._slots.size:
                self._slots = build_index(self.ids, _capacity_for(self.size))
            else:
                add_to_index(self._slots, self._ids[: self.size], start)
        for name in self.names:
            self._columns[name][rows] = values[name]
        return added

    def combine(self, rows: np.ndarray, deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unique rows, their deltas summed in float32 in the order given) of stored ``rows`` (all >= 0)."""
        return combine_by_row(rows, deltas)

    def reinforce(self, rows: np.ndarray, deltas: np.ndarray, iteration: int) -> None:
        """Add ``deltas`` to the strength of ``rows`` (unique), clamped to [0, 1]; mark them touched."""
        if self._mirror is not None and self.on_device:
            self._mirror.reinforce(self._device_columns(), rows, deltas)
            self._columns["touched"][rows] = iteration
            return
        strength = self.column("strength")
        apply_deltas(strength, self._columns["touched"], rows, deltas, np.int64(iteration))

    def decay(self, rate: float) -> None:
        """Subtract ``rate`` from every strength, clamped to [0, 1]."""
        if self._mirror is not None and self.on_device:
            self._mirror.decay(*self._device_columns(), np.float32(rate))
        else:
            decay(self.column("strength"), np.float32(rate))

    def iteration_pass(self, rate: float, low: float, high: float, bins: int, k: int) -> PassOutput:
        """Decay, and this partition's part of the aggregates and the top-k (``kernels.memstore``)."""
        if self._mirror is not None and self.on_device:
            return self._mirror.iteration_pass(self._device_columns(), np.float32(rate), low, high, bins, k)
        strength = self.column("strength")
        return fused_pass(strength, self.column("quality"), self.ids, np.float32(rate), low, high, bins, k)

    def delete(self, ids: np.ndarray) -> int:
        """Remove the stored ones of ``ids``; returns how many were removed."""
        rows = np.unique(self.rows_of(ids))
        rows = rows[rows >= 0]
        if not len(rows):
            return 0
        self._leave_device()
        keep = np.ones(self.size, bool)
        keep[rows] = False
        survivors = np.flatnonzero(keep)
        self._ids[: len(survivors)] = self._ids[survivors]
        for column in self._columns.values():
            column[: len(survivors)] = column[survivors]
        self.size = len(survivors)
        self._slots = build_index(self.ids, _capacity_for(self.size))
        return len(rows)

    def _reserve(self, records: int) -> None:
        if records <= len(self._ids):
            return
        capacity = max(records, 2 * len(self._ids))
        grown = np.empty(capacity, np.int64)
        grown[: self.size] = self._ids[: self.size]
        self._ids = grown
        for name, column in self._columns.items():
            wider = np.empty(capacity, column.dtype)
            wider[: self.size] = column[: self.size]
            self._columns[name] = wider

    def nbytes(self) -> int:
        """Host memory held: the columns, ids and index (with their spare room)."""
        return self._ids.nbytes + sum(c.nbytes for c in self._columns.values()) + self._slots.nbytes

    def device_nbytes(self) -> int:
        """GPU memory held by the copies of the columns."""
        return self._mirror.nbytes() if self._mirror is not None else 0
