"""The checked exchange a rank of a plain program (one not under ``mpiscale.run``) makes as its program ends
normally, before MPI is finalized: on the world's communicator and on every other one it has made blocking calls on.

Under plain ``mpirun`` a rank whose program returns without a call every rank must make (the estimator's ``fit``
skipped by a branch) waits in MPI's finalize, and the ranks that make the call wait in it for that one. Its host's
ranks see its marker (:mod:`mpiscale.ended_ranks`), but a rank of another host waited for ever. The end of a
program now begins like every blocking collective call, with :func:`~mpiscale.runtime.checked_entry`, posted at once
on the world and on each communicator of :mod:`.used_comms`: a rank in such a call on any of them meets it there
and every rank ends at once with one report naming each rank's call, whatever host it runs on. A communicator
this rank never made a blocking call on is not known here (the marker covers its host). Where every rank ends its
program, the exchanges complete as one more barrier each before finalize's own; they wait without a word, since the
others may still be working.
"""

from __future__ import annotations

from typing import Any

from ..ended_ranks import meet_at_end
from ..ranks import by_ranks, end_every_rank, leave_report_to_another
from ..words import ranks_named
from .blocking import checked_entry_on_each
from .errors import CollectiveMismatch
from .used_comms import used_communicators

_CALL = "the end of the program"
_SAID = "the end of its program (it returned, or called sys.exit)"


def meet_the_other_ranks() -> None:
    """This rank's program ended normally: wait for every rank's end on the world's communicator and on each other
    one this rank has used, or, where a rank waits in another collective call on one, end the job with the report
    (one rank's; the others say one line)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    try:
        checked_entry_on_each([world, *used_communicators()], _CALL, _CALL, lambda: _SAID, _came_apart)
    except CollectiveMismatch as error:
        leave_report_to_another(MPI, error)  # (a rank in the call reports it: its error is uncaught there)
        end_every_rank(MPI, f"mpiscale: rank {world.Get_rank()}: {type(error).__name__}: {error}")


def _came_apart(comm: Any, calls: list[str], ranks: tuple[int, ...]) -> str:
    named = comm.Get_name() or f"a communicator of {ranks_named(list(ranks))}"
    return (
        f"the ranks came to different collective calls on {named} as a program ended: {by_ranks(calls, ranks)}; "
        "every rank must make the same collective calls on it, in the same order, before its program ends"
    )


meet_at_end(meet_the_other_ranks)
