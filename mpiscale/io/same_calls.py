"""The collective calls made on one file object (a writer, a data set read collectively), checked as each starts to
be the same call, the same one in order, on every rank.

Each of those calls (a round's write, a read, the close) is a collective of
MPI-IO's underneath, on HDF5's own copy of the communicator. A rank that skips
one (``if len(rows):`` around a write) goes on to the next call while the
others make this one: two writes of different rounds met (rows written where
they do not belong), or a write met the close and every rank waited for ever.
Each call now starts with one small exchange on the caller's communicator,
a digest of every rank's call and call count (``runtime.checked_entry``, the
exchange every collective of the library's and the runtime's begins with): two
ranks at different calls are found at that exchange, before any data moves,
a call on this object and one on another too, and every rank raises one
``CollectiveMismatch`` naming each rank's call and line. The exchange is
waited for as :func:`~mpiscale.runtime.blocking_barrier` is: a rank that never
comes is said after ``MPISCALE_COLLECTIVE_CHECK_S`` and, inside
``mpiscale.run`` or where it ended its program on this host, ends the job.
"""

from __future__ import annotations

import os

from ..ranks import EACH_RANK, Comm, by_ranks
from ..runtime import RuntimeConfig, blocking_entry, call_site, checked_entry

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

#: What a rank without rows in a round does, said with the calls' order.
NO_ROWS_READ = " (a rank without rows in a round reads an empty range: read_collective(n, n))"
NO_ROWS_WRITTEN = " (a rank without rows in a round writes empty arrays)"


class SameCalls:
    """The collective calls made on one object over ``comm``, named ``what`` (``"RowWriter(out.h5)"``) in what is
    said; ``hint`` follows what each rank must do (``" (a rank with no rows passes empty ones)"``); ``alike`` names
    it alike on every rank where ``what`` names it as this rank was given it (``on_files``)."""

    def __init__(self, comm: Comm | None, what: str, hint: str = "", alike: str | None = None) -> None:
        self._comm = None if comm is None or comm.Get_size() == 1 else comm
        self._what, self._must, self._made = what, f"{EACH_RANK} make the same calls on it in the same order{hint}", 0
        self._alike = alike or what  # (the object as every rank names it: in the check, and in the calls said)
        self._check_s = RuntimeConfig.setting("collective_check_s")
        self._known: dict[str, tuple[str, str, str]] = {}  # call -> (what.call, the runtime's name, the overdue text)
        #: Whether the last mismatch found a rank in a call on another object (or another collective): then the
        #: ranks are not all here, and this object's own clean-up, collective, would wait for them.
        self.met_other_calls = False

    def enter(self, doing: str, must: str) -> None:
        """Wait until every rank comes to make this object (``io.entered_by_all``), checked by the name every rank
        gives it (``alike``: its files' real paths, found once for the object and its calls)."""
        blocking_entry(self._comm, self._what, doing, must, alike=self._alike)

    def begin(self, call: str, site: str | None = None, most: int = 0) -> int:
        """Wait until every rank comes to its next call on this object; raise ``CollectiveMismatch`` on every rank
        where one came to another call (``call`` names this rank's: ``"write(X, codes)"``, ``"close"``), or to
        this one after making fewer or more calls. ``site``: where it was called, said in the error (by default the
        caller's line outside mpiscale). Returns the most any rank gave as ``most`` (a number the call needs agreed
        anyway, as the rounds of a transfer: one exchange, not two)."""
        comm = self._comm
        if comm is None or not comm:  # (not comm: freed, as a job's end frees its own: HDF5 has one)
            return most
        self._made += 1
        known = self._known.get(call)
        if known is None:
            from mpi4py import MPI

            overdue = (f"{self._what}.{call}: rank {MPI.COMM_WORLD.Get_rank()} has waited "
                       f"{self._check_s:g} s for the other ranks of its communicator to come to it too: {self._must}, "
                       "or this wait never ends")  # fmt: skip
            operation = f"{self._what.split('(')[0]}.{call.split('(')[0]}"  # (RowWriter.write: the runtime's report)
            known = self._known[call] = (f"{self._alike}.{call}", operation, overdue)
        named, made = known[0], self._made
        return max(checked_entry(comm, named, most, known[1], known[2],
                                 lambda: f"{named}, its call {made} on it, at {site or call_site(_PACKAGE_DIR)}",
                                 self._mismatch, nth=made))  # fmt: skip

    def _mismatch(self, calls: list[str], ranks: tuple[int, ...]) -> str:
        """What every rank raises where the ranks' calls differ (``calls``: each rank's, named with its object; by
        ``ranks``, their world ranks): the calls on this object named by their call alone."""
        prefix = f"{self._alike}."
        self.met_other_calls = not all(call.startswith(prefix) for call in calls)
        named = by_ranks([call.removeprefix(prefix) for call in calls], ranks)
        on_it = "" if self.met_other_calls else " on it"
        return f"{self._what}: the ranks made different calls{on_it}: {named}; {self._must}"


def on_files(comm: Comm | None, kind: str, path: str | os.PathLike | list, hint: str = "") -> SameCalls:
    """The calls on a ``kind`` object (``"RowWriter"``) of the file or files at ``path``: said as this rank was given
    the path, checked by its real path (``out.h5`` on one rank and ``/scratch/job/out.h5`` on another name one
    file, where the ranks' calls on it differed at its first call)."""
    given = ", ".join(map(os.fspath, path)) if isinstance(path, list) else os.fspath(path)
    return SameCalls(comm, f"{kind}({given})", hint, alike=named_alike(kind, path))


def named_alike(kind: str, path: str | os.PathLike | list) -> str:
    """``kind(real path)``: a ``kind`` object (``"RowWriter"``) of the file or files at ``path`` as every rank names
    it, whichever way each was given the path (``out.h5``, a link to its directory)."""
    return f"{kind}({', '.join(real_paths(path if isinstance(path, list) else [path]))})"


def real_paths(paths: list) -> list[str]:
    """Each path's ``os.path.realpath``, each folder resolved once: a file that is no link itself costs one lookup,
    where a list of thousands of shards cost every rank a lookup for each part of each path (some 15 µs a file)."""
    folders: dict[str, str] = {}
    real = []
    for each in map(os.fspath, paths):
        folder, name = os.path.split(each)
        if name in ("", os.curdir, os.pardir) or os.path.islink(each):
            real.append(os.path.realpath(each))
            continue
        if folder not in folders:
            folders[folder] = os.path.realpath(folder or os.curdir)
        real.append(os.path.join(folders[folder], name))
    return real
