"""The compiled dispatch of arrived envelopes and the compiled send queue against their references: the same
actors run the same handlers, the same replies and failures, the same frames on the wire.

The whole message path runs under the MPI tests of the suite on both paths (``make test`` reruns the messaging
tests with ``MPISCALE_PURE_PYTHON=1``); here each case is put to both twins in one process."""

import asyncio
import os

import numpy as np
import pytest

from mpiscale.runtime import dispatch, outbox, wire
from mpiscale.runtime.actor import Actor, ActorCell, ActorRef, RestartPolicy
from mpiscale.runtime.errors import Failure, TransportError

if os.environ.get(wire.PURE_ENV, "0") not in ("", "0"):
    pytest.skip(f"{wire.PURE_ENV} forces the reference: nothing compiled to compare", allow_module_level=True)
compiled = wire.chosen()[0]


class Rank:
    """What dispatching needs of the rank, recording what it is asked to do."""

    rank, host, origin = 0, "here", "rank 0 on host here"

    def __init__(self) -> None:
        self.stopping = False
        self.refused_tells = 0
        self.replies: list = []
        self.failures: list = []
        self.sent_by_outbox = 0

    @property
    def outbox(self):
        """The compiled send queue, its ``send`` recording what leaves as a reply (the compiled dispatch sends
        compact replies through it, the rest through :meth:`reply`)."""
        from mpi4py import MPI

        rank = self

        class Recording(compiled.Outbox):
            def send(self, dest, obj):
                body = compiled.compact_body(obj, 65536)
                if body is None:
                    return -1
                kind, ask_id, value, failed = obj
                assert kind == dispatch.REPLY and not failed
                rank.replies.append(((dest, ask_id), value))
                rank.sent_by_outbox += 1
                return len(body)

        return Recording(compiled.Endpoint(MPI, MPI.COMM_SELF), compiled, 65536, None, None)

    def reply(self, reply_to, value) -> None:
        if isinstance(value, Failure):
            value = (type(value.error).__name__, str(value.error), value.origin)
        self.replies.append((reply_to, value))

    def fail(self, error, context, status=1) -> None:
        self.failures.append((type(error).__name__, str(error), context))


class Counter(Actor):
    def __init__(self) -> None:
        self.seen: list = []

    def add(self, value, scale=1):
        self.seen.append(value * scale)
        return len(self.seen)

    async def double(self, value):
        return 2 * value

    async def later(self, value):
        await asyncio.sleep(0)
        return value

    def broken(self, value):
        raise ValueError(f"broken by {value}")

    def deferred(self, value):
        return asyncio.sleep(0, value)  # a plain handler that returns an awaitable


FOUR = Failure(ValueError("four"), "(its traceback)", "rank 1")  # one object: both routes' results compare equal
MALFORMED = [
    ((2, "c", "add", (1,), {}, -1), "a tuple of 6 items (int, str, str, tuple, dict, int), of kind 2"),
    ((0, "c", "add", (1,), {}), "a tuple of 5 items (int, str, str, tuple, dict), of kind 0"),
    ((0, ["c"], "add", (1,), {}, -1), "(int, list, str, tuple, dict, int), of kind 0"),
    ((0, "c", ("add",), (1,), {}, -1), "(int, str, tuple, tuple, dict, int), of kind 0"),
    ((0, "c", "add", [1], {}, -1), "(int, str, str, list, dict, int), of kind 0"),
    ((0, "c", "add", (1,), {1: 2}, -1), "(int, str, str, tuple, dict, int), of kind 0"),
    ((0, "c", "add", (1,), {}, 1.5), "(int, str, str, tuple, dict, float), of kind 0"),
    ((1, 3, "three", True), "a tuple of 4 items (int, int, str, bool), of kind 1"),
    ((1, 3, "three", 0), "a tuple of 4 items (int, int, str, int), of kind 1"),
    ((1, "3", "three", False), "a tuple of 4 items (int, str, str, bool), of kind 1"),
    ((np.zeros(1, "V16"), "c", "add", (1,), {}, -1), "a tuple of 6 items (ndarray, str, str, tuple, dict, int)"),
    ([0, "c", "add", (1,), {}, -1], "a list, not a tuple"),
    ((), "a tuple of 0 items ()"),
]


@pytest.mark.parametrize("kind", ["compiled", "reference"])
@pytest.mark.parametrize("envelope, said", MALFORMED)
def test_an_envelope_no_rank_sends_is_refused_alike_and_routes_nothing(kind, envelope, said):
    async def refused():
        rank, cells = Rank(), {}
        cells["c"] = ActorCell(rank, ActorRef(0, "c"), Counter, (), {}, None)
        cells["c"].start()
        await asyncio.sleep(0)
        routes = (compiled.Dispatch if kind == "compiled" else dispatch.Dispatch)(rank, cells, {})
        routes.envelope(1, (0, "c", "add", (1,), {}, -1))  # its handler known: the compiled one takes the next
        with pytest.raises(TransportError, match="no envelope of this runtime") as refusal:
            routes.envelope(1, envelope)
        await asyncio.sleep(0.01)
        cells["c"].task.cancel()
        return str(refusal.value), cells["c"].instance.seen, rank.replies, rank.failures

    text, seen, replies, failures = asyncio.run(refused())
    assert said in text and seen == [1] and replies == [] and failures == []


