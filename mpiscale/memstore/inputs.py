"""The checks of what callers pass the memory store (ids, one value per id, settings every rank must share), and
whole records as the log's table."""

from __future__ import annotations

import numpy as np

INT64_LIMIT = 2**63 - 1


def record_table(columns: list[np.ndarray]) -> np.ndarray:
    """Whole records as one table for the log: float64, exact for the float32 columns and the integer ``touched``
    (logs of earlier versions hold float32 tables, which replay alike)."""
    return np.column_stack([column.astype(np.float64) for column in columns])


def checked_ids(ids: np.ndarray) -> np.ndarray:
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"ids must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"ids must be integers, got {array.dtype}")
    if array.size and array.dtype.kind == "u" and int(array.max()) > INT64_LIMIT:
        raise ValueError(f"ids must fit in int64: {int(array.max())} does not")
    return np.ascontiguousarray(array, dtype=np.int64)


def per_rank(values: np.ndarray) -> str:
    """'0.5 on every rank' or 'rank 0: 0.5, rank 1: nan' (invalid input shows as nan)."""
    if (values == values[0]).all():
        return f"{values[0]:g} on every rank"
    return ", ".join(f"rank {rank}: {value:g}" for rank, value in enumerate(values))


def finite(values: np.ndarray, name: str, count: int) -> np.ndarray:
    given = np.asarray(values)
    if given.ndim != 1:
        raise ValueError(f"{name}: one value per id, got an array of shape {given.shape}")
    if given.dtype.kind not in "biuf":
        raise TypeError(f"{name}: values must be numbers, got {given.dtype}")
    if len(given) != count:
        raise ValueError(f"{name}: {len(given)} values for {count} ids")
    with np.errstate(over="ignore"):
        array = given.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(array))
    if len(bad):
        value = given[bad[0]]
        past = ", past float32's largest (the store keeps float32)" if np.isfinite(value) else ""
        raise ValueError(f"{name}: value {bad[0]} is {value}{past}; values must be finite")
    return array
