"""A quota that only one rank hits, inside the collective level-3 write: the job must end, not hang.

usage: checkpoint_quota.py SHARED_DIR VICTIM_RANK
Step 1 is saved normally. Then VICTIM_RANK may write files of at most 1 MiB
(RLIMIT_FSIZE: its writes fail with EFBIG, as on a full quota) and step 2 (10
MiB per rank) is saved: the other ranks wait in MPI-IO for a rank that left.
"""

import resource
import signal
import sys

import numpy as np
from mpi4py import MPI

from mpiscale.io import Checkpointer

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
with Checkpointer(sys.argv[1], comm, background=True, timeout_s=10) as checkpoints:
    checkpoints.save(1, sharded={"x": np.full((100, 8), float(rank))})
    checkpoints.wait()
    if rank == int(sys.argv[2]):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    checkpoints.save(2, sharded={"x": np.ones((20000, 64))})
    checkpoints.wait()
print(f"rank {rank}: step 2 was saved past the quota", flush=True)