async def route(kind) -> dict:
    """Every kind of envelope through ``kind`` (a Dispatch class), and what came of each."""
    rank, cells, asks = Rank(), {}, {}
    for name, policy in (("c", None), ("r", RestartPolicy(max_restarts=1))):
        cells[name] = ActorCell(rank, ActorRef(0, name), Counter, (), {}, policy)
        cells[name].start()
    while not all(cell._started for cell in cells.values()):
        await asyncio.sleep(0)
    routes = kind(rank, cells, asks)
    loop = asyncio.get_running_loop()
    asks[3] = dispatch.PendingAsk(loop.create_future(), ActorRef(1, "x"), "m", 0.0)
    asks[4] = dispatch.PendingAsk(loop.create_future(), ActorRef(1, "x"), "m", 0.0)
    routes.envelopes(1, [(0, "c", "add", (1,), {}, -1), (0, "c", "add", (2,), {"scale": 10}, 5)])
    for _ in range(2):  # the second time, each handler is known
        routes.envelope(1, (0, "c", "add", (3,), {}, -1))
        routes.envelope(1, (0, "c", "double", (np.arange(3),), {}, 6))
        routes.envelope(1, (0, "c", "broken", ("ask",), {}, 7))
        routes.envelope(1, (0, "c", "later", (5,), {}, 8))  # queued: the actor is busy until its task runs
        await asyncio.sleep(0.01)
        routes.envelope(1, (0, "c", "deferred", ("d",), {}, 9))
        routes.envelope(1, (0, "c", "missing", (), {}, 10))
        routes.envelope(1, (0, "nobody", "add", (1,), {}, 11))
        routes.envelope(1, (0, "r", "broken", ("tell",), {}, -1))  # restarted once, by its policy
        routes.envelope(0, (0, "c", "add", (4,), {}, 12))  # from this rank: queued, as a local send is
        await asyncio.sleep(0.01)
    routes.envelopes(1, [(1, 3, "three", False), (1, 4, FOUR, True), (1, 99, "nobody asked", False)])
    routes.envelope(1, (0, "nobody", "add", (1,), {}, -1))  # a lost tell ends the job
    rank.stopping = True
    routes.envelopes(1, [(0, "c", "add", (5,), {}, 13), (0, "c", "add", (6,), {}, -1)])
    await asyncio.sleep(0.01)
    for cell in cells.values():
        cell.task.cancel()
    replies = [(to, value.tolist() if isinstance(value, np.ndarray) else value) for to, value in rank.replies]
    return rank.sent_by_outbox, {
        "replies": replies,
        "failures": rank.failures,
        "refused": rank.refused_tells,
        "seen": {name: cell.instance.seen for name, cell in cells.items()},
        "restarts": len(cells["r"].restarts),
        "asks": [asks.get(i) for i in (3, 4)]
        + [f.future.result() for f in (asks.pop(3, None), asks.pop(4, None)) if f],
    }


def test_the_compiled_dispatch_routes_every_envelope_as_the_reference():
    (by_outbox, mine), (_, expected) = asyncio.run(route(compiled.Dispatch)), asyncio.run(route(dispatch.Dispatch))
    assert mine == expected
    assert by_outbox == 2  # the asks of a known handler (add, then double) leave by the send queue, the rest by reply
    replies = dict(expected["replies"])
    assert replies[(1, 5)] == 2 and replies[(1, 6)] == [0, 2, 4] and replies[(1, 8)] == 5 and replies[(1, 9)] == "d"
    assert replies[(1, 7)][:2] == ("ValueError", "broken by ask")
    assert replies[(1, 10)][0] == "AttributeError" and replies[(1, 11)][0] == "ActorNotFound"
    assert replies[(1, 13)][0] == "ActorStopped" and expected["refused"] == 1
    assert expected["seen"]["c"] == [1, 20, 3, 4, 3, 4] and expected["restarts"] == 1
    assert [name for name, *_ in expected["failures"]] == ["ValueError", "ActorNotFound"]  # r's second failure


async def queue_and_send(kind, endpoint, frames) -> tuple[list, int, int]:
    """One stream of small messages through an outbox of ``kind``: what ``post`` and ``send`` returned."""
    box = kind(endpoint, frames, 256, lambda *pending: None, lambda: None, turn_s=60.0)  # (no turn ends by time)
    results = [box.post(0, (0, "a", "m", (0,), {}, -1))]  # the turn's first: the caller sends it
    results.append(box.send(0, (0, "a", "m", (0,), {}, -1)))
    results += [box.post(0, (0, "a", "m", (i, np.full(3, i)), {}, -1)) is not None for i in range(1, 12)]
    results.append(box.post(0, ({1: 2},)))  # not compact: the caller pickles it
    results.append(box.send(0, ({1: 2},)))
    results.append(box.send(0, ("after the queued ones",)))
    results += [box.post(0, (i,)) is not None for i in range(3)]
    await asyncio.sleep(0)  # the turn ends: what is queued leaves
    results.append(dict(box.queued))
    return results, box.messages, box.bytes


def test_the_compiled_outbox_sends_the_references_frames():
    """Both queues, on one real endpoint to this process: the same answers and the same frames, in order."""
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    endpoint = compiled.Endpoint(MPI, comm)
    sent = {}
    try:
        for kind, frames in ((compiled.Outbox, compiled), (outbox.Outbox, wire.PURE)):
            results = asyncio.run(queue_and_send(kind, endpoint, frames))
            arrived = []
            while (found := endpoint.match()) is not None:
                arrived.append(bytes(found[1]))
            sent[kind] = results, arrived
    finally:
        comm.Free()
    (mine, mine_frames), (expected, expected_frames) = sent.values()
    assert mine == expected and mine_frames == expected_frames
    answers, messages, nbytes = expected
    assert answers[0] is None and answers[1] > 0 and all(answers[2:13]) and answers[13:15] == [None, -1]
    assert messages == 1 + 11 + 1 + 3 and nbytes == sum(map(len, expected_frames)) and answers[-1] == {}
    assert len(expected_frames) > 4  # at once, batches over 256 bytes at once, before a send, at the turn's end
