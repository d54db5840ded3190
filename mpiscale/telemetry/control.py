"""Remote control of a running job: the commands and their check.

A command is a JSON object published to ``mpiscale/<job>/control``, with the
job's token (``mpiscale.telemetry.token``)::

    {"id": "a1", "command": "checkpoint", "token": "..."}
    {"id": "a2", "command": "stop", "token": "..."}   # checkpoint, then end with status 0
    {"id": "a3", "command": "dump", "token": "..."}   # every rank writes its diagnostics to stderr
    {"id": "a4", "command": "log-level", "level": "DEBUG", "token": "..."}

Rank 0 checks each one (``parse``): a command it cannot obey, or without the
job's token, is rejected with the reason, and never reaches the job. ``dump``
and ``log-level`` act on every rank at once. ``checkpoint`` and ``stop`` change
the job's state, so every rank must act after the same step: telemetry hands
them to the runtime's steering (``mpiscale.runtime.steering``), where the
ranks agree on them at the job's step ends, as they do on a SIGTERM.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from ..errors import MpiscaleError
from .token import matches

COMMANDS = ("checkpoint", "stop", "dump", "log-level")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_BYTES = 4096  # a command is a few dozen bytes; anything far larger is not one
MAX_ID = 64


@dataclass(frozen=True)
class Command:
    id: str
    command: str
    level: str | None = None


class Rejected(MpiscaleError, ValueError):
    """A control message that is not a command this job obeys; ``id`` when the message had one."""

    def __init__(self, reason: str, id: str | None = None) -> None:
        super().__init__(reason)
        self.id = id


def parse(raw: bytes, token: str | None) -> Command:
    """The command in a control message that carries ``token``, or :class:`Rejected` with the reason (every
    command is rejected when ``token`` is None: the job could not keep one)."""
    if len(raw) > MAX_BYTES:
        raise Rejected(f"a command is at most {MAX_BYTES} bytes, got {len(raw)}")
    try:
        message = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise Rejected('not JSON: a command is an object such as {"id": "1", "command": "stop"}') from None
    except RecursionError:  # a few KB of brackets: the parser's recursion, not the job, gives up
        raise Rejected("nested too deeply: a command is a flat JSON object") from None
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
    extra = set(message) - {"id", "command", "level", "token"}
    if extra:
        raise Rejected(f"unknown fields {sorted(extra)}"[:200], id)
    if not matches(message.get("token"), token):
        raise Rejected("no token or not this job's: send commands with mpiscale control, which reads the job's "
                       "token file, or give them the token as MPISCALE_CONTROL_TOKEN", id)  # fmt: skip
    return Command(id, name, level)


def set_log_level(level: str) -> None:
    """The project's loggers' level on this rank."""
    logging.getLogger("mpiscale").setLevel(level)
