"""The collective calls made on one file object (a writer, a data set read collectively), checked as each starts to
be the same call, the same one in order, on every rank.

Each of those calls (a round's write, a read, the close) is a collective of
MPI-IO's underneath, on HDF5's own copy of the communicator. A rank that skips
one (``if len(rows):`` around a write) goes on to the next call while the
others make this one: two writes of different rounds met (rows written where
they do not belong), or a write met the close and every rank waited for ever.
Each call now starts with one small exchange on the caller's communicator,
every rank's call count and name: two ranks at different calls are found at
that exchange, before any data moves, and every rank raises one
``CollectiveMismatch`` naming each rank's call and line. The exchange is
waited for as :func:`~mpiscale.runtime.blocking_barrier` is: a rank that never
comes is said after ``MPISCALE_COLLECTIVE_CHECK_S`` and, inside
``mpiscale.run`` or where it ended its program on this host, ends the job.
"""

from __future__ import annotations

import os
import zlib

import numpy as np

from ..ranks import EACH_RANK, Comm, by_ranks
from ..runtime import CollectiveMismatch, RuntimeConfig, blocking_collective, call_site

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

#: What a rank without rows in a round does, said with the calls' order.
NO_ROWS_READ = " (a rank without rows in a round reads an empty range: read_collective(n, n))"
NO_ROWS_WRITTEN = " (a rank without rows in a round writes empty arrays)"


class SameCalls:
    """The collective calls made on one object over ``comm``, named ``what`` (``"RowWriter(out.h5)"``) in what is
    said; ``hint`` follows what each rank must do (``" (a rank with no rows passes empty ones)"``)."""

    def __init__(self, comm: Comm | None, what: str, hint: str = "") -> None:
        self._comm = None if comm is None or comm.Get_size() == 1 else comm
        self._what, self._must, self._made = what, f"{EACH_RANK} make the same calls on it in the same order{hint}", 0
        self._check_s = RuntimeConfig.setting("collective_check_s")
        self._every = None if self._comm is None else np.empty((self._comm.Get_size(), 3), np.int64)
        self._known: dict[str, tuple[int, str, str]] = {}  # call -> (its digest, the runtime's name, the overdue text)

    def begin(self, call: str, site: str | None = None, most: int = 0) -> int:
        """Wait until every rank comes to its next call on this object; raise ``CollectiveMismatch`` on every rank
        where one came to another call (``call`` names this rank's: ``"write(X, codes)"``, ``"close"``), or to
        this one after making fewer or more calls. ``site``: where it was called, said in the error (by default the
        caller's line outside mpiscale). Returns the most any rank gave as ``most`` (a number the call needs agreed
        anyway, as the rounds of a transfer: one exchange, not two)."""
        comm, every = self._comm, self._every
        if comm is None or every is None or not comm:  # (not comm: freed, as a job's end frees its own: HDF5 has one)
            return most
        self._made += 1
        known = self._known.get(call)
        if known is None:
            overdue = (f"{self._what}.{call}: rank {comm.Get_rank()} has waited {self._check_s:g} s for the other "
                       f"ranks of its communicator to come to it too: {self._must}, or this wait never "
                       "ends")  # fmt: skip
            operation = f"{self._what.split('(')[0]}.{call.split('(')[0]}"  # (RowWriter.write: the runtime's report)
            known = self._known[call] = (zlib.crc32(f"{self._what}.{call}".encode()), operation, overdue)
        mine = np.array([known[0], self._made, most], np.int64)
        blocking_collective(comm, lambda raw: raw.Iallgather(mine, every), known[1], known[2])
        found = every.ravel().tolist()  # (compared in Python: numpy's compare costs µs)
        digests, counts = found[0::3], found[1::3]
        if digests.count(digests[0]) == len(digests) and counts.count(counts[0]) == len(counts):
            return max(found[2::3])
        from mpi4py import MPI

        said = f"{call}, its call {self._made} on it, at {site or call_site(_PACKAGE_DIR)}"
        world_ranks, calls = zip(*comm.allgather((MPI.COMM_WORLD.Get_rank(), said)))
        error = CollectiveMismatch(f"{self._what}: the ranks made different calls on it: {by_ranks(list(calls))}; "
                                   f"{self._must}")  # fmt: skip
        error.reporter = world_ranks[0]  # every rank raises it: under mpiscale.run, one report (its first rank's)
        raise error
