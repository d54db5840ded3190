"""The store's durability behind one seam: its changes logged, committed on two nodes, checkpointed, and recovered.

``DurableLog`` knows nothing of how the store applies a change: the store
gives it a ``Replica`` (its columns, ``apply`` to replay a logged operation,
``snapshot`` for a checkpoint's records) and hands it each change it applied
(``log``). Everything here is collective except ``log``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..io import Checkpointer
from ..runtime import ActorSystem
from .journal import Journal, Op
from .recovery import Recovered, Replica, recover


@dataclass(frozen=True)
class Durability:
    """Where a durable store keeps its checkpoints (``directory``, shared by all nodes) and its logs.

    With ``local_dir`` (node-local storage: ``local_dir/node-K`` per node), the
    logs and checkpoint shards go there, each copied to a partner rank on the
    next node, and a checkpoint reaches ``directory`` every ``shared_every``
    saves; without it, everything is in ``directory``. ``keep`` checkpoints are
    kept.
    """

    directory: str | os.PathLike
    local_dir: str | os.PathLike | None = None
    keep: int = 2
    shared_every: int = 1


class DurableLog:
    """A store's logs, commits and checkpoints (made by ``recover``, the first call of a durable store)."""

    def __init__(self, system: ActorSystem, settings: Durability, replica: Replica) -> None:
        self.system, self.settings, self.replica = system, settings, replica
        #: Commits made so far (recovered ones included); the changes since the last one, to log at the next.
        self.commits = 0
        self._pending: list[Op] = []
        self._journal: Journal | None = None
        self._checkpointed = 0  # the commit of the newest checkpoint

    def check_ready(self) -> None:
        """Refuse changes before ``recover`` has run (the store checks before it applies one)."""
        if self._journal is None:
            raise RuntimeError("a durable store must recover() before it changes (it may hold a dead job's records)")

    def log(self, op: Op) -> None:
        """Keep an applied change for the next commit's record."""
        self.check_ready()
        self._pending.append(op)

    async def recover(self, meta: dict | None = None, accept_rollback: bool = False) -> Recovered | None:
        """Rebuild the store from its checkpoints and logs, or start them (collective; first call).

        ``meta`` (JSON) names the job: logs and checkpoints of another job are
        refused with a CheckpointError before anything is written. Lost or
        damaged logs are refused too, unless ``accept_rollback``. Returns None
        when there was nothing to recover.
        """
        if self._journal is not None:
            raise RuntimeError("recover() was called already")
        settings = self.settings
        checkpoints = Checkpointer(
            settings.directory,
            self.system.world.comm,
            keep=settings.keep,
            local_dir=settings.local_dir,
            shared_every=settings.shared_every,
        )
        self._journal = Journal(self.system, checkpoints)
        try:
            recovered = await recover(self._journal, self.replica, self.save, json_safe(meta or {}), accept_rollback)
        except BaseException:
            self.close()
            raise
        if recovered is not None:
            self.commits = recovered.commits
            self._checkpointed = recovered.commits if recovered.notes else recovered.checkpoint  # see recover()
        return recovered

    @property
    def logged_bytes(self) -> int:
        """Bytes this rank wrote to its log and to the partner copies it keeps, so far."""
        return self._journal.bytes_written if self._journal is not None else 0

    @property
    def local_directory(self) -> Path | None:
        """This rank's node-local directory (with ``local_dir``, after ``recover``), else None."""
        return self._journal.local_directory if self._journal is not None else None

    async def commit(self, notes: dict[str, np.ndarray] | None = None) -> int:
        """Make the changes since the last commit durable on this node and the partner's; the commit's number."""
        if self._journal is None:
            raise RuntimeError("commit() needs a durable store that has called recover()")
        await self.system.world.agree(_notes_problem(notes or {}), "memory store commit", ValueError)
        await self._journal.write(self.commits + 1, self._pending, notes or {})
        self.commits += 1
        self._pending = []
        return self.commits

    async def checkpoint(self, replicated: dict[str, np.ndarray] | None = None, meta: dict | None = None) -> None:
        """Checkpoint the store as of the last commit, with the caller's arrays and metadata (in the background).

        The logs before the previous checkpoint are deleted.
        """
        if self._journal is None:
            raise RuntimeError("checkpoint() needs a durable store that has called recover()")
        pending = "commit() the changes before a checkpoint" if self._pending else None
        await self.system.world.agree(pending, "memory store")
        if self.commits == self._checkpointed:
            return
        self.save(self.commits, replicated or {}, meta or {})
        previous, self._checkpointed = self._checkpointed, self.commits
        self._journal.rotate(self.commits, keep_from=previous)

    def save(self, commit: int, replicated: dict[str, np.ndarray], meta: dict) -> None:
        """Start a checkpoint of the store's records as of ``commit`` (collective)."""
        assert self._journal is not None
        store = {"columns": list(self.replica.columns), "commits": commit}
        self._journal.checkpoints.save(commit, self.replica.snapshot(), replicated, {"store": store, "caller": meta})

    def close(self) -> None:
        """Close the logs and wait for the last checkpoint (collective)."""
        if self._journal is not None:
            journal, self._journal = self._journal, None
            journal.close()
            journal.comm.Free()
            journal.checkpoints.close()


def _notes_problem(notes: dict[str, np.ndarray]) -> str | None:
    """Why ``notes`` cannot be logged (None: they can): arrays of numbers, booleans or fixed-width strings only."""
    for name, value in notes.items():
        array = np.asarray(value)
        if not isinstance(name, str) or array.dtype.kind not in "biufcSU":
            return f"note {name!r} is of type {array.dtype}; notes are arrays of numbers, booleans or strings"
    return None


def json_safe(meta: dict) -> dict:
    """``meta`` as it reads back from JSON (tuples become lists), so saved and given settings compare equal."""
    return json.loads(json.dumps(meta))
