"""A RowWriter from Python growing a data set past a small disk, round after round, until a write fails.

usage: rows_full.py OUT.h5 [LIMIT]

Every rank grows the data set by 256 rows of 8 KiB and writes its half of them; the job must end in one line
naming the full disk, its temporary file removed (it crashed in HDF5's close of the file, SIGSEGV, leaving it).
With LIMIT, the ranks may write files of at most LIMIT bytes (``ulimit -f``, set once MPI has started), as a site's
limit or a per-file quota stops them on a disk with room.
"""

import resource
import sys

import numpy as np
from mpi4py import MPI

from mpiscale.io import RowWriter

comm = MPI.COMM_WORLD
if len(sys.argv) > 2:
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
half = 256 // comm.Get_size()
writer = RowWriter(sys.argv[1], {"x": ((0, 1024), np.float64)}, comm, growing=("x",))
for step in range(1, 1000):
    writer.grow({"x": step * 256})
    writer.write((step - 1) * 256 + comm.Get_rank() * half, {"x": np.ones((half, 1024))})
raise SystemExit(f"rank {comm.Get_rank()}: 500 MiB written on a disk of a few")
