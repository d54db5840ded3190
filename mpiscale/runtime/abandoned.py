"""Collectives some rank will never enter: found by asking the other ranks, then reported.

MPI cannot tell a rank that waits in a collective that a peer returned from
``main`` or called another operation: it waits forever. Each ``Communicator``
keeps a :class:`CollectiveLog` (how many collectives this rank started on it,
which are still pending, and the code line that called each). A rank that has
waited ``collective_check_s`` in one asks every other member for its logs
(an ask to the runtime's system actor, answered while that rank awaits a
collective or waits to shut down) and :func:`diagnose` decides from the
answers. Only proof ends the job: a member that left ``main`` after fewer
collectives on that communicator, or one that waits in a different operation
at the same position, or one that waits in a collective on another
communicator which this rank (a member there too) has not entered: each waits
for the other. A member that is only slow, busy or silent is never taken for a
culprit; the question is asked again, less and less often.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

from ..words import counted
from .errors import CollectiveAbandoned

_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ASK_TIMEOUT_S = 2.0  # a rank that does not answer within this is listed as silent
_LONGEST_INTERVAL = 8  # the question is asked again after 1, 2, 4, 8, 8, ... times collective_check_s
_NO_COLLECTIVES: dict[str, Any] = {
    "started": 0,
    "last": None,
    "pending": {},
}  # the log of a communicator a rank never used


#: The call sites found so far, by (the id of a code object, an instruction's offset in it): that code object, kept
#: so that no other takes its id while the entry stands, and the site. A frame's line number is worked out by walking
#: its code's line table from the function's first line: a collective called 300 lines into a function spent 1.9 µs
#: on it, against 0.4 µs for its site found here (2026-12-04).
_SITES: dict[tuple[int, int], tuple[CodeType, str]] = {}
_KEPT_SITES = 4096  # more than a program's distinct lines that start collectives


def call_site(outside: str = _RUNTIME_DIR) -> str:
    """``file:line`` of the nearest caller outside the folder ``outside`` (the runtime package by default: where
    user code started a collective), for :meth:`CollectiveLog.begin`: the walk starts at begin's caller
    (``sys._getframe`` makes a frame object only for the frame it returns; each ``f_back`` makes one more)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(outside):
        frame = frame.f_back
    code, offset = frame.f_code, frame.f_lasti
    found = _SITES.get((id(code), offset))
    if found is None:
        found = (code, f"{os.path.basename(code.co_filename)}:{frame.f_lineno}")
        if len(_SITES) < _KEPT_SITES:
            _SITES[(id(code), offset)] = found
    return found[1]


@dataclass
class CollectiveLog:
    """The collectives one rank started on one communicator, and which of them still wait.

    Thread-safe: the hierarchical allreduces of gradient buckets begin in autograd's threads and end in the
    reducer's worker, while the loop reads the log for diagnostics."""

    name: str
    members: tuple[int, ...]  # world ranks, in the communicator's rank order
    started: int = 0
    last: tuple[str, int, str] | None = None  # (operation, number, call site) of the latest one
    pending: dict[int, tuple[str, str, float]] = field(default_factory=dict)  # number -> (operation, site, since)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def begin(self, operation: str, outside: str = _RUNTIME_DIR) -> int:
        """Record a collective this rank enters, called where its nearest caller outside the folder ``outside`` (the
        runtime's by default) is; returns its number (1 = the first on this communicator)."""
        site = call_site(outside)
        with self._lock:
            self.started += 1
            self.last = (operation, self.started, site)
            self.pending[self.started] = (operation, site, time.monotonic())
            return self.started

    def site(self, number: int) -> str:
        """Where the pending collective ``number`` was called."""
        with self._lock:
            return self.pending[number][1]

    def end(self, number: int) -> None:
        """The collective ``number`` completed (or failed) on this rank."""
        with self._lock:
            self.pending.pop(number, None)

    def cancel(self, number: int) -> None:
        """The collective ``number`` was refused before it reached MPI (bad arguments): it does not count."""
        with self._lock:
            self.pending.pop(number, None)
            if number == self.started:
                self.started -= 1
                self.last = None

    def oldest(self) -> tuple[int, str, str, float] | None:
        """(number, operation, site, seconds waited) of the oldest pending collective, or None."""
        with self._lock:
            if not self.pending:
                return None
            number = min(self.pending)
            operation, site, since = self.pending[number]
        return number, operation, site, time.monotonic() - since

    def state(self) -> dict[str, Any]:
        """Plain data for another rank's diagnosis."""
        now = time.monotonic()
        with self._lock:
            pending = {n: (op, site, now - since) for n, (op, site, since) in self.pending.items()}
            return {"started": self.started, "last": self.last, "pending": pending, "members": list(self.members)}


