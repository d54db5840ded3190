"""Point-to-point benchmark: actor ``ask`` round trip versus raw mpi4py and other ways to do it.

Run on exactly two ranks. Every comparison carries the same numpy payload
between the same two processes in the same run: raw ``Send``/``Recv``, raw
with an ask's buffers (the reply into a second buffer: what a large ask cannot
avoid), persistent requests, mpi4py's pickle-based ``send``/``recv``, a bare
asyncio loop, and ``mpi4py.futures``; the ask is timed plain and with its reply
into the array sent (``reply_into``). Each round trip is timed on its own, so
the tables give medians (p50) and p99; the ratio ours / raw is what to quote.
The ways take turns, a batch of round trips each, in rounds: a ratio is the
median over the rounds of the two ways' medians in each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, cast

import numpy as np

from ..ranks import Comm
from ..runtime import Actor, ActorRef, ActorSystem, message_path, run
from . import plots
from .report import Progress, median_ratio, table, write_json

SIZES = [8, 64, 512, 4096, 32768, 262144, 2 << 20, 16 << 20]
SMALL_TARGET = 5.0  # 8-byte ask round trip within 5x of raw
SMALL_PICKLE_TARGET = 0.5  # ... and within half of mpi4py's pickled send/recv round trip
LARGE_TARGET = 1.10  # 16 MiB ask within 1.10x of raw
APART_TARGET = 1.05  # ... and within 1.05x of raw with an ask's buffers (the reply apart)
TELL_TARGET = 1.0  # tells at least the raw Isend stream's rate
ECHO = "bench.echo"
MANY_ACTORS = 100  # echo actors per rank for the many-actors case


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
    budget = 1 << 20 if quick else 64 << 20
    return int(min(300 if quick else 20000, max(5, budget // max(size, 1) // 4)))


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_round_trips(
    comm: Comm, repeats: int, batches: int, round_trip: Callable[[], None], warm_up: bool = True
) -> list[float]:
    """Seconds of each ``round_trip()`` after a warm-up batch (``warm_up``); every batch starts with a barrier. Each
    peer below goes through this same harness (one Python call per round trip, some 50 ns)."""
    clock = time.perf_counter
    samples: list[float] = []
    for batch in range(1 - warm_up, batches + 1):  # batch 0 warms up
        comm.Barrier()
        for _ in range(repeats):
            start = clock()
            round_trip()
            if batch:
                samples.append(clock() - start)
    return samples


def _raw_round_trip(comm: Comm, size: int, repeats: int, batches: int, warm_up: bool = True) -> list[float]:
    """Round trips of blocking Send/Recv of the payload's buffer."""
    buffer = np.zeros(size, dtype=np.uint8)
    peer = 1 - comm.Get_rank()

    def ping() -> None:
        comm.Send(buffer, peer, 7)
        comm.Recv(buffer, peer, 7)

    def pong() -> None:
        comm.Recv(buffer, peer, 7)
        comm.Send(buffer, peer, 7)

    return _time_round_trips(comm, repeats, batches, ping if comm.Get_rank() == 0 else pong, warm_up)


def _raw_reply_apart_round_trip(comm: Comm, size: int, repeats: int, batches: int, warm_up: bool = True) -> list[float]:
    """Round trips of blocking Send/Recv with an ask's buffers: the asker receives the reply into a second buffer
    and sends from it next (an ask's reply is a new array while the caller holds its request's), the echo rank
    uses one. What raw MPI pays for that pattern: the floor of an ask of large arrays on this machine."""
    buffers = [np.zeros(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)]
    peer = 1 - comm.Get_rank()
    turn = [0]

    def ping() -> None:
        comm.Send(buffers[turn[0]], peer, 13)
        turn[0] ^= 1
        comm.Recv(buffers[turn[0]], peer, 13)

    def pong() -> None:
        comm.Recv(buffers[0], peer, 13)
        comm.Send(buffers[0], peer, 13)

    return _time_round_trips(comm, repeats, batches, ping if comm.Get_rank() == 0 else pong, warm_up)


