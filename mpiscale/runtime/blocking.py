"""Collectives that synchronous code makes inside a running job, found like the awaitable ones when a rank never comes.

A library call every rank must make (the estimator's ``fit``) cannot await: it starts with :func:`blocking_barrier`, a
non-blocking exchange of every rank's call (the one the awaitable collectives begin with, so that two ranks at different
calls are found there) polled back to back for 50 µs, then with short sleeps (a waiting rank spins no core), that says
once, after ``collective_check_s``, what it waits for. Inside ``mpiscale.run`` the barrier is also entered in a
collective log of the runtime's (``ActorSystem.call_logs``), so the other ranks' answers show where each stands, and a
rank that provably never comes (it left ``main``, or waits in another collective) ends the job with the runtime's
report. The call usually holds the rank's event loop (``main`` calls it without awaiting), and the loop's watch then
cannot run: the barrier makes the watch's check itself, its questions to the other ranks posted and polled for in its
own stack (:class:`HeldAsks`). A call made off the loop (``asyncio.to_thread``) is found by the loop's watch.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np

from ..ended_ranks import ended
from ..ranks import EACH_RANK, AnyComm, as_mpi, by_ranks, end_every_rank, wait_at_entries, world_ranks
from ..words import ranks_named
from .abandoned import CollectiveLog, call_site
from .actor import ActorRef, current_system
from .collectives import part_offsets
from .config import RuntimeConfig
from .dispatch import MESSAGE, PendingAsk
from .errors import CollectiveMismatch, signature_digest
from .progress import ProgressEngine
from .used_comms import note_used

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SPIN_S = 5e-5  # the barrier's polls: back to back at first (a sleep lasts some 60 µs, however short), then
_LONGEST_PAUSE_S = 1e-3  # 10 µs apart, doubling to this
_LONGEST_QUIET_PAUSE_S = 2e-2  # or to this in a wait without a word (a program's end: the others may work for hours)
_LOOK_EVERY_S = 1.0  # outside the runtime: how often the barrier looks for members that ended on its host,
_FIRST_LOOK_S = 5.0  # from this long into the wait (or the check, where shorter): no call waits for an ended member
_LONGEST_NAME = 40  # the most characters of a communicator's members named in its log's name
_SAY_FIRST_S = 5.0  # how long a rank that ends a job with another rank's words waits for that one to say them
_SETTLE_S = 1.0  # how long a member's end is given to complete the barrier (it came, then ended) before the abort
_LOG_KEY: list[int] = []  # the MPI attribute that keeps a communicator's log of blocking calls on it (made once)
_CAME_APART = "the ranks of its communicator came to different collective calls"
_SAME_ORDER = f"{EACH_RANK} make the same collective calls on it, in the same order"


class HeldAsks:
    """One question to other ranks (``method()`` of the actor named ``actor`` on each) asked by a caller that holds
    this rank's event loop: posted at once, its replies polled for in the caller's stack (a reply resolves its
    future as the poll delivers it; nothing else need run); and the same question from the others, answered."""

    def __init__(
        self,
        asks: dict[int, PendingAsk],
        ids: Iterator[int],
        post: Callable[[int, tuple, bool], object],
        engine: ProgressEngine,
        actor: str,
        method: str,
    ) -> None:
        self._asks, self._ids, self._post, self._engine = asks, ids, post, engine
        self._actor, self._method = actor, method

    def answer(self) -> None:
        """Answer the other ranks' questions that have landed (``ProgressEngine.answer_held``)."""
        self._engine.answer_held()

    def ask(self, ranks: list[int], timeout: float) -> dict[int, Any]:
        """Rank -> its answer, None where it failed or gave none within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        sent: dict[int, tuple[int, asyncio.Future]] = {}
        try:
            for rank in ranks:
                ask_id, future = next(self._ids), loop.create_future()
                self._asks[ask_id] = PendingAsk(future, ActorRef(rank, self._actor), self._method, time.monotonic())
                sent[rank] = (ask_id, future)
                self._post(rank, (MESSAGE, self._actor, self._method, (), {}, ask_id), False)  # (untracked)
            end = time.monotonic() + timeout
            answers = {}
            for rank, (_, future) in sent.items():
                self._engine.poll_held(future, end - time.monotonic())
                value, failed = future.result() if future.done() else (None, True)
                answers[rank] = None if failed else value
            return answers
        finally:
            for ask_id, _ in sent.values():
                self._asks.pop(ask_id, None)


def blocking_barrier(comm: AnyComm, operation: str, overdue: str) -> None:
    """Return once every rank of ``comm`` (an mpi4py communicator or a runtime ``Communicator``) has called this
    barrier, printing ``overdue`` to stderr once this rank has waited ``collective_check_s``. ``operation`` names
    the call in the runtime's reports (``"DictionaryLearning.fit"``). Inside ``mpiscale.run``, a rank that never
    calls it is found and reported, ending the job, as for the runtime's own collectives; a rank that came to
    another collective call of the library's or the runtime's on ``comm`` makes every rank raise
    ``CollectiveMismatch`` (:func:`checked_entry`)."""
    _entered(comm, operation, 0, overdue)


def blocking_entry(
    comm: AnyComm | None, what: str, doing: str, must: str = EACH_RANK, mine: int = 0, alike: str | None = None
) -> list[int]:
    """Wait until every rank of ``comm`` comes to ``what`` (``"RowWriter(out.h5)"``), a collective call that a rank
    alone would wait in for ever, as ``blocking_barrier`` waits: said after ``MPISCALE_COLLECTIVE_CHECK_S`` (that
    rank waits for the others "to ``doing`` too: ``must``, or this wait never ends"), and inside ``mpiscale.run`` a
    rank that never comes ends the job with the runtime's report. A rank that came to another collective call
    on ``comm`` makes every rank raise ``CollectiveMismatch`` naming each rank's call and line: another kind of call
    than ``what``'s (the name before its parenthesis), or, given ``alike`` (the call as every rank names it: a
    file's real path, where ``what`` has the path as this rank was given it), another call of its kind. Returns
    every rank's ``mine`` (a number the call needs from each anyway, carried in the same exchange); nothing to wait
    for without a comm, or with one rank (``[mine]``)."""
    raw = None if comm is None else as_mpi(comm)
    if raw is None or raw.Get_size() == 1:
        return [mine]
    from mpi4py import MPI

    check_s, rank = RuntimeConfig.setting("collective_check_s"), MPI.COMM_WORLD.Get_rank()  # (the job's rank)
    return _entered(raw, what, mine, f"{what}: rank {rank} has waited {check_s:g} s for the other ranks of its "
                    f"communicator to {doing} too: {must}, or this wait never ends", alike)  # fmt: skip


def _entered(comm: AnyComm, what: str, mine: int, overdue: str, alike: str | None = None) -> list[int]:
    """``checked_entry`` for the call ``what`` (``"RowWriter(out.h5)"``), told apart from others by ``alike``, else
    by its kind (the name before its parenthesis: ranks may name one file two ways)."""
    operation = what.split("(")[0]
    return checked_entry(comm, f"entry {alike or operation}", mine, operation, overdue,
                         lambda: f"{what}, at {call_site(_PACKAGE_DIR)}",
                         lambda calls, ranks: f"{what}: {_CAME_APART}: {by_ranks(calls, ranks)}; "
                                              f"{_SAME_ORDER}")  # fmt: skip


def checked_entry(
    comm: AnyComm,
    called: str,
    mine: int,
    operation: str,
    overdue: str | None,
    said: Callable[[], str],
    mismatch: Callable[[list[str], tuple[int, ...]], str],
    nth: int = 0,
) -> list[int]:
    """The first exchange of a blocking collective call, the one the runtime's collectives begin with: every rank's
    digest of ``called`` (its call: different calls differ there) and of ``nth`` (which call of an object this is,
    where the ranks must agree on that too), and a number ``mine``, in one ``Iallgather`` waited for as
    :func:`blocking_collective` waits. Whatever two ranks call on one communicator, blocking or awaited, their first
    MPI calls are this one and match, so different calls are found here: not let past each other (a barrier met
    another call's barrier, and both went on into collectives of their own, waiting for ever), nor one's messages
    read as another's (``MPI_ERR_TRUNCATE``). Returns every rank's ``mine``; where the digests differ, every rank
    gathers each rank's ``said()`` (its call and line, as the runtime's collectives gather theirs) and raises one
    ``CollectiveMismatch`` of ``mismatch(those texts, the world rank of each)``, reported by the communicator's first
    rank."""
    raw = as_mpi(comm)
    row = np.array([signature_digest(called) ^ nth, mine], np.int64)
    every = np.empty((raw.Get_size(), 2), np.int64)
    blocking_collective(raw, lambda raw: raw.Iallgather(row, every), operation, overdue)
    found = every.ravel().tolist()  # (compared in Python: numpy's compare costs µs)
    if not _alike(found[0::2]):
        _mismatched(raw, said(), mismatch, operation, overdue)
    return found[1::2]


def checked_entry_on_each(
    comms: list[Any],
    called: str,
    operation: str,
    said: Callable[[], str],
    mismatch: Callable[[Any, list[str], tuple[int, ...]], str],
) -> None:
    """:func:`checked_entry`'s exchange (no number) on each of ``comms`` (mpi4py communicators) at once, waited for
    without a word until all complete: a call that any of them may be waiting for (a program's end, on every
    communicator the rank has used). Where one finds different calls, its ranks gather their ``said()`` and raise
    its ``CollectiveMismatch`` of ``mismatch(comm, those texts, their world ranks)`` (the others may never complete:
    not waited for)."""
    row = np.array([signature_digest(called), 0], np.int64)
    entries = _Entries(comms, row)
    blocking_collective(comms[0], lambda _raw: entries, operation, None)
    if entries.apart is not None:
        raw = entries.apart
        _mismatched(raw, said(), lambda calls, ranks: mismatch(raw, calls, ranks), operation, None)


class _Entries:
    """First exchanges posted on several communicators, tested as one request: complete once every one is, or once
    one has found different calls (``apart``, its communicator)."""

    def __init__(self, comms: list[Any], row: np.ndarray) -> None:
        self.found = [np.empty((comm.Get_size(), 2), np.int64) for comm in comms]
        self.requests = [comm.Iallgather(row, every) for comm, every in zip(comms, self.found)]
        self.comms, self.apart = comms, None

    def Test(self) -> bool:  # noqa: N802  (an MPI request's name, as blocking_collective tests it)
        if self.apart is not None:
            return True
        for index, request in enumerate(self.requests):
            if request is not None and request.Test():
                self.requests[index] = None
                if not _alike(self.found[index][:, 0].tolist()):
                    self.apart = self.comms[index]
                    return True
        return all(request is None for request in self.requests)


def _alike(digests: list[int]) -> bool:
    """Whether every rank's call digest is the same."""
    return digests.count(digests[0]) == len(digests)


