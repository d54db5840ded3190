"""A digest of a data set's values that every split of its rows among ranks gives alike, so that a resumed run, on
any number of ranks, can tell the data its checkpoint learned from from data written again under the same name."""

from __future__ import annotations

import hashlib

import numpy as np

from ..ranks import Comm

_ROW_MIX = np.uint64(0x9E3779B97F4A7C15)  # (the golden ratio's odd 64-bit multiplier: spreads row numbers)
_ROW_SALT = np.uint64(0x632BE59BD9B4E019)
_ROWS_AT_ONCE = 1 << 16  # rows weighed at once: a temporary of 64K rows x the row's values x 8 bytes


class Fingerprint:
    """Adds up each value's float64 bits times an odd weight of its column and of its row, modulo 2**64.

    The sum does not depend on the order in which blocks of rows come, so each
    rank adds its own rows and ``digest`` combines the ranks' sums. Any one
    changed value changes the digest (odd weights are invertible modulo
    2**64); so do moved rows and columns. It is a check against data written
    again by mistake, not against an adversary.
    """

    def __init__(self, total: int = 0) -> None:
        self._sum = total  # (a sum kept from earlier rows: a run that goes on adds to it)
        self._weights: np.ndarray | None = None

    @property
    def total(self) -> int:
        """This rank's sum so far (below 2**64): the ranks' sums, added modulo 2**64, are the data's."""
        return self._sum

    def add(self, first_row: int, rows: np.ndarray) -> None:
        """Add ``rows`` (2-D: rows x values, any numeric dtype), the first of which is row ``first_row`` of the data."""
        self._sum = (self._sum + self.weigh(first_row, rows)) % 2**64

    def weigh(self, first_row: int, rows: np.ndarray) -> int:
        """The sum ``add`` would add for ``rows``, without adding it: the digest of those rows alone (below 2**64)."""
        total = 0
        for start in range(0, len(rows), _ROWS_AT_ONCE):
            part = np.ascontiguousarray(rows[start : start + _ROWS_AT_ONCE], dtype=np.float64).view(np.uint64)
            weighed = part @ self._column_weights(part.shape[1])  # (integer products and sums wrap at 2**64)
            numbers = np.arange(first_row + start, first_row + start + len(part), dtype=np.uint64)
            row_weights = numbers * _ROW_MIX + _ROW_SALT | np.uint64(1)
            total += int((weighed * row_weights).sum(dtype=np.uint64))
        return total % 2**64

    def digest(self, comm: Comm, *parts: object) -> str:
        """The data's digest (collective): every rank's sum, with ``parts`` (shapes, say) that must match too."""
        total = sum(comm.allgather(self._sum)) % 2**64
        return hashlib.blake2b(repr((total, *parts)).encode(), digest_size=12).hexdigest()

    def _column_weights(self, columns: int) -> np.ndarray:
        if self._weights is None or len(self._weights) != columns:
            rng = np.random.default_rng(0x6D7069)  # fixed: the same weights in every run and on every rank
            self._weights = rng.integers(0, 2**63, columns, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        return self._weights
