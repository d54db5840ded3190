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
step: a request waits for at most two steps' ends, and a step pays one
non-blocking reduction of three integers.

Two steps' ends are nothing for steps of milliseconds, but too long for steps
of seconds (a stop would outlast its grace). So each round also carries
whether a rank's last step took ``PROMPT_STEP_S`` or more; once a completed
round says so, every rank (reading the same round at the same step) completes
the next rounds at the step that posts them: a request is obeyed at the end of
the step it came in, for the price of one short wait per long step. A round
of short steps turns the pipelining back on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from .progress import ProgressEngine

REQUESTS = ("stop", "checkpoint")
_STOP, _CHECKPOINT, _SLOW = 0, 1, 2
PROMPT_STEP_S = 0.25  # a step this long or longer makes the rounds complete at the step that posts them


@dataclass
class Orders:
    """What every rank agreed to do after this step: the same on every rank (``ids`` excepted)."""

    checkpoint: bool = False
    stop: bool = False
    ids: list[str] = field(default_factory=list)  # this rank's requests (a command's id) these orders answer

    def __bool__(self) -> bool:
        return self.checkpoint or self.stop

    def __or__(self, later: Orders) -> Orders:
        return Orders(self.checkpoint or later.checkpoint, self.stop or later.stop, self.ids + later.ids)


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
        self._wanted = np.zeros(3, np.int64)
        self._ids: list[str] = []
        self._round: _Round | None = None
        self._prompt = False  # the last completed round said a step was long: complete rounds at once
        self._step_began = time.monotonic()
        self._stop_when_begun = False
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
        self._step_began = time.monotonic()
        if self._stop_when_begun:
            self._stop_when_begun = False
            self.request("stop")

    def stop_when_begun(self) -> None:
        """Ask the job this rank begins to steer next to stop (a stop that came before it began)."""
        self._stop_when_begun = True

    def cancel_stop_when_begun(self) -> bool:
        """Drop the request of ``stop_when_begun`` if no job has taken it; whether it was still waiting."""
        waiting, self._stop_when_begun = self._stop_when_begun, False
        return waiting

    async def agree(self) -> Orders:
        """Collective, at every step's end on every rank: the orders of the round posted one step ago, or, while
        steps are long, of the round posted now."""
        now = time.monotonic()
        slow, self._step_began = now - self._step_began >= PROMPT_STEP_S, now
        orders = Orders()
        if self._round is not None:
            orders, self._round = await self._complete(self._round), None
        prompt = self._prompt  # what the last completed round said: the same on every rank
        posted = self._post(slow)
        if prompt:
            return orders | await self._complete(posted)
        self._round = posted
        return orders

    async def agree_now(self) -> Orders:
        """Collective: the requests made so far on any rank, agreed at once (before a job's first step, whose end
        may be far off)."""
        orders = Orders()
        if self._round is not None:
            orders, self._round = await self._complete(self._round), None
        orders = orders | await self._complete(self._post(False))
        self._step_began = time.monotonic()
        return orders

    def _post(self, slow: bool) -> _Round:
        mine, ids = self._wanted.copy(), self._ids
        mine[_SLOW] = int(slow)
        self._wanted[:], self._ids = 0, []
        return _Round(self.comm.Iallreduce(self._MPI.IN_PLACE, mine, self._MPI.MAX), mine, ids)

    async def _complete(self, posted: _Round) -> Orders:
        if not posted.request.Test():
            await self._engine.wait(posted.request, "agreement on stop and checkpoint requests", posted.wanted)
        wanted = posted.wanted
        self._prompt = bool(wanted[_SLOW])
        return Orders(checkpoint=bool(wanted[_CHECKPOINT]), stop=bool(wanted[_STOP]), ids=posted.ids)

    def end(self) -> None:
        """The job stopped steering on this rank; requests not yet obeyed are dropped.

        The round in flight is left to the progress engine, which completes it
        (every rank posted it) before the rank shuts down.
        """
        self.active = False
        last, self._round = self._round, None
        if last is not None:
            self._engine.wait(last.request, "the last agreement on stop and checkpoint requests", last.wanted)
        self._wanted[:], self._ids, self._prompt = 0, [], False
