"""``mpiscale memstore``: a synthetic learning workload on the store, with progress, results and the final records.

The workload depends only on the seed, through per-sample random streams
(``SampleRandom``): record ``i`` has id ``7919 i + 13`` and its starting
strength and quality; the reinforcement entry ``j`` of iteration ``t`` picks a
record and a delta from stream ``t``. Each rank generates its block of every
batch, so the results are the same bits on any number of ranks.
"""

from __future__ import annotations

import json
import time

import h5py
import numpy as np

from ..io import SampleRandom, open_file, publish, stamp, write_dataset
from ..jobs import ProgressLine, check_outputs, lock_results, start_agreed
from ..kernels.threads import share_cores
from ..ranks import rank_rows, ranks_sharing_cores
from ..runtime import ActorSystem
from .config import MemstoreConfig
from .store import Aggregate, MemoryStore

RESULTS_FORMAT = "mpiscale.memstore-results/1"


def record_ids(indices: np.ndarray) -> np.ndarray:
    """The id of record number ``i``: sparse, increasing, far from ``i`` itself."""
    return indices.astype(np.int64) * 7919 + 13


async def run_memstore(system: ActorSystem, config: MemstoreConfig) -> dict:
    """The job on every rank; returns the last aggregate's summary."""

    def prepare():
        from mpi4py import MPI

        share_cores(ranks_sharing_cores(MPI.COMM_WORLD))
        check_outputs(config.out, None)
        return lock_results(config.out, MPI.COMM_WORLD)

    lock = await start_agreed(system, "memstore", prepare)
    try:
        return await _run(system, config)
    finally:
        if lock is not None:
            lock.release()


async def _run(system: ActorSystem, config: MemstoreConfig) -> dict:
    store = MemoryStore(system, histogram_bins=config.bins)
    streams = SampleRandom(config.seed)
    lo, hi = rank_rows(config.records, system.size, system.rank)
    start = streams.uniform(0, range(lo, hi), 2).astype(np.float32)
    await store.upsert(record_ids(np.arange(lo, hi)), {"strength": start[:, 0], "quality": start[:, 1]})
    batch = int(round(config.records * config.reinforce))
    b_lo, b_hi = rank_rows(batch, system.size, system.rank)
    history: list[tuple[Aggregate, float]] = []
    progress = ProgressLine(config.iterations, 0, config.progress_every if system.rank == 0 else None, "records")
    for iteration in range(config.iterations):
        began = time.perf_counter()
        entries = range(b_lo, b_hi)
        picked = streams.integers(iteration + 1, entries, 1, 0, config.records)[:, 0]
        deltas = (0.1 * streams.normal(iteration + 1, entries, 1, stream=1)[:, 0]).astype(np.float32)
        await store.reinforce(record_ids(picked), deltas, iteration)
        result = await store.iterate(config.rate, config.top)
        history.append((result, time.perf_counter() - began))
        text = f"mean quality {result.mean:.4f}  {1e3 * history[-1][1]:.2f} ms/iteration"
        progress.update(iteration + 1, text, config.records)
    progress.finish()
    columns = {name: store.partition.column(name) for name in store.columns}
    write_dataset(config.records_path, {"ids": store.partition.ids} | columns, system.world.comm, config.to_dict())
    if system.rank == 0:
        _write_results(config, system.size, history, store.partition.nbytes())
        print(f"wrote {config.out} and {config.records_path}: {config.records} records, {system.size} ranks")
    last = history[-1][0]
    return {"count": last.count, "mean": last.mean, "top_ids": last.top_ids.tolist()}


def _write_results(config: MemstoreConfig, ranks: int, history: list[tuple[Aggregate, float]], nbytes: int) -> None:
    temporary = f"{config.out}.tmp"
    with h5py.File(temporary, "w") as file:
        stamp(file, RESULTS_FORMAT, ranks, config.to_dict())
        results = [aggregate for aggregate, _ in history]
        file["iteration_s"] = np.array([seconds for _, seconds in history])
        for name in ("count", "total", "mean", "maximum"):
            file[name] = np.array([getattr(aggregate, name) for aggregate in results])
        file["histogram"] = np.stack([aggregate.histogram for aggregate in results])
        file["histogram_edges"] = results[0].edges
        file["top_ids"] = np.stack([aggregate.top_ids for aggregate in results])
        file["top_quality"] = np.stack([aggregate.top_quality for aggregate in results])
        file.attrs["records_file"] = config.records_path
        file.attrs["rank0_bytes"] = nbytes
    publish(temporary, config.out)


def summarize(path: str) -> str:
    """A short report of a results file."""
    with open_file(path, (RESULTS_FORMAT,)) as file:
        seconds = file["iteration_s"][()]
        settings = json.loads(file.attrs["config"])
        ranks = file.attrs["world_size"]
        return "\n".join(
            [
                f"{path}: {settings['records']:,} records, {len(seconds)} iterations on {ranks} ranks, "
                f"mpiscale {file.attrs['mpiscale_version']}, {file.attrs['created']}",
                f"time per iteration: median {1e3 * np.median(seconds):.2f} ms, first {1e3 * seconds[0]:.2f} ms",
                f"last iteration: mean quality {file['mean'][-1]:.6f}, maximum {file['maximum'][-1]:.6f}, "
                f"count {int(file['count'][-1])}",
                f"top 5 ids: {', '.join(str(i) for i in file['top_ids'][-1][:5])}",
                f"records: {file.attrs['records_file']}",
            ]
        )
