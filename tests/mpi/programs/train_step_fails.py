"""``mpiscale train`` (the command line's own main, on every rank) whose loss raises on rank 1 in its third step, as
a GPU out of memory on one rank does; the other ranks wait in that step's gradient allreduce.

``train_step_fails.py ARGS...``: ARGS as for ``mpiscale``.
"""

import sys

import torch
from mpi4py import MPI

from mpiscale.cli import main

cross_entropy = torch.nn.functional.cross_entropy
calls = 0


def failing_on_rank_1(*args, **kwargs):
    global calls
    calls += 1
    if MPI.COMM_WORLD.Get_rank() == 1 and calls == 3:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (planted on rank 1 in its third step)")
    return cross_entropy(*args, **kwargs)


torch.nn.functional.cross_entropy = failing_on_rank_1
sys.exit(main(sys.argv[1:]))
