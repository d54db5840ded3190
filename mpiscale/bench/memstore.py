"""The memory store: decay bandwidth against numpy and a memory copy, and full iterations by phase.

1. On each rank's share of 10M records (1M with --quick): the decay kernel,
   the same update in plain numpy, and a copy of the same bytes (a Numba copy
   with as many threads, the machine's limit, and ``np.copyto``), as GB/s of
   bytes read and written, caches cold, same run.
2. Full iterations (decay + 1% of the records reinforced + aggregate + top-100)
   at 1M and 10M records over the job's ranks, on the CPU and, when there is a
   GPU, on the GPU too: median ms per iteration and the
   split by phase, against one process doing the same iteration in plain numpy
   (``np.add.at``, ``np.histogram``-style binning, ``argpartition``), and the
   design target of the memory store: 1.17 ms per iteration for 1M records on one CPU process.
3. Memory per record and bytes each rank sends per iteration.
   A single-record get from another rank's partition by a client on rank 0,
   idle (against a bare 8-byte ask in the same run) and while the store
   iterates (against the iteration's time: a get waits for at most one pass).
4. Durability at 1M records (100k with --quick): iterations with a commit
   (logged on this node and, with simulated nodes, the partner's) against the
   same iterations without, the commit against a plain write + fsync of the
   same bytes (the disk's limit), and the time ``recover`` takes to rebuild the
   store from the checkpoint and the logs, in a scratch directory beside the
   results.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from numba import njit, prange

from ..kernels.devices import cuda_usable
from ..kernels.memstore import decay, owners
from ..kernels.threads import share_cores
from ..memstore import Durability, MemoryStore, StoreClient, serve_queries
from ..memstore.job import record_ids
from ..ranks import rank_rows, ranks_sharing_cores
from ..runtime import Actor, ActorSystem, RuntimeConfig, run
from .report import best_of, table, write_json


@njit(parallel=True, cache=True)
def _parallel_copy(source, target):
    """A copy with every thread, as the decay kernel uses them: the machine's limit for the same bytes."""
    for i in prange(source.size):
        target[i] = source[i]


REINFORCED, TOP_K, RATE = 0.01, 100, 0.001
LOOKUP_BATCH = 10_000
TARGET_MS = 1.17  # the memory store's design target: one iteration, 1M records, one CPU process


def _bandwidth(records: int, repeats: int) -> dict:
    """GB/s of the decay kernel, numpy's clip, and a copy, on ``records`` float32 strengths (read + write).

    Every run starts with cold caches (a 256 MiB scratch array is written first): this machine's 32 MiB L3
    holds most of 10M strengths, and an in-place update of them would otherwise race a copy that does not fit.
    """
    rng = np.random.default_rng(0)
    strength = rng.random(records, dtype=np.float32)
    other = np.empty_like(strength)
    scratch = np.zeros(32 << 20, np.float64)

    def evict() -> None:  # not timed: pushes the arrays out of the caches, so every run streams from memory
        np.add(scratch, 1, out=scratch)

    decay(strength[:16], np.float32(RATE))  # compile
    _parallel_copy(strength[:16], other[:16])
    moved = 2 * strength.nbytes
    seconds = {
        "kernel": best_of(lambda: decay(strength, np.float32(RATE)), repeats, evict),
        "numpy": best_of(lambda: np.clip(strength - np.float32(RATE), 0, 1, out=strength), repeats, evict),
        "copy": best_of(lambda: _parallel_copy(strength, other), repeats, evict),
        "numpy_copy": best_of(lambda: np.copyto(other, strength), repeats, evict),
    }
    return {name: moved / value / 1e9 for name, value in seconds.items()}


