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
from functools import partial

import h5py
import numpy as np

from ..io import CheckpointError, DataFileError, SampleRandom, WriteError, open_file, stamp, write_dataset
from ..jobs import ProgressLine, announce, check_outputs, lock_results, start_agreed, steer, write_results
from ..kernels.threads import share_cores
from ..ranks import rank_rows, ranks_sharing_cores
from ..runtime import ActorSystem, JobRefused
from ..telemetry import restart_count
from .config import MemstoreConfig
from .rehearsal import PlantedFailure, planted_failure
from .store import Aggregate, Durability, MemoryStore

RESULTS_FORMAT = "mpiscale.memstore-results/1"


def record_ids(indices: np.ndarray) -> np.ndarray:
    """The id of record number ``i``: sparse, increasing, far from ``i`` itself."""
    return indices.astype(np.int64) * 7919 + 13


async def run_memstore(system: ActorSystem, config: MemstoreConfig) -> dict:
    """The job on every rank; returns the last aggregate's summary."""

    def prepare():
        from mpi4py import MPI

        share_cores(ranks_sharing_cores(MPI.COMM_WORLD))
        failure = planted_failure()  # a malformed rehearsal setting is bad input
        check_outputs(config.out, config.checkpoints or None)
        return lock_results(config.out, MPI.COMM_WORLD), failure

    lock, failure = await start_agreed(system, "memstore", prepare)
    try:
        return await _run(system, config, failure)
    finally:
        if lock is not None:
            lock.release()


async def _run(system: ActorSystem, config: MemstoreConfig, failure: PlantedFailure | None) -> dict:
    durable = Durability(config.checkpoints, config.local_dir or None) if config.checkpoints else None
    store = MemoryStore(system, histogram_bins=config.bins, durable=durable, device=config.device)
    try:
        return await _iterate(system, config, store, failure)
    finally:
        store.close()


async def _iterate(
    system: ActorSystem, config: MemstoreConfig, store: MemoryStore, failure: PlantedFailure | None
) -> dict:
    streams = SampleRandom(config.seed)
    history, recovery = await _start(system, config, store, streams)
    batch = int(round(config.records * config.reinforce))
    b_lo, b_hi = rank_rows(batch, system.size, system.rank)
    progress = ProgressLine(
        config.iterations, len(history), config.progress_every if system.rank == 0 else None, "records"
    )
    for iteration in range(len(history), config.iterations):
        began = time.perf_counter()
        if recovery is not None and "resumed_at" not in recovery:
            recovery["resumed_at"] = time.time()
        entries = range(b_lo, b_hi)
        picked = streams.integers(iteration + 1, entries, 1, 0, config.records)[:, 0]
        deltas = (0.1 * streams.normal(iteration + 1, entries, 1, stream=1)[:, 0]).astype(np.float32)
        await store.reinforce(record_ids(picked), deltas, iteration)
        if failure is not None:
            failure.strike(system.rank, iteration, store.local_directory)
        result = await store.iterate(config.rate, config.top)
        seconds = time.perf_counter() - began
        history.append((result, seconds))
        if config.checkpoints:
            await store.commit(history_arrays(history[-1:]))
            if (iteration + 1) % config.checkpoint_every == 0:
                await store.checkpoint(history_arrays(history))
        text = f"mean quality {result.mean:.4f}  {1e3 * seconds:.2f} ms/iteration"
        progress.update(iteration + 1, text, config.records, {"iteration": seconds})
        saving = (lambda: store.checkpoint(history_arrays(history))) if config.checkpoints else None
        if await steer(system, f"iteration {iteration + 1}", saving):
            break
    progress.finish()
    columns = {name: store.partition.column(name) for name in store.columns}
    try:
        write_dataset(config.records_path, {"ids": store.partition.ids} | columns, system.world.comm, config.to_dict())
    except WriteError as error:  # agreed: raised on every rank
        raise JobRefused(f"mpiscale memstore: {error}", status=1) from None
    write = partial(_write_results, config=config, ranks=system.size, history=history,
                    nbytes=store.partition.nbytes(), recovery=recovery)  # fmt: skip
    done = f"wrote {config.out} and {config.records_path}: {config.records} records, {system.size} ranks"
    failed = f"mpiscale memstore: could not write {config.out}: {{}}".format
    await write_results(system, config.out, write, done, failed)
    last = history[-1][0]
    return {"count": last.count, "mean": last.mean, "top_ids": last.top_ids.tolist()}