def _ranks(ranks: list[int]) -> str:
    return f"rank{'' if len(ranks) == 1 else 's'} {', '.join(map(str, ranks))}"


def describe_rank(rank: int, state: dict[str, Any] | None, log: str) -> str:
    """One line of the report: what ``rank`` does on the communicator ``log``, from its answer."""
    if state is None:
        return f"rank {rank}: no answer within {_ASK_TIMEOUT_S:g} s (busy outside the runtime, or gone)"
    own = state["logs"].get(log, _NO_COLLECTIVES)
    if own["pending"]:
        number = min(own["pending"])
        operation, site, waited = own["pending"][number]
        where = f"waits in {operation} #{number} on {log} for {waited:.1f} s, called at {site}"
    else:
        where = f"is not in a collective on {log} ({counted(own['started'], 'collective')} started on it)"
    if state["main"] != "running":
        last = own["last"]
        tail = f"; the last: {last[0]} #{last[1]}, called at {last[2]}" if last else ""
        where = f"left main ({state['main']}) after {counted(own['started'], 'collective')} on {log}{tail}"
    elif not own["pending"]:
        where += "".join(f"; it waits in {operation} #{number} on {other} for {waited:.1f} s, called at {site}"
                         for other, (number, operation, site, waited) in _waits(state, log).items())  # fmt: skip
    return f"rank {rank} (host {state['host']}): {where}"


def _waits(state: dict[str, Any], besides: str) -> dict[str, tuple[int, str, str, float]]:
    """The oldest collective a rank waits in on each communicator but ``besides``: (number, operation, site,
    seconds)."""
    found = {}
    for name, own in state["logs"].items():
        if name != besides and own["pending"]:
            number = min(own["pending"])
            found[name] = (number, *own["pending"][number])
    return found


def _waits_for_me(me: int, state: dict[str, Any], besides: str, mine: dict[str, CollectiveLog]) -> bool:
    """Whether a rank waits in a collective on another communicator that this rank, a member there, has not
    entered (not even its first, where this rank made no call there): it waits for this rank, which waits for it."""
    for name, (number, _, _, _) in _waits(state, besides).items():
        log = mine.get(name)
        started = log.started if log is not None else 0 if me in state["logs"][name].get("members", ()) else None
        if started is not None and started < number:
            return True
    return False


def diagnose(
    me: int,
    host: str,
    log: CollectiveLog,
    states: dict[int, dict[str, Any] | None],
    mine: dict[str, CollectiveLog] | None = None,
) -> tuple[str, int] | None:
    """The report if some member provably never enters this rank's oldest pending collective on ``log``.

    ``states`` holds every other member's answer (None: no answer); ``mine``
    this rank's logs of every communicator (by name), to see a member that
    waits for it elsewhere. Returns (report, the rank that should print it:
    the lowest member waiting at that position, whichever operation), or None
    when nothing is proven.
    """
    oldest = log.oldest()
    if oldest is None:
        return None
    number, operation, _, _ = oldest
    culprits = []
    waiting = [me]
    stuck = [me]  # waiting in collective ``number`` here, whichever operation
    for rank, state in states.items():
        if state is None:
            continue
        own = state["logs"].get(log.name, _NO_COLLECTIVES)
        other = own["pending"].get(number)
        if state["main"] != "running" and own["started"] < number:
            culprits.append(rank)
        elif other is not None and other[0] != operation:
            culprits.append(rank)
            stuck.append(rank)
        elif other is not None:
            waiting.append(rank)
            stuck.append(rank)
        elif state["main"] == "running" and own["started"] < number and _waits_for_me(me, state, log.name, mine or {}):
            culprits.append(rank)  # (a rank that started this collective has passed it: this rank's wait will end)
            stuck.append(rank)  # it finds this rank the same way: the lower of the two reports
    if not culprits:
        return None
    lines = [
        f"a collective that not every rank will enter: {operation} #{number} on {log.name} "
        f"({_ranks(sorted(waiting))} {'waits' if len(waiting) == 1 else 'wait'} in it; {_ranks(culprits)} never will)",
        describe_rank(me, {"main": "running", "host": host, "logs": {log.name: log.state()}}, log.name),
    ]
    lines += [describe_rank(rank, states[rank], log.name) for rank in sorted(states)]
    return "\n  ".join(lines), min(stuck)


