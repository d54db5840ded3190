"""Where an envelope that arrives on a rank goes: a reply to its asker's future, a message to its actor.

An envelope is ``(MESSAGE, actor name, method, args, kwargs, ask id)`` (ask id -1 for a tell) or ``(REPLY, ask
id, value, failed)``. A message is handled at once, in the caller's stack, when its actor is idle and the handler
cannot suspend (:meth:`ActorCell.deliver`), else queued in the actor's mailbox. While the rank shuts down an ask is
answered with :class:`ActorStopped` and a tell is refused and counted; a message to an actor that does not exist
fails its ask, or ends the job for a tell (a lost tell would be a silent wrong answer).

:class:`Dispatch` here is the reference. The compiled message path has a twin (``_wire.Dispatch``) that takes the
common cases in C, a reply and a message whose actor is idle and whose handler it has run before, and hands every
other envelope to this one, so the rare cases have one implementation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from .actor import ActorCell, ActorRef, Message
from .errors import ActorNotFound, ActorStopped, Failure, TransportError

SYSTEM_ACTOR = "mpiscale.system"  # the runtime's own actor on every rank
#: Its question about a rank's collective calls, which a rank whose loop a blocking call holds still answers where
#: it lands (two ranks held in calls that never meet find each other so); it touches nothing of ``main``'s.
STATE = "collective_state"

MESSAGE, REPLY = 0, 1


@dataclass
class PendingAsk:
    """An ask awaiting its reply: the future its reply resolves with ``(value, failed)``."""

    future: asyncio.Future
    ref: ActorRef
    method: str
    started: float
    timeout: float | None = None  # seconds (None: none)
    deadline: float | None = None  # when it times out, on the loop's clock


class Router(Protocol):
    """What dispatching needs of the rank (the ActorSystem is one)."""

    rank: int
    stopping: bool
    refused_tells: int

    @property
    def origin(self) -> str: ...

    @property
    def outbox(self) -> Any: ...

    def reply(self, reply_to: tuple[int, int], value: Any) -> None: ...

    def fail(self, error: BaseException, context: str, status: int = 1) -> None: ...


class Dispatch:
    """Routes the envelopes of one rank to the ``cells`` (actors by name) and ``asks`` (pending asks by id) that
    the rank's ``system`` owns."""

    def __init__(self, system: Router, cells: dict[str, ActorCell], asks: dict[int, PendingAsk]) -> None:
        self.system = system
        self.cells = cells
        self.asks = asks
        self.held = False  # a blocking call polls in main's stack: messages wait for the loop (but STATE questions)

    def envelopes(self, source: int, envelopes: list) -> None:
        """Route ``envelopes`` from rank ``source``, in order."""
        for envelope in envelopes:
            self.envelope(source, envelope)

    def envelope(self, source: int, envelope: tuple) -> None:
        """Route one envelope from rank ``source``; :class:`TransportError` for one no rank sends."""
        if not _well_formed(envelope):
            raise TransportError(f"its message is no envelope of this runtime: {_summary(envelope)}")
        if envelope[0] == REPLY:
            _, ask_id, value, failed = envelope
            pending = self.asks.pop(ask_id, None)
            if pending is not None and not pending.future.done():
                pending.future.set_result((value, failed))
            return
        _, name, method, args, kwargs, ask_id = envelope
        system = self.system
        reply_to = (source, ask_id) if ask_id >= 0 else None
        if system.stopping:
            if reply_to is not None:
                error = ActorStopped(f"rank {system.rank} is shutting down; {name!r} did not handle {method!r}")
                system.reply(reply_to, Failure.capture(error, system.origin))
            else:
                system.refused_tells += 1
            return
        cell = self.cells.get(name)
        if cell is None:
            missing = ActorNotFound(f"no actor {name!r} on rank {system.rank} (message {method!r} from rank {source})")
            if reply_to is not None:
                system.reply(reply_to, Failure.capture(missing, system.origin))
            else:
                system.fail(missing, "a tell was addressed to an actor that does not exist")
            return
        message = Message(method, args, kwargs, reply_to, source)
        if source == system.rank or (self.held and (name, method) != (SYSTEM_ACTOR, STATE)):
            cell.post(message)  # a local send returns before its handler runs, as a remote one does
        else:
            cell.deliver(message)


def _well_formed(envelope: object) -> bool:
    """Whether ``envelope`` is one the runtime sends: ``(MESSAGE, actor, method, args, kwargs, ask id)`` or
    ``(REPLY, ask id, value, failed)``, a failed reply's value a :class:`Failure`."""
    if type(envelope) is not tuple or not envelope or type(envelope[0]) is not int:
        return False
    if envelope[0] == MESSAGE and len(envelope) == 6:
        _, name, method, args, kwargs, ask_id = envelope
        return (type(name) is str and type(method) is str and type(args) is tuple and type(kwargs) is dict
                and all(type(key) is str for key in kwargs) and type(ask_id) is int)  # fmt: skip
    if envelope[0] == REPLY and len(envelope) == 4:
        _, ask_id, value, failed = envelope
        return type(ask_id) is int and type(failed) is bool and (not failed or isinstance(value, Failure))
    return False


def _summary(envelope: object) -> str:
    """A short description of a malformed envelope: its type, and its items' types."""
    if type(envelope) is not tuple:
        return f"a {type(envelope).__name__}, not a tuple"
    kinds = ", ".join(type(item).__name__ for item in envelope[:8])
    first = envelope[0] if envelope and type(envelope[0]) is int else None
    return f"a tuple of {len(envelope)} items ({kinds}{', ...' if len(envelope) > 8 else ''})" + (
        f", of kind {first}" if first is not None else ""
    )