def _mismatched(
    raw: Any, text: str, mismatch: Callable[[list[str], tuple[int, ...]], str], operation: str, overdue: str | None
) -> NoReturn:
    """Every rank's ``text``, gathered as an awaited collective's mismatch gathers its calls (their lengths, then
    the texts): the same MPI calls, so a blocking call and an awaited one meet here too; then the error."""

    mine = np.frombuffer(text.encode(), np.uint8)
    length, lengths = np.array([len(mine)], np.int64), np.empty(raw.Get_size(), np.int64)
    blocking_collective(raw, lambda raw: raw.Iallgather(length, lengths), operation, overdue)
    offsets = part_offsets(lengths)
    every = np.empty(int(lengths.sum()), np.uint8)
    blocking_collective(raw, lambda raw: raw.Iallgatherv(mine, [every, (lengths, offsets)]), operation, overdue)
    texts = [every[start : start + size].tobytes().decode(errors="replace") for start, size in zip(offsets, lengths)]
    members = world_ranks(raw)  # (the reports name the job's ranks, where a part of them calls)
    error = CollectiveMismatch(mismatch(texts, members))
    error.reporter = members[0]  # every rank raises it: one report, the lowest rank's
    raise error


def blocking_collective(comm: AnyComm, start: Callable[[Any], Any], operation: str, overdue: str | None) -> None:
    """:func:`blocking_barrier` for any non-blocking collective: ``start(mpi_comm)`` posts it and returns its request
    (``lambda raw: raw.Iallreduce(mine, out, MPI.MAX)``), which is waited for as the barrier is, said, watched and
    ended alike; with ``overdue`` None, waited for as long as it takes, without a word (a program's end, where the
    other ranks may still be working)."""
    raw = as_mpi(comm)
    system = _running_system()
    check_s = _check_s(system)
    if system is None and raw.Get_size() > 1:
        note_used(raw)  # (its members' ends meet a later call on it: a plain program's end)
    log = None if system is None or raw.Get_size() == 1 else _call_log(system, raw)
    watch = None if log is None or not _holds_loop() else system.abandoned_watch
    began = time.monotonic()  # (before the log's entry: the wait is said before the watch's check can end the job)
    number = None if log is None else log.begin(operation, _PACKAGE_DIR)  # (the user's line, not the library's)
    request, pause, said = start(raw), 1e-5, False
    looks = check_s and system is None and overdue is not None  # (inside the runtime its watch asks the ranks)
    look_at = began + min(_FIRST_LOOK_S, check_s) if looks else None
    longest = _LONGEST_PAUSE_S if overdue is not None else _LONGEST_QUIET_PAUSE_S
    try:
        while not request.Test() and time.monotonic() - began < _SPIN_S:  # ranks that come together: no sleep
            pass  # (no sched_yield: with the kernels' threads busy on the cores, it made fit 20% slower)
        while not request.Test():
            now = time.monotonic()  # (one reading for both: a look due at the check comes after the wait is said)
            if check_s and overdue is not None and not said and now - began >= check_s:
                print(overdue, file=sys.stderr, flush=True)
                said = True
            if look_at is not None and now >= look_at:
                _end_if_one_ended(raw, request, operation)
                look_at = time.monotonic() + _LOOK_EVERY_S
            if watch is not None and log is not None:
                watch.check_held(log)  # (ends the job on proof; a no-op until this rank has waited the check)
            time.sleep(pause)
            pause = min(2 * pause, longest)
    finally:
        if log is not None and number is not None:
            log.end(number)


