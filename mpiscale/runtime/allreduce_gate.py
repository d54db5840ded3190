"""The gate before each hierarchical allreduce: every rank reaches the call, and with checks on the ranks compare
their arguments; a two-rank exchange's first send travels meanwhile.

A rank ahead of the others waits at the gate mostly asleep (see :mod:`.hierarchical`), so the gate is a collective
on a communicator of its own: an ``Ibarrier``, or with checks on the ``Iallgather`` of each rank's digest of its
arguments. On one node of two ranks, a checked call that is the exchange of :mod:`.pair_reduce` posts its first
send before the gate, so the check and the data take one round of latency, not two. When the digests differ, each
rank first takes the other's early send off the wire, so that no later call reads it as its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ..ranks import Comm, by_ranks
from .collectives import described
from .errors import CollectiveMismatch, signature_digest
from .pair_reduce import TAG, send_first


@dataclass
class Opened:
    """A call at its gate."""

    request: Any  # the gate's own
    gathered: np.ndarray | None  # every rank's (digest, bytes sent ahead), once complete; None without checks
    signature: str  # the call's arguments as text
    first: Any = None  # the exchange's first send, when posted ahead of the gate


class Gate:
    """The gates of one world's hierarchical calls, in call order (built collectively, once)."""

    def __init__(self, MPI: ModuleType, world: Comm, check: bool, pair: Comm | None) -> None:
        """``pair``: the two-rank communicator of the exchange when the world is one node of two ranks, else None
        (calls then send nothing ahead)."""
        self._MPI, self._check, self.pair = MPI, check, pair
        self._comm = world.Dup()  # apart from the calls' own traffic
        # the job's rank of the first one here: it reports a mismatch every rank raises
        self._reporter = MPI.Group.Translate_ranks(world.Get_group(), [0], MPI.COMM_WORLD.Get_group())[0]

    def open(self, array: np.ndarray, op_name: str, send_ahead: bool) -> Opened:
        """Start the gate of a call of ``array``; ``send_ahead``: the call is the exchange on :attr:`pair`, and
        ``array`` is C-contiguous (its first send is posted now, when checks are on)."""
        signature = described(array.dtype, array.shape, op_name)
        if not self._check:
            return Opened(self._comm.Ibarrier(), None, signature)
        first, ahead = send_first(self.pair, array) if send_ahead and self.pair is not None else (None, 0)
        mine = np.array([signature_digest(signature), ahead], np.int64)
        gathered = np.empty((self._comm.Get_size(), 2), np.int64)
        return Opened(self._comm.Iallgather(mine, gathered), gathered, signature, first)

    def passed(self, opened: Opened, call: tuple[str, str]) -> None:
        """After the gate: a mismatch of the ranks' arguments is one :class:`CollectiveMismatch` naming every rank's
        arguments and call site (raised on every rank; the lowest one reports it). ``call``: what the call is and
        where it was made."""
        gathered = opened.gathered
        if gathered is None or len(set(gathered[:, 0].tolist())) == 1:
            return
        if self.pair is not None:  # the other rank's early send taken off the wire, this rank's taken by it
            other = 1 - self.pair.Get_rank()
            unread = np.empty(int(gathered[1 - self._comm.Get_rank(), 1]), np.uint8)
            if unread.size:
                self.pair.Recv([unread, self._MPI.BYTE], other, TAG)
            if opened.first is not None:
                opened.first.Wait()
        calls = self._comm.allgather(f"allreduce({opened.signature}) at {call[1]}")
        error = CollectiveMismatch(f"{call[0]}: the ranks passed different arguments (shape, dtype, op), where all "
                                   f"must pass the same: {by_ranks(calls)}")  # fmt: skip
        error.reporter = self._reporter
        raise error
