"""Level 2 of a checkpoint: each rank's shard is copied to a rank on the next node, so one lost node loses nothing."""

from __future__ import annotations

from ...ranks import MAX_MESSAGE_BYTES, Comm, chunks
from ..h5file import write_atomically
from .files import Layout

_PARTNER_TAG = 29


def choose_partners(placement: list[tuple[int, int]], rank: int, nodes: int) -> tuple[int | None, list[int]]:
    """(the rank on the next node that keeps a copy of ``rank``'s shard, the ranks whose copies ``rank`` keeps).

    ``placement`` is every rank's (node, rank on the node).
    """
    if nodes < 2:
        return None, []
    ranks_of = [[r for r, (node, _) in enumerate(placement) if node == n] for n in range(nodes)]
    partner_of = []
    for node, local_rank in placement:
        following = ranks_of[(node + 1) % nodes]
        partner_of.append(following[local_rank % len(following)])
    return partner_of[rank], [r for r, p in enumerate(partner_of) if p == rank]


def copy_to_partner(comm: Comm, layout: Layout, node: int, step: int, partner: int, senders: list[int]) -> None:
    """Send this rank's level-1 shard of ``step`` to ``partner``; store the shards of ``senders`` (collective)."""
    from mpi4py import MPI

    mine = layout.shard(node, step, comm.Get_rank()).read_bytes()
    sizes = comm.allgather(len(mine))
    incoming = {sender: bytearray(sizes[sender]) for sender in senders}
    requests = []
    for sender, buffer in incoming.items():
        for piece in chunks(memoryview(buffer), MAX_MESSAGE_BYTES):
            requests.append(comm.Irecv([piece, MPI.BYTE], sender, _PARTNER_TAG))
    for piece in chunks(memoryview(mine), MAX_MESSAGE_BYTES):
        requests.append(comm.Isend([piece, MPI.BYTE], partner, _PARTNER_TAG))
    MPI.Request.Waitall(requests)
    for sender, buffer in incoming.items():
        write_atomically(layout.shard(node, step, sender, copy=True), buffer)
