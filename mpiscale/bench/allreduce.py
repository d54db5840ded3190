"""Allreduce bandwidth: the hierarchical allreduce and the world's against plain ``MPI.Allreduce`` and torch (gloo).

Every column reduces the same float32 buffer in the same run, the columns in
turns: each round times every column once over, and a ratio is the median over
the rounds of each round's ratio (MPI's own 64 KiB call took 20 µs in one run
and 63 in the next on the development VM). A time is the median of the slowest
rank's (under 256 KiB, of calls back to back that reduce 256 KiB in all, over
their count). Bus bandwidth is
``algbw * 2(p-1)/p``, what the links carry in a ring allreduce, so it can be
compared across rank counts. Run at 2 and 4 ranks, flat and with simulated
nodes (``launch/mpiscale-run --ranks-per-node 2``).

The "floor" column is what any Python caller that never blocks in MPI pays for
the messages ours sends: on two ranks the same exchange (``pair_reduce.rounds``),
elsewhere ``Iallreduce``, each tested in a bare loop, with no check, log or event
loop around it. ``ours/floor`` is then the runtime's own cost, and ``floor/MPI``
what no Python caller of non-blocking MPI can gain on MPI's blocking call.

Calls back to back keep the buffers in cache and the event loop turning; a job's iterations do neither (dictlearn
reduces its statistics after a millisecond or two of coding). ``--compute-ms MS`` times each call, one a sample, after
``MS`` of work through 16 MiB of memory on every rank (after the barrier, untimed): what a call costs in such a job.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np

from ..ranks import Comm, rendezvous
from ..runtime import ActorSystem, run
from ..runtime.pair_reduce import UFUNCS, exchanged, room, rounds
from . import plots
from .report import Progress, median_ratio, table, timed, timed_async, write_json

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


def _repeats(nbytes: int, quick: bool) -> int:
    budget = (16 if quick else 1024) << 20  # bytes reduced per column and size
    return int(min(50 if quick else 200, max(3, budget // nbytes)))


def init_torch_group(comm: Comm, backend: str = "gloo"):
    """torch.distributed with ``backend`` (gloo; nccl on GPUs) on the same ranks (rank 0's address, a free port),
    or None without torch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    address, port = rendezvous(comm)
    os.environ.setdefault("MASTER_ADDR", address)
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=comm.Get_rank(), world_size=comm.Get_size())
    return torch, dist


#: Each size's columns take turns this many times (the ratios: the median over the rounds of each round's ratio).
ROUNDS, QUICK_ROUNDS = 5, 3


