"""Queries of a running store: rank 0's client reads single records while every rank iterates.

The answers must match the store at the end (a collective lookup, and the
top-k of the last iteration), and rank 0 prints the median latency of a
single-record get from another rank's partition, during the iterations and
after them (the other ranks then wait in a barrier, serving queries).
"""

import asyncio
import statistics
import time

import numpy as np

import mpiscale
from mpiscale.kernels.memstore import owners
from mpiscale.memstore import MemoryStore, StoreClient, serve_queries

RECORDS, ITERATIONS, K = 4000, 30, 10


async def main(system) -> None:
    store = MemoryStore(system)
    rng = np.random.default_rng(system.rank)
    ids = np.arange(system.rank, RECORDS, system.size, dtype=np.int64) * 31 + 5
    await store.upsert(ids, {"strength": rng.random(len(ids)), "quality": rng.random(len(ids))})
    group = await serve_queries(store)
    client = StoreClient(store, group)
    every_id = np.arange(RECORDS, dtype=np.int64) * 31 + 5
    remote = every_id[owners(every_id, system.size) != 0] if system.size > 1 else every_id
    latencies: list[float] = []

    async def reader(latencies: list[float]) -> None:
        pick = np.random.default_rng(9)
        for _ in range(300):
            probe = pick.choice(remote, 1)
            start = time.perf_counter()
            found, values = await client.get(probe)
            latencies.append(time.perf_counter() - start)
            assert found.all() and 0 <= values[0, 0] <= 1
            await asyncio.sleep(0)

    task = asyncio.create_task(reader(latencies)) if system.rank == 0 else None
    result = None
    for iteration in range(ITERATIONS):
        picked = rng.choice(ids, 20)
        await store.reinforce(picked, rng.normal(0, 0.1, 20).astype(np.float32), iteration)
        result = await store.iterate(0.001, k=K)
    if task is not None:
        await task
    await system.world.barrier()  # every rank's iterations are over: answers now are final
    probe = np.concatenate([every_id[::13], [1, 2]]) if system.rank == 0 else np.empty(0, np.int64)
    found, values = await store.lookup(probe)
    if system.rank == 0:
        got_found, got_values = await client.get(probe)
        assert np.array_equal(found, got_found) and np.array_equal(values[found], got_values[found])
        quality, top_ids = await client.top(K)
        assert np.array_equal(top_ids, result.top_ids) and np.array_equal(quality, result.top_quality)
        idle: list[float] = []
        await reader(idle)
        busy_us, idle_us = 1e6 * statistics.median(latencies), 1e6 * statistics.median(idle)
        print(
            f"memstore queries ok: {system.size} ranks, single remote get median {busy_us:.0f} us during "
            f"iterations, {idle_us:.0f} us between them"
        )
    await system.world.barrier()


mpiscale.run(main)
