"""The run's record: metrics and atom usage in rows of ``every`` iterations, about 1,000 rows per run.

Runs of up to 1,000 iterations get one row per iteration. Longer runs combine
consecutive iterations into a row (means, sums or last values, per metric), so
results files and checkpoints stay the same size however long the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

ROWS = 1000
MEAN, SUM, LAST, LAST_NUMBER = "mean", "sum", "last", "last number"
#: Each metric and how a row combines its iterations.
METRICS = {
    "objective": MEAN,  # 0.5 ||x - cD||^2 (+ alpha ||c||_1 for lasso) per signal of the batch, before the update
    "error": MEAN,  # relative reconstruction error of the batch, ||X - CD||_F / ||X||_F
    "sparsity": MEAN,  # non-zeros per code
    "unused": MEAN,  # atoms no code of the batch used
    "replaced": SUM,  # atoms replaced after the update
    "read_s": SUM,  # seconds waiting for the batch
    "compute_s": SUM,  # seconds coding and computing the statistics
    "comm_s": SUM,  # seconds in the allreduce (waiting for slower ranks included)
    "update_s": SUM,  # seconds in the dictionary update and replacement
    "time_s": LAST,  # training seconds since the start, at the end of the row
    "full_error": LAST_NUMBER,  # relative error on the whole data set, last evaluated (NaN: none in the row)
    "recovered": LAST_NUMBER,  # planted data: the share of planted atoms recovered, at the evaluations (else NaN)
}


@dataclass
class History:
    """Metrics and atom usage (codes using each atom, summed) in rows of ``every`` iterations."""

    every: int
    atoms: int
    iterations: int = 0
    metrics: dict[str, list] = field(default_factory=lambda: {name: [] for name in METRICS})
    usage: list = field(default_factory=list)

    @classmethod
    def start(cls, iterations: int, atoms: int) -> History:
        """An empty record sized for a run of ``iterations`` with ``atoms`` atoms."""
        return cls(max(1, math.ceil(iterations / ROWS)), atoms)

    def record(self, values: dict[str, float], usage: np.ndarray) -> None:
        """Add the next iteration's metrics and atom usage."""
        position = self.iterations % self.every  # iterations already in the current row
        if position == 0:
            for name, value in values.items():
                self.metrics[name].append(value)
            self.usage.append(usage.astype(np.int64))
        else:
            for name, value in values.items():
                row = self.metrics[name]
                kind = METRICS[name]
                if kind == MEAN:
                    row[-1] += (value - row[-1]) / (position + 1)
                elif kind == SUM:
                    row[-1] += value
                elif kind == LAST or not math.isnan(value):
                    row[-1] = value
            self.usage[-1] = self.usage[-1] + usage
        self.iterations += 1

    def row_ends(self) -> np.ndarray:
        """The (1-based) iteration that ends each row."""
        rows = len(self.usage)
        return np.minimum(np.arange(1, rows + 1) * self.every, self.iterations)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays, for checkpoints (``jobs.Stateful``)."""
        arrays: dict[str, np.ndarray] = {
            f"metric_{name}": np.asarray(values, dtype=np.float64) for name, values in self.metrics.items()
        }
        arrays["usage"] = np.asarray(self.usage, dtype=np.int64).reshape(-1, self.atoms)
        arrays["record"] = np.array([self.every, self.iterations], dtype=np.int64)
        return arrays

    def from_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The record ``to_arrays`` gave."""
        self.every, self.iterations = (int(v) for v in arrays["record"])
        rows = len(arrays["usage"])  # a metric added since the checkpoint was saved is NaN in its rows
        self.metrics = {
            name: arrays[f"metric_{name}"].tolist() if f"metric_{name}" in arrays else [math.nan] * rows
            for name in METRICS
        }
        self.usage = list(arrays["usage"])
