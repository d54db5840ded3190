"""Steering: the stop and checkpoint requests a running job obeys at a step's end, agreed by every rank.

Requests come from anywhere, on any rank: SIGTERM or SIGUSR2 (Slurm's time
limit, ``scancel``, the launcher), the control commands telemetry receives, or
the user's own code (``system.steering.request("checkpoint")``). A job that
steers calls ``agree`` once at each step's end on every rank, and every rank
must then act on the same orders after the same step.

The agreement is pipelined so that it bounds a request's wait by steps, never
by a count chosen from the steps' past pace: at each step's end a rank
completes the round it posted at the previous step's end (normally done
already, the step's own communication having progressed it) and posts the next
one, carrying the requests made since. Every rank posts and completes the same
rounds at the same steps, so every rank reads the same orders at the same
step: a request waits for at most two steps' ends, however long the steps
suddenly take, and a step pays one non-blocking reduction of two integers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from .progress import ProgressEngine

REQUESTS = ("stop", "checkpoint")
_STOP, _CHECKPOINT = 0, 1


@dataclass
class Orders:
    """What every rank agreed to do after this step: the same on every rank (``ids`` excepted)."""

    checkpoint: bool = False
    stop: bool = False
    ids: list[str] = field(default_factory=list)  # this rank's requests (a command's id) these orders answer

    def __bool__(self) -> bool:
        return self.checkpoint or self.stop


@dataclass
class _Round:
    request: Any  # the MPI request of the reduction
    wanted: np.ndarray  # reduced in place: stop, checkpoint
    ids: list[str]


class Steering:
    """Where the ranks of a job agree on stop and checkpoint requests; one per rank (``system.steering``)."""

    def __init__(self, MPI: ModuleType, comm: Any, engine: ProgressEngine) -> None:
        self._MPI = MPI
        self.comm = comm  # a communicator of its own: its rounds never match any other collective
        self._engine = engine
        self._wanted = np.zeros(2, np.int64)
        self._ids: list[str] = []
        self._round: _Round | None = None
        #: True while a job that obeys requests at its steps' ends runs (SIGTERM then asks it to stop).
        self.active = False

    def request(self, what: str, id: str | None = None) -> None:
        """Ask for a ``stop`` or a ``checkpoint`` after the next steps (any rank, any time, from the event loop)."""
        if what not in REQUESTS:
            raise ValueError(f"a steering request is one of {', '.join(REQUESTS)}, got {what!r}")
        self._wanted[_STOP if what == "stop" else _CHECKPOINT] = 1
        if id is not None:
            self._ids.append(id)

    def begin(self) -> None:
        """A job that obeys requests at its steps' ends starts on this rank."""
        self.active = True

    async def agree(self) -> Orders:
        """Collective, at every step's end on every rank: the orders of the round posted one step ago."""
        orders = Orders()
        previous = self._round
        if previous is not None:
            if not previous.request.Test():
                await self._engine.wait(previous.request, "agreement on stop and checkpoint requests", previous.wanted)
            wanted = previous.wanted
            orders = Orders(checkpoint=bool(wanted[_CHECKPOINT]), stop=bool(wanted[_STOP]), ids=previous.ids)
        mine, ids = self._wanted.copy(), self._ids
        self._wanted[:], self._ids = 0, []
        request = self.comm.Iallreduce(self._MPI.IN_PLACE, mine, self._MPI.MAX)
        self._round = _Round(request, mine, ids)
        return orders

    def end(self) -> None:
        """The job stopped steering on this rank; requests not yet obeyed are dropped.

        The round in flight is left to the progress engine, which completes it
        (every rank posted it) before the rank shuts down.
        """
        self.active = False
        last, self._round = self._round, None
        if last is not None:
            self._engine.wait(last.request, "the last agreement on stop and checkpoint requests", last.wanted)
        self._wanted[:], self._ids = 0, []
