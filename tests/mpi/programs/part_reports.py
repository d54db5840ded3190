"""Reports of calls on a part of the world's ranks (4 ranks, split in pairs), which named each rank by its place in
the part: "rank 1" for world rank 3. Argument ``blocking`` (a plain mpi4py program) or ``awaited`` (under
``mpiscale.run``, a ``system.split`` group). In each pair the second rank fails an agreement, and then, in the
second pair, the ranks make different calls (and, under the runtime, every pair passes different shapes to its
hierarchical allreduce); each rank prints what it raised. In the plain program rank 3 comes late to the first
agreement, and the second pair's ranks give ``write_dataset`` and a checkpoint's save arrays of other dtypes (in
the directory given after the mode)."""

import sys
import time
from pathlib import Path

import numpy as np

import mpiscale
from mpiscale.io import Checkpointer, write_dataset
from mpiscale.ranks import AgreedError, agree, on_rank_0


def said(error: Exception, rank: int) -> None:
    """One write a line (print writes the line and its end apart: the ranks' lines interleaved)."""
    sys.stdout.write(f"rank {rank} raised {type(error).__name__}: {error}\n")
    sys.stdout.flush()


async def main(system) -> None:
    pair = system.split(system.rank // 2, "pairs")
    try:
        await pair.world.agree("bad input" if system.rank % 2 else None, "checking")
    except RuntimeError as error:
        said(error, system.rank)
    try:
        if system.rank == 2:
            await pair.world.barrier()
        elif system.rank == 3:
            await pair.world.allreduce(np.ones(1))
    except mpiscale.CollectiveMismatch as error:
        said(error, system.rank)
    try:  # the hierarchical allreduce's own check of the arguments: one value more on the pair's second rank
        await pair.hierarchy.allreduce(np.ones(4 + system.rank % 2))
    except mpiscale.CollectiveMismatch as error:
        said(error, system.rank)


if sys.argv[1] == "awaited":
    mpiscale.run(main, name="part-reports")
else:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    pair = world.Split(rank // 2, rank)
    if rank == 3:
        time.sleep(1.5)  # (rank 2 says its wait in the agreement after the collective check, 1 s in the test)
    try:
        agree(pair, "bad input" if rank % 2 else None, "checking")
    except AgreedError as error:
        said(error, rank)
    try:
        if rank == 2:
            on_rank_0(pair, lambda: 0)
        elif rank == 3:
            agree(pair, None, "going on")
    except mpiscale.CollectiveMismatch as error:
        said(error, rank)
    if rank >= 2:  # the file calls' refusals of arrays that differ (float32 on rank 3)
        rows = np.zeros((2, 3), np.float32 if rank == 3 else np.float64)
        try:
            write_dataset(Path(sys.argv[2]) / "rows.h5", {"X": rows}, pair)
        except ValueError as error:
            said(error, rank)
        with Checkpointer(Path(sys.argv[2]) / "checkpoints", pair) as checkpoints:
            try:
                checkpoints.save(1, sharded={"x": rows})
            except ValueError as error:
                said(error, rank)
