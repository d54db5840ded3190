"""One rank's partition of the memory store: contiguous float32 columns, the id column, and the id index.

Records live in rows ``0 .. len - 1``; the arrays grow by doubling, the index
is rebuilt at twice the size when it would pass half full, and a delete
compacts the rows and rebuilds the index. Nothing depends on the rows' order:
ties in rankings are broken by id, and sums are exact.
"""

from __future__ import annotations

import numpy as np

from ..kernels.memstore import add_to_index, apply_deltas, build_index, find_rows

BASE_COLUMNS = ("strength", "quality", "touched")


def _capacity_for(records: int) -> int:
    """Index slots: a power of two at least twice the records."""
    return 1 << max(4, int(2 * max(records, 1) - 1).bit_length())


class Partition:
    """The records this rank owns. ``extra`` names user-defined float32 columns."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.names = (*BASE_COLUMNS, *extra)
        self.size = 0
        self._ids = np.empty(16, np.int64)
        self._columns = {name: np.empty(16, np.float32) for name in self.names}
        self._slots = build_index(self._ids[:0], 16)

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self.size]

    def column(self, name: str) -> np.ndarray:
        """A live view of ``name``'s values, row by row."""
        return self._columns[name][: self.size]

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id, -1 where it is not stored."""
        return find_rows(self._slots, self._ids[: self.size], np.ascontiguousarray(ids, np.int64))

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, one row of every column per id: NaN where not found) for ``ids``."""
        rows = self.rows_of(ids)
        found = rows >= 0
        table = np.full((len(rows), len(self.names)), np.nan, np.float32)
        for j, name in enumerate(self.names):
            table[found, j] = self.column(name)[rows[found]]
        return found, table

    def upsert(self, ids: np.ndarray, values: dict[str, np.ndarray]) -> int:
        """Store records (ids unique); existing ones are overwritten. Returns how many were new."""
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

    def reinforce(self, rows: np.ndarray, deltas: np.ndarray, iteration: int) -> None:
        """Add ``deltas`` to the strength of ``rows`` (unique), clamped to [0, 1]; mark them touched."""
        apply_deltas(self._columns["strength"], self._columns["touched"], rows, deltas, np.float32(iteration))

    def delete(self, ids: np.ndarray) -> int:
        """Remove the stored ones of ``ids``; returns how many were removed."""
        rows = np.unique(self.rows_of(ids))
        rows = rows[rows >= 0]
        if not len(rows):
            return 0
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
            wider = np.empty(capacity, np.float32)
            wider[: self.size] = column[: self.size]
            self._columns[name] = wider

    def nbytes(self) -> int:
        """Memory held: the columns, ids and index (with their spare room)."""
        return self._ids.nbytes + sum(c.nbytes for c in self._columns.values()) + self._slots.nbytes
