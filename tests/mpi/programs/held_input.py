"""A user's program opens a data set's file for writing (plain h5py, another process) while the job's ranks read it
through MPI-IO, then again once they have closed it. Argument: the file (a data set ``X``, written by the test)."""

import subprocess
import sys

from mpi4py import MPI

from mpiscale.io import ShardedDataset

PATH = sys.argv[1]
WRITER = "import h5py, sys; h5py.File(sys.argv[1], 'a')['Y'] = [1.0]"


def users_write(when: str) -> None:
    """Rank 0 runs the user's writer and says how it went."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        done = subprocess.run([sys.executable, "-c", WRITER, PATH], capture_output=True, text=True, timeout=60)
        refused = "unable to lock file" in done.stderr
        print(f"{when}: the write {'was refused (locked)' if refused else f'ended {done.returncode}'}", flush=True)
    MPI.COMM_WORLD.Barrier()


comm = MPI.COMM_WORLD
with ShardedDataset(PATH, "X", comm) as data:
    rows = data.read_collective(comm.Get_rank(), comm.Get_rank() + 1)
    users_write("while read")
print(f"rank {comm.Get_rank()} read {rows.sum():g}", flush=True)
users_write("once closed")
