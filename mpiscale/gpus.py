"""One GPU per rank, decided by the GPUs' physical identity (UUIDs), not by how many a rank sees.

A rank sees the GPUs its launcher left it: all of the host's under plain
``mpirun``, exactly one under Slurm's ``--gpus-per-task=1`` or ``--gpu-bind``
(``CUDA_VISIBLE_DEVICES``), a MIG slice, or some other subset. Counting ranks
against ``device_count()`` refuses the first of these. So the ranks of a host
gather the UUIDs each one sees (in its own index order); ranks that see the
same set form a group, and the k-th rank of a group takes the group's GPU
``k mod n`` (the first member's order), at its own index. Only two ranks on
one physical GPU are refused, unless GPUs are shared on purpose
(``MPISCALE_SHARE_GPUS=1``). The rule is plain logic (``assign_gpus``), tested
with made-up UUIDs on any machine; ``place_on_gpus`` is its collective form.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .words import counted, ranks_named

SHARE_GPUS = "MPISCALE_SHARE_GPUS"


@dataclass(frozen=True)
class GpuChoice:
    """A rank's GPU: its index among the GPUs the rank sees, and its UUID."""

    index: int
    uuid: str


def shared_on_purpose() -> bool:
    """Whether the user lets ranks share a GPU (``MPISCALE_SHARE_GPUS=1``)."""
    return os.environ.get(SHARE_GPUS) == "1"


def assign_gpus(views: Sequence[Sequence[str]], share: bool = False, finder: str = "torch") -> list[GpuChoice]:
    """Each rank's GPU, given every rank of one host's view (the UUIDs ``finder`` shows it, in its index order), in
    host-rank order. Raises ``ValueError`` (one line) for a rank that sees no GPU, and for two ranks on one GPU
    unless ``share``."""
    blind = [rank for rank, view in enumerate(views) if not view]
    if blind:
        raise ValueError(f"{finder} sees no CUDA GPU for {ranks_named(blind)} of this host (mpiscale doctor says what "
                         "it finds)")  # fmt: skip
    groups: dict[frozenset[str], list[int]] = {}
    for rank, view in enumerate(views):
        groups.setdefault(frozenset(view), []).append(rank)
    chosen: list[GpuChoice | None] = [None] * len(views)
    for members in groups.values():
        order = list(views[members[0]])
        for k, rank in enumerate(members):
            uuid = order[k % len(order)]
            chosen[rank] = GpuChoice(list(views[rank]).index(uuid), uuid)
    choices = [choice for choice in chosen if choice is not None]
    if not share:
        on: dict[str, list[int]] = {}
        for rank, choice in enumerate(choices):
            on.setdefault(choice.uuid, []).append(rank)
        crowded = next((ranks for ranks in on.values() if len(ranks) > 1), None)
        if crowded is not None:
            seen = len({uuid for view in views for uuid in view})
            raise ValueError(
                f"{ranks_named(crowded)} of this host would share GPU {choices[crowded[0]].uuid} ({len(views)} "
                f"ranks and {counted(seen, 'GPU')} between them): start one rank per GPU, or set {SHARE_GPUS}=1 to "
                "share GPUs on purpose"
            )
    return choices


def place_on_gpus(comm: Any, seen: Sequence[str], share: bool | None = None, finder: str = "torch") -> GpuChoice | str:
    """This rank's GPU under ``assign_gpus``, from the UUIDs ``seen`` by each rank of its host (collective over
    ``comm``, an mpi4py communicator); the refusal's text instead where the host's ranks cannot each have one. Every
    rank of a host gets the same refusal."""
    from mpi4py import MPI

    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        views = host.allgather([str(uuid) for uuid in seen])
        rank = host.Get_rank()
    finally:
        host.Free()
    try:
        return assign_gpus(views, shared_on_purpose() if share is None else share, finder)[rank]
    except ValueError as refusal:
        return str(refusal)
