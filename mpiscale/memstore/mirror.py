"""A partition's columns on a GPU: what every iteration reads and writes stays there between iterations.

The strength, quality and id columns are uploaded at the first kernel that
needs them and stay on the device while iterations decay and reinforce them.
The host's strength is brought up to date only when something reads it (a
lookup, a checkpoint, the final records), and the copies are dropped when an
upsert or a delete changes the rows, to be uploaded again at the next
iteration. ``touched`` stays on the host: only a reinforcement writes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import memstore_cuda


class DeviceMirror:
    """Device copies of one partition's strength, quality and ids."""

    def __init__(self) -> None:
        self._arrays: tuple[Any, Any, Any] | None = None  # (strength, quality, ids) on the device
        self._device_newer = False  # the device's strength has changes the host's has not
        self._buffers = memstore_cuda.PassBuffers()  # what each iteration's pass fills, kept between iterations

    def arrays(self, strength: np.ndarray, quality: np.ndarray, ids: np.ndarray) -> tuple[Any, Any, Any]:
        """The device copies, uploaded from these host columns if there are none."""
        if self._arrays is None:
            from numba import cuda

            self._arrays = (cuda.to_device(strength), cuda.to_device(quality), cuda.to_device(ids))
        return self._arrays

    def changed_strength(self) -> None:
        """A kernel changed the device's strength."""
        self._device_newer = True

    def refresh(self, strength: np.ndarray) -> None:
        """Bring the host's ``strength`` up to date."""
        if self._device_newer and self._arrays is not None:
            self._arrays[0].copy_to_host(strength)
        self._device_newer = False

    def drop(self, strength: np.ndarray) -> None:
        """Refresh the host, then forget the device copies (the rows are about to change)."""
        self.refresh(strength)
        self._arrays = None

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays) if self._arrays is not None else 0

    def decay(self, strength: np.ndarray, quality: np.ndarray, ids: np.ndarray, rate: np.float32) -> None:
        memstore_cuda.decay(self.arrays(strength, quality, ids)[0], rate)
        self.changed_strength()

    def reinforce(self, columns: tuple, rows: np.ndarray, deltas: np.ndarray) -> None:
        memstore_cuda.apply_deltas(self.arrays(*columns)[0], rows, deltas)
        self.changed_strength()

    def iteration_pass(self, columns: tuple, rate, low, high, bins, k) -> memstore_cuda.PassOutput:
        result = memstore_cuda.iteration_pass(*self.arrays(*columns), rate, low, high, bins, k, self._buffers)
        self.changed_strength()
        return result
