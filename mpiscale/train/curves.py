"""A training run's learning curves: one row per step, one per epoch for the held-out score.

Kept as lists while training; saved in checkpoints (so a resumed run keeps
its whole curve) and in the results file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

STEP_METRICS = ("loss", "accuracy", "time_s", "comm_wait_s")
EPOCH_METRICS = ("epoch", "validation_loss", "validation_accuracy")


@dataclass
class Curves:
    """Per-step training metrics and per-epoch held-out scores."""

    steps: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in STEP_METRICS})
    epochs: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in EPOCH_METRICS})

    def record_step(self, **values: float) -> None:
        for name in STEP_METRICS:
            self.steps[name].append(float(values[name]))

    def record_epoch(self, **values: float) -> None:
        for name in EPOCH_METRICS:
            self.epochs[name].append(float(values[name]))

    @property
    def done(self) -> int:
        """Steps recorded."""
        return len(self.steps["loss"])

    @property
    def elapsed(self) -> float:
        """Training seconds so far (across resumed runs)."""
        return self.steps["time_s"][-1] if self.done else 0.0

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Every curve as a float64 array named ``curves.<step|epoch>.<metric>`` (``jobs.Stateful``)."""
        arrays = {f"curves.step.{k}": np.asarray(v, np.float64) for k, v in self.steps.items()}
        return arrays | {f"curves.epoch.{k}": np.asarray(v, np.float64) for k, v in self.epochs.items()}

    def from_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The curves ``to_arrays`` gave."""
        self.steps = {name: [float(v) for v in arrays[f"curves.step.{name}"]] for name in STEP_METRICS}
        self.epochs = {name: [float(v) for v in arrays[f"curves.epoch.{name}"]] for name in EPOCH_METRICS}
