"""Which handlers may run at once where their message arrives (``inline_kind``)."""

import asyncio
import functools

from mpiscale.runtime.actor import NEVER_SUSPENDS, PLAIN, QUEUED, inline_kind


class Handlers:
    def plain(self, value):
        return value

    async def awaits_nothing(self, value):
        return [value * 2 for _ in range(3)]

    async def awaits(self, value):
        await asyncio.sleep(0)
        return value

    async def iterates(self, source):
        return [item async for item in source]

    async def enters(self, lock):
        async with lock:
            return 1

    def generates(self):
        yield 1

    async def streams(self):
        yield 1


def test_plain_functions_and_async_ones_that_await_nothing_run_inline():
    handlers = Handlers()
    assert inline_kind(handlers.plain) == PLAIN
    assert inline_kind(handlers.awaits_nothing) == NEVER_SUSPENDS
    assert inline_kind(Handlers.awaits_nothing) == NEVER_SUSPENDS


def test_anything_that_may_suspend_or_is_not_a_function_is_queued():
    handlers = Handlers()
    for handler in (handlers.awaits, handlers.iterates, handlers.enters, handlers.generates, handlers.streams):
        assert inline_kind(handler) == QUEUED, handler
    assert inline_kind(functools.partial(handlers.plain, 1)) == QUEUED  # no code of its own to inspect
    assert inline_kind(print) == QUEUED
