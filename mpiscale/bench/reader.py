"""The data path of `mpiscale dictlearn`: read bandwidth against the disk, and reading's share of training.

In one run, on a data set written the way a user writes one (plain h5py,
contiguous float64 rows) and the same bytes as a raw file:

1. the disk: ``np.fromfile`` of the raw bytes, page cache dropped (root only;
   the table says when it could not be);
2. our reads of the same rows, page cache dropped: the read that keeps the data
   in memory (every rank reads it all), and one epoch streamed window by window;
3. the training job (the issue's setting: 64 features, 256 atoms, 8 non-zeros,
   batches of 256) with the data in memory, and streamed from a cold cache with
   shuffle windows a small fraction of the file: reading's share of training
   time, over the whole run and at steady state (after the first 10%).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..dictlearn.config import DictLearnConfig
from ..dictlearn.learner import learn
from ..io import BatchReader, epoch_order
from ..ranks import Comm
from ..runtime import ActorSystem, run
from .report import cold_cache, table, timed, write_json

FEATURES, ATOMS, SPARSITY, BATCH = 64, 256, 8, 256
FULL: dict[str, Any] = {
    "rows": 1 << 19,
    "iterations": 1200,
    "window_mib": 8.0,
}  # 256 MiB: 16x the streaming reader's 16 MiB
QUICK: dict[str, Any] = {"rows": 1 << 16, "iterations": 300, "window_mib": 1.0}


def _write_user_file(path: Path, raw: Path, rows: int) -> None:
    """Rows of planted-like signals in chunks, written with plain h5py and as raw bytes (rank 0)."""
    import h5py

    rng = np.random.default_rng(0)
    atoms = rng.standard_normal((ATOMS, FEATURES))
    with h5py.File(path, "w") as file, open(raw, "wb") as flat:
        data = file.create_dataset("X", shape=(rows, FEATURES), dtype=np.float64)
        for start in range(0, rows, 1 << 16):
            stop = min(rows, start + (1 << 16))
            codes = rng.standard_normal((stop - start, ATOMS)) * (rng.random((stop - start, ATOMS)) < 8 / ATOMS)
            block = codes @ atoms + 0.1 * rng.standard_normal((stop - start, FEATURES))
            data[start:stop] = block
            block.tofile(flat)
        flat.flush()
        os.fsync(flat.fileno())


def _stream_epoch(path: Path, comm: Comm, window_rows: int) -> None:
    with BatchReader(path, ["X"], BATCH, comm, shuffle=True, shuffle_window=window_rows, in_memory=False) as reader:
        for _ in reader.epoch(0):
            pass


def _shares(out: str) -> dict:
    import h5py

    with h5py.File(out, "r") as file:
        read = file["metrics"]["read_s"][()]
        steps = np.diff(file["metrics"]["time_s"][()], prepend=0.0)
    steady = slice(len(read) // 10, None)
    return {
        "train_seconds": float(steps.sum()),
        "read_share": float(read.sum() / steps.sum()),
        "steady_read_share": float(read[steady].sum() / steps[steady].sum()),
        "steady_read_us_per_iteration": float(read[steady].mean() * 1e6),
    }


async def run_reader_bench(system: ActorSystem, json_path: str, workdir: str, quick: bool = False) -> dict | None:
    """All ranks call; rank 0 prints the table and writes JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    setting = QUICK if quick else FULL
    base = Path(workdir) / "bench-reader"
    data, raw = base / "data.h5", base / "data.raw"
    if comm.rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        _write_user_file(data, raw, setting["rows"])
    nbytes = setting["rows"] * FEATURES * 8
    epoch_order(BATCH, 0, 0, True)  # compile (or load) the shuffle's random-number kernel outside the timings
    window_rows = int(setting["window_mib"] * 2**20) // (8 * FEATURES)
    cold = [cold_cache(comm)]
    disk = comm.bcast(_timed_alone(raw) if comm.rank == 0 else None, 0)
    cold.append(cold_cache(comm))
    load = timed(comm, lambda: BatchReader(data, ["X"], BATCH, comm, in_memory=True).close())
    cold.append(cold_cache(comm))
    stream = timed(comm, lambda: _stream_epoch(data, comm, window_rows))
    jobs = {}
    for mode in ("yes", "no"):
        cold.append(cold_cache(comm))
        config = DictLearnConfig(
            data=f"{data}:/X", atoms=ATOMS, sparsity=SPARSITY, batch_size=BATCH, iterations=setting["iterations"],
            in_memory=mode, shuffle_window_mib=setting["window_mib"], out=str(base / f"results-{mode}.h5"),
            progress_every=0,
        )  # fmt: skip
        await learn(system, config)
        jobs["in memory" if mode == "yes" else "streamed"] = _shares(config.out) if comm.rank == 0 else None
    if comm.rank != 0:
        return None
    shutil.rmtree(base, ignore_errors=True)
    return _report(json_path, comm.size, setting, nbytes, disk, load, stream, jobs, all(cold))


def _timed_alone(raw: Path) -> float:
    started = time.perf_counter()
    np.fromfile(raw, dtype=np.float64)
    return time.perf_counter() - started


def _report(json_path, ranks, setting, nbytes, disk, load, stream, jobs, cold) -> dict:
    gb = nbytes / 1e9
    print(
        f"{setting['rows']:,} rows x {FEATURES} float64 ({nbytes / 2**20:.0f} MiB, plain h5py), {ranks} ranks; "
        f"page cache {'dropped before each read' if cold else 'NOT dropped: reads come from memory'}"
    )
    rows = [
        ["np.fromfile, 1 process (the disk)", disk, gb / disk, 1.0],
        [f"load into memory, {ranks} ranks (each reads all)", load, gb / load, disk / load],
        [f"stream one epoch, {setting['window_mib']:g} MiB windows", stream, gb / stream, disk / stream],
    ]
    print(table(["read", "seconds", "GB/s", "vs disk"], rows))
    headers = ["training", "seconds", "reading share", "at steady state", "read us/iteration"]
    print(f"\ndictlearn: {setting['iterations']} iterations, {ATOMS} atoms, L={SPARSITY}, batch {BATCH}")
    print(
        table(
            headers,
            [
                [name, j["train_seconds"], f"{j['read_share']:.2%}", f"{j['steady_read_share']:.2%}",
                 j["steady_read_us_per_iteration"]]
                for name, j in jobs.items()
            ],
        )
    )  # fmt: skip
    results = {
        "setting": setting | {"features": FEATURES, "atoms": ATOMS, "sparsity": SPARSITY, "batch_size": BATCH},
        "bytes": nbytes,
        "page_cache_dropped": cold,
        "baseline": {"what": "np.fromfile of the same bytes, one process", "seconds": disk},
        "ours": {"load_seconds": load, "stream_epoch_seconds": stream, "training": jobs},
        "load_vs_disk": disk / load,
        "stream_vs_disk": disk / stream,
    }
    write_json(json_path, "reader", ranks, results)
    return results


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run(lambda system: run_reader_bench(system, args.json, args.dir, quick=args.quick))
    return 0
