"""Awaitable collectives, checked against numpy, while actors keep exchanging messages."""

import asyncio
import itertools
import os

import numpy as np

import mpiscale
from mpiscale import CollectiveMismatch


class Counter(mpiscale.Actor):
    def __init__(self):
        self.count = 0

    def hit(self, payload):
        self.count += 1

    def total(self) -> int:
        return self.count


async def chatter(system, counters, stop: asyncio.Event) -> int:
    """Tell other ranks' counters continuously until told to stop."""
    sent = 0
    while not stop.is_set():
        for ref in counters:
            if ref.rank != system.rank:
                ref.tell("hit", np.full(100, sent))
                sent += 1
        await asyncio.sleep(0)
    return sent


async def main(system):
    rank, size = system.rank, system.size
    counters = await system.spawn_group(Counter, name="counter")
    stop = asyncio.Event()
    chat = asyncio.create_task(chatter(system, counters, stop))
    world = system.world
    rng = np.random.default_rng(1234)
    everyone = [rng.random((5, 3)) for _ in range(size)]  # the same on every rank
    mine = everyone[rank]

    for _ in range(5):
        total = await world.allreduce(mine)
        assert np.allclose(total, sum(everyone))
        assert np.allclose(await world.allreduce(mine, op="max"), np.max(everyone, axis=0))
        assert np.allclose(await world.allreduce(mine, op="min"), np.min(everyone, axis=0))
        inplace = mine.copy()
        assert await world.allreduce(inplace, out=inplace) is inplace
        assert np.allclose(inplace, sum(everyone))
        assert np.array_equal(await world.allgather(mine), np.stack(everyone))
        scalar = await world.allreduce(np.array(float(rank)))  # a 0-d array keeps its shape
        assert scalar.shape == () and float(scalar) == sum(range(size)), scalar
        assert np.array_equal(await world.allgather(mine.astype(">f8")), np.stack(everyone))  # by value, any order
        gathered = await world.gather(mine, root=size - 1)
        assert (gathered is None) == (rank != size - 1)
        if gathered is not None:
            assert np.array_equal(gathered, np.stack(everyone))
        reduced = await world.reduce(mine, root=0)
        assert (reduced is None) == (rank != 0)
        if reduced is not None:
            assert np.allclose(reduced, sum(everyone))
        rows = np.arange(size * 2 + 1, dtype=np.float64)[:, None] * np.ones(3) * (rank + 1)
        block = await world.reduce_scatter(rows)
        expected = np.array_split(np.arange(size * 2 + 1.0)[:, None] * np.ones(3) * sum(range(1, size + 1)), size)
        assert np.allclose(block, expected[rank])
        message = {"step": 3, "weights": np.arange(6.0).reshape(2, 3), "big": np.ones(50_000)}
        got = await world.bcast(message if rank == 1 else None, root=1)
        assert got["step"] == 3 and np.array_equal(got["weights"], message["weights"]) and got["big"].sum() == 50_000
        buffer = np.arange(4.0) if rank == 0 else np.zeros(4)
        await world.bcast_array(buffer)
        assert np.array_equal(buffer, np.arange(4.0))
        await world.barrier()

    # float16, which this MPI has no type for (each of these calls ended in MPI_ERR_TYPE): moved as its 16-bit words,
    # reduced in float32 and rounded once, as the hierarchical allreduce reduces it (these sums are exact in float32)
    halves = [(values * 10).astype(np.float16) for values in everyone]
    exact = sum(half.astype(np.float32) for half in halves).astype(np.float16)
    assert (await world.allreduce(halves[rank])).tobytes() == exact.tobytes()
    in_place = halves[rank].copy()
    assert await world.allreduce(in_place, out=in_place) is in_place and in_place.tobytes() == exact.tobytes()
    on_root = await world.reduce(halves[rank], root=size - 1)
    assert (on_root is None) == (rank != size - 1) and (on_root is None or on_root.tobytes() == exact.tobytes())
    assert (await world.reduce_scatter(halves[rank])).tobytes() == np.array_split(exact, size)[rank].tobytes()
    assert np.array_equal(await world.allgather(halves[rank]), np.stack(halves))
    gathered = await world.gather(halves[rank])
    assert (gathered is None) == (rank != 0) and (gathered is None or np.array_equal(gathered, np.stack(halves)))
    copy = halves[rank].copy()
    assert np.array_equal(await world.bcast_array(copy, root=size - 1), halves[size - 1])
    rows, counts = await world.alltoallv(np.repeat(halves[rank][:1], size, axis=0), np.ones(size, np.int64))
    assert np.array_equal(rows, np.stack([half[0] for half in halves])) and (counts == 1).all()

    # Arrays mpi4py cannot type (strings, bytes, records, dates: it raised KeyError or BufferError) move as their
    # bytes; reductions of them, and of booleans (MPI adds none: MPI_ERR_OP), are refused before any MPI call.
    labels = np.array([f"rank {r}" for r in range(size)])  # a unicode array, as a user's file of names gives
    assert np.array_equal(await world.allgather(labels[rank : rank + 1]), labels[:, None])
    stamps = np.array(["2026-12-04T12:00"], "datetime64[s]") + np.arange(size)
    gathered_stamps = await world.gather(stamps[rank, ...], root=size - 1)  # a 0-d array
    assert gathered_stamps is None or np.array_equal(gathered_stamps, stamps)
    records = np.zeros(3, [("id", "i4"), ("name", "S6"), ("score", "f8")])
    if rank == 0:
        records[:] = [(1, b"first", 0.5), (2, b"second", 1.5), (3, b"third", 2.5)]
    await world.bcast_array(records)
    assert records["name"].tolist() == [b"first", b"second", b"third"] and records["score"].sum() == 4.5
    words, came = await world.alltoallv(np.array([f"to {r} from {rank}" for r in range(size)]), np.ones(size, int))
    assert words.tolist() == [f"to {rank} from {r}" for r in range(size)] and (came == 1).all()
    mask = np.arange(6) % (rank + 2) == 0
    for reduce in (world.allreduce, system.hierarchy.allreduce, world.reduce, world.reduce_scatter):
        for values in (mask, labels):
            try:
                await reduce(values)
            except TypeError as error:
                assert f"reduces numbers, not {values.dtype} arrays" in str(error), error
                assert ("'max' for any" in str(error)) == (values.dtype == bool), error
            else:
                raise AssertionError(f"{reduce} took {values.dtype}")
    # An array in the other byte order, as a file of another machine gives it, broadcast into itself (mpi4py refused
    # it, BufferError, after the check): its bytes move, and its dtype stays.
    foreign = (np.arange(5.0) * (rank + 1)).astype(">f8")
    assert await world.bcast_array(foreign, root=size - 1) is foreign and foreign.dtype == np.dtype(">f8")
    assert np.array_equal(foreign, np.arange(5.0) * size)

    # A root that is no rank (MPI_ERR_ROOT after the check, or a negative one indexing the ranks from the end) and
    # counts that are no row counts (MPI_ERR_COUNT on one rank, a numpy error on another) are refused before any MPI
    # call, every rank alike; the next call is whole.
    for root in (size, -1, 1.0):
        for call, value in ((world.reduce, np.ones(2)), (world.gather, np.ones(2)), (world.bcast_array, np.ones(2)),
                            (world.bcast, "x")):  # fmt: skip
            try:
                await call(value, root=root)
            except ValueError as error:
                assert f"root must be a rank of world, 0 to {size - 1}, got {root!r}" in str(error), error
            else:
                raise AssertionError(f"{call} took root {root!r}")
    for counts in ([size + 1, *[-1] * (size - 1)], [size / 2] * 2 + [0] * (size - 2)):
        try:
            await world.alltoallv(np.ones((size, 3)), np.array(counts))
        except ValueError as error:
            assert f"{size} counts, whole numbers from 0, summing to the {size} rows are needed" in str(error), error
        else:
            raise AssertionError(f"counts {counts} taken")
    assert (await world.reduce(np.ones(2), root=size - 1) is None) == (rank != size - 1)

    # min and max of complex numbers (MPI_ERR_OP after the check), and a reduction of no known name (refused after the
    # check by the world's), are refused before any MPI call.
    for reduce in (world.allreduce, system.hierarchy.allreduce, world.reduce, world.reduce_scatter):
        for op in ("min", "max", "mean"):
            try:
                await reduce(np.ones((size, 2), np.complex128 if op != "mean" else np.float64), op=op)
            except (TypeError, ValueError) as error:
                expected = "unknown reduction 'mean'" if op == "mean" else f"{op} of complex128 has no meaning"
                assert expected in str(error), error
            else:
                raise AssertionError(f"{reduce} took op {op}")
    anyone = np.max([np.arange(6) % (r + 2) == 0 for r in range(size)], axis=0)
    assert (await system.hierarchy.allreduce(mask.astype(np.uint8), op="max") == anyone).all()

    # Node-local and leader communicators, and the two-level allreduce.
    h = system.hierarchy
    per_node = int(os.environ.get("MPISCALE_RANKS_PER_NODE", "0"))
    if per_node:
        assert h.node_count == -(-size // per_node), h.node_count
        assert h.node.size == min(per_node, size - h.node_index * per_node)
        assert h.node_index == rank // per_node
    assert (h.leaders is not None) == (h.node.rank == 0)
    two_level = await h.allreduce(mine)
    assert np.allclose(two_level, sum(everyone))
    ints = np.arange(7, dtype=np.int64) * (rank + 1)
    assert np.array_equal(await h.allreduce(ints), np.arange(7) * sum(range(1, size + 1)))

    # Ranks that pass different shapes get the same clear error, not a hang.
    try:
        await world.allreduce(np.ones(3 if rank == 0 else 4))
    except CollectiveMismatch as error:
        assert "the ranks called different collectives, or passed different arguments" in str(error), error
        assert "rank 0: allreduce(float64(3,) sum)" in str(error), error
    else:
        raise AssertionError("mismatch not detected")
    # Every kind of mismatch (shapes, sizes past 512 KiB where two ranks swap halves, dtypes, a barrier against an
    # allreduce) leaves nothing of the mismatched calls behind: the next calls, small and large, are exact.
    pairs = [(np.ones(3), np.ones(4)), (np.ones(1 << 17), np.ones(3 << 16)), (np.ones(5), np.ones(5, np.float16))]
    cases = [*itertools.product((world.allreduce, h.allreduce), pairs), (world.allreduce, (np.ones(1 << 17), None))]
    for reduce, calls in cases:
        call = calls[rank % 2]
        try:
            await (world.barrier() if call is None else reduce(call))
        except CollectiveMismatch as error:
            assert "different arguments" in str(error), error
        else:
            raise AssertionError(f"mismatch of {calls} by {reduce} not detected")
        for length in (4, 1 << 17):
            assert (await reduce(np.full(length, rank + 1.0)) == sum(range(1, size + 1))).all()

    # An out that cannot hold the result is refused with one message before any MPI call (MPI's own refusal would come
    # after the check, with the other ranks already in the reduction). The next call is whole.
    for reduce in (world.allreduce, h.allreduce):
        try:
            await reduce(np.ones(4), out=np.empty(3))
        except ValueError as error:
            assert "out holds 3 elements, the array 4" in str(error), error
        else:
            raise AssertionError(f"{reduce} took an out of the wrong size")
    try:  # (the root refused it after the check, the other ranks' part of the reduction already sent)
        await world.reduce(np.ones(4), out=np.empty(4, np.float32))
    except ValueError as error:
        assert "reduce: out must be a C-contiguous float64 array, got float32" in str(error), error
    else:
        raise AssertionError("reduce took an out of another dtype")
    assert (await h.allreduce(np.ones(4), out=np.empty(4)) == size).all()

    # An out that overlaps the array without being it (two views of one buffer) gets the right result: MPI read the
    # array as it wrote the out, and the world's and the root's results came out wrong on 4 ranks, the hierarchical
    # one's past 1 MiB.
    for length in (8, 1 << 14, 1 << 18):
        for shift in (length // 2, -(length // 2)):
            for reduce in (world.allreduce, h.allreduce, world.reduce):
                buffer = np.arange(2 * length, dtype=np.float64) + rank
                data = buffer[max(0, -shift) : max(0, -shift) + length]
                out = buffer[max(0, shift) : max(0, shift) + length]
                expected = sum(data - rank + r for r in range(size))
                if await reduce(data, out=out) is not None:
                    assert np.array_equal(out, expected), (reduce, length, shift)

    # min and max keep a NaN, as numpy's do, whatever the rank count and size: MPI's own kept or dropped it by the
    # order the values met in (4 ranks: none of the NaNs at 4 elements, a quarter of them at 32 KiB).
    for length in (4, 1 << 12, 1 << 18):
        for op, ufunc in (("min", np.minimum), ("max", np.maximum)):
            values = [np.arange(length, dtype=np.float64) * (r - 1.5) for r in range(size)]
            values[1][::2] = np.nan
            expected = ufunc.reduce(np.stack(values))
            for reduce in (world.allreduce, h.allreduce, world.reduce, world.reduce_scatter):
                got = await reduce(values[rank], op=op)
                if reduce == world.reduce_scatter:
                    expected_part = np.array_split(expected, size)[rank]
                else:
                    expected_part = None if got is None else expected
                assert got is None or np.array_equal(got, expected_part, equal_nan=True), (reduce, op, length)
            halves = values[rank].astype(np.float16)  # reduced in float32
            assert np.array_equal(await world.allreduce(halves, op=op), expected.astype(np.float16), equal_nan=True)

    # The hierarchical allreduce fills an out of another dtype, as numpy's same_kind rule lets a ufunc: a float32 out
    # of a float64 sum, not an int32 one. That int32 out took the sum cut to whole numbers without a word on the
    # loop's paths, and the reducer's thread refused it after the reduction (4 ranks, 2 MiB).
    for length in (4, 1 << 18):
        halves = np.full(length, 0.75 * (rank + 1))
        narrower = np.zeros(length, np.float32)
        assert await h.allreduce(halves, out=narrower) is narrower and (narrower == 0.375 * size * (size + 1)).all()
        try:
            await h.allreduce(halves, out=np.zeros(length, np.int32))
        except TypeError as error:
            assert "out of int32 cannot take a result of float64 (numpy's same_kind rule)" in str(error), error
        else:
            raise AssertionError("an int32 out took a float64 sum")

    # A read-only out is refused the same way; mpi4py refused it only as it posted the call, after the check. And
    # bcast_array into a read-only array off the root: refused there before any MPI call, the root waiting in the
    # call's check, so a retry gets the root's values. Before, the root's message stayed unmatched and the next
    # collective of those ranks read it (MPI_ERR_TRUNCATE, or a wrong answer where the sizes agreed).
    frozen = np.ones(4)
    frozen.flags.writeable = False
    for reduce in (world.allreduce, world.reduce, h.allreduce, h.start_allreduce):
        try:
            called = reduce(np.ones(4), out=frozen)
            await (asyncio.wrap_future(called) if reduce == h.start_allreduce else called)
        except ValueError as error:
            assert "out is read-only, so it cannot take the result" in str(error), error
        else:
            raise AssertionError(f"{reduce} took a read-only out")
    values = np.full(6, rank + 1.0)
    values.flags.writeable = rank == 0  # the root's array is only read: read-only is fine there
    if rank != 0:
        try:
            await world.bcast_array(values, root=0)
        except TypeError as error:
            assert f"bcast_array: rank {rank} receives into its array, which is read-only" in str(error), error
        else:
            raise AssertionError("bcast_array received into a read-only array")
        values = np.zeros(6)
    assert (await world.bcast_array(values, root=0) == 1.0).all()
    assert (await world.allreduce(np.ones(3)) == size).all() and (await h.allreduce(np.ones(3)) == size).all()

    stop.set()
    sent = await chat
    sent_total = await world.allreduce(np.array([sent], dtype=np.int64))
    await world.barrier()
    while True:  # every tell sent during the collectives arrives
        received = await world.allreduce(np.array([await counters[rank].ask("total")], dtype=np.int64))
        if received[0] == sent_total[0]:
            break
        await asyncio.sleep(0.01)
    if rank == 0:
        print(f"collectives ok on {size} ranks, {h.node_count} nodes, {int(sent_total[0])} tells meanwhile")


mpiscale.run(main)
