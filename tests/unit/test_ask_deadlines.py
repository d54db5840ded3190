"""Timed asks share one timer, set for the earliest deadline still pending: each ask fails at its own deadline,
not before, an answered ask never fails, and asks without a timeout are left alone."""

import asyncio

import pytest

from mpiscale.runtime import AskTimeout
from mpiscale.runtime.actor import ActorRef
from mpiscale.runtime.deadlines import AskDeadlines
from mpiscale.runtime.dispatch import PendingAsk


async def _asks_at_their_deadlines() -> tuple[dict, list]:
    loop = asyncio.get_running_loop()
    asks: dict[int, PendingAsk] = {}
    deadlines = AskDeadlines(asks)
    began = loop.time()
    for ask_id, timeout in enumerate([0.15, 0.05, 0.10, None, 0.08]):  # the second moves the timer earlier
        pending = PendingAsk(loop.create_future(), ActorRef(1, f"actor{ask_id}"), "work", began, timeout)
        if timeout is not None:
            pending.deadline = began + timeout
            deadlines.add(loop, pending.deadline)
        asks[ask_id] = pending
    ended: dict = {}
    for ask_id, pending in asks.items():
        pending.future.add_done_callback(lambda future, ask_id=ask_id: ended.setdefault(ask_id, loop.time() - began))
    await asyncio.sleep(0.02)
    asks.pop(4).future.set_result((7, False))  # answered before its deadline: the dispatch pops it
    await asyncio.sleep(0.25)
    errors = [(ask_id, str(pending.future.exception())) for ask_id, pending in asks.items() if pending.future.done()]
    return ended, errors


def test_each_timed_ask_fails_at_its_own_deadline_and_an_answered_one_never():
    ended, errors = asyncio.run(_asks_at_their_deadlines())
    assert sorted(ended, key=ended.get) == [4, 1, 2, 0]  # the answered one first, then by deadline
    for ask_id, timeout in ((1, 0.05), (2, 0.10), (0, 0.15)):
        assert timeout <= ended[ask_id] < timeout + 0.05, (ask_id, ended[ask_id])
    assert errors == [
        (0, "no reply from actor actor0@1 to 'work' within 0.15s"),
        (1, "no reply from actor actor1@1 to 'work' within 0.05s"),
        (2, "no reply from actor actor2@1 to 'work' within 0.1s"),
    ]
    assert 3 not in ended  # no timeout: left alone


def test_a_timeout_is_an_ask_timeout():
    async def one() -> None:
        loop = asyncio.get_running_loop()
        asks = {0: PendingAsk(loop.create_future(), ActorRef(0, "a"), "m", loop.time(), 0.0, loop.time())}
        AskDeadlines(asks).add(loop, asks[0].deadline or 0.0)
        await asks[0].future

    with pytest.raises(AskTimeout, match="within 0s"):
        asyncio.run(one())
