"""Rounds of rows written and read collectively, ours against h5py's own collective transfer of the same rows.

Jobs that cannot hold their output (collect's activations, encode's codes,
circuits' features) write it round by round with ``RowWriter.write``, and read
their input with ``ShardedDataset.read_collective``; each call checks that every
rank came to the same one (``io.same_calls``). The floor, measured in the same
run on the same file layout, is what a user writes with h5py alone: a file
opened with the MPI driver and ``with dset.collective: dset[lo:hi] = rows``,
its collective read ``dset.read_direct(rows, np.s_[lo:hi])`` in the same
context (h5py's slicing reads independently even there, through its fast path)
and, beside them, h5py's slicing against ``ShardedDataset.read`` (independent
reads), every rank with rows in every round. Output whose size is known only as
it is made (encode's non-zeros) grows a chunked data set each round: ours
``RowWriter.grow`` then ``write``, h5py's ``dset.resize`` then the collective
write, with the same chunks, never filled first. The ways take turns, a batch of
rounds each, six times, each going first in every other turn (the disk writes
back the first one's pages while the second runs); a time is the median
batch's, per round, of the slowest rank. Writes go to the page cache: this
measures each round's cost, not the disk (``bench checkpoint`` and ``bench
reader`` measure that).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from ..io import RowWriter, ShardedDataset
from ..ranks import Comm
from ..runtime import ActorSystem, run
from .report import Progress, scratch_folder, table, write_json

ROW_FLOATS = 128  # rows of 1 KiB
SIZES_KIB = (4, 64, 1024, 16384)  # a rank's rows in a round
TURNS = 6  # batches of rounds each way, taking turns (an even number: each way goes first as often)
BATCH_BYTES = 64 << 20  # what a batch of rounds moves on each rank (at least MIN_ROUNDS rounds)
MIN_ROUNDS, MAX_ROUNDS = 4, 200
#: Each way, h5py's beside ours: collective writes, collective reads, independent reads, a growing data set's rounds.
WAYS = ("h5py write", "ours write", "h5py read", "ours read", "h5py slice", "ours independent", "h5py grow",
        "ours grow")  # fmt: skip
CHUNK_BYTES = 1 << 20  # a growing data set's chunks, as RowWriter makes them


def _rounds(size_kib: int, quick: bool) -> int:
    return int(np.clip((BATCH_BYTES >> (2 if quick else 0)) // (size_kib << 10), MIN_ROUNDS, MAX_ROUNDS))


def _per_round(comm: Comm, rounds: int, one_round: Callable[[int], object]) -> float:
    """Seconds a round, of the slowest rank, over ``rounds`` calls of ``one_round(index)``."""
    from mpi4py import MPI

    comm.Barrier()
    started = time.perf_counter()
    for index in range(rounds):
        one_round(index)
    return comm.allreduce((time.perf_counter() - started) / rounds, op=MPI.MAX)


def _measure(comm: Comm, folder: Path, size_kib: int, rounds: int) -> dict[str, float]:
    """Median seconds a round of each way (``WAYS``) at ``size_kib`` a rank."""
    import h5py

    size, rank = comm.Get_size(), comm.Get_rank()
    rows = (size_kib << 10) // (ROW_FLOATS * 8)
    block, out = np.full((rows, ROW_FLOATS), float(rank)), np.empty((rows, ROW_FLOATS))
    shape = (rows * size * rounds, ROW_FLOATS)

    def mine(index: int) -> slice:
        return slice((index * size + rank) * rows, (index * size + rank + 1) * rows)

    def h5py_write(dset: h5py.Dataset, index: int) -> None:
        with dset.collective:
            dset[mine(index)] = block

    def h5py_read_direct(dset: h5py.Dataset, index: int) -> None:
        with dset.collective:
            dset.read_direct(out, mine(index))

    def h5py_slice(dset: h5py.Dataset, index: int) -> np.ndarray:
        return dset[mine(index)]

    def h5py_grow(dset: h5py.Dataset, index: int) -> None:
        dset.resize((index + 1) * rows * size, axis=0)
        h5py_write(dset, index)

    def ours_grow(writer: RowWriter, index: int) -> None:
        writer.grow({"X": (index + 1) * rows * size})
        writer.write(mine(index).start, {"X": block})

    times: dict[str, list[float]] = {way: [] for way in WAYS}

    def timed(way: str, one_round: Callable[[int], object]) -> None:
        times[way].append(_per_round(comm, rounds, one_round))

    def write_h5py(path: Path) -> None:
        with h5py.File(path, "w", driver="mpio", comm=comm) as file:
            timed("h5py write", partial(h5py_write, file.create_dataset("X", shape, np.float64)))

    def write_ours(path: Path) -> None:
        with RowWriter(path, {"X": (shape, np.dtype(np.float64))}, comm) as writer:
            timed("ours write", lambda index: writer.write(mine(index).start, {"X": block}))

    def read_h5py(path: Path) -> None:
        with h5py.File(path, "r", driver="mpio", comm=comm) as file:
            timed("h5py read", partial(h5py_read_direct, file["X"]))
            timed("h5py slice", partial(h5py_slice, file["X"]))

    def grow_h5py(path: Path) -> None:
        with h5py.File(path, "w", driver="mpio", comm=comm) as file:
            chunks = (CHUNK_BYTES // (ROW_FLOATS * 8), ROW_FLOATS)
            dset = file.create_dataset(
                "X", (0, ROW_FLOATS), np.float64, maxshape=(None, ROW_FLOATS), chunks=chunks, fill_time="never"
            )  # (as ours: MPI-IO would fill each grown chunk first)
            timed("h5py grow", partial(h5py_grow, dset))

    def grow_ours(path: Path) -> None:
        with RowWriter(path, {"X": ((0, ROW_FLOATS), np.dtype(np.float64))}, comm, growing=("X",)) as writer:
            timed("ours grow", partial(ours_grow, writer))

    def read_ours(path: Path) -> None:
        with ShardedDataset(path, "X", comm) as data:
            timed("ours read", lambda index: data.read_collective(mine(index).start, mine(index).stop))
            timed("ours independent", lambda index: data.read(mine(index).start, mine(index).stop))

    for turn in range(TURNS):  # (each goes first in every other turn: the disk writes back the first one's pages)
        written = (folder / f"h5py-{turn}.h5", folder / f"ours-{turn}.h5")
        grown = (folder / f"h5py-grown-{turn}.h5", folder / f"ours-grown-{turn}.h5")  # (new files, as ours writes:
        passes = ((write_h5py, write_ours), written), ((read_h5py, read_ours), written), ((grow_h5py, grow_ours), grown)
        for ways, paths in passes:  # h5py's truncating its old file dropped that file's dirty pages, a head start)
            for way, path in list(zip(ways, paths))[:: 1 if turn % 2 == 0 else -1]:
                way(path)
        comm.Barrier()
        if rank == 0:
            for path in written + grown:
                path.unlink()
    return {way: statistics.median(each) for way, each in times.items()}


async def run_rounds(system: ActorSystem, json_path: str, scratch: str, quick: bool = False) -> dict | None:
    """Rank 0 prints the table and writes JSON; returns the record there."""
    comm = system.world.comm
    progress = Progress(system.rank == 0)
    measured = {}
    with scratch_folder(comm, scratch, "rounds") as folder:
        for size_kib in SIZES_KIB[:3] if quick else SIZES_KIB:
            rounds = _rounds(size_kib, quick)
            measured[size_kib] = _measure(comm, folder, size_kib, rounds)
            progress(f"{size_kib} KiB a rank: {TURNS} x {rounds} rounds each way")
    if system.rank != 0:
        return None
    rows = []
    for size_kib, way in measured.items():
        row: list[object] = [size_kib]
        for floor, ours in zip(WAYS[0::2], WAYS[1::2]):
            row += [way[floor] * 1e6, way[ours] * 1e6, way[ours] / way[floor]]
        rows.append(row)
    print(f"a round of rows of 1 KiB on {system.size} rank(s), each with rows in every round; µs a round, slowest "
          "rank; collective writes, collective reads, independent reads, a growing data set's rounds")  # fmt: skip
    print(table(["KiB a rank", *(name for pair in zip(WAYS[0::2], WAYS[1::2]) for name in (*pair, "ours/h5py"))],
                rows))  # fmt: skip
    results = {
        "baseline": "h5py, a file opened with driver='mpio': with dset.collective: dset[lo:hi] = rows, and "
        "dset.read_direct(rows, np.s_[lo:hi]); h5py's dset[lo:hi] for the independent reads; dset.resize then the "
        "collective write for a growing data set's rounds (the same chunks, fill_time='never')",
        "turns": TURNS,
        "seconds_per_round": {str(size): way for size, way in measured.items()},
        "ours_vs_h5py": {
            str(row[0]): {"write": row[3], "read": row[6], "independent": row[9], "grow": row[12]} for row in rows
        },  # fmt: skip
    }
    write_json(json_path, "rounds", system.size, results)
    return results


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench rounds``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run(lambda system: run_rounds(system, args.json, args.dir, quick=args.quick))
    return 0
