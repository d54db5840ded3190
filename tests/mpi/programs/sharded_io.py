"""Sharded datasets and the batch reader across world sizes, uneven and empty slices.

Writes one file at this world size, two more as jobs of other sizes (split
sub-communicators), indexes them, and checks every read against the values the
rows were built from.
"""

import sys
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

import mpiscale
from mpiscale.io import BatchReader, ShardedDataset, epoch_order, read_dataset, write_dataset, write_index


def rows(ids: np.ndarray) -> dict[str, np.ndarray]:
    """The values of global rows ``ids``: every row is different and knows its id."""
    ids = np.asarray(ids, dtype=np.int64)
    x = (ids[:, None, None] * 10 + np.arange(6).reshape(3, 2)).astype(np.float32)
    return {"x": x, "y": ids * 7 % 5}


async def main(system):
    directory = Path(sys.argv[1])
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.rank, comm.size
    # Shard a: this world size, rank r holds r rows (rank 0 none).
    first = rank * (rank - 1) // 2
    shapes = write_dataset(directory / "a.h5", rows(np.arange(first, first + rank)), comm)
    total_a = size * (size - 1) // 2
    assert shapes["x"] == (total_a, 3, 2), shapes
    # Shards b and c: "earlier jobs" of 1 and size-1 ranks.
    alone = rank == 0
    part = comm.Split(0 if alone else 1, rank)
    if alone:
        write_dataset(directory / "b.h5", rows(np.arange(total_a, total_a + 5)), part)
    else:
        start = total_a + 5 + 2 * part.rank
        write_dataset(directory / "c.h5", rows(np.arange(start, start + 2)), part)
    comm.Barrier()
    total = total_a + 5 + 2 * (size - 1)
    if rank == 0:
        write_index(directory / "all.h5", [directory / name for name in ("a.h5", "b.h5", "c.h5")])
        with h5py.File(directory / "all.h5", "r") as plain:  # a notebook's view: one array
            assert np.array_equal(plain["x"][:], rows(np.arange(total))["x"])
    comm.Barrier()

    # Collective read of my block, from the index and from one file.
    mine = read_dataset(directory / "all.h5", "x", comm)
    everything = np.concatenate(comm.allgather(mine))
    assert np.array_equal(everything, rows(np.arange(total))["x"]), "collective read differs"
    assert len(read_dataset(directory / "a.h5", "y", comm)) == len(np.array_split(np.arange(total_a), size)[rank])

    # Batches: the global order depends only on (seed, epoch) and the window, never on the world size,
    # nor on whether the rows are kept in memory or streamed a window at a time.
    settings = [
        (True, 1, None, None),
        (False, 0, None, False),
        (True, 0, 8, False),
        (True, 2, 5, False),
        (True, 1, 8, True),
    ]
    for shuffle, prefetch, window, in_memory in settings:
        options = {"prefetch": prefetch, "shuffle_window": window, "in_memory": in_memory}
        with BatchReader(directory / "all.h5", ["x", "y"], 4, comm, shuffle, 11, **options) as reader:
            assert reader.in_memory == (in_memory is not False), "a small data set is kept in memory by default"
            for epoch in (0, 3):
                seen = [(b.step, b.ids, b.data) for b in reader.epoch(epoch)]
                assert [s for s, _, _ in seen] == list(range(reader.steps))
                for _, ids, data in seen:
                    for name, values in rows(ids).items():
                        assert np.array_equal(data[name], values), f"batch rows differ for {name}"
                gathered = comm.gather([ids for _, ids, _ in seen])
                if rank == 0:
                    order = epoch_order(total, epoch, 11, shuffle, window)
                    for step in range(reader.steps):
                        joined = np.concatenate([per_rank[step] for per_rank in gathered])
                        assert np.array_equal(joined, order[step * 4 : (step + 1) * 4]), (shuffle, epoch, step)
            resumed = [b.ids for b in reader.epoch(3, start_step=2)]
            assert all(np.array_equal(a, b) for a, b in zip(resumed, [ids for _, ids, _ in seen][2:]))
    assert not np.array_equal(epoch_order(total, 0, 11, True), epoch_order(total, 1, 11, True))

    # More ranks than samples: one row in all; most ranks get empty slices and batches.
    write_dataset(directory / "one.h5", rows(np.arange(1) if rank == size - 1 else np.arange(0)), comm)
    got = read_dataset(directory / "one.h5", "y", comm)
    assert len(got) == (1 if rank == 0 else 0), got
    with ShardedDataset(directory / "one.h5", "x", comm) as one:
        assert one.shape == (1, 3, 2) and len(one.read_collective(0, 0)) == 0
    with BatchReader(directory / "one.h5", ["y"], 3, comm, shuffle=True) as reader:
        batches = list(reader.epoch(0))
        assert len(batches) == 1 and len(batches[0].ids) == (1 if rank == 0 else 0)
    # Ranks that disagree on a dtype all get the same clear error, not a hang.
    try:
        write_dataset(directory / "bad.h5", {"x": np.zeros((1, 2), np.float32 if rank else np.float64)}, comm)
    except ValueError as error:
        assert "must agree" in str(error), error
    else:
        raise AssertionError("mismatched dtypes were accepted")
    # A single value on the last rank alone, and values HDF5 has no type for: every rank refuses, nothing is left.
    for name, values, said in [
        ("scalar.h5", np.float64(3.0) if rank == size - 1 else np.zeros(2), f"rank {size - 1} passes x as a single"),
        ("text.h5", np.array(["ab", "c"]), "x is <U2, which HDF5 cannot store; store bytes (.astype('S'))"),
        ("dates.h5", np.array(["2026-12-04"], "M8[D]"), "x is datetime64[D], which HDF5 cannot store"),
        ("objects.h5", np.array([1, "x"], object), "x is object, which HDF5 cannot store"),
    ]:
        try:
            write_dataset(directory / name, {"x": values}, comm)
        except (TypeError, ValueError) as error:  # (was h5py's TypeError, leaving NAME.tmp; a hang for the scalar)
            assert said in str(error), error
        else:
            raise AssertionError(f"{name}: {values!r} was written")
        comm.Barrier()
        assert not list(directory.glob(f"{name}*")), list(directory.glob(f"{name}*"))
    # A big-endian tool's HDF5 beside a little-endian .npy: one data set, read in this machine's order collectively
    # (HDF5 converts) and by byte range (swapped after the read); they were refused as of different dtypes.
    values = np.arange(24, dtype=np.float64).reshape(12, 2) / 7
    if rank == 0:
        with h5py.File(directory / "big.h5", "w") as plain:
            plain["v"] = values[:7].astype(">f8")
        np.save(directory / "little.npy", values[7:])
        (directory / "mixed.txt").write_text(f"{directory / 'big.h5'}\n{directory / 'little.npy'}\n")
    comm.Barrier()
    mixed = np.concatenate(comm.allgather(read_dataset(directory / "mixed.txt", "v", comm)))
    assert mixed.dtype.isnative and np.array_equal(mixed, values), mixed
    with BatchReader(directory / "mixed.txt", ["v"], 4, comm, True, 3, in_memory=False) as reader:
        for batch in reader.epoch(0):
            assert np.array_equal(batch.data["v"], values[batch.ids]), batch.ids
    if rank == 0:
        print(f"sharded io ok on {size} ranks")


mpiscale.run(main)
