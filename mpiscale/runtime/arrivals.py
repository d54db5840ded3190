"""Values other actors tell, kept by key until the code that needs them takes them.

A stage of a pipeline or a node of a compiled graph runs a fixed schedule:
it takes the value of a key (an activation of micro-batch m, the output of
node n for batch b) when its schedule reaches it, whether the value arrived
earlier or arrives later. ``put`` is called by the inbox actor's handler (a
plain method, so it runs inline as the message is received), ``take`` by the
schedule. A key put twice is an error: a message would be lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")


class Arrivals(Generic[Key, Value]):
    """Arrived values by key, and the futures of those awaited before they arrived."""

    def __init__(self, what: str) -> None:
        self.what = what  # for messages: "pipeline message", "graph value"
        self.arrived: dict[Key, Value] = {}
        self.waiting: dict[Key, asyncio.Future] = {}

    def put(self, key: Key, value: Value) -> None:
        future = self.waiting.pop(key, None)
        if future is not None:
            future.set_result(value)
        elif key in self.arrived:
            raise RuntimeError(f"{self.what} {key} arrived twice")
        else:
            self.arrived[key] = value

    async def take(self, key: Key, on_wait: Callable[[asyncio.Future], None] | None = None) -> Value:
        """The value of ``key``, once it arrived; ``on_wait(future)`` first when it has to be waited for."""
        if key in self.arrived:
            return self.arrived.pop(key)
        future = self.waiting[key] = asyncio.get_running_loop().create_future()
        if on_wait is not None:
            on_wait(future)
        return await future
