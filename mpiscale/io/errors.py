"""Exceptions of the I/O layer: bad data files and failed checkpoints."""

from __future__ import annotations

import os

from ..errors import MpiscaleError


class DataFileError(MpiscaleError, ValueError):
    """An input or mpiscale file is missing, unreadable, of another format, or lacks the data set asked for."""

    def __init__(self, path: str | os.PathLike, message: str, dataset: str | None = None) -> None:
        self.path = os.fspath(path)
        self.dataset = dataset
        self.message = message
        where = f"{self.path}:{dataset}" if dataset else self.path
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # travels between ranks (one rank lists the files, all raise)
        return type(self), (self.path, self.message, self.dataset)


class WriteError(MpiscaleError, OSError):
    """A file could not be written (full disk, quota, read-only file system); raised on every rank alike."""


class CheckpointError(MpiscaleError, RuntimeError):
    """A save failed (raised on every rank), or no checkpoint could be restored."""


class LockedError(MpiscaleError, RuntimeError):
    """Another job holds the checkpoint directory or results file this one was given."""
