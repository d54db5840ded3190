"""The hierarchical allreduce against numpy: any size, float64/32/16, several in flight, the same bits everywhere."""

import asyncio
import hashlib

import numpy as np

import mpiscale

SIZES = [0, 1, 5, 1000, (1 << 18) + 3]
DTYPES = [np.float64, np.float32, np.float16]


def contribution(rank: int, size: int, dtype) -> np.ndarray:
    return np.random.default_rng([rank, size]).standard_normal(size).astype(dtype)


async def main(system) -> None:
    rank, ranks, h = system.rank, system.size, system.hierarchy
    for dtype in DTYPES:
        # Several in flight at once, started in the same order on every rank.
        results = await asyncio.gather(*(h.allreduce(contribution(rank, n, dtype)) for n in SIZES))
        for n, result in zip(SIZES, results):
            expected = sum(contribution(r, n, dtype).astype(np.float64) for r in range(ranks))
            tolerance = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-2}[dtype]
            assert result.dtype == dtype and result.shape == (n,), (result.dtype, result.shape)
            assert np.allclose(result, expected, rtol=tolerance, atol=tolerance * ranks), (dtype, n)
            digest = np.frombuffer(hashlib.sha256(result.tobytes()).digest()[:8], np.int64)
            everyone = await system.world.allgather(digest)
            assert (everyone == everyone[0]).all(), f"ranks disagree on the bits of {dtype.__name__}[{n}]"
    # Big-endian arrays, as a file written on another machine holds them: reduced as the native ones, float16 summed
    # in float32 too (a big-endian float16 array once went to MPI as float16: MPI_ERR_TYPE ended the job)
    for dtype in (np.float16, np.float32):
        native = await h.allreduce(contribution(rank, 1000, dtype))
        foreign = await h.allreduce(contribution(rank, 1000, dtype).astype(np.dtype(dtype).newbyteorder(">")))
        assert foreign.dtype == dtype and foreign.tobytes() == native.tobytes(), dtype
    for shape in [(3, 4), (300, 40)]:  # under and over the 4 KiB from which the tests run the stages
        matrix = np.full(shape, float(rank + 1))
        assert await h.allreduce(matrix, out=matrix) is matrix and (matrix == ranks * (ranks + 1) / 2).all()
        row = np.arange(float(shape[0] * shape[1]))
        assert (await h.allreduce(row * rank, op="max") == row * (ranks - 1)).all()
    # ``out`` apart from the array, overlapping it, of another dtype: the sum lands in it each time (MPI's own call
    # reduces straight into an ``out`` apart, through a buffer of its own where they overlap or differ)
    values = np.arange(12.0) + rank
    total = sum(np.arange(12.0) + r for r in range(ranks))
    into = np.empty(12)
    assert await h.allreduce(values, out=into) is into and (into == total).all()
    assert (values == np.arange(12.0) + rank).all(), "the array changed"
    both = np.zeros(24)
    both[:12] = values
    overlapping = both[6:18]
    assert await h.allreduce(both[:12], out=overlapping) is overlapping and (overlapping == total).all()
    narrow = np.empty(12, np.float32)
    assert await h.allreduce(values, out=narrow) is narrow and (narrow == total.astype(np.float32)).all()
    # A small call runs on the event loop where the reducer's thread is idle, and queues behind the thread's calls
    # where it is not: rank 0 makes it with its 4 MiB call still in flight, the others after theirs ended. Every
    # rank's calls still meet in the same order.
    large = h.start_allreduce(np.full(1 << 19, float(rank)))
    if rank != 0:
        await h.finish(large)
    assert (await h.allreduce(np.full(10, rank + 1.0)) == ranks * (ranks + 1) / 2).all()
    assert (await h.finish(large) == ranks * (ranks - 1) / 2).all()
    try:  # shapes that differ by rank: refused on every rank alike, before any stage starts
        await h.allreduce(np.zeros(1000 + rank))
    except mpiscale.CollectiveMismatch as error:
        assert "the ranks passed different arguments (shape, dtype, op)" in str(error), error
    else:
        assert ranks == 1, "a mismatch went through"
    assert (await h.allreduce(np.ones(2000)) == ranks).all()  # and the next call is whole
    if rank == 0:
        print(f"hierarchical allreduce ok: {ranks} ranks, {h.node_count} nodes, blocks {h.reducer.blocks}")


mpiscale.run(main)