def _persistent_round_trip(comm: Comm, size: int, repeats: int, batches: int, warm_up: bool = True) -> list[float]:
    """Round trips of persistent requests (``Send_init``/``Recv_init``, then Start and Wait): MPI's cheapest path."""
    buffer = np.zeros(size, dtype=np.uint8)
    peer = 1 - comm.Get_rank()
    send, receive = comm.Send_init(buffer, peer, 11), comm.Recv_init(buffer, peer, 11)
    order = (send, receive) if comm.Get_rank() == 0 else (receive, send)

    def round_trip() -> None:
        for request in order:
            request.Start()
            request.Wait()

    samples = _time_round_trips(comm, repeats, batches, round_trip, warm_up)
    send.Free()
    receive.Free()
    return samples


def _pickled_round_trip(comm: Comm, size: int, repeats: int, batches: int, warm_up: bool = True) -> list[float]:
    """Round trips of mpi4py's pickle-based ``send``/``recv`` of the numpy payload: what a plain mpi4py program
    that sends Python objects pays."""
    payload = np.zeros(size, dtype=np.uint8)
    peer = 1 - comm.Get_rank()

    def ping() -> None:
        comm.send(payload, peer, 12)
        comm.recv(source=peer, tag=12)

    def pong() -> None:
        comm.send(comm.recv(source=peer, tag=12), peer, 12)

    return _time_round_trips(comm, repeats, batches, ping if comm.Get_rank() == 0 else pong, warm_up)


