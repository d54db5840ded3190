"""Checkpoint bandwidth: level 1, level 3 and background saves against the disk itself.

Baselines measured in the same run, by rank 0 alone while the others wait:
numpy ``tofile`` + fsync of the same number of bytes (the disk's own write
bandwidth; also measured right before and after every level-1 and level-3
save, whose "vs disk" figures are the medians over saves of the mean of the
two, since a cloud VM's disk throttles after a burst of a few GiB),
``fromfile`` of that file, and
``torch.save`` + fsync of the same arrays. Ours: every rank saves its rows of the global state. The page cache is
dropped before each read when the system allows it (root on Linux); otherwise
reads are from memory and the table says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from ..io import Checkpointer
from ..ranks import Comm, block_rows
from ..runtime import ActorSystem, run
from .report import cold_cache, drop_page_cache, table, timed, write_json

ROW = 1 << 14  # float64 values per row: 128 KiB rows


def _write_raw(arrays: list[np.ndarray], path: Path) -> None:
    """The disk's own write speed: numpy tofile of the arrays, then fsync."""
    with open(path, "wb") as file:
        for array in arrays:
            array.tofile(file)
        file.flush()
        os.fsync(file.fileno())


def _raw_baselines(arrays: list[np.ndarray], directory: Path, repeats: int) -> dict[str, float]:
    """Seconds for numpy tofile+fsync, fromfile, and torch.save+fsync of ``arrays`` (one process)."""
    import torch

    raw, torch_path = directory / "raw.bin", directory / "state.pt"
    tensors = {f"part{i}": torch.from_numpy(a) for i, a in enumerate(arrays)}

    def tofile() -> None:
        _write_raw(arrays, raw)

    def torch_save() -> None:
        with open(torch_path, "wb") as file:
            torch.save(tensors, file)
            file.flush()
            os.fsync(file.fileno())

    def median(action: Callable[[], object], before: Callable[[], object] | None = None) -> float:
        times = []
        for _ in range(repeats):
            if before:
                before()
            start = time.perf_counter()
            action()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    results = {
        "raw_write": median(tofile),
        "raw_read": median(lambda: np.fromfile(raw, dtype=np.float64), drop_page_cache),
        "torch_save": median(torch_save),
    }
    raw.unlink()
    torch_path.unlink()
    return results