class AbandonedWatch:
    """Asks the other ranks about a collective this rank has waited in too long; fails the job on proof.

    ``ask_state(rank, timeout)`` asks one rank for its :meth:`ActorSystem.collective_state`, awaited in the watch's
    task; ``ask_held(ranks, timeout)`` asks several at once for a caller that holds the event loop
    (:meth:`check_held`), and ``answer_held()`` answers the others' questions that have landed meanwhile."""

    def __init__(
        self,
        rank: int,
        host: str,
        logs: Callable[[], list[CollectiveLog]],
        fail: Callable[[BaseException, str], None],
        ask_state: Callable[[int, float], Awaitable[dict[str, Any]]],
        ask_held: Callable[[list[int], float], dict[int, dict[str, Any] | None]],
        answer_held: Callable[[], None],
        check_s: float,
    ) -> None:
        self._rank, self._host = rank, host
        self._logs = logs
        self._ask_state, self._ask_held, self._answer_held = ask_state, ask_held, answer_held
        self._fail = fail
        self._check_s = check_s
        self._asked: dict[str, tuple[int, float, int]] = {}  # log -> (collective number, next question, times asked)

    async def run(self) -> None:
        """Look at the pending collectives a few times per ``check_s``, until cancelled."""
        while True:
            await asyncio.sleep(max(self._check_s / 4, 0.1))
            for log in self._logs():
                times = self._due(log, log.oldest())
                if times is not None:
                    others = self._others(log)
                    answers = await asyncio.gather(*(self._answer(rank) for rank in others))
                    self._judge(log, dict(zip(others, answers)), times)

    def check_held(self, log: CollectiveLog) -> None:
        """The check of :meth:`run` for ``log``, made by a caller that holds the event loop (a blocking call in
        ``main``, where the watch's own task cannot run), its questions polled for in the caller's stack; and, once
        the caller has waited ``check_s``, the other ranks' questions answered as it waits (two ranks held so in
        calls that never meet find each other)."""
        oldest = log.oldest()
        if oldest is None or oldest[3] < self._check_s:
            return
        self._answer_held()
        times = self._due(log, oldest)
        if times is not None:
            self._judge(log, self._ask_held(self._others(log), _ASK_TIMEOUT_S), times)

    def _due(self, log: CollectiveLog, oldest: tuple[int, str, str, float] | None) -> int | None:
        """How many times the other ranks were asked about ``log``'s oldest pending collective (``oldest``, as
        ``log.oldest()`` gives it), once this rank has waited in it ``check_s`` and the next question is due (counted
        as asked); None while none is."""
        if oldest is None or oldest[3] < self._check_s:
            return None
        number, due, times = self._asked.get(log.name, (oldest[0], 0.0, 0))
        if number != oldest[0]:  # another collective than the one asked about: ask afresh
            due, times = 0.0, 0
        if time.monotonic() < due:
            return None
        interval = self._check_s * min(2**times, _LONGEST_INTERVAL)
        self._asked[log.name] = (oldest[0], time.monotonic() + interval, times + 1)
        return times

    def _others(self, log: CollectiveLog) -> list[int]:
        return [rank for rank in log.members if rank != self._rank]

    def _judge(self, log: CollectiveLog, answers: dict[int, dict[str, Any] | None], times: int) -> None:
        """Fail the job on proof in the other ranks' ``answers`` that one never enters ``log``'s oldest pending
        collective."""
        mine = {own.name: own for own in self._logs()}
        found = diagnose(self._rank, self._host, log, answers, mine)
        if found is None:
            return
        report, reporter = found
        if reporter == self._rank or times > 0:  # the lowest waiting rank reports; the others if it has not
            self._fail(CollectiveAbandoned(report), "a collective cannot complete")

    async def _answer(self, rank: int) -> dict[str, Any] | None:
        try:
            return await self._ask_state(rank, _ASK_TIMEOUT_S)
        except Exception:  # silent, shutting down, gone: no proof either way
            return None
