"""A program that refuses its job (status 2) while a thread it leaves running holds its files open: a writer kept for a
resumed run (a row written) and a data set the user wrote with h5py, both over the world's communicator. A daemon
thread's arguments outlive the interpreter's end, so nothing closes them before MPI is finalized.

Arguments: a directory (``in.h5`` in it, written by the test), and how it runs (``run``: under mpiscale.run;
``plain``: a plain mpi4py program)."""

import sys
import threading
import time
from pathlib import Path

import numpy as np

import mpiscale
from mpiscale.io import RowWriter, ShardedDataset

DIRECTORY, HOW = Path(sys.argv[1]), sys.argv[2]


def job(comm) -> None:
    """Open both, write this rank's row, keep the writer for a resumed run, hand both to a thread that never ends."""
    rank, size = comm.Get_rank(), comm.Get_size()
    data = ShardedDataset(DIRECTORY / "in.h5", "X", comm)
    writer = RowWriter(DIRECTORY / "out.h5", {"X": ((size, 2), np.float64)}, comm, resumable=True)
    writer.write(rank, {"X": data.read(rank, rank + 1)})
    writer.keep()
    threading.Thread(target=lambda *held: time.sleep(3600), args=(data, writer), daemon=True).start()
    print(f"rank {rank}: refused with a thread holding the files", flush=True)


async def main(system):
    job(system.world.comm)
    raise mpiscale.JobRefused("the job was refused", status=2)


if HOW == "run":
    mpiscale.run(main, name="held-at-end")
else:
    from mpi4py import MPI

    job(MPI.COMM_WORLD)
    sys.exit(2)