def _numpy_iteration(records: int, iterations: int) -> float:
    """Median seconds of the same iteration in plain numpy, one process, ids as row numbers."""
    rng = np.random.default_rng(1)
    strength, quality = rng.random(records, dtype=np.float32), rng.random(records, dtype=np.float32)
    ids = np.arange(records, dtype=np.int64)
    times = []
    for _ in range(iterations):
        picked = rng.integers(0, records, int(records * REINFORCED))
        deltas = rng.normal(0, 0.1, len(picked)).astype(np.float32)
        start = time.perf_counter()
        np.clip(strength - np.float32(RATE), 0, 1, out=strength)
        np.add.at(strength, picked, deltas)
        np.clip(strength, 0, 1, out=strength)
        bins = np.clip((quality * 32).astype(np.int64), 0, 31)
        np.bincount(bins, minlength=32), quality.sum(dtype=np.float64), quality.max()
        best = np.argpartition(-quality, TOP_K)[:TOP_K]
        ids[best[np.lexsort((ids[best], -quality[best]))]]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _loaded_store(
    system: ActorSystem, records: int, seed: int, store: MemoryStore
) -> tuple[MemoryStore, np.ndarray, np.random.Generator]:
    """``store`` holding ``records`` (each rank inserts its block), this rank's ids, and its random stream."""
    lo, hi = rank_rows(records, system.size, system.rank)
    rng = np.random.default_rng([seed, system.rank])
    ids = record_ids(np.arange(lo, hi))  # sparse, sequential-looking ids: the hash spreads them
    values = {"strength": rng.random(hi - lo, dtype=np.float32), "quality": rng.random(hi - lo, dtype=np.float32)}
    await store.upsert(ids, values)
    return store, ids, rng


