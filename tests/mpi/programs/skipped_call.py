"""A rank with no rows in a round skips that round's collective call, as a user writes it (``if len(mine):``), while
the other ranks make it: two calls of different rounds met, or a call met the close, and every rank waited for ever.
Arguments: a directory, the call (``write`` with a RowWriter, ``read`` from a ShardedDataset, ``ended``: rank 1
returns from its program after the first round, the writer left unclosed; ``unclosed``: every rank leaves its
writers unclosed), and how it runs (``run``: under
mpiscale.run; ``plain``: a plain mpi4py program). Five rows in rounds of four over two ranks: rank 1 has none in the
second round. ``fixed`` after them: every rank makes every call (one without rows with an empty range)."""

import sys
from pathlib import Path

import h5py
import numpy as np

import mpiscale
from mpiscale.io import RowWriter, ShardedDataset

DIRECTORY, CALL, HOW = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
FIXED = sys.argv[4:] == ["fixed"]
ROWS, ROUND = 5, 4


def rounds(rank: int, size: int):
    """This rank's rows of each round: (lo, hi), empty where it has none."""
    for first in range(0, ROWS, ROUND):
        count = min(ROUND, ROWS - first)
        share = -(-count // size)
        lo = min(first + rank * share, first + count)
        yield lo, min(lo + share, first + count)


def write(comm) -> None:
    rank = comm.Get_rank()
    with RowWriter(DIRECTORY / "out.h5", {"X": ((ROWS, 2), np.float64)}, comm) as writer:
        for lo, hi in rounds(rank, comm.Get_size()):
            mine = np.arange(2.0 * lo, 2.0 * hi).reshape(hi - lo, 2)
            if len(mine) or FIXED:
                writer.write(lo, {"X": mine})


def read(comm) -> None:
    rank = comm.Get_rank()
    with ShardedDataset(DIRECTORY / "in.h5", "X", comm) as data:
        for lo, hi in rounds(rank, comm.Get_size()):
            if hi > lo or FIXED:
                print(f"rank {rank} read {data.read_collective(lo, hi).sum():g}", flush=True)


def ended(comm) -> None:
    rank = comm.Get_rank()
    writer = RowWriter(DIRECTORY / "out.h5", {"X": ((ROWS, 2), np.float64)}, comm)
    for lo, hi in rounds(rank, comm.Get_size()):
        if hi == lo and not FIXED:
            return  # (the writer left as it is)
        writer.write(lo, {"X": np.zeros((hi - lo, 2))})
    writer.close()


def unclosed(comm) -> None:
    """Every rank leaves two writers unclosed, one over a communicator it freed before its end."""
    rank, size = comm.Get_rank(), comm.Get_size()
    part = comm.Split(0, rank)
    for path, over in ((DIRECTORY / "out.h5", comm), (DIRECTORY / "part.h5", part)):
        writer = RowWriter(path, {"X": ((2 * size, 2), np.float64)}, over)
        writer.write(2 * rank, {"X": np.full((2, 2), float(rank))})
    part.Free()


def job(comm) -> None:
    if CALL == "read" and comm.Get_rank() == 0:
        with h5py.File(DIRECTORY / "in.h5", "w") as file:  # (plain h5py, as a user writes one)
            file["X"] = np.arange(2.0 * ROWS).reshape(ROWS, 2)
    comm.Barrier()
    {"write": write, "read": read, "ended": ended, "unclosed": unclosed}[CALL](comm)
    print(f"rank {comm.Get_rank()} done", flush=True)


async def main(system):
    job(system.world.comm)


if HOW == "run":
    mpiscale.run(main, name="skipped-call")
else:
    from mpi4py import MPI

    job(MPI.COMM_WORLD)
