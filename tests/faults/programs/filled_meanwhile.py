"""A RowWriter's file of 2 MiB, made on a small disk that another job (here rank 0, as another process would) then
fills, before the rows are written: the rows must all be written and the file put in place, the other job's write
meeting the full disk. Before, the file's room was only asked as it was made and given back at once: the rows'
write met the full disk, and the job ended there. With ``growing``, the data set is made empty and grown to its
rows before the disk fills (its room, before, was never set aside).

usage: filled_meanwhile.py OUT.h5 FILLER [growing]
"""

import sys

import numpy as np
from mpi4py import MPI

from mpiscale.io import RowWriter, read_dataset

comm = MPI.COMM_WORLD
rank, half = comm.Get_rank(), 256 // comm.Get_size()
out, filler = sys.argv[1], sys.argv[2]
if sys.argv[3:] == ["growing"]:
    writer = RowWriter(out, {"x": ((0, 1024), np.float64)}, comm, growing=("x",))
    writer.grow({"x": 256})
else:
    writer = RowWriter(out, {"x": ((256, 1024), np.float64)}, comm)
comm.Barrier()
if rank == 0:
    with open(filler, "wb", buffering=0) as other:  # (unbuffered: nothing left for the close to write)
        try:
            for _ in range(1024):  # at most 64 MiB, in pieces of 64 KiB
                other.write(b"\1" * (1 << 16))
            print("the other job wrote 64 MiB: no quota stopped it")
        except OSError as error:
            print(f"the other job's write: {error}")
comm.Barrier()
writer.write(rank * half, {"x": np.full((half, 1024), rank, np.float64)})
writer.close()
if rank == 0:
    rows = read_dataset(out, "x")
    assert (rows == np.repeat(np.arange(comm.Get_size()), half)[:, None]).all()
    print("the rows are written and the file in place")
