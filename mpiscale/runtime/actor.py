"""Actors: the base class, references that travel in messages, and mailboxes.

An actor is an object whose public methods are its message handlers (``async``
or plain). Each actor has one mailbox and one consumer task, so it handles one
message at a time, in arrival order; a handler may ``await`` other actors
without blocking its rank.
"""

from __future__ import annotations

import asyncio
import dis
import inspect
import logging
import operator
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ..words import counted
from .errors import ActorStopped, Failure

log = logging.getLogger(__name__)


class Host(Protocol):
    """What actors and references need of the rank that hosts them (the ActorSystem is one): where they are, how
    to send, how to answer an ask, and how to end the job on a failure nobody can handle."""

    rank: int
    host: str

    async def ask(
        self, ref: ActorRef, method: str, args: tuple, kwargs: dict, timeout: float | None, reply_into: Any = None
    ) -> Any: ...

    def tell(self, ref: ActorRef, method: str, args: tuple, kwargs: dict) -> asyncio.Future: ...

    def reply(self, reply_to: tuple[int, int], value: Any) -> None: ...

    def fail(self, error: BaseException, context: str, status: int = 1) -> None: ...


_current_system: Host | None = None


def current_system() -> Any:
    """The ActorSystem of this rank; references use it to send."""
    if _current_system is None:
        raise RuntimeError("no mpiscale ActorSystem is running on this rank; start one with mpiscale.run(main)")
    return _current_system