def entered_failures(comm: Any, what: str, problem: str | None) -> list[int]:
    """1 for each rank of ``comm`` with a problem in ``what``, a call they entered together (a file call), else 0.

    A rank with one may have left a collective call of the file library's (HDF5's over MPI-IO) that the others still
    wait in, and will wait in for ever: a full disk failed one rank's part of a growing data set's allocation, its
    partner waited in HDF5's barrier and it here, and both spun a core for good. So it waits for them at most the
    collective check (then ends every rank, saying its problem); a rank without one waits in MPI as long as it takes,
    as it did in the blocking allgather this exchange replaced (which cost the same)."""
    raw = as_mpi(comm)
    flag, flags = np.array([problem is not None], np.int64), np.empty(raw.Get_size(), np.int64)
    request = raw.Iallgather(flag, flags)
    limit = _check_s(_running_system()) if problem is not None else 0.0
    if not limit:
        request.Wait()
        return flags.tolist()
    began, pause = time.monotonic(), 1e-5
    while not request.Test():
        waited = time.monotonic() - began
        if waited >= limit:
            end_job(f"{what} failed: {problem}; the other ranks of its communicator did not come to hear it within "
                    f"{limit:g} s (they wait, it seems, in a collective step of the file library that this rank left "
                    "on its error): ending every rank")  # fmt: skip
        if waited >= _SPIN_S:
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_PAUSE_S)
    return flags.tolist()