def _reinforcements(rng: np.random.Generator, ids: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` of ``ids`` drawn with repeats, and their deltas."""
    picked = rng.choice(ids, count) if len(ids) else ids[:0]
    return picked, rng.normal(0, 0.1, len(picked)).astype(np.float32)


async def _store_iterations(
    system: ActorSystem, records: int, iterations: int, new_quality: bool, device: str = "cpu"
) -> dict:
    """Build a store of ``records`` (each rank inserts its block) and time full iterations, by phase.

    ``new_quality``: each iteration also upserts new qualities for 1% of the records, so the aggregate
    and top-k must be computed again (without it, decay alone leaves them unchanged and they are reused).
    """
    store, ids, rng = await _loaded_store(system, records, 7, MemoryStore(system, device=device))
    per_rank = int(records * REINFORCED) // system.size
    phases: dict[str, list[float]] = {"total_s": []}
    await store.iterate(RATE, TOP_K)  # compile and warm
    sent_before = store.bytes_sent
    for iteration in range(iterations):
        picked, deltas = _reinforcements(rng, ids, per_rank)
        await system.world.barrier()
        start = time.perf_counter()
        await store.reinforce(picked, deltas, iteration)
        if new_quality:
            chosen = np.unique(picked)
            fresh = {
                "strength": rng.random(len(chosen), dtype=np.float32),
                "quality": rng.random(len(chosen), dtype=np.float32),
            }
            await store.upsert(chosen, fresh)
        await store.iterate(RATE, TOP_K)
        if device == "cuda":  # kernels launched but not finished would leave their time to the next iteration
            from numba import cuda

            cuda.synchronize()
        elapsed = time.perf_counter() - start
        slowest = await system.world.allreduce(np.array([elapsed]), op="max")
        phases["total_s"].append(float(slowest[0]))
        for name, value in store.timings.items():
            phases.setdefault(name, []).append(value)
    memory = await system.world.allreduce(np.array([store.partition.nbytes()], np.int64))
    sent = (store.bytes_sent - sent_before) / iterations  # before the lookups add theirs
    lookups = await _lookup_rate(system, store, records, rng) if not new_quality else None
    return {
        "lookup_ids_per_s": lookups,
        "records": records,
        "new_quality": new_quality,
        "device": device,
        "ms_per_iteration": 1e3 * statistics.median(phases["total_s"]),
        "phases_ms_rank0": {k: 1e3 * statistics.median(v) for k, v in phases.items() if k != "total_s"},
        "bytes_per_record": int(memory[0]) / records,
        "bytes_sent_per_iteration_rank0": sent,
    }


async def _lookup_rate(system: ActorSystem, store: MemoryStore, records: int, rng: np.random.Generator) -> dict:
    """Ids per second of a batched lookup of 10,000 ids: collective (split over the ranks) and by rank 0's client."""
    wanted = record_ids(rng.permutation(records)[:LOOKUP_BATCH])
    wanted = system.world.comm.bcast(wanted, 0)  # the same 10,000 on every rank
    lo, hi = rank_rows(LOOKUP_BATCH, system.size, system.rank)
    times = []
    for _ in range(5):
        await system.world.barrier()
        start = time.perf_counter()
        found, _ = await store.lookup(wanted[lo:hi])
        times.append(float((await system.world.allreduce(np.array([time.perf_counter() - start]), op="max"))[0]))
        assert found.all()
    client = StoreClient(store, await serve_queries(store, name=f"bench-queries-{records}"))
    client_times = []
    if system.rank == 0:
        for _ in range(5):
            start = time.perf_counter()
            found, _ = await client.get(wanted)
            client_times.append(time.perf_counter() - start)
            assert found.all()
    await system.world.barrier()  # the other ranks serve rank 0's queries while they wait here
    rate = {"collective": LOOKUP_BATCH / statistics.median(times)}
    return rate | ({"client_rank0": LOOKUP_BATCH / statistics.median(client_times)} if client_times else {})


class _Echo(Actor):
    """The bare ask a single get is compared with: the same round trip with no store behind it."""

    def echo(self, payload: np.ndarray) -> np.ndarray:
        return payload


def _p50_p99_us(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return 1e6 * statistics.median(ordered), 1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _single_gets(system: ActorSystem, records: int, gets: int, iterations: int) -> dict:
    """Rank 0's client gets one record owned by another rank: ``gets`` times while every rank is idle, against a
    bare 8-byte ask to that rank in the same run, then without pause while the store runs ``iterations`` full
    iterations (a get waits for the owner's kernel pass in progress). Latencies in µs, p50 and p99."""
    store, ids, rng = await _loaded_store(system, records, 13, MemoryStore(system))
    client = StoreClient(store, await serve_queries(store, name="bench-single-gets"))
    echo = await system.spawn_group(_Echo, name="bench-single-gets-echo")
    owner = 1 % system.size
    candidates = record_ids(np.arange(min(records, 100_000)))
    remote = candidates[owners(candidates, system.size) == owner]
    picks = [remote[i : i + 1] for i in np.random.default_rng(5).integers(0, len(remote), gets)]
    clock = time.perf_counter
    idle: list[float] = []
    bare: list[float] = []
    await system.world.barrier()
    if system.rank == 0:
        payload = np.zeros(8, np.uint8)
        for one in picks:
            start = clock()
            found, _ = await client.get(one)
            idle.append(clock() - start)
            assert found.all()
            start = clock()
            payload = await echo[owner].ask("echo", payload)
            bare.append(clock() - start)
    await system.world.barrier()  # the owner serves the gets meanwhile
    busy: list[float] = []
    iteration_s: list[float] = []
    running = True

    async def keep_getting() -> None:
        index = 0
        while running:
            start = clock()
            await client.get(picks[index % len(picks)])
            busy.append(clock() - start)
            index += 1

    getter = asyncio.get_running_loop().create_task(keep_getting()) if system.rank == 0 else None
    per_rank = int(records * REINFORCED) // system.size
    for iteration in range(iterations):
        picked, deltas = _reinforcements(rng, ids, per_rank)
        start = clock()
        await store.reinforce(picked, deltas, iteration)
        await store.iterate(RATE, TOP_K)
        iteration_s.append(clock() - start)
    running = False
    if getter is not None:
        await getter
    await system.world.barrier()
    result: dict = {"records": records, "iteration_ms": 1e3 * statistics.median(iteration_s)}
    if system.rank == 0:
        for name, samples in (("idle_get", idle), ("bare_ask", bare), ("get_while_iterating", busy)):
            result[f"{name}_us"] = dict(zip(("p50", "p99"), _p50_p99_us(samples)))
        result["gets_while_iterating"] = len(busy)
    return result


async def _durability(system: ActorSystem, records: int, iterations: int, directory: str) -> dict:
    """Iterations with and without commits, a raw write + fsync of a commit's bytes, and a recovery, timed."""
    per_node = RuntimeConfig.from_env().ranks_per_node
    settings = Durability(f"{directory}/checkpoints", f"{directory}/local" if per_node else None)
    store = MemoryStore(system, durable=settings)
    await store.recover()
    store, ids, rng = await _loaded_store(system, records, 11, store)
    await store.commit()
    await store.checkpoint()
    per_rank = int(records * REINFORCED) // system.size
    times: dict[str, list[float]] = {"iteration": [], "with_commit": [], "commit": [], "raw": []}
    scratch = os.path.join(directory, f"raw-{system.rank}")
    logged_before = store.logged_bytes
    for iteration in range(iterations):
        picked, deltas = _reinforcements(rng, ids, per_rank)
        await system.world.barrier()
        start = time.perf_counter()
        await store.reinforce(picked, deltas, iteration)
        await store.iterate(RATE, TOP_K)
        computed = time.perf_counter()
        before = store.logged_bytes
        await store.commit()
        done = time.perf_counter()
        slowest = await system.world.allreduce(np.array([computed - start, done - start]), op="max")
        times["iteration"].append(float(slowest[0]))
        times["with_commit"].append(float(slowest[1]))
        times["commit"].append(done - computed)
        times["raw"].append(_write_and_sync(scratch, store.logged_bytes - before))
    logged = (store.logged_bytes - logged_before) / iterations
    store.close()
    await system.world.barrier()
    began = time.perf_counter()
    again = MemoryStore(system, durable=settings)
    recovered = await again.recover()
    seconds = time.perf_counter() - began
    again.close()
    assert recovered is not None and recovered.records == records
    return {
        "records": records,
        "ms_plain": 1e3 * statistics.median(times["iteration"]),
        "ms_committed": 1e3 * statistics.median(times["with_commit"]),
        "ms_commit_rank0": 1e3 * statistics.median(times["commit"]),
        "ms_raw_write_fsync_rank0": 1e3 * statistics.median(times["raw"]),
        "bytes_logged_per_commit_rank0": logged,
        "recovery_s": seconds,
        "recovery_phases_s": recovered.seconds,
        "recovery_source": recovered.source,
        "partner_copies": per_node > 0,
    }


def _write_and_sync(path: str, nbytes: int) -> float:
    """Seconds to append ``nbytes`` to a file and fsync it: what the disk allows for a commit's record."""
    data = os.urandom(max(nbytes, 1))
    start = time.perf_counter()
    with open(path, "ab") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return time.perf_counter() - start


async def run_memstore_bench(system: ActorSystem, json_path: str, quick: bool = False) -> dict | None:
    """Run the three parts; rank 0 prints the tables and writes the JSON record."""
    threads = share_cores(ranks_sharing_cores(system.world.comm))
    sizes = [100_000, 1_000_000] if quick else [1_000_000, 10_000_000]
    iterations = 5 if quick else 20
    share = rank_rows(sizes[-1], system.size, system.rank)
    bandwidth = _bandwidth(share[1] - share[0], 3 if quick else 10)
    runs = [
        await _store_iterations(system, records, iterations, new_quality, device)
        for device in (("cpu", "cuda") if cuda_usable() else ("cpu",))
        for records in sizes
        for new_quality in (False, True)
    ]
    baseline = (
        {records: 1e3 * _numpy_iteration(records, 3 if quick else 5) for records in sizes} if system.rank == 0 else {}
    )
    gets = await _single_gets(system, sizes[0], 500 if quick else 5000, iterations)
    scratch = system.world.comm.bcast(
        tempfile.mkdtemp(prefix="memstore-bench-", dir=os.path.dirname(os.path.abspath(json_path)))
        if system.rank == 0
        else None,
        0,
    )
    try:
        durability = await _durability(system, sizes[0], iterations, scratch)
    finally:
        await system.world.barrier()
        if system.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    if system.rank != 0:
        return None
    print(f"memory store on {system.size} ranks, {threads} Numba threads each")
    print(f"decay of {share[1] - share[0]:,} records (rank 0's share of {sizes[-1]:,}), GB/s read + written:")
    print(table(["kernel", "numpy", "copy (limit)", "numpy copy", "kernel/copy", "kernel/numpy"], [[
        bandwidth["kernel"], bandwidth["numpy"], bandwidth["copy"], bandwidth["numpy_copy"],
        bandwidth["kernel"] / bandwidth["copy"], bandwidth["kernel"] / bandwidth["numpy"]]]))  # fmt: skip
    rows = []
    for record in runs:
        phases = record["phases_ms_rank0"]
        rows.append([
            record["device"], f"{record['records']:,}", "yes" if record["new_quality"] else "no",
            record["ms_per_iteration"],
            baseline[record["records"]], baseline[record["records"]] / record["ms_per_iteration"], phases["pass_s"],
            phases["aggregate_exchange_s"], phases["reinforce_exchange_s"], phases["reinforce_apply_s"],
            record["bytes_per_record"], f"{record['bytes_sent_per_iteration_rank0']:,.0f}",
        ])  # fmt: skip
    print(f"full iteration (decay, {REINFORCED:.0%} reinforced, aggregate, top-{TOP_K}), median ms; phases on rank 0")
    print("(without new qualities the aggregate is reused; with them, 1% of the records are upserted too):")
    headers = ["device", "records", "1% new quality", "ours", "numpy (1 proc)", "numpy/ours", "pass", "aggregate xchg",
               "reinforce xchg", "reinforce apply", "B/record", "B sent/iter"]  # fmt: skip
    print(table(headers, rows))
    print(f"the store's design target: {TARGET_MS} ms per iteration at 1M records on one process")
    for record in runs:
        if record["lookup_ids_per_s"]:
            rates = ", ".join(f"{way} {rate:,.0f}" for way, rate in record["lookup_ids_per_s"].items())
            print(f"batched lookup of {LOOKUP_BATCH:,} ids among {record['records']:,} records, ids/s: {rates}")
    g = gets
    print(f"single-record get by rank 0 from rank {1 % system.size}'s partition ({g['records']:,} records), µs:")
    print(table(["get idle p50", "p99", "bare ask p50", "get/ask", "while iterating p50", "p99", "iteration ms",
                 "p99/iteration"], [[g["idle_get_us"]["p50"], g["idle_get_us"]["p99"], g["bare_ask_us"]["p50"],
                 g["idle_get_us"]["p50"] / g["bare_ask_us"]["p50"], g["get_while_iterating_us"]["p50"],
                 g["get_while_iterating_us"]["p99"], g["iteration_ms"],
                 g["get_while_iterating_us"]["p99"] / 1e3 / g["iteration_ms"]]]))  # fmt: skip
    d = durability
    print(
        f"durability at {d['records']:,} records ({'log and partner copy' if d['partner_copies'] else 'log'}"
        " per commit), median ms:"
    )
    print(table(["iteration", "+ commit", "ratio", "commit (rank 0)", "write+fsync same bytes", "commit/raw",
                 "B/commit", "recovery s"], [[d["ms_plain"], d["ms_committed"], d["ms_committed"] / d["ms_plain"],
                 d["ms_commit_rank0"], d["ms_raw_write_fsync_rank0"],
                 d["ms_commit_rank0"] / d["ms_raw_write_fsync_rank0"], f"{d['bytes_logged_per_commit_rank0']:,.0f}",
                 d["recovery_s"]]]))  # fmt: skip
    print(f"recovery: {d['recovery_source']}")
    results = {
        "single_get": gets,
        "durability": durability,
        "threads_per_rank": threads,
        "decay_gb_per_s": bandwidth,
        "decay_vs_copy": bandwidth["kernel"] / bandwidth["copy"],
        "iterations": runs,
        "numpy_ms_per_iteration": baseline,
        "design_target_ms_1m": TARGET_MS,
    }
    write_json(json_path, "memstore", system.size, results)
    return results


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run(lambda system: run_memstore_bench(system, args.json, quick=args.quick))
    return 0
