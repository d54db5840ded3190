"""Remote exceptions, deadlines, unknown actors and handlers, supervision restarts."""

import asyncio
import enum
import socket
import threading
import time

import numpy as np

import mpiscale
from mpiscale import ActorNotFound, ActorRef, AskTimeout, RemoteError, RemoteTraceback, RestartPolicy


class Handler(enum.StrEnum):
    PING = "ping"


class Names(str, enum.Enum):  # noqa: UP042 - as code older than StrEnum writes it; str() is "Names.FAULTY"
    FAULTY = "faulty"


class DataError(ValueError):
    """A user exception type that must survive the trip back."""


class Faulty(mpiscale.Actor):
    def __init__(self):
        self.calls = 0

    def fail(self, message: str):
        raise DataError(message)

    def fail_unpicklable(self):
        error = RuntimeError("carries a lock")
        error.lock = threading.Lock()
        raise error

    async def slow(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "late"

    def ping(self) -> int:
        self.calls += 1
        return self.calls


class Fragile(mpiscale.Actor):
    """Restarted on failure; its state starts again from the constructor."""

    restart_policy = RestartPolicy(max_restarts=2, window_s=60)

    def __init__(self, start: int):
        self.value = start

    def add(self, amount: int):
        if amount < 0:
            raise ValueError("negative amounts crash the actor")
        self.value += amount

    def get(self) -> int:
        return self.value


async def main(system):
    rank, size = system.rank, system.size
    faulty = await system.spawn_group(Faulty, name="faulty")
    peer = faulty[(rank + 1) % size]

    # The same exception type, chained to a traceback naming rank, host and actor.
    try:
        await peer.ask("fail", f"bad input from {rank}")
    except DataError as error:
        assert str(error) == f"bad input from {rank}"
        cause = error.__cause__
        assert isinstance(cause, RemoteTraceback), type(cause)
        text = str(cause)
        assert f"rank {peer.rank} on host {socket.gethostname()}" in text or f"rank {peer.rank} on host" in text
        assert "actor 'faulty' (Faulty.fail)" in text and "DataError: bad input" in text, text
    else:
        raise AssertionError("no exception")

    # An exception that cannot be pickled arrives as RemoteError with the original text.
    try:
        await peer.ask("fail_unpicklable")
    except RemoteError as error:
        assert "RuntimeError: carries a lock" in str(error)
    else:
        raise AssertionError("no exception")

    # Unknown actors and handlers are errors for the asker, not hangs.
    for target, method, expected in [
        (ActorRef(peer.rank, "nobody"), "ping", ActorNotFound),
        (peer, "no_such_handler", AttributeError),
        (peer, "_private", AttributeError),
    ]:
        try:
            await target.ask(method)
        except expected:
            pass
        else:
            raise AssertionError(f"{method} did not raise {expected.__name__}")

    # What the receiving rank could not take is refused to the caller (it once ended the job there), and names of
    # str subclasses (a StrEnum's members) and numpy ranks travel as plain str and int.
    for target, method in [(peer, 5), (peer, b"ping"), (ActorRef(peer.rank, 7), "ping"), (ActorRef(1.0, "x"), "p")]:
        for verb in ("ask", "tell"):
            try:
                await getattr(target, verb)(method)
            except TypeError as error:
                assert any(words in str(error) for words in ("named by a str", "rank is an int")), error
            else:
                raise AssertionError(f"{target!r}.{method!r} was sent")
    before = await peer.ask(Handler.PING)
    await ActorRef(np.int64(peer.rank), Names.FAULTY).tell(Handler.PING)
    assert await ActorRef(np.int32(peer.rank), Names.FAULTY).ask(Handler.PING) == before + 2

    # Deadlines: an ask times out on time; the actor then goes on serving.
    start = time.monotonic()
    try:
        await peer.ask("slow", 5.0, timeout=0.3)
    except AskTimeout as error:
        waited = time.monotonic() - start
        assert 0.3 <= waited < 2.0, waited
        assert "faulty" in str(error) and "slow" in str(error)
    else:
        raise AssertionError("no timeout")
    assert isinstance(await peer.ask("ping", timeout=30), int)
    for bad in (-1.0, float("nan"), "5"):  # refused before anything is sent
        try:
            await peer.ask("ping", timeout=bad)
        except (ValueError, TypeError) as error:
            assert "timeout must be >= 0 seconds or None" in str(error), error
        else:
            raise AssertionError(f"timeout={bad} accepted")

    # Supervision: a failed tell restarts the actor with its original arguments.
    fragile = await system.spawn_group(Fragile, 10, name="fragile")
    target = fragile[(rank + 1) % size]
    await system.world.barrier()
    if rank == 0:
        target.tell("add", 5)
        assert await target.ask("get") == 15
        target.tell("add", -1)  # crashes; restarted from Fragile(10)
        assert await target.ask("get") == 10
        target.tell("add", 1)
        assert await target.ask("get") == 11
    await system.world.barrier()
    if rank == 0:
        print(f"errors ok on {size} ranks")


mpiscale.run(main)
