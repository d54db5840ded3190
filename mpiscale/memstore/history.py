"""The memory-store job's record: each iteration's aggregate and seconds, as arrays for its results and checkpoints."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .store import Aggregate

_FIELDS = ("count", "total", "mean", "maximum", "histogram", "top_ids", "top_quality")


class IterationHistory:
    """Every iteration's aggregate and its seconds (a ``jobs.Stateful``: checkpoints, commit notes, results)."""

    def __init__(self) -> None:
        self.rows: list[tuple[Aggregate, float]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, aggregate: Aggregate, seconds: float) -> None:
        self.rows.append((aggregate, seconds))

    @property
    def last(self) -> Aggregate:
        return self.rows[-1][0]

    def to_arrays(self, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """The ``rows`` (all by default) stacked by name: ``iteration_s``, one array per aggregate field, edges."""
        chosen = self.rows[rows]
        arrays = {"iteration_s": np.array([seconds for _, seconds in chosen], np.float64)}
        for name in _FIELDS:
            arrays[name] = np.stack([np.asarray(getattr(aggregate, name)) for aggregate, _ in chosen])
        arrays["histogram_edges"] = chosen[0][0].edges if chosen else np.empty(0)
        return arrays

    def from_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The rows ``to_arrays`` gave (none if ``arrays`` holds none)."""
        self.rows = []
        self.extend(arrays)

    def extend(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Add the rows of ``arrays`` (a commit's notes, say) after those held."""
        if "iteration_s" not in arrays:
            return
        for i, seconds in enumerate(arrays["iteration_s"]):
            aggregate = Aggregate(
                count=int(arrays["count"][i]),
                total=float(arrays["total"][i]),
                mean=float(arrays["mean"][i]),
                maximum=float(arrays["maximum"][i]),
                histogram=arrays["histogram"][i],
                edges=arrays["histogram_edges"],
                top_ids=arrays["top_ids"][i],
                top_quality=arrays["top_quality"][i],
            )
            self.rows.append((aggregate, float(seconds)))
