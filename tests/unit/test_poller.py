"""The engine's poll and its two spins (``polling.Poller``) against their compiled twin: the same answers, the same
calls made, the same time bounds.

Every MPI test of the suite runs the engine on them (``make test`` reruns the messaging tests on the reference);
here each case is put to both twins in one process, over ``COMM_SELF``."""

import asyncio
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from mpiscale.runtime import compact, polling, transport, wire

if os.environ.get(wire.PURE_ENV, "0") not in ("", "0"):
    pytest.skip(f"{wire.PURE_ENV} forces the reference: nothing compiled to compare", allow_module_level=True)
compiled = wire.chosen()[0]
TWINS = [(compiled.Poller, compiled.Endpoint), (polling.Poller, wire.Endpoint)]


class Engine:
    """What a poller calls back, recording each call: the counts of delivered messages, the frames it leaves, the
    match of awaited parts, the pending requests that completed, a channel's poller that reports activity on the
    calls listed in ``busy_on``."""

    def __init__(self, busy_on=()) -> None:
        self.messages_received = self.bytes_received = 0
        self.calls: list = []
        self.pending: list = []
        self.unmatched: list = []
        self.polls = 0
        self.busy_on = set(busy_on)

    def envelopes(self, source, messages) -> None:
        self.calls.append(("delivered", len(messages)))

    def frames_found(self, found) -> bool:
        self.calls.append(("left", bytes(found[1])))
        return True

    def match_parts(self) -> bool:
        self.calls.append(("matched", len(self.unmatched)))
        self.unmatched.clear()
        return False

    def pending_done(self, indices) -> None:
        self.calls.append(("done", sorted(indices)))
        self.pending[:] = [item for i, item in enumerate(self.pending) if i not in indices]

    def channel(self) -> bool:
        self.polls += 1
        return self.polls in self.busy_on


def poller_of(kinds, comm, engine: Engine):
    poller, endpoint = kinds
    return poller(endpoint(__import__("mpi4py.MPI").MPI, comm), {}, engine, engine, engine.pending, engine.unmatched,
                  [engine.channel], engine.frames_found, engine.match_parts, engine.pending_done)  # fmt: skip


def polled(kinds) -> tuple:
    """Five polls over COMM_SELF: before anything arrives (a request pending), after a compact and a pickled frame,
    after the request's message, and two more (the channel poller busy on the fourth, a message's parts awaited on
    the fifth); the answers and the calls."""
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    try:
        engine = Engine(busy_on={4})
        waiting = np.zeros(1)
        engine.pending.append(SimpleNamespace(request=comm.Irecv(waiting, 0, 77)))
        poller = poller_of(kinds, comm, engine)
        answers = [poller.poll()]
        for frame in (transport.encode_compact(compact.encode((1, "a")), 0), transport.encode([1], 1, 100).frame):
            comm.Send([frame, MPI.BYTE], 0, transport.FRAME_TAG)
        answers.append(poller.poll())
        comm.Send(np.ones(1), 0, 77)
        answers += [poller.poll(), poller.poll()]
        engine.unmatched.append("a message's parts")
        answers.append(poller.poll())
        return answers, engine.calls, engine.polls, engine.messages_received, waiting[0]
    finally:
        comm.Free()


def test_a_poll_takes_in_frames_tests_requests_and_runs_the_pollers():
    """One poll: the small frames delivered, a pickled one left to the engine, the pending requests tested and only
    the completed ones handed back, awaited parts matched while there are any, every channel poller run; whether
    anything happened. Both twins give the same record."""
    mine, expected = polled(TWINS[0]), polled(TWINS[1])
    assert mine == expected
    answers, calls, polls, messages, received = expected
    assert answers == [False, True, True, True, False]
    assert calls == [("delivered", 1), ("left", calls[1][1]), ("done", [0]), ("matched", 1)]
    assert polls == 5 and messages == 1 and received == 1


@pytest.mark.parametrize("kinds", TWINS, ids=["compiled", "reference"])
def test_a_burst_polls_until_something_happens_or_its_time_is_up(kinds):
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    try:
        engine = Engine(busy_on={50})
        poller = poller_of(kinds, comm, engine)
        assert poller.burst(5.0) is True and engine.polls == 50  # the 50th poll saw something
        began = time.monotonic()
        assert poller.burst(0.02) is False
        assert 0.02 <= time.monotonic() - began < 1.0 and engine.polls > 51
    finally:
        comm.Free()


@pytest.mark.parametrize("kinds", TWINS, ids=["compiled", "reference"])
def test_a_spin_for_a_value_ends_when_it_is_there_or_its_time_is_up(kinds):
    """``until``: polls until the future is done (here by what the 30th poll brings) or the time is up, and says
    whether anything happened meanwhile."""
    from mpi4py import MPI

    async def spins():
        comm = MPI.COMM_SELF.Dup()
        try:
            engine = Engine(busy_on={30})
            future = asyncio.get_running_loop().create_future()
            channel = engine.channel

            def bring() -> bool:
                busy = channel()
                if busy and not future.done():
                    future.set_result("the value")
                return busy

            engine.channel = bring
            poller = poller_of(kinds, comm, engine)
            assert poller.until(future, 5.0, 20e-6) is True and future.result() == "the value" and engine.polls == 30
            never = asyncio.get_running_loop().create_future()
            began = time.monotonic()
            assert poller.until(never, 0.02, 20e-6) is False and not never.done()
            assert 0.02 <= time.monotonic() - began < 1.0
            engine.busy_on = {engine.polls + 3}
            assert poller.until(never, 0.02, 20e-6) is True  # something happened, though not the value
        finally:
            comm.Free()

    asyncio.run(spins())