def end_job(why: str | None) -> NoReturn:
    """Say ``why`` as this rank's last words and abort every rank: inside ``mpiscale.run`` as the runtime aborts (its
    death watch told that the deaths that follow are the job's end, not news), else as a plain program's rank. With
    ``why`` None (another rank says it), this rank first gives that one ``_SAY_FIRST_S`` to abort the job."""
    from mpi4py import MPI

    if why is None:
        time.sleep(_SAY_FIRST_S)
        why = "ending every rank"
    line = f"mpiscale: rank {MPI.COMM_WORLD.Get_rank()}: {why}"
    system = _running_system()
    if system is not None:
        system.abort(f"{line}\n", 1)
    end_every_rank(MPI, line)
    raise SystemExit(1)  # (never reached: MPI aborted this process)


def _check_s(system: Any) -> float:
    """How long a rank waits in a collective before it says so (0: never): the running system's setting, else the
    environment's."""
    return system.config.collective_check_s if system is not None else RuntimeConfig.setting("collective_check_s")


wait_at_entries(blocking_entry, entered_failures)  # (ranks.on_rank_0 and agree start with them: ranks sits below)


def _end_if_one_ended(comm: Any, request: Any, operation: str) -> None:
    """Outside ``mpiscale.run``: abort the job where a member of ``comm`` on this host has ended its program (it
    will never come to ``operation``), unless the barrier completes meanwhile (that member came, then ended)."""
    gone = ended(world_ranks(comm))
    if not gone:
        return
    settle_until = time.monotonic() + _SETTLE_S
    while time.monotonic() < settle_until:
        if request.Test():
            return
        time.sleep(_LONGEST_PAUSE_S)
    end_job(f"{ranks_named(gone)} of the job ended (the program returned) without coming to {operation}, which every "
            "rank of its communicator must call: ending every rank (this one would wait for it for ever)")  # fmt: skip


