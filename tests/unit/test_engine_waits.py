"""A wait for one MPI request (``ProgressEngine.wait``): polled for in the caller's stack first, and counted.

A wait that ends in that spin must queue nothing in the event loop: a done callback queued there made the next
caller's ``others_ready`` true, and the second swap of a 4 MiB allreduce went through the loop (0.78x its
messages' floor)."""

import asyncio
import time

import numpy as np
from mpi4py import MPI

from mpiscale.runtime import progress
from mpiscale.runtime.config import RuntimeConfig
from mpiscale.runtime.waits import WaitClock


class Deliveries:
    """Where arrived actor messages would go: none come on this communicator."""

    def envelope(self, source, envelope) -> None:
        raise AssertionError("no actor message is sent on this communicator")

    envelopes = envelope


def test_a_wait_that_ends_in_the_spin_queues_nothing_and_one_that_does_not_is_named_until_it_ends():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        comm = MPI.COMM_WORLD.Dup()  # (a process alone: its own world)
        engine = progress.ProgressEngine(MPI, comm, RuntimeConfig(), Deliveries())
        sent, received = np.arange(4.0), np.zeros(4)
        sending = comm.Isend(sent, 0, 7)
        queued = len(loop._ready)
        engine._turn_at = time.monotonic()  # (as if the engine had just turned: the caller may spin)
        done = engine.wait(comm.Irecv(received, 0, 7), "a value from myself", spin_s=1.0)
        assert done.done() and received.tolist() == sent.tolist()
        assert len(loop._ready) == queued and not engine.others_ready()
        assert engine.waits.oldest() is None and engine.waits.total_s >= 0
        sending.Wait()

        before = engine.waits.total_s
        later = engine.wait(comm.Irecv(received, 0, 8), "a value nobody sent yet", spin_s=0.01)
        assert not later.done()
        what, seconds = engine.waits.oldest()
        assert what == "a value nobody sent yet" and seconds >= 0.01
        comm.Send(sent * 2, 0, 8)  # (eager: it lands in the posted receive)
        engine._turn_at = time.monotonic()
        engine.poll_until(later, 1.0)
        await later
        await asyncio.sleep(0)  # (the wait's done callback runs in the loop's next turn)
        assert engine.waits.oldest() is None and engine.waits.total_s >= before + 0.01
        assert received.tolist() == (sent * 2).tolist()
        comm.Free()

    asyncio.run(main())


def test_a_wait_named_by_a_function_is_named_only_when_it_is_asked_for_while_open():
    """A pipeline names its wait with a function (the name is not made for a wait its spin ends): the function is
    called when the hang watch or the diagnostics ask what is awaited, never for a wait that ended before."""

    async def main() -> None:
        clock = WaitClock()
        calls = []

        def named(text: str):
            return lambda: calls.append(text) or text

        ended = asyncio.get_running_loop().create_future()
        ended.set_result(None)
        clock.count(ended, named("the activation that came at once"))
        assert clock.oldest() is None and calls == []
        open_wait = asyncio.get_running_loop().create_future()
        clock.count(open_wait, named("the gradient of micro-batch 3"), time.monotonic() - 0.5)
        what, seconds = clock.oldest()
        assert what == "the gradient of micro-batch 3" and seconds >= 0.5
        assert calls == ["the gradient of micro-batch 3"]
        open_wait.set_result(None)
        await asyncio.sleep(0)
        assert clock.oldest() is None and clock.total_s >= 0.5

    asyncio.run(main())
