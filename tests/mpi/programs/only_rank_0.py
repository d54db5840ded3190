"""A collective file call that only rank 0 makes, given the world's communicator (the classic ``if rank == 0:``
slip), while rank 1 returns from main: rank 0 waited in the call's first collective for ever. Arguments: a
directory to write in, the call: ``RowWriter``, ``RowWriter.reopen``, ``write_dataset``, ``RaggedDataset``,
``on_rank_0``, ``agree``, ``Checkpointer``, ``Checkpointer.save`` or ``Checkpointer.load`` (the calls before it, where
there are, made by every rank), and ``plain`` after them for a plain mpi4py program (not under mpiscale.run), with
``-dup`` where it makes the call on a duplicate of the world's communicator, ``-first-half`` where the first half of
the ranks make it (a host's, with 2 ranks a host) while the others' programs end, and ``-again`` where every rank
makes the call once before (``plain-dup-again``)."""

import os
import sys
from pathlib import Path

import h5py
import numpy as np

import mpiscale
from mpiscale.io import Checkpointer, RaggedDataset, RowWriter, write_dataset
from mpiscale.ranks import agree, as_mpi, on_rank_0

DIRECTORY, CALL, PLAIN = Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
LAYOUT = {"X": ((4, 2), np.float64)}


def job(world, alone: bool) -> None:
    if CALL == "RowWriter" and alone:
        RowWriter(DIRECTORY / "rows.h5", LAYOUT, world)
    elif CALL == "RowWriter.reopen":
        RowWriter(DIRECTORY / "rows.h5", LAYOUT, world).close(DIRECTORY / "kept.h5")
        if alone:
            RowWriter.reopen(DIRECTORY / "rows.h5", DIRECTORY / "kept.h5", world)
    elif CALL == "write_dataset" and alone:
        write_dataset(DIRECTORY / "rows.h5", {"X": np.zeros((4, 2))}, world)
    elif CALL == "RaggedDataset" and alone:
        with h5py.File(DIRECTORY / "ragged.h5", "w") as file:  # (plain h5py: values and offsets, as users keep them)
            file["values"], file["offsets"] = np.arange(6.0), np.array([0, 2, 6])
        RaggedDataset(DIRECTORY / "ragged.h5", "values", "offsets", world)
    elif CALL == "on_rank_0" and alone:
        on_rank_0(as_mpi(world), os.getcwd)  # (small: rank 0's broadcast went out, to nobody)
    elif CALL == "agree" and alone:
        agree(as_mpi(world), None, "checking the inputs")  # (rank 0's allgather waited for ever)
    elif CALL == "Checkpointer" and alone:
        Checkpointer(DIRECTORY / "checkpoints", world)
    elif CALL.startswith("Checkpointer."):
        with Checkpointer(DIRECTORY / "checkpoints", world) as checkpoints:
            if CALL == "Checkpointer.load":
                checkpoints.save(1, sharded={"w": np.zeros(3)})
                checkpoints.wait()
            if alone:
                getattr(checkpoints, CALL.split(".")[1])(*([2] if CALL == "Checkpointer.save" else []))


async def main(system):
    job(system.world, system.rank == 0)


if PLAIN:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    calling = world.Get_rank() < world.Get_size() // 2 if "-first-half" in PLAIN else world.Get_rank() == 0
    comm = world.Dup() if "-dup" in PLAIN else world
    if "-again" in PLAIN:
        job(comm, True)  # (every rank: each knows the communicator at its end)
    job(comm, calling)
else:
    mpiscale.run(main, name="only-rank-0")
