"""The first node's ranks held in a parallel HDF5 open that waits for the other node's ranks (h5py keeps the GIL
there, as in a background checkpoint's open), the other node's ranks elsewhere: tests/integration/test_cluster.py
kills the other node meanwhile. Argument: where the HDF5 file would go."""

import asyncio
import sys

import h5py
from mpi4py import MPI

import mpiscale


async def main(system):
    comm = MPI.COMM_WORLD.Dup()  # the file's communicator: every rank of the job
    if system.host == system.hosts[0]:
        print(f"rank {system.rank} holds", flush=True)
        await asyncio.to_thread(h5py.File, sys.argv[1], "w", driver="mpio", comm=comm)  # never returns
    else:
        await asyncio.sleep(120)


mpiscale.run(main, name="held")
