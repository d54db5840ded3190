"""One rank's error inside ``with ShardedDataset(path, name, comm)`` while the other ranks go on to a collective
read: the block's close, collective with MPI-IO, waited for them forever with the error unsaid. Arguments: the
HDF5 file (a data set X of at least 8 rows), and optionally ``rank-0-alone``: only rank 0 opens it, passing the
world's communicator (the others return from main), which waited for them forever."""

import sys

import mpiscale
from mpiscale.io import ShardedDataset


async def main(system):
    if sys.argv[2:] == ["rank-0-alone"]:
        if system.rank == 0:
            with ShardedDataset(sys.argv[1], "X", system.world) as data:
                print(data.shape)
        return
    with ShardedDataset(sys.argv[1], "X", system.world) as data:
        if system.rank == 1:
            raise ValueError("a check of this rank's own failed (planted on rank 1)")
        data.read_collective(0, 8)


mpiscale.run(main, name="sharded-error")
