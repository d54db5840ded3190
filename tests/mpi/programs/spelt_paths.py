"""One file named two ways: rank 0 gives a path relative to the working directory, the others the same file through
a symbolic link to its directory (as a site's ``$SCRATCH`` link may be). Each rank writes its two rows with a
RowWriter, then reads every row back collectively from a ShardedDataset. Arguments: the directory, and the link to
it to make. Every call on either object was taken for a different call (a CollectiveMismatch at the first write)."""

import os
import sys

import numpy as np
from mpi4py import MPI

import mpiscale  # noqa: F401  (a rank's uncaught error ends the job)
from mpiscale.io import RowWriter, ShardedDataset

comm = MPI.COMM_WORLD
directory, link = sys.argv[1], sys.argv[2]
if comm.rank == 0:
    os.symlink(directory, link)
comm.Barrier()
os.chdir(directory)
path = "rows.h5" if comm.rank == 0 else os.path.join(link, "rows.h5")
with RowWriter(path, {"X": ((2 * comm.size, 2), np.float64)}, comm) as writer:
    writer.write(2 * comm.rank, {"X": np.full((2, 2), float(comm.rank))})
with ShardedDataset(path, "X", comm) as data:
    every = data.read_collective(0, 2 * comm.size)
print(f"rank {comm.rank} read {every.sum():g} as {path}", flush=True)
