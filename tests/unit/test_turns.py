"""When a caller that would poll in its own stack must let the event loop turn instead (``others_ready``): another
callback ready, a timer due, or no turn for a while; the engine's own next turn, ready or due, does not count. A
pipeline stage computes for milliseconds between its takes, so the engine's sleep timer is then long due: counted, it
sent every take through the loop."""

import asyncio
import time

from mpi4py import MPI

from mpiscale.runtime import progress
from mpiscale.runtime.config import RuntimeConfig


class Deliveries:
    """Where arrived messages would go: none come on this communicator."""

    def envelope(self, source, envelope) -> None:
        raise AssertionError("nothing is sent on this communicator")

    envelopes = envelope


def test_a_ready_callback_or_a_due_timer_lets_the_loop_turn_and_the_engines_own_timer_does_not():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        comm = MPI.COMM_WORLD.Dup()  # (a process alone: its own world; a duplicate of COMM_SELF has no TAG_UB here)
        engine = progress.ProgressEngine(MPI, comm, RuntimeConfig(), Deliveries())
        engine._turn_at = time.monotonic()
        assert not engine.others_ready()
        later = loop.call_later(60, lambda: None)  # a timer not yet due
        assert not engine.others_ready()
        soon = loop.call_soon(lambda: None)
        assert engine.others_ready()  # a callback is ready
        soon.cancel()
        await asyncio.sleep(0)  # (the turn drops the cancelled callback)
        engine._turn_at = time.monotonic()
        own = engine._wake_at = loop.call_at(loop.time() - 1, lambda: None)  # the engine's sleep, ended already
        assert not engine.others_ready()  # its poll is what the engine's turn would do
        other = loop.call_at(loop.time() - 0.5, lambda: None)
        assert engine.others_ready()  # someone else's timer is due (the next after the engine's in the heap)
        for timer in (own, other, later):
            timer.cancel()
        await asyncio.sleep(0)
        engine._wake_at = None
        engine._turn_at = time.monotonic() - 2 * progress._IO_TURN_S
        assert engine.others_ready()  # no turn for a while: sockets are read only in one
        comm.Free()

    asyncio.run(main())
