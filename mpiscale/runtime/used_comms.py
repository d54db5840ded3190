"""The communicators other than the world's that a rank of a plain program (not under ``mpiscale.run``) has made
blocking calls on, for the checked exchange its program's end makes on each (:mod:`.program_end`).

A rank that waits in a blocking call on a copy or a part of the world's communicator, for a rank whose program has
ended, met that end on its own host only (the ended rank's marker); a rank of another host waited for ever. Every
member of a communicator made each collective call on it, so each knows the communicator; at its end a rank posts
the end's exchange on every one it has used, and a member waiting in a later call there meets it, on any host.

A communicator freed (by any of its handles) leaves the list as MPI deletes its attributes; one never freed stays,
and every member's end meets the others' there.
"""

from __future__ import annotations

from typing import Any

_USED: dict[int, Any] = {}  # handle -> the communicator (None: the world's, or an intercommunicator: not kept)
_FREED_KEY: list[int] = []  # the MPI attribute whose deletion (the communicator freed) takes one off the list


def note_used(comm: Any) -> None:
    """Keep ``comm`` (an mpi4py communicator of several ranks, about to make a blocking collective call) for this
    rank's end; the world's communicator and intercommunicators are left out. Once per communicator (a look-up)."""
    handle = comm.handle
    if handle in _USED:
        return
    from mpi4py import MPI

    if handle == MPI.COMM_WORLD.handle:
        _USED[handle] = None
        return
    if not _FREED_KEY:
        _FREED_KEY.append(MPI.Comm.Create_keyval(delete_fn=lambda _comm, _key, freed: _USED.pop(freed, None)))
    comm.Set_attr(_FREED_KEY[0], handle)
    _USED[handle] = None if comm.Is_inter() else comm


def used_communicators() -> list[Any]:
    """The communicators kept by :func:`note_used` and not freed since, in the order they were first used."""
    return [comm for comm in list(_USED.values()) if comm is not None]  # (list: one step, whatever threads do)
