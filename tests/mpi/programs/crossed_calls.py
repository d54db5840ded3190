"""Ranks that come to different collective calls on one communicator, as a branch on the rank makes them: the first half
of the ranks makes the first call of a pair, the others the second. Arguments: a directory, the pair, and how it runs
(``run``: under mpiscale.run; ``plain``: a plain mpi4py program). Pairs: ``writer/dataset`` (a RowWriter made against
a ShardedDataset opened: their entries met and let each other past, and the ranks waited in the two opens'
collectives for ever), ``writer/other_writer`` (two files: the two creates waited for ever), ``agree/on_rank_0``,
``allreduce/writer`` (an awaited allreduce against a RowWriter made, under mpiscale.run: MPI_ERR_TRUNCATE),
``unclosed/writer`` (the ranks of the second half write a round in a writer, then return from their program with it
unclosed, while the first half write the same round and make a second writer: the close at the program's end met the
second writer's entry, MPI_ERR_TRUNCATE in a plain program)."""

import os
import sys
from pathlib import Path

import h5py
import numpy as np

import mpiscale
from mpiscale.io import RowWriter, ShardedDataset
from mpiscale.ranks import agree, on_rank_0

DIRECTORY, PAIR, HOW = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
LAYOUT = {"X": ((8, 2), np.float64)}


def made(comm, call: str) -> None:
    """This rank's call of the pair."""
    if call == "writer":
        RowWriter(DIRECTORY / "b.h5", LAYOUT, comm)
    elif call == "other_writer":
        RowWriter(DIRECTORY / "d.h5", LAYOUT, comm)  # (another file)
    elif call == "dataset":
        with ShardedDataset(DIRECTORY / "c.h5", "X", comm) as data:
            data.read_collective(0, 1)
    elif call == "agree":
        agree(comm, None, "checking the inputs")
    elif call == "on_rank_0":
        on_rank_0(comm, os.getcwd)


def unclosed(comm, second_half: bool) -> None:
    """Every rank writes a round of the first writer; the second half returns, the first makes another writer."""
    writer = RowWriter(DIRECTORY / "a.h5", LAYOUT, comm)
    writer.write(2 * comm.Get_rank(), {"X": np.ones((2, 2))})
    if second_half:
        return  # (the writer left unclosed: closed at the program's end)
    RowWriter(DIRECTORY / "b.h5", LAYOUT, comm)  # (a second writer)


def job(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        with h5py.File(DIRECTORY / "c.h5", "w") as file:  # (plain h5py, as a user writes one)
            file["X"] = np.arange(8.0).reshape(4, 2)
    comm.Barrier()
    first, second = PAIR.split("/")
    if first == "unclosed":
        unclosed(comm, rank >= size // 2)
    else:
        made(comm, first if rank < size // 2 else second)
    print(f"rank {rank} done", flush=True)


async def main(system):
    if PAIR == "allreduce/writer" and system.rank < system.size // 2:
        await system.world.allreduce(np.ones(4))
    elif PAIR == "allreduce/writer":
        made(system.world.comm, "writer")
    else:
        job(system.world.comm)


if HOW == "run":
    mpiscale.run(main, name="crossed-calls")
else:
    from mpi4py import MPI

    job(MPI.COMM_WORLD)