async def _loop_floor_round_trip(
    comm: Comm, size: int, repeats: int, batches: int, warm_up: bool = True
) -> list[float]:
    """Round trips of a bare asyncio loop doing Isend/Improbe/Irecv: no pickling, no actors.

    The cost of driving MPI from an event loop task by task (a yield to the loop between polls).
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

    clock = time.perf_counter
    samples: list[float] = []
    for batch in range(1 - warm_up, batches + 1):
        comm.Barrier()
        for _ in range(repeats):
            start = clock()
            if rank == 0:
                await complete(comm.Isend(buffer, peer, 8))
                await receive()
            else:
                await receive()
                await complete(comm.Isend(buffer, peer, 8))
            if batch:
                samples.append(clock() - start)
    return samples


async def _ask_round_trip(
    system: ActorSystem, size: int, repeats: int, batches: int, actors: int = 1, into: str = "", warm_up: bool = True
) -> list[float]:
    """Round trips of ``ask`` from rank 0 to an echo actor on rank 1 (one of ``actors``, chosen at random). The
    reply into the array sent: ``into="lend"`` lends it (``reply_into``), ``into="copy"`` copies the reply there."""
    payload = np.zeros(size, dtype=np.uint8)
    targets = [ActorRef(1, ECHO if actors == 1 else f"{ECHO}.{i}") for i in range(actors)]
    pick = np.random.default_rng(0).integers(0, actors, repeats)
    clock = time.perf_counter
    samples: list[float] = []
    for batch in range(1 - warm_up, batches + 1):
        await system.world.barrier()
        if system.rank == 0:
            for i in range(repeats):
                start = clock()
                if into == "copy":
                    np.copyto(payload, await targets[pick[i]].ask("echo", payload))
                else:
                    payload = await targets[pick[i]].ask("echo", payload, reply_into=payload if into else None)
                if batch:
                    samples.append(clock() - start)
        await system.world.barrier()  # rank 1 serves the asks meanwhile
    return samples


def _echo(payload: np.ndarray) -> np.ndarray:
    return payload


def _futures_round_trip(comm: Comm, repeats: int) -> list[float]:
    """Round trips of an mpi4py.futures task that echoes 8 bytes (rank 1 serves as its worker meanwhile)."""
    from mpi4py.futures import MPICommExecutor

    payload = np.zeros(8, dtype=np.uint8)
    clock = time.perf_counter
    samples: list[float] = []
    with MPICommExecutor(cast(Any, comm), root=0) as manager:
        executor = cast("Executor | None", manager)  # None on the worker rank; the stubs call it the manager
        if executor is not None:
            for i in range(repeats + repeats // 5):  # the first fifth warms up
                start = clock()
                payload = executor.submit(_echo, payload).result()
                if i >= repeats // 5:
                    samples.append(clock() - start)
    return samples


RAW_WINDOW = 256  # Isends in flight at once in the raw stream


def _raw_stream(comm: Comm, count: int) -> float:
    """Messages per second of back-to-back 8-byte Isend -> Recv, ``RAW_WINDOW`` Isends at a time (then Waitall).
    All ``count`` Isends at once, as before, swung from 0.1 to 1.7 million messages/s from run to run here (a
    receiver that falls behind queues unexpected messages); windows of 256 gave 1.4-2.0 million steadily."""
    from mpi4py import MPI

    buffer = np.zeros(8, dtype=np.uint8)
    comm.Barrier()
    start = time.perf_counter()
    if comm.Get_rank() == 0:
        for first in range(0, count, RAW_WINDOW):
            MPI.Request.Waitall([comm.Isend(buffer, 1, 9) for _ in range(min(RAW_WINDOW, count - first))])
        comm.Recv(buffer, 1, 10)
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


#: The ratios the tables quote, each ours over a peer: (ours, the peer) by the names of ``_one_round``.
RATIOS = {"ratio": ("ask", "raw"), "ratio_to_reply_apart": ("ask", "apart"), "ask_into_ratio": ("into", "raw")}


async def _one_round(system: ActorSystem, comm: Comm, size: int, repeats: int, warm_up: bool) -> dict[str, list]:
    """One batch of round trips of each way, one way after the other (collective; the asks' samples on rank 0)."""
    return {
        "raw": _raw_round_trip(comm, size, repeats, 1, warm_up),
        "apart": _raw_reply_apart_round_trip(comm, size, repeats, 1, warm_up),
        "persistent": _persistent_round_trip(comm, size, repeats, 1, warm_up),
        "pickled": _pickled_round_trip(comm, size, repeats, 1, warm_up),
        "floor": await _loop_floor_round_trip(comm, size, repeats, 1, warm_up),
        "ask": await _ask_round_trip(system, size, repeats, 1, warm_up=warm_up),
        "into": await _ask_round_trip(system, size, repeats, 1, into="lend", warm_up=warm_up),
        "copy": await _ask_round_trip(system, size, repeats, 1, into="copy", warm_up=warm_up),
    }


async def run_pingpong(system: ActorSystem, json_path: str, quick: bool = False) -> dict | None:
    """The whole benchmark; rank 0 prints the tables and writes JSON, returns the record."""
    if system.size != 2:
        raise SystemExit(
            f"bench pingpong needs exactly 2 ranks, got {system.size}: "
            "launch/mpiscale-run -n 2 -- mpiscale bench pingpong"
        )
    await system.spawn_group(Echo, name=ECHO)
    for i in range(MANY_ACTORS):
        system.spawn_local(Echo, name=f"{ECHO}.{i}")
    await system.world.barrier()
    comm = system.world.comm.Dup()
    batches = 2 if quick else 5
    rows, records = [], []
    said = Progress(system.rank == 0)
    for size in SIZES:
        repeats = _repeats(size, quick)
        rounds = [await _one_round(system, comm, size, repeats, warm_up=not turn) for turn in range(batches)]
        if system.rank == 0:
            measured = {name: [sample for one in rounds for sample in one[name]] for name in rounds[0]}
            ours = measured["ask"]
            p50 = {name: statistics.median(samples) for name, samples in measured.items()}
            ask_p99 = _percentile(ours, 0.99)
            in_turns = {ratio: median_ratio(rounds, *names) for ratio, names in RATIOS.items()}
            records.append(
                {
                    "bytes": size,
                    "raw_rtt_s": p50["raw"],
                    "raw_p99_s": _percentile(measured["raw"], 0.99),
                    "raw_reply_apart_rtt_s": p50["apart"],
                    "persistent_rtt_s": p50["persistent"],
                    "mpi4py_pickle_rtt_s": p50["pickled"],
                    "asyncio_floor_rtt_s": p50["floor"],
                    "ask_rtt_s": p50["ask"],
                    "ask_p99_s": ask_p99,
                    "ask_into_rtt_s": p50["into"],
                    "ask_then_copy_rtt_s": p50["copy"],
                }
                | in_turns
            )
            rows.append([size] + [p50[k] * 1e6 for k in ("raw", "apart", "persistent", "pickled", "floor", "ask")]
                        + [ask_p99 * 1e6, in_turns["ratio"], in_turns["ratio_to_reply_apart"],
                           ask_p99 / p50["ask"], p50["into"] * 1e6, in_turns["ask_into_ratio"],
                           p50["copy"] * 1e6])  # fmt: skip
            said(f"round trips of {size:,} B: ask {p50['ask'] * 1e6:.3g} µs, raw {p50['raw'] * 1e6:.3g} µs "
                 f"({len(records)} of {len(SIZES)} sizes)")  # fmt: skip
    said("asks to 1 of 100 actors, mpi4py.futures, and the one-way streams")
    small_repeats = _repeats(8, quick)
    many = await _ask_round_trip(system, 8, small_repeats, batches, actors=MANY_ACTORS)
    futures = _futures_round_trip(comm, 200 if quick else 2000)
    count = 2000 if quick else 20000
    raw_rate = _raw_stream(comm, count)
    tell_rate = await _tell_stream(system, count)
    comm.Free()
    if system.rank != 0:
        return None
    small, large = records[0], records[-1]
    targets = {
        "small_ask_within_5x_of_raw": small["ratio"] <= SMALL_TARGET,
        "small_ask_within_half_of_mpi4py_pickle": small["ask_rtt_s"]
        <= SMALL_PICKLE_TARGET * small["mpi4py_pickle_rtt_s"],
        "small_ask_p99_within_3x_of_p50": small["ask_p99_s"] <= 3 * small["ask_rtt_s"],
        "16MiB_ask_within_1.10x_of_raw": large["ratio"] <= LARGE_TARGET,
        "16MiB_ask_within_1.05x_of_reply_apart": large["ratio_to_reply_apart"] <= APART_TARGET,
        "16MiB_ask_into_within_1.10x_of_raw": large["ask_into_ratio"] <= LARGE_TARGET,
        "tell_rate_at_least_raw": tell_rate >= TELL_TARGET * raw_rate,
    }
    headers = ["bytes", "raw µs", "raw, reply apart µs", "persistent µs", "mpi4py pickle µs", "loop floor µs",
               "ask µs", "ask p99 µs", "ask/raw", "ask/reply apart", "p99/p50", "ask into µs",
               "into/raw", "ask + copy µs"]  # fmt: skip
    print(f"message path: {message_path()[0]}")
    print("round trip, median (p50) of single round trips unless marked p99")
    print(table(headers, rows))
    extra = [
        [f"ask to 1 of {MANY_ACTORS} actors (8 B)", statistics.median(many) * 1e6, _percentile(many, 0.99) * 1e6],
        ["mpi4py.futures submit().result() (8 B)", statistics.median(futures) * 1e6, _percentile(futures, 0.99) * 1e6],
    ]
    print(table(["8 B round trip", "p50 µs", "p99 µs"], extra))
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
        "other_baselines": {
            "raw_reply_apart": "Send/Recv with an ask's buffers: the reply into a second buffer on the asker",
            "persistent": "Send_init/Recv_init, Start and Wait",
            "mpi4py_pickle": "mpi4py's pickle-based comm.send/comm.recv of the numpy payload",
            "asyncio_floor": "a bare asyncio loop doing Isend/Improbe/Irecv, no pickling or actors",
            "mpi4py_futures": "MPICommExecutor submit(echo).result(), rank 1 the worker",
        },
        "ask_into": "ask(..., reply_into=payload): the reply received into the array sent",
        "ask_then_copy": "a plain ask, then the reply copied into the array sent (what reply_into saves)",
        "round_trip": records,
        "many_actors": {
            "actors_per_rank": MANY_ACTORS,
            "ask_rtt_s": statistics.median(many),
            "ask_p99_s": _percentile(many, 0.99),
        },
        "mpi4py_futures": {"rtt_s": statistics.median(futures), "p99_s": _percentile(futures, 0.99)},
        "one_way": {
            "messages": count,
            "raw_msgs_per_s": raw_rate,
            "tell_msgs_per_s": tell_rate,
            "ratio": tell_rate / raw_rate,
        },
        "targets": targets,
    }
    write_json(json_path, "pingpong", system.size, results)
    return results


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    result = run(lambda system: run_pingpong(system, args.json, quick=args.quick))
    if args.plot and result is not None:  # rank 0
        plots.round_trips(result, args.plot)
    return 0