async def run_allreduce_bench(system: ActorSystem, json_path: str, quick: bool = False,
                              compute_ms: float = 0.0) -> dict | None:  # fmt: skip
    """Run every size through the allreduces, in turns (each call after ``compute_ms`` of work, where that is not
    0); rank 0 prints the table and writes the JSON record."""
    comm, ranks = system.world.comm.Dup(), system.size
    gloo = init_torch_group(comm)
    bus = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    sizes, turns = (QUICK_SIZES, QUICK_ROUNDS) if quick else (SIZES, ROUNDS)
    said = Progress(system.rank == 0)
    before = working(compute_ms * 1e-3) if compute_ms else None
    records = []
    for nbytes in sizes:
        data = np.random.default_rng(system.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(data)
        calls = 1 if before is not None else _calls_per_sample(nbytes)
        columns: dict[str, Callable[[], object]] = {
            "mpi": _calls(calls, comm.Allreduce, data, out),
            "floor": _calls(calls, _nonblocking_floor(comm, data, out)),
            "ours": _awaited_calls(calls, system.hierarchy.allreduce, data, out=out),
            "world": _awaited_calls(calls, system.world.allreduce, data, out=out),
        }
        if gloo is not None:
            torch, dist = gloo
            columns["gloo"] = _calls(calls, dist.all_reduce, torch.from_numpy(data.copy()))
        samples = -(-_repeats(nbytes, quick) // turns)  # each column's samples a round
        rounds = [await _one_round(system, comm, columns, samples, warm_up=turn == 0, per=calls, before=before)
                  for turn in range(turns)]  # fmt: skip
        records.append(_record(nbytes, rounds, bus, samples, calls))
        said(f"{_size(nbytes)}: ours/MPI {records[-1]['ours_vs_mpi']:.3g} ({len(records)} of {len(sizes)} sizes)")
    if gloo is not None:
        gloo[1].destroy_process_group()
    comm.Free()
    if system.rank != 0:
        return None
    headers = ["bytes", "MPI GB/s", "ours GB/s", "ours/MPI", "world/MPI", "floor/MPI", "ours/floor", "gloo GB/s",
               "ours/gloo"]  # fmt: skip
    rows = [
        [_size(int(r["bytes"])), r["mpi_busbw_gbs"], r["ours_busbw_gbs"], r["ours_vs_mpi"], r["world_vs_mpi"],
         r["floor_vs_mpi"], r["ours_vs_floor"], r.get("gloo_busbw_gbs", "-"), r.get("ours_vs_gloo", "-")]
        for r in records
    ]  # fmt: skip
    nodes = system.hierarchy.node_count
    print(f"allreduce of float32, {ranks} ranks on {nodes} node(s); bus bandwidth = algbw * 2(p-1)/p")
    print(f"ratios: the median over {turns} rounds, the columns in turns in each, of the round's ratio of medians")
    if compute_ms:
        print(f"each call after {compute_ms:g} ms of work through 16 MiB of memory on every rank (untimed)")
    print(table(headers, rows))
    results = {"ranks": ranks, "nodes": nodes, "dtype": "float32", "rounds": turns, "compute_ms": compute_ms,
               "sizes": records}  # fmt: skip
    write_json(json_path, "allreduce", ranks, results)
    return results


async def _one_round(system: ActorSystem, comm: Comm, columns: dict[str, Callable[[], object]], samples: int,
                     warm_up: bool, per: int, before: Callable[[], None] | None) -> dict[str, list[float]]:  # fmt: skip
    """``samples`` timed runs of each column, one column after the other (collective): seconds a call, the slowest
    rank's, each after ``before()`` (untimed; None: nothing). The first round runs each column once untimed first."""
    measured = {}
    for name, action in columns.items():
        if inspect.iscoroutinefunction(action):
            times = [await timed_async(system, action, before) for _ in range(samples + warm_up)]
        else:
            times = [timed(comm, action, before) for _ in range(samples + warm_up)]
        measured[name] = [seconds / per for seconds in times[warm_up:]]
    return measured


#: The record's ratios: its key, and the columns whose times it divides (the peer's over ours': above 1, ours wins).
RATIOS = {"ours_vs_mpi": ("mpi", "ours"), "world_vs_mpi": ("mpi", "world"), "floor_vs_mpi": ("mpi", "floor"),
          "ours_vs_floor": ("floor", "ours"), "ours_vs_gloo": ("gloo", "ours")}  # fmt: skip


def _record(nbytes: int, rounds: list[dict[str, list[float]]], bus: float, samples: int, calls: int) -> dict:
    """One size's JSON record: each column's median time a call over every round's samples, its bus bandwidth, each
    round's median, and the ratios in turns (:func:`report.median_ratio`)."""
    record: dict = {"bytes": nbytes, "samples_per_round": samples, "calls_per_sample": calls}
    for name in rounds[0]:
        seconds = statistics.median([time for one in rounds for time in one[name]])
        record[f"{name}_s"] = seconds
        record[f"{name}_busbw_gbs"] = nbytes / seconds * bus / 1e9
        record[f"{name}_rounds_s"] = [statistics.median(one[name]) for one in rounds]
    for key, (peer, ours) in RATIOS.items():
        if peer in rounds[0]:
            record[key] = median_ratio(rounds, peer, ours)
    return record


#: A sample of a small size times back-to-back calls that reduce at least this many bytes in all: one call after a
#: barrier took the barrier's uneven exit with it (a few µs, as long as a 4 KiB call), and the ratios at 4 KiB came
#: out 0.26-0.61 in three runs of the same code.
_SAMPLE_BYTES = 256 << 10


def _calls_per_sample(nbytes: int) -> int:
    return max(1, _SAMPLE_BYTES // nbytes)


def _calls(count: int, call: Callable[..., object], *args: object) -> Callable[[], None]:
    """``call(*args)`` ``count`` times in a row, as one action to time."""

    def action() -> None:
        for _ in range(count):
            call(*args)

    return action


def _awaited_calls(
    count: int, call: Callable[..., Awaitable[object]], *args: object, **kwargs: object
) -> Callable[[], Awaitable[None]]:
    """``await call(*args, **kwargs)`` ``count`` times in a row, as one awaitable action to time."""

    async def action() -> None:
        for _ in range(count):
            await call(*args, **kwargs)

    return action


def working(seconds: float) -> Callable[[], None]:
    """Work through 16 MiB of memory, 256 KiB at a time, for ``seconds``: a job's iteration between its collectives
    (the caches then hold other data, and the event loop has had no turn)."""
    scratch = np.ones(2 << 20)
    step = 32 << 10

    def work() -> None:
        end, offset = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            block = scratch[offset : offset + step]
            np.multiply(block, 1.0, out=block)
            offset = (offset + step) % scratch.size

    return work


def _nonblocking_floor(comm: Comm, data: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    """One call of the floor column: the allreduce of ``data`` into ``out`` by the messages ours sends, tested in
    a bare loop. Its choice of messages and its buffer for the other rank's values are made here, once (ours keeps
    its buffer between calls too), so the timed calls hold nothing else."""
    from mpi4py import MPI

    ufunc = exchanged(comm.Get_size(), data.dtype, UFUNCS["sum"])
    theirs, test_all = np.empty(room(data), np.uint8), MPI.Request.Testall

    def call() -> None:
        if ufunc is None:
            steps = iter([[comm.Iallreduce(data, out, MPI.SUM)]])
        else:
            steps = rounds(comm, ufunc, data, out, theirs)
        for requests in steps:
            while not test_all(requests):
                pass

    return call


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    result = run(lambda system: run_allreduce_bench(system, args.json, quick=args.quick, compute_ms=args.compute_ms))
    if args.plot and result is not None:  # rank 0
        plots.bus_bandwidth(result, args.plot)
    return 0