def _running_system() -> Any:
    """This rank's ActorSystem while ``mpiscale.run`` runs it, else None."""
    try:
        return current_system()
    except RuntimeError:
        return None


def _holds_loop() -> bool:
    """Whether the caller runs in an event loop's thread (in ``main``, holding the loop) rather than off it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _call_log(system: Any, comm: Any) -> CollectiveLog:
    """The log of the blocking calls made on ``comm``, named alike on every member: ``world`` for the job's world
    communicator, else by MPI's name for it, with its members where they are not the whole world (logs are told
    apart by name: two communicators of other ranks, both unnamed, would share one log). Made once per name, and
    kept on ``comm`` as an MPI attribute of its own (working its members out again took 1-2 µs a call)."""
    if not _LOG_KEY:
        _LOG_KEY.append(system.MPI.Comm.Create_keyval())
    kept = comm.Get_attr(_LOG_KEY[0])
    if kept is not None and kept[0] is system.call_logs:  # (kept by this system: not one of an earlier run's)
        return kept[1]
    members = world_ranks(comm)
    name = "world" if comm is system.world.comm else comm.Get_name() or "a communicator"
    if len(members) < system.size:
        name += f" of world {_members_named(members)}"
    name += " (blocking calls)"
    log = system.call_logs.get(name)
    if log is None:
        log = system.call_logs[name] = CollectiveLog(name, members)
    comm.Set_attr(_LOG_KEY[0], (system.call_logs, log))
    return log


def _members_named(members: tuple[int, ...]) -> str:
    """``ranks 0, 2``, ``ranks 0-63``; where that is long (a stride over many ranks), the count, the first and last,
    and a digest of the rest: the name stays short in reports and in the answers that carry it."""
    named = ranks_named(list(members))
    if len(named) <= _LONGEST_NAME:
        return named
    return f"{len(members)} ranks {members[0]} to {members[-1]} #{zlib.crc32(bytes(repr(members), 'ascii')):08x}"