async def _start(
    system: ActorSystem, config: MemstoreConfig, store: MemoryStore, streams: SampleRandom
) -> tuple[list[tuple[Aggregate, float]], dict | None]:
    """The history so far and a report of the recovery: recovered from the store's files, or a fresh load."""
    if config.checkpoints:
        problem, recovered = None, None
        try:
            recovered = await store.recover(config.workload())
        except (CheckpointError, DataFileError) as error:  # agreed: every rank raised it
            problem = ValueError(f"mpiscale memstore: {error}")
        await system.agree(problem, "the store's checkpoints and logs")
        if recovered is not None:
            history = history_from(recovered.replicated) + [
                row for notes in recovered.notes for row in history_from(notes)
            ]
            report = {
                "restart": restart_count(),
                "iterations_done": len(history),
                "source": recovered.source,
                "seconds": recovered.seconds,
                "records": recovered.records,
            }
            announce("resumed", f"{recovered.records:,} records after iteration {len(history)}")
            if system.rank == 0:
                print(
                    f"recovered {recovered.records:,} records after iteration {len(history)} from "
                    f"{recovered.source} in {recovered.seconds['total']:.2f} s",
                    flush=True,
                )
            return history, report
    lo, hi = rank_rows(config.records, system.size, system.rank)
    start = streams.uniform(0, range(lo, hi), 2).astype(np.float32)
    await store.upsert(record_ids(np.arange(lo, hi)), {"strength": start[:, 0], "quality": start[:, 1]})
    if config.checkpoints:
        await store.commit()
    return [], None


_HISTORY = ("count", "total", "mean", "maximum", "histogram", "top_ids", "top_quality")


def history_arrays(history: list[tuple[Aggregate, float]]) -> dict[str, np.ndarray]:
    """Per-iteration results stacked by name (for the results file, checkpoints and commit notes)."""
    arrays = {"iteration_s": np.array([seconds for _, seconds in history], np.float64)}
    for name in _HISTORY:
        arrays[name] = np.stack([np.asarray(getattr(aggregate, name)) for aggregate, _ in history])
    arrays["histogram_edges"] = history[0][0].edges if history else np.empty(0)
    return arrays


def history_from(arrays: dict[str, np.ndarray]) -> list[tuple[Aggregate, float]]:
    """The inverse of ``history_arrays``."""
    if "iteration_s" not in arrays:
        return []
    return [
        (
            Aggregate(
                count=int(arrays["count"][i]),
                total=float(arrays["total"][i]),
                mean=float(arrays["mean"][i]),
                maximum=float(arrays["maximum"][i]),
                histogram=arrays["histogram"][i],
                edges=arrays["histogram_edges"],
                top_ids=arrays["top_ids"][i],
                top_quality=arrays["top_quality"][i],
            ),
            float(seconds),
        )
        for i, seconds in enumerate(arrays["iteration_s"])
    ]


def _write_results(
    file: h5py.File,
    config: MemstoreConfig,
    ranks: int,
    history: list[tuple[Aggregate, float]],
    nbytes: int,
    recovery: dict | None,
) -> None:
    stamp(file, RESULTS_FORMAT, ranks, config.to_dict())
    for name, values in history_arrays(history).items():
        file[name] = values
    file.attrs["records_file"] = config.records_path
    file.attrs["rank0_bytes"] = nbytes
    if recovery is not None:
        file.attrs["recovery"] = json.dumps(recovery)


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
