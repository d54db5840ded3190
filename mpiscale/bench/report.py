"""Benchmark helpers: machine facts, an aligned table, a JSON record, collective timing, a cold page cache."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..io import utc_timestamp
from ..ranks import Comm
from ..runtime import ActorSystem, message_path


def machine() -> dict:
    """Cores, CPU model and GPU (if any) of this machine."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        result = subprocess.run(query, capture_output=True, text=True, check=False)
        gpu = result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else None
    return {
        "host": platform.node(),
        "cores": os.cpu_count(),
        "cpu": model,
        "gpu": gpu,
        "python": sys.version.split()[0],
    }


class Progress:
    """A line per part of a long benchmark as it ends, with the seconds since the start, so that a run on a loaded
    machine shows it is alive long before its table (``make bench`` once said nothing for 300 s)."""

    def __init__(self, shown: bool = True) -> None:
        self.shown, self.started = shown, time.perf_counter()

    def __call__(self, what: str) -> None:
        if self.shown:
            print(f"[{time.perf_counter() - self.started:5.0f} s] {what}", flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Render rows as a right-aligned text table."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def write_json(path: str | Path, name: str, world_size: int, results: dict) -> None:
    """Write one benchmark record with the command, world size and machine, and say where."""
    record = {
        "benchmark": name,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "world_size": world_size,
        "machine": machine(),
        "message_path": message_path()[0],  # compiled, or the pure-Python reference (and why)
        "date": utc_timestamp(),
        **results,
    }
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


def best_of(action: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``action`` (one process); ``before`` runs untimed first."""
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def timed(comm: Comm, action: Callable[[], object], before: Callable[[], object] | None = None) -> float:
    """Seconds from a barrier (and ``before()``, untimed) until the slowest rank of ``comm`` finished ``action``."""
    from mpi4py import MPI

    comm.Barrier()
    if before is not None:
        before()
    start = time.perf_counter()
    action()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def median_ratio(rounds: Sequence[Mapping[str, Sequence[float]]], numerator: str, denominator: str) -> float:
    """The median over ``rounds`` (each: samples by way) of each round's median ``numerator`` / median
    ``denominator``: two ways measured one shortly after the other, as the machine's speed drifts (a 16 MiB raw round
    trip took 1.5 ms in one run, 2.7 in another; MPI's own 64 KiB allreduce 20 µs in one run, 63 in the next)."""
    return statistics.median(statistics.median(one[numerator]) / statistics.median(one[denominator]) for one in rounds)


async def timed_async(system: ActorSystem, action: Callable[[], Awaitable[object]],
                      before: Callable[[], object] | None = None) -> float:  # fmt: skip
    """``timed`` for an awaitable action, with the event loop running (an awaitable barrier)."""
    from mpi4py import MPI

    await system.world.barrier()
    if before is not None:
        before()
    start = time.perf_counter()
    await action()
    return system.world.comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


async def median_slowest_async(system: ActorSystem, action: Callable[[], Awaitable[object]], repeats: int) -> float:
    """Median over ``repeats`` runs of ``timed_async`` (after one warm-up run)."""
    return statistics.median([await timed_async(system, action) for _ in range(repeats + 1)][1:])


def drop_page_cache() -> bool:
    """Flush and drop the page cache so the next read comes from the disk; False when not allowed (not root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def cold_cache(comm: Comm) -> bool:
    """Drop the page cache on rank 0 (one host: it is shared) and tell every rank whether that worked."""
    return bool(comm.bcast(drop_page_cache() if comm.rank == 0 else None, 0))


@contextmanager
def scratch_folder(comm: Comm, scratch: str, name: str) -> Iterator[Path]:
    """``scratch/name``, made by rank 0 for the bench's files and removed when it ends (collective), with ``scratch``
    itself where that leaves it empty (the bench's ``--dir``, made for it)."""
    folder = Path(scratch) / name
    if comm.Get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    comm.Barrier()
    try:
        yield folder
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
            if not os.listdir(scratch):
                os.rmdir(scratch)