def set_current_system(system: Host | None) -> None:
    global _current_system
    _current_system = system


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a failed actor at most ``max_restarts`` times within ``window_s`` seconds."""

    max_restarts: int = 3
    window_s: float = 60.0


class Actor:
    """Base class for actors. Public methods are handlers; ``on_start``/``on_stop`` are hooks.

    Set ``restart_policy`` on the class (or pass ``restart=`` to spawn) to have a
    failed ``tell`` restart the actor with its original arguments instead of
    ending the job.
    """

    restart_policy: ClassVar[RestartPolicy | None] = None
    #: This actor's own reference, set before ``on_start``.
    ref: ActorRef
    #: The rank's ActorSystem, set before ``on_start`` (typed loosely: this module knows it only as a ``Host``).
    system: Any

    async def on_start(self) -> None:
        """Called before the first message (and after each restart)."""

    async def on_stop(self) -> None:
        """Called once when the system shuts down."""


@dataclass(frozen=True)
class ActorRef:
    """The address of an actor: (rank, name). Picklable, so it can be sent in messages."""

    rank: int
    name: str

    async def ask(
        self, method: str, *args: Any, timeout: float | None = None, reply_into: Any = None, **kwargs: Any
    ) -> Any:
        """Call ``method`` on the actor and await its result (or its exception).

        ``timeout`` (seconds) raises :class:`~mpiscale.AskTimeout` when no reply comes. ``reply_into``, a writable
        C-contiguous numpy array, takes the reply, which must be an array of its dtype and shape: a large reply is
        received straight into it (no allocation, no copy), and the ask returns it. It may be the array sent.
        """
        return await current_system().ask(self, method, args, kwargs, timeout, reply_into)

    def tell(self, method: str, *args: Any, **kwargs: Any) -> asyncio.Future:
        """Send ``method(*args)`` without waiting for a result.

        The returned future resolves once the message buffers may be reused
        (arrays are sent without a copy); ignoring it is fine.
        """
        return current_system().tell(self, method, args, kwargs)

    def __str__(self) -> str:
        return f"{self.name}@{self.rank}"


def address(ref: ActorRef, method: object, size: int) -> tuple[ActorRef, str]:
    """``ref`` and ``method`` as the receiving rank takes them, in a job of ``size`` ranks: refused here what would
    end the job there."""
    if type(method) is not str or type(ref.name) is not str or type(ref.rank) is not int:
        ref, method = _plain_call(ref, method)
    if not 0 <= ref.rank < size:
        raise ValueError(f"{ref}: rank {ref.rank} is outside this job of {counted(size, 'rank')}")
    return ref, method


def _plain_call(ref: ActorRef, method: object) -> tuple[ActorRef, str]:
    """``ref`` and ``method`` in the plain types a message carries: a str subclass (a ``StrEnum``'s member) as its
    text, a numpy integer rank as an int; TypeError for any other type, before the message leaves."""
    if not isinstance(method, str):
        raise TypeError(f"{ref}: the method must be named by a str, got {type(method).__name__} {method!r}")
    if not isinstance(ref.name, str):
        raise TypeError(f"an actor is named by a str, got {type(ref.name).__name__} {ref.name!r}")
    try:
        rank = operator.index(ref.rank)
    except TypeError:
        raise TypeError(f"an actor's rank is an int, got {type(ref.rank).__name__} {ref.rank!r}") from None
    return ActorRef(rank, str.__str__(ref.name)), str.__str__(method)


@dataclass(frozen=True)
class ActorGroup:
    """One actor of the same name on every rank, as made by ``spawn_group``."""

    name: str
    size: int

    def __getitem__(self, rank: int) -> ActorRef:
        if not 0 <= rank < self.size:
            raise IndexError(f"group {self.name!r} has ranks 0..{self.size - 1}, not {rank}")
        return ActorRef(rank, self.name)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[ActorRef]:
        return (ActorRef(rank, self.name) for rank in range(self.size))

    async def ask_all(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Ask every member; the results in rank order."""
        return list(await asyncio.gather(*(ref.ask(method, *args, timeout=timeout, **kwargs) for ref in self)))

    def tell_all(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Tell every member."""
        for ref in self:
            ref.tell(method, *args, **kwargs)


@dataclass
class Message:
    """A message in a mailbox; ``reply_to`` is (rank, ask id) for an ask, else None."""

    method: str
    args: tuple
    kwargs: dict
    reply_to: tuple[int, int] | None
    sender: int


@dataclass
class _Resume:
    """A message handled inline whose end the consumer task sees to: the awaitable a plain handler returned, or
    the error a tell raised (supervision may restart the actor, which awaits ``on_start``)."""

    message: Message
    awaitable: Any = None
    error: Exception | None = None


# What an ``async def`` compiles to where it may suspend: await, async for, async with.
_SUSPENDING_OPS = frozenset({"GET_AWAITABLE", "SEND", "YIELD_VALUE", "GET_AITER", "GET_ANEXT", "BEFORE_ASYNC_WITH"})
QUEUED, PLAIN, NEVER_SUSPENDS = 0, 1, 2
_inline_kinds: dict[object, int] = {}


def inline_kind(handler: Any) -> int:
    """How a handler can run in the caller's stack: ``PLAIN`` (a plain function), ``NEVER_SUSPENDS`` (an ``async
    def`` that awaits nothing, so it runs to its end at its first step), else ``QUEUED`` (its actor's task runs
    it). Cached per function."""
    function = getattr(handler, "__func__", handler)
    kind = _inline_kinds.get(function)
    if kind is None:
        code = getattr(function, "__code__", None)
        if code is None or inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function):
            kind = QUEUED
        elif not inspect.iscoroutinefunction(function):
            kind = PLAIN
        elif any(op.opname in _SUSPENDING_OPS for op in dis.get_instructions(code)):
            kind = QUEUED
        else:
            kind = NEVER_SUSPENDS
        _inline_kinds[function] = kind
    return kind


@dataclass(slots=True)  # (slots: the compiled dispatch reads and sets a cell's state for every message)
class ActorCell:
    """The runtime side of one actor: instance, mailbox, consumer task, supervision."""

    system: Host
    ref: ActorRef
    cls: type
    args: tuple
    kwargs: dict
    policy: RestartPolicy | None
    mailbox: deque = field(default_factory=deque)
    instance: Any = None
    current: str | None = None  # method being handled
    busy_since: float = 0.0  # when the current message began (meaningful while current is set)
    restarts: list[float] = field(default_factory=list)
    task: asyncio.Task | None = None
    _waiter: asyncio.Future | None = None
    _started: bool = False  # on_start has returned: messages may be handled
    #: Each method handled so far: its handler and how it may run (``inline_kind``); emptied by a restart.
    handlers: dict[str, tuple[Any, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.instance = self._create()

    @property
    def idle(self) -> bool:
        return not self.mailbox and self.current is None

    def post(self, message: Message | _Resume) -> None:
        self.mailbox.append(message)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def deliver(self, message: Message) -> None:
        """Handle ``message`` at once, in the caller's stack, when the actor is idle and its handler cannot
        suspend; else queue it for the consumer task. Either way one message at a time, in arrival order: the fast
        path skips the two task switches (to the consumer task and back) that a queued message costs. (The compiled
        ``_wire.Dispatch`` does the same in C for a handler found here before.)"""
        if not self._started or self.mailbox or self.current is not None:
            self.post(message)
            return
        try:
            handler, kind = self.handler(message.method)
        except AttributeError:
            self.post(message)  # the consumer task answers with the error, as for any failing handler
            return
        if kind == QUEUED:
            self.post(message)
            return
        self.current, self.busy_since = message.method, time.monotonic()
        try:
            result = handler(*message.args, **message.kwargs)
            if kind == NEVER_SUSPENDS:
                result = finish_at_once(result)
        except Exception as error:
            self.inline_failed(message, error)
            return
        finally:
            self.current = None
        self.inline_done(message, result)

    def inline_failed(self, message: Message, error: Exception) -> None:
        """A message handled inline raised ``error``: its ask fails, or the consumer task supervises its tell."""
        if message.reply_to is None:
            self.post(_Resume(message, error=error))
        else:
            self.system.reply(message.reply_to, Failure.capture(error, self.origin(message.method)))

    def inline_done(self, message: Message, result: Any) -> None:
        """A message handled inline returned ``result``: an awaitable is left to the consumer task, a value
        answers the ask."""
        if inspect.isawaitable(result):
            self.post(_Resume(message, awaitable=result))
        elif message.reply_to is not None:
            self.system.reply(message.reply_to, result)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"actor {self.ref}")

    def describe(self) -> str:
        state = "idle"
        if self.current is not None:
            state = f"handling {self.current!r} for {time.monotonic() - self.busy_since:.3f}s"
        return f"actor {self.ref.name!r} ({self.cls.__qualname__}): mailbox {len(self.mailbox)}, {state}"

    def origin(self, method: str) -> str:
        s = self.system
        return f"rank {s.rank} on host {s.host}, actor {self.ref.name!r} ({self.cls.__qualname__}.{method})"

    def fail_pending(self) -> None:
        """Answer every queued ask with ActorStopped (used at shutdown)."""
        while self.mailbox:
            item = self.mailbox.popleft()
            message = item.message if isinstance(item, _Resume) else item
            if isinstance(item, _Resume) and inspect.iscoroutine(item.awaitable):
                item.awaitable.close()  # begun inline, never to be awaited
            if message.reply_to is not None:
                error = ActorStopped(f"actor {self.ref} stopped before handling {message.method!r}")
                self.system.reply(message.reply_to, Failure.capture(error, self.origin(message.method)))

    def _create(self) -> Any:
        self.handlers.clear()
        instance = self.cls(*self.args, **self.kwargs)
        instance.ref = self.ref
        instance.system = self.system
        return instance

    async def _run(self) -> None:
        await self._start_instance()
        self._started = True
        loop = asyncio.get_running_loop()
        while True:
            if not self.mailbox:
                self._waiter = loop.create_future()
                await self._waiter
                self._waiter = None
                continue
            item = self.mailbox.popleft()
            message = item.message if isinstance(item, _Resume) else item
            self.current, self.busy_since = message.method, time.monotonic()
            try:
                if isinstance(item, _Resume):
                    await self._resume(item)
                else:
                    await self._handle(item)
            finally:
                self.current = None

    async def _start_instance(self) -> None:
        try:
            await self.instance.on_start()
        except Exception as error:
            self.system.fail(error, f"on_start of actor {self.ref} ({self.cls.__qualname__}) failed")

    def handler(self, method: str) -> tuple[Any, int]:
        """The handler of ``method`` on the current instance and how it may run (``inline_kind``); AttributeError
        when the actor has none (cached until the actor restarts)."""
        entry = self.handlers.get(method)
        if entry is None:
            handler = None if method.startswith("_") else getattr(self.instance, method, None)
            if handler is None or not callable(handler) or method in ("on_start", "on_stop"):
                raise AttributeError(f"actor {self.ref.name!r} ({self.cls.__qualname__}) has no handler {method!r}")
            entry = self.handlers[method] = (handler, inline_kind(handler))
        return entry

    async def _handle(self, message: Message) -> None:
        try:
            result = self.handler(message.method)[0](*message.args, **message.kwargs)
            if inspect.isawaitable(result):
                result = await result
        except Exception as error:
            await self._failed(message, error)
            return
        if message.reply_to is not None:
            self.system.reply(message.reply_to, result)

    async def _resume(self, item: _Resume) -> None:
        """The end of a message begun inline: await what its handler returned, or handle the error it raised."""
        message = item.message
        try:
            if item.error is not None:
                raise item.error
            result = await item.awaitable
        except Exception as error:
            await self._failed(message, error)
            return
        if message.reply_to is not None:
            self.system.reply(message.reply_to, result)

    async def _failed(self, message: Message, error: Exception) -> None:
        if message.reply_to is not None:
            self.system.reply(message.reply_to, Failure.capture(error, self.origin(message.method)))
        else:
            await self._supervise(error, message)

    async def _supervise(self, error: Exception, message: Message) -> None:
        """A failed tell: restart within the policy's limits, else escalate (end the job)."""
        now = time.monotonic()
        policy = self.policy
        where = (
            f"actor {self.ref} ({self.cls.__qualname__}) failed in tell {message.method!r} from rank {message.sender}"
        )
        if policy is None:
            self.system.fail(error, f"{where}; it has no restart policy, so the failure escalates")
            return
        self.restarts = [t for t in self.restarts if now - t < policy.window_s]
        if len(self.restarts) >= policy.max_restarts:
            self.system.fail(error, f"{where}; restart limit reached ({policy.max_restarts} in {policy.window_s:g}s)")
            return
        self.restarts.append(now)
        log.warning(
            "%s: %s: %s; restarting (%d/%d in %gs)",
            where,
            type(error).__name__,
            error,
            len(self.restarts),
            policy.max_restarts,
            policy.window_s,
        )
        try:
            self.instance = self._create()
        except Exception as create_error:
            self.system.fail(create_error, f"restarting actor {self.ref} failed")
            return
        await self._start_instance()


def finish_at_once(coroutine: Any) -> Any:
    """Run a coroutine that cannot suspend (``NEVER_SUSPENDS``) to its end; its result, or its exception raised."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError(f"{coroutine.__qualname__} suspended although it awaits nothing")  # not reached in CPython
