"""An ``mpiscale`` command (the command line's own main, on every rank) in which rank 1 raises at the Nth call of a
function, as a GPU out of memory on one rank does; the other ranks go on into the round's collective.

``one_rank_fails.py MODULE FUNCTION N ARGS...``: ``MODULE.FUNCTION`` raises on rank 1 at its Nth call; ARGS as for
``mpiscale``.
"""

import importlib
import sys

import torch
from mpi4py import MPI

from mpiscale.cli import main

module, name, nth = importlib.import_module(sys.argv[1]), sys.argv[2], int(sys.argv[3])
real = getattr(module, name)
calls = 0


def failing_on_rank_1(*args, **kwargs):
    global calls
    calls += 1
    if MPI.COMM_WORLD.Get_rank() == 1 and calls == nth:
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (planted on rank 1 in call {nth} of {name})")
    return real(*args, **kwargs)


setattr(module, name, failing_on_rank_1)
sys.exit(main(sys.argv[4:]))
