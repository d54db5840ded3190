"""A job under telemetry and steering: started, progress from its progress line, finished or failed, on every rank."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..runtime import ActorSystem
from ..telemetry import Telemetry, set_current

Result = TypeVar("Result")


async def observed(
    system: ActorSystem, command: str, out: str | None, work: Callable[[], Awaitable[Result]], steers: bool = True
) -> Result:
    """Run ``work()`` with this rank's telemetry session current (collective start and end).

    ``steers``: the job calls ``jobs.steer`` at every step's end, so it obeys
    SIGTERM and the checkpoint and stop commands (with telemetry on or off).
    """
    if steers:
        system.steering.begin()  # before telemetry takes commands
    session = await Telemetry.start(system, command, out)
    set_current(session)
    try:
        result = await work()
    except BaseException as error:
        await session.fail(f"{type(error).__name__}: {error}")
        raise
    finally:
        set_current(None)
        if steers:
            system.steering.end()
    await session.close()
    return result
