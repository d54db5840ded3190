"""The Checkpointer from Python on a nearly full disk: step 1 fits, step 2 does not; every rank must refuse it.

usage: checkpoint_full.py SHARED_DIR [held]

``held``: rank 0 holds the room it sets aside for a second before it lets it go (a slow file system), and rank 1
looks at the free space 0.3 s late (a loaded node).
"""

import sys

import numpy as np
from mpi4py import MPI

from mpiscale.io import Checkpointer, CheckpointError

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
if sys.argv[2:] == ["held"]:  # rank 0 holds the room it sets aside; rank 1 looks at the free space meanwhile
    import time

    from mpiscale.io import space

    set_aside, look = space._refused, space.free_bytes

    def held(*args):
        refused = set_aside(*args)
        time.sleep(1.0)  # (the room still set aside: its file is closed after this returns)
        return refused

    def late(directory):
        time.sleep(0.3)
        return look(directory)

    if rank == 0:
        space._refused = held
    else:
        space.free_bytes = late
small = {"x": np.full((1000, 64), float(rank))}  # 0.5 MiB per rank
big = {"x": np.zeros((20000, 64))}  # 10 MiB per rank: cannot fit in 4 MiB
with Checkpointer(sys.argv[1], comm, background=True) as checkpoints:
    checkpoints.save(1, sharded=small)
    try:
        checkpoints.save(2, sharded=big)
        checkpoints.wait()
        raise SystemExit(f"rank {rank}: step 2 was saved on a disk that cannot hold it")
    except CheckpointError as error:
        print(f"rank {rank} refused: {error}", flush=True)
    restored = checkpoints.load()
    assert restored.step == 1 and (restored.sharded["x"] == rank).all(), restored.step
    comm.Barrier()
    if rank == 0:
        print("restored step 1 intact", flush=True)
