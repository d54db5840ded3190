"""Arrays between ranks without pickle, received into buffers posted ahead.

A :class:`Channel` carries numpy arrays point to point (a pipeline stage's
activations and gradients, a compiled graph's edge values) on a communicator
of its own. A message is a fixed header (its lane, a key of three integers,
the dtype and shape) and then the array's bytes as they lie in memory. An
array of at most ``INLINE_BYTES`` travels in its header's message, one MPI
message in all, and is copied out of it on arrival (a copy of 4 KiB costs less
than a second message).

Each (peer, lane) has a capacity: the size of the first larger array sent on
it. An array that fits travels on the lane's *fit* tag, whose receive the receiver
posted ahead into a buffer of that capacity, so it lands in place: nothing is
unpickled, copied again or rebuilt, and the receiver is handed a view of the
buffer. A bigger array, and a lane's first, travels on the lane's *over* tag
and is received, once its header has arrived, into memory of its own size.
Both ends decide fit or over by the same rule from the same history, so
nothing is negotiated per message and shapes may vary from one to the next.

A buffer is posted again only when nothing outside the channel refers to it
(a view handed out keeps it, and its reference count says so); otherwise a
new one is made. An array handed out therefore stays valid as long as it is
held, however far the sender runs ahead.

Headers from every source arrive on one tag, through a ring of receives posted
for any source; MPI keeps each sender's order per tag, so the arrays of a
(peer, lane) arrive in the order they were sent. The progress engine polls the
channel every turn, and an arrived array goes to ``deliver(source, lane, key,
array)`` at once, whether or not anything awaits it yet. A header that is not
one of this channel's (damaged, another program's, a shape that disagrees with
its size or its message's, an object dtype) is a :class:`TransportError`, which
ends the job. The two ends are :mod:`.channel_send` and :mod:`.channel_receive`
(the header's layout: :mod:`.channel_format`), each with a compiled twin that
``wire`` picks where it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np

from ..ranks import Comm
from . import wire
from .channel_format import INLINE_BYTES
from .channel_receive import Deliver
from .config import RuntimeConfig
from .progress import ProgressEngine


class Channel:
    """Raw arrays to and from any rank of ``comm`` (a communicator of the channel's own; see the module notes)."""

    def __init__(self, MPI: ModuleType, comm: Comm, engine: ProgressEngine, config: RuntimeConfig, name: str,
                 deliver: Deliver) -> None:  # fmt: skip
        self.comm, self._engine, self.name = comm, engine, name
        tag_ub = comm.Get_attr(MPI.TAG_UB)
        assert isinstance(tag_ub, int), tag_ub  # MPI sets it on every communicator
        self.lanes = (tag_ub - 2) // 2  # lanes 0 .. lanes-1 have tags
        frames = wire.chosen()[0]  # the compiled path's calls, or the reference's
        inline_bytes = min(INLINE_BYTES, config.chunk_bytes)
        self._sender = frames.ChannelSender(MPI, comm, frames.Endpoint(MPI, comm), engine, name, self.lanes,
                                            config.chunk_bytes, inline_bytes)  # fmt: skip
        self._receiver = frames.ChannelReceiver(MPI, comm, engine, name, self.lanes, config.chunk_bytes, deliver)
        self.poll = self._receiver.poll
        engine.pollers.append(self.poll)
        #: ``send(dest, lane, key, array)``: send ``array`` (C-contiguous, of plain numbers) to rank ``dest`` on
        #: ``lane`` with ``key`` (three integers); it is kept alive until MPI is done with it, and must not be changed
        #: before then. The sender's own call (a pipeline stage sends twice a micro-batch: no wrapper in between).
        self.send: Callable[[int, int, tuple[int, int, int], np.ndarray], None] = self._sender.send
        self.closed = False

    def close(self) -> None:
        """Cancel the receives posted ahead (at the job's end, when every sent array has arrived) and free the
        communicator."""
        if self.closed:
            return
        self.closed = True
        self._sender.close()
        self._engine.pollers.remove(self.poll)
        self._receiver.cancel()
        self.comm.Free()
