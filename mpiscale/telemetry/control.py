"""Remote control of a running job: the commands, their check, and where the ranks agree to obey them.

A command is a JSON object published to ``mpiscale/<job>/control``::

    {"id": "a1", "command": "checkpoint"}
    {"id": "a2", "command": "stop"}              # checkpoint, then end with status 0
    {"id": "a3", "command": "dump"}              # every rank writes its diagnostics to stderr
    {"id": "a4", "command": "log-level", "level": "DEBUG"}

Rank 0 checks each one (``parse``): a command it cannot obey is rejected
with the reason, and never reaches the job. ``dump`` and ``log-level`` act on
every rank at once. ``checkpoint`` and ``stop`` change the job's state, so
every rank must act at the same step: the job calls ``Steering.agree`` at
each step's end, and every few steps (about every ``CHECK_EVERY_S``, a
spacing rank 0 picks and every rank learns in the same reduction) the ranks
combine their requests in one small allreduce. A request raised on any rank
(a signal, say) is obeyed by all.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from ..runtime import Communicator

COMMANDS = ("checkpoint", "stop", "dump", "log-level")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_BYTES = 4096  # a command is a few dozen bytes; anything far larger is not one
MAX_ID = 64
CHECK_EVERY_S = 0.2  # how often the ranks agree on requests: a command's latency, one small allreduce's cost
_STOP, _CHECKPOINT, _GAP = 0, 1, 2


@dataclass(frozen=True)
class Command:
    id: str
    command: str
    level: str | None = None


class Rejected(ValueError):
    """A control message that is not a command this job obeys; ``id`` when the message had one."""

    def __init__(self, reason: str, id: str | None = None) -> None:
        super().__init__(reason)
        self.id = id


def parse(raw: bytes) -> Command:
    """The command in a control message, or :class:`Rejected` with the reason."""
    if len(raw) > MAX_BYTES:
        raise Rejected(f"a command is at most {MAX_BYTES} bytes, got {len(raw)}")
    try:
        message = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise Rejected('not JSON: a command is an object such as {"id": "1", "command": "stop"}') from None
    if not isinstance(message, dict):
        raise Rejected(f"a command is a JSON object, got {type(message).__name__}")
    id = message.get("id")
    if not isinstance(id, str) or not 0 < len(id) <= MAX_ID:
        raise Rejected(f"id must be a string of 1 to {MAX_ID} characters, got {id!r}"[:200])
    name = message.get("command")
    if name not in COMMANDS:
        raise Rejected(f"unknown command {name!r}; commands: {', '.join(COMMANDS)}"[:200], id)
    level = message.get("level")
    if name == "log-level" and level not in LEVELS:
        raise Rejected(f"log-level needs level, one of {', '.join(LEVELS)}; got {level!r}"[:200], id)
    extra = set(message) - {"id", "command", "level"}
    if extra:
        raise Rejected(f"unknown fields {sorted(extra)}"[:200], id)
    return Command(id, name, level)


def set_log_level(level: str) -> None:
    """The project's loggers' level on this rank."""
    logging.getLogger("mpiscale").setLevel(level)


@dataclass
class Orders:
    """What the ranks agreed to do at this step: the same on every rank."""

    checkpoint: bool = False
    stop: bool = False
    ids: list[str] = field(default_factory=list)  # rank 0: the commands these orders answer

    def __bool__(self) -> bool:
        return self.checkpoint or self.stop


class Steering:
    """The points where every rank learns the job's requests; call ``agree`` once per step on every rank."""

    def __init__(self, world: Communicator) -> None:
        self.world = world
        self._wanted = np.zeros(3, np.int64)  # stop, checkpoint, (rank 0) steps until the next agreement
        self._ids: list[str] = []
        self._calls = 0
        self._next = 1
        self._since = (0, time.monotonic())  # (calls, time) at the last agreement

    def request(self, what: str, id: str | None = None) -> None:
        """Ask for a ``stop`` or a ``checkpoint`` at the next agreement (on any rank)."""
        self._wanted[_STOP if what == "stop" else _CHECKPOINT] = 1
        if id is not None:
            self._ids.append(id)

    async def agree(self) -> Orders:
        """Collective, at a step's end: the requests of every rank, when this step is an agreement point."""
        self._calls += 1
        if self._calls < self._next:
            return Orders()
        if self.world.rank == 0:
            calls, then = self._since
            per_call = (time.monotonic() - then) / max(self._calls - calls, 1)
            self._wanted[_GAP] = int(min(max(CHECK_EVERY_S / max(per_call, 1e-9), 1), 10_000))
        mine, ids = self._wanted.copy(), self._ids  # requests made while reducing wait for the next agreement
        self._wanted[:], self._ids = 0, []
        every = await self.world.allreduce(mine, op="max")
        self._since = (self._calls, time.monotonic())
        self._next = self._calls + int(every[_GAP])
        return Orders(checkpoint=bool(every[_CHECKPOINT]), stop=bool(every[_STOP]), ids=ids)
