"""Two ranks' allreduce by exchange (runtime/pair_reduce.py), on the world and the hierarchical paths: exactly
numpy's reduction of the pair in rank order, the same bits on both ranks, in place or not, whole buffers swapped
or halves, and a buffer the caller changes right after the call does not reach the other rank; a 0-d array, one
in the other byte order, an out overlapping the array. With "mixed", rank 1 runs the pure-Python reference and
rank 0 the compiled path: the two talk to each other."""

import hashlib
import os
import sys

import numpy as np

import mpiscale
from mpiscale.runtime import wire
from mpiscale.runtime.pair_reduce import HALVES_FROM_BYTES

#: Elements: empty, one, odd, just under and over the size from which halves are swapped (float64), and 3 MiB.
COUNTS = [0, 1, 1001, HALVES_FROM_BYTES // 8 - 1, HALVES_FROM_BYTES // 8 + 1, 3 << 17]
KINDS = {
    "sum": [np.float64, np.float32, np.int32, np.int64, np.uint8, np.complex128],
    "prod": [np.float64, np.int64, np.complex64],
    "min": [np.float32, np.int16],
    "max": [np.float64, np.uint64],
}
PAIR = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def contribution(rank: int, count: int, dtype: type) -> np.ndarray:
    """Values whose pairwise reduction rounds (floats), wraps (small integers) and holds signed zeros."""
    rng = np.random.default_rng([rank, count])
    values = rng.standard_normal(count) * 1e3
    if np.dtype(dtype).kind == "c":
        return (values + 1j * rng.standard_normal(count)).astype(dtype)
    if np.dtype(dtype).kind == "f":
        values[::7] = -0.0 if rank == 0 else 0.0  # min/max must pick the same zero on both ranks
        return values.astype(dtype)
    return values.astype(np.int64).astype(dtype)


async def same_bits_everywhere(system, result: np.ndarray, what: str) -> None:
    digest = np.frombuffer(hashlib.sha256(result.tobytes()).digest()[:8], np.int64)
    everyone = await system.world.allgather(digest)
    assert (everyone == everyone[0]).all(), f"the ranks' bits differ: {what}"


async def main(system) -> None:
    rank, world, hierarchy = system.rank, system.world, system.hierarchy
    assert system.size == 2, "a two-rank program"
    for op, dtypes in KINDS.items():
        for dtype in dtypes:
            for count in COUNTS:
                what = f"{op} of {count} {np.dtype(dtype)}"
                expected = PAIR[op](contribution(0, count, dtype), contribution(1, count, dtype))
                mine = contribution(rank, count, dtype)
                for name, reduce in [("world", world.allreduce), ("hierarchy", hierarchy.allreduce)]:
                    result = await reduce(mine, op=op)
                    assert result.tobytes() == expected.tobytes(), f"{name}: {what}"
                    await same_bits_everywhere(system, result, f"{name}: {what}")
                    inplace = mine.copy()
                    assert await reduce(inplace, op=op, out=inplace) is inplace
                    assert inplace.tobytes() == expected.tobytes(), f"{name} in place: {what}"
                    shaped = np.empty((1, count), dtype)  # another shape of the same size
                    assert await reduce(mine, op=op, out=shaped) is shaped
                    assert shaped.tobytes() == expected.tobytes(), f"{name} into out: {what}"
    # The reducer's thread runs the same exchange (a call started from a hook, or queued behind one).
    large = contribution(rank, 3 << 17, np.float64)
    started = hierarchy.start_allreduce(large)
    assert (await hierarchy.finish(started)).tobytes() == np.add(
        contribution(0, 3 << 17, np.float64), contribution(1, 3 << 17, np.float64)
    ).tobytes()
    # A 0-d array keeps its shape, a big-endian one is reduced by value, an out overlapping the array gets the sum.
    for name, reduce in [("world", world.allreduce), ("hierarchy", hierarchy.allreduce)]:
        scalar = await reduce(np.array(2.0 + rank))
        assert scalar.shape == () and float(scalar) == 5.0, f"{name}: {scalar!r}"
        swapped = await reduce(np.arange(5, dtype=">i8") * (rank + 1))
        assert swapped.tolist() == [0, 3, 6, 9, 12], f"{name}: {swapped!r}"
        buffer = np.arange(2001, dtype=np.float64)
        assert (await reduce(buffer[:2000], out=buffer[1:])).tolist() == [2.0 * v for v in range(2000)], name
    # One rank's worker and the other's event loop run the same call, whole buffers or halves: the same messages.
    for count in (1001, HALVES_FROM_BYTES // 8 + 1):
        values = contribution(rank, count, np.float64)
        started = hierarchy.start_allreduce(values) if rank == 0 else None
        result = await (hierarchy.finish(started) if started is not None else hierarchy.allreduce(values))
        expected = np.add(contribution(0, count, np.float64), contribution(1, count, np.float64))
        assert result.tobytes() == expected.tobytes(), count
    # A caller may change its buffer as soon as the call returns: it has left for the other rank by then.
    for reduce in (world.allreduce, hierarchy.allreduce):
        for count in (1000, 3 << 17):
            buffer = np.full(count, float(rank + 1))
            result = await reduce(buffer)
            buffer[:] = np.nan
            assert (result == 3.0).all()
    path = wire.chosen()[1].split()[0]
    paths = await world.allgather(np.frombuffer(path.ljust(12).encode(), np.uint8))
    if rank == 0:
        names = ",".join(bytes(row).decode().strip() for row in paths)
        print(f"pair allreduce ok: {sum(map(len, KINDS.values())) * len(COUNTS)} cases on two paths ({names})")


if "mixed" in sys.argv[1:]:  # read once the runtime starts
    os.environ[wire.PURE_ENV] = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
mpiscale.run(main)