def run_checkpoint_bench(comm: Comm, json_path: str, directory: str, total_bytes: int, repeats: int) -> dict | None:
    """All ranks call; rank 0 prints the table and writes JSON (and returns the record)."""
    base = Path(directory)
    if comm.rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
    comm.Barrier()
    rows = block_rows(max(total_bytes // (ROW * 8), comm.size), comm.size)[comm.rank]
    mine = np.random.default_rng(comm.rank).standard_normal((rows, ROW))
    total = comm.allreduce(mine.nbytes)
    everything: list[np.ndarray] = []
    baselines = {}
    if comm.rank == 0:  # the same bytes, held by one process, for the baselines
        counts = block_rows(total // (ROW * 8), comm.size)
        everything = [np.random.default_rng(r).standard_normal((n, ROW)) for r, n in enumerate(counts)]
        baselines = _raw_baselines(everything, base, repeats)
    comm.Barrier()
    names = ("l1_write", "l3_write", "async_blocked", "async_total", "l1_read", "l3_read")
    results: dict[str, list[float]] = {name: [] for name in names}
    drops = []  # whether rank 0 could drop the page cache before each load
    local = base / "local"
    level1 = Checkpointer(base / "l1", comm, keep=1, local_dir=local, partner=False, shared_every=0, background=False)
    level3 = Checkpointer(base / "l3", comm, keep=1, background=False)
    background = Checkpointer(base / "async", comm, keep=1, background=True)
    ratios: dict[str, list[float]] = {"l1_write": [], "l3_write": []}
    disk_pairs: list[tuple[float, float]] = []
    for step in range(1, repeats + 1):
        state = {"weights": mine}
        # A cloud VM's disk writes a few GiB at full speed, then throttles (here: 1 GiB in 0.6-0.7 s three
        # times, then in 2.5-3.6 s). So each save is compared with tofile + fsync of the same bytes (rank 0
        # alone) just before and just after it: the mean of the two sees the disk in the state the save saw.
        # The order alternates: a parallel-HDF5 write right after a level-1 save (and its retention, which
        # deletes the previous one) ran at a quarter of the disk's speed, whichever of the two it was.
        levels = [("l1_write", level1), ("l3_write", level3)]
        for name, checkpoints in levels if step % 2 else levels[::-1]:
            before = timed(comm, lambda: _write_raw(everything, base / "raw.bin") if comm.rank == 0 else None)
            results[name].append(timed(comm, partial(checkpoints.save, step, state)))
            after = timed(comm, lambda: _write_raw(everything, base / "raw.bin") if comm.rank == 0 else None)
            ratios[name].append((before + after) / 2 / results[name][-1])
            disk_pairs.append((before, after))
        blocked = timed(comm, partial(background.save, step, state))
        results["async_blocked"].append(blocked)
        results["async_total"].append(blocked + timed(comm, background.wait))
        for name, checkpoints in (("l1_read", level1), ("l3_read", level3)):
            drops.append(cold_cache(comm))
            results[name].append(timed(comm, checkpoints.load))
    for checkpoints in (level1, level3, background):
        checkpoints.close()
    if comm.rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        medians = {name: statistics.median(times) for name, times in results.items()}
        paired: dict[str, object] = {name: statistics.median(values) for name, values in ratios.items()}
        paired["disk_write_seconds"] = disk_pairs
        return _report(comm.size, json_path, total, baselines, medians, paired, all(drops))
    return None


def _report(
    size: int, json_path: str, total: int, baselines: dict, ours: dict, paired: dict, cache_dropped: bool
) -> dict:
    def row(what: str, op: str, seconds: float, disk_seconds: float | None) -> list:
        if disk_seconds is None:
            return [what, op, seconds, "-", "-"]
        return [what, op, seconds, total / 1e9 / seconds, disk_seconds / seconds]

    write, read = baselines["raw_write"], baselines["raw_read"]
    rows = [
        row("numpy tofile + fsync, 1 process (disk)", "write", write, write),
        row("torch.save + fsync, 1 process", "write", baselines["torch_save"], write),
        row(f"level 1 (node-local shards), {size} ranks", "write", ours["l1_write"], write),
        row(f"level 3 (parallel HDF5), {size} ranks", "write", ours["l3_write"], write),
        row(f"level 3 in background, {size} ranks: whole save", "write", ours["async_total"], write),
        row(f"level 3 in background, {size} ranks: caller blocked", "write", ours["async_blocked"], None),
        row("numpy fromfile, 1 process (disk)", "read", read, read),
        row(f"level 1 load, {size} ranks", "read", ours["l1_read"], read),
        row(f"level 3 load, {size} ranks", "read", ours["l3_read"], read),
    ]
    cache = "dropped before reads" if cache_dropped else "NOT dropped: reads come from memory"
    print(f"checkpoint of {total / 2**30:.2f} GiB of float64 rows over {size} ranks; medians; page cache {cache}")
    print(table(["what", "op", "seconds", "GB/s", "vs disk"], rows))
    blocked_share = ours["async_blocked"] / ours["l3_write"]
    level3_share, level1_share = paired["l3_write"], paired["l1_write"]
    disk = [seconds for pair in paired["disk_write_seconds"] for seconds in pair]
    print(f"tofile + fsync around the saves took {min(disk):.2f} to {max(disk):.2f} s (the disk throttles)")
    print(
        f"against tofile + fsync just before and after each save (median): level-3 write {level3_share:.0%} "
        f"of the disk (target >= 80%), level-1 {level1_share:.0%} (target >= 90%); background save blocks "
        f"the caller {blocked_share:.1%} of a synchronous save (target < 10%)"
    )
    results = {
        "baseline": "one process: numpy tofile+fsync and fromfile of the same bytes; torch.save+fsync of the arrays",
        "bytes": total,
        "page_cache_dropped": cache_dropped,
        "baseline_seconds": baselines,
        "ours_seconds": ours,
        "level3_write_vs_disk": level3_share,
        "async_blocked_vs_sync": blocked_share,
        "level1_write_vs_disk": level1_share,
        "vs_disk_how": "median over saves of mean(tofile+fsync seconds just before and after the save) / save seconds",
        "disk_write_seconds_around_saves": paired["disk_write_seconds"],
        "torch_save_vs_disk": write / baselines["torch_save"],
    }
    write_json(json_path, "checkpoint", size, results)
    return results


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    size_mib = args.size_mib or (128 if args.quick else 1024)
    repeats = 1 if args.quick else 5

    async def bench_checkpoint(system: ActorSystem) -> dict | None:
        return run_checkpoint_bench(system.world.comm, args.json, args.dir, size_mib << 20, repeats)

    run(bench_checkpoint)
    return 0
