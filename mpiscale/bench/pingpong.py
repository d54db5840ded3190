"""Point-to-point benchmark: actor ``ask`` round trip versus raw mpi4py Send/Recv.

Run on exactly two ranks. Both sides of each comparison carry the same numpy
payload in the same run; the ratio (ours / raw) is what to quote.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

from ..ranks import Comm
from ..runtime import Actor, ActorRef, ActorSystem
from .report import table, write_json

SIZES = [8, 64, 512, 4096, 32768, 262144, 2 << 20, 16 << 20]
SMALL_TARGET = 10.0  # small-message ask round trip within 10x of raw
LARGE_TARGET = 1.25  # 16 MiB ask within 1.25x of raw
ECHO = "bench.echo"


class Echo(Actor):
    """Returns what it is sent; counts one-way messages."""

    def __init__(self) -> None:
        self.received = 0

    async def echo(self, payload: np.ndarray) -> np.ndarray:
        return payload

    def hit(self, payload: np.ndarray) -> None:
        self.received += 1

    def count(self) -> int:
        return self.received


def _repeats(size: int, quick: bool) -> int:
    budget = 4 << 20 if quick else 64 << 20
    return int(min(2000 if quick else 20000, max(5, budget // max(size, 1) // 4)))


def _raw_round_trip(comm: Comm, size: int, repeats: int, batches: int) -> list[float]:
    """Per-round-trip seconds of blocking Send/Recv, one value per batch."""
    buffer = np.zeros(size, dtype=np.uint8)
    peer = 1 - comm.Get_rank()
    results = []
    for batch in range(batches + 1):  # batch 0 warms up
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            if comm.Get_rank() == 0:
                comm.Send(buffer, peer, 7)
                comm.Recv(buffer, peer, 7)
            else:
                comm.Recv(buffer, peer, 7)
                comm.Send(buffer, peer, 7)
        if batch:
            results.append((time.perf_counter() - start) / repeats)
    return results


async def _loop_floor_round_trip(comm: Comm, size: int, repeats: int, batches: int) -> list[float]:
    """Round trip of a bare asyncio loop doing Isend/Improbe/Irecv: no pickling, no actors.

    The cost of driving MPI from an event loop at all; any asyncio runtime pays it.
    """
    from mpi4py import MPI

    buffer = np.zeros(size, dtype=np.uint8)
    rank = comm.Get_rank()
    peer = 1 - rank
    status = MPI.Status()

    async def complete(request) -> None:
        while not request.Test():
            await asyncio.sleep(0)

    async def receive() -> None:
        while (message := comm.Improbe(peer, 8, status)) is None:
            await asyncio.sleep(0)
        await complete(message.Irecv(buffer))

    results = []
    for batch in range(batches + 1):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            if rank == 0:
                await complete(comm.Isend(buffer, peer, 8))
                await receive()
            else:
                await receive()
                await complete(comm.Isend(buffer, peer, 8))
        if batch:
            results.append((time.perf_counter() - start) / repeats)
    return results


async def _ask_round_trip(system: ActorSystem, size: int, repeats: int, batches: int) -> list[float]:
    payload = np.zeros(size, dtype=np.uint8)
    echo = ActorRef(1, ECHO)
    results = []
    for batch in range(batches + 1):
        await system.world.barrier()
        if system.rank == 0:
            start = time.perf_counter()
            for _ in range(repeats):
                payload = await echo.ask("echo", payload)
            if batch:
                results.append((time.perf_counter() - start) / repeats)
        await system.world.barrier()  # rank 1 serves the asks meanwhile
    return results


def _raw_stream(comm: Comm, count: int) -> float:
    """Messages per second of back-to-back 8-byte Isend -> Recv."""
    buffer = np.zeros(8, dtype=np.uint8)
    comm.Barrier()
    start = time.perf_counter()
    if comm.Get_rank() == 0:
        requests = [comm.Isend(buffer, 1, 9) for _ in range(count)]
        comm.Recv(buffer, 1, 10)
        from mpi4py import MPI

        MPI.Request.Waitall(requests)
    else:
        for _ in range(count):
            comm.Recv(buffer, 0, 9)
        comm.Send(buffer, 0, 10)
    return count / (time.perf_counter() - start)


async def _tell_stream(system: ActorSystem, count: int) -> float:
    payload = np.zeros(8, dtype=np.uint8)
    echo = ActorRef(1, ECHO)
    await system.world.barrier()
    rate = 0.0
    if system.rank == 0:
        start = time.perf_counter()
        before = await echo.ask("count")
        for _ in range(count):
            echo.tell("hit", payload)
        received = await echo.ask("count")
        rate = count / (time.perf_counter() - start)
        if received - before != count:
            raise RuntimeError(f"lost tells: {received - before} of {count} arrived")
    await system.world.barrier()
    return rate


async def run_pingpong(system: ActorSystem, json_path: str, quick: bool = False) -> dict | None:
    """The whole benchmark; rank 0 prints the table and writes JSON, returns the record."""
    if system.size != 2:
        raise SystemExit(
            f"bench pingpong needs exactly 2 ranks, got {system.size}: "
            "launch/mpiscale-run -n 2 -- mpiscale bench pingpong"
        )
    await system.spawn_group(Echo, name=ECHO)
    comm = system.world.comm.Dup()
    batches = 3 if quick else 5
    rows, records = [], []
    for size in SIZES:
        repeats = _repeats(size, quick)
        raw = statistics.median(_raw_round_trip(comm, size, repeats, batches))
        floor = statistics.median(await _loop_floor_round_trip(comm, size, repeats, batches))
        ours = await _ask_round_trip(system, size, repeats, batches)
        if system.rank == 0:
            ask = statistics.median(ours)
            ratio = ask / raw
            records.append(
                {"bytes": size, "raw_rtt_s": raw, "asyncio_floor_rtt_s": floor, "ask_rtt_s": ask, "ratio": ratio}
            )
            rows.append([size, raw * 1e6, floor * 1e6, ask * 1e6, ratio, floor / raw, 2 * size / ask / 1e6])
    count = 2000 if quick else 20000
    raw_rate = _raw_stream(comm, count)
    tell_rate = await _tell_stream(system, count)
    comm.Free()
    if system.rank != 0:
        return None
    small, large = records[0], records[-1]
    targets = {
        "small_ask_within_10x_of_raw": small["ratio"] <= SMALL_TARGET,
        "16MiB_ask_within_1.25x_of_raw": large["ratio"] <= LARGE_TARGET,
    }
    print(table(["bytes", "raw RTT µs", "loop floor µs", "ask RTT µs", "ask/raw", "floor/raw", "ask MB/s"], rows))
    print(
        table(
            ["one-way 8 B", "raw Isend msg/s", "tell msg/s", "tell/raw"],
            [["rate", raw_rate, tell_rate, tell_rate / raw_rate]],
        )
    )
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")
    results = {
        "baseline": "mpi4py Comm.Send/Recv on numpy buffers (same run, same payload)",
        "second_baseline": "asyncio_floor: a bare asyncio loop doing Isend/Improbe/Irecv, no pickling or actors",
        "round_trip": records,
        "one_way": {
            "messages": count,
            "raw_msgs_per_s": raw_rate,
            "tell_msgs_per_s": tell_rate,
            "ratio": tell_rate / raw_rate,
        },
        "targets": targets,
    }
    path = write_json(json_path, "pingpong", system.size, results)
    print(f"wrote {path}")
    return results
