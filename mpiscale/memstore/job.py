"""``mpiscale memstore``: a synthetic learning workload on the store, with progress, results and the final records.

The workload depends only on the seed, through per-sample random streams
(``SampleRandom``): record ``i`` has id ``7919 i + 13`` and its starting
strength and quality; the reinforcement entry ``j`` of iteration ``t`` picks a
record and a delta from stream ``t``. Each rank generates its block of every
batch, so the results are the same bits on any number of ranks.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field
from functools import partial

import h5py
import numpy as np

from ..io import (
    DATASET_FORMAT,
    CheckpointError,
    DataFileError,
    OutputLock,
    SampleRandom,
    open_file,
    stamp,
    write_dataset,
)
from ..jobs import (
    Ended,
    Plan,
    Step,
    announce,
    check_replaceable,
    claim_outputs,
    give_back,
    run_lifecycle,
    write_results,
)
from ..kernels.threads import share_cores
from ..ranks import rank_rows, ranks_sharing_cores
from ..runtime import ActorSystem
from ..telemetry import restart_count
from ..words import counted
from .config import MemstoreConfig
from .durability import Durability
from .history import IterationHistory
from .rehearsal import VARIABLE, PlantedFailure, planted_failure
from .store import MemoryStore

RESULTS_FORMAT = "mpiscale.memstore-results/1"


def record_ids(indices: np.ndarray) -> np.ndarray:
    """The id of record number ``i``: sparse, increasing, far from ``i`` itself."""
    return indices.astype(np.int64) * 7919 + 13


async def run_memstore(system: ActorSystem, config: MemstoreConfig) -> dict:
    """The job on every rank; returns the last aggregate's summary."""
    return await run_lifecycle(system, "memstore", lambda: _prepare(system, config))


def _prepare(system: ActorSystem, config: MemstoreConfig) -> _Memstore:
    from mpi4py import MPI

    prepared_at = time.time()  # MPI and the runtime are up, the modules imported
    share_cores(ranks_sharing_cores(MPI.COMM_WORLD))
    failure = planted_failure()  # a malformed rehearsal setting is bad input
    if failure is not None and failure.kills:  # the rank says why as it dies: one line for the whole failure
        system.planned_deaths[failure.rank] = f"killed by {VARIABLE} in iteration {failure.iteration}"
    lock = claim_outputs(config.out, config.checkpoint_dir or None, [], MPI.COMM_WORLD, RESULTS_FORMAT)
    try:
        check_replaceable(config.records_path, DATASET_FORMAT, MPI.COMM_WORLD, "the records file")
    except ValueError:
        give_back(lock)
        raise
    durable = Durability(config.checkpoint_dir, config.local_dir or None) if config.checkpoint_dir else None
    try:
        store = MemoryStore(system, histogram_bins=config.bins, durable=durable, device=config.device)
    except BaseException:
        give_back(lock)  # the job never started
        raise
    # every iteration is committed (its logs hold the last ones): no checkpoint at the end
    plan = Plan("iteration", "records", config.iterations, config.progress_every, config.checkpoint_every,
                saves=bool(config.checkpoint_dir))  # fmt: skip
    return _Memstore(system, config, store, failure, lock, plan, prepared_at=prepared_at)


@dataclass
class _Memstore:
    """The job between its checks and its results (a ``jobs.SteppedJob``)."""

    system: ActorSystem
    config: MemstoreConfig
    store: MemoryStore
    failure: PlantedFailure | None
    results_lock: OutputLock | None
    plan: Plan
    history: IterationHistory = field(default_factory=IterationHistory)
    prepared_at: float = 0.0
    recovery: dict | None = None  # how the store was recovered, and what the restart cost, for the results file

    async def restore(self) -> int:
        """The iterations the store's files hold (recovered), or 0 after a fresh load of the records."""
        system, config, store = self.system, self.config, self.store
        if config.checkpoint_dir:
            problem, recovered = None, None
            try:
                recovered = await store.recover(config.workload(), config.accept_rollback)
            except (CheckpointError, DataFileError) as error:  # agreed: every rank raised it
                problem = ValueError(f"mpiscale memstore: {error}")
            await system.agree(problem, "the store's checkpoints and logs")
            if recovered is not None:
                self.history.from_arrays(recovered.replicated)
                for notes in recovered.notes:
                    self.history.extend(notes)
                done = len(self.history)
                self.recovery = {"restart": restart_count(), "iterations_done": done, "source": recovered.source,
                                 "seconds": recovered.seconds, "records": recovered.records,
                                 "process_started_at": _process_started_at(),
                                 "prepared_at": self.prepared_at}  # fmt: skip
                announce("resumed", f"{recovered.records:,} records after iteration {done}")
                if system.rank == 0:
                    print(
                        f"recovered {recovered.records:,} records after iteration {done} from "
                        f"{recovered.source} in {recovered.seconds['total']:.2f} s",
                        flush=True,
                    )
                return done
        lo, hi = rank_rows(config.records, system.size, system.rank)
        start = SampleRandom(config.seed).uniform(0, range(lo, hi), 2).astype(np.float32)
        await store.upsert(record_ids(np.arange(lo, hi)), {"strength": start[:, 0], "quality": start[:, 1]})
        if config.checkpoint_dir:
            await store.commit()
        return 0

    def steps(self, start: int) -> AsyncGenerator[Step, None]:
        return _iterate(self, start)

    def save(self, done: int) -> Awaitable[None]:
        return self.store.checkpoint(self.history.to_arrays())

    def close_checkpoints(self) -> CheckpointError | None:
        try:
            self.store.close()
        except CheckpointError as error:
            return error
        return None

    async def finish(self, ended: Ended) -> dict:
        system, config, store = self.system, self.config, self.store
        columns = {name: store.partition.column(name) for name in store.columns}
        write_dataset(config.records_path, {"ids": store.partition.ids} | columns, system.world.comm,
                      config.to_dict())  # fmt: skip
        write = partial(_write_results, config=config, ranks=system.size, history=self.history,
                        nbytes=store.partition.nbytes(), recovery=self.recovery)  # fmt: skip
        done = f"wrote {config.out} and {config.records_path}: {config.records} records, {counted(system.size, 'rank')}"
        failed = f"mpiscale memstore: could not write {config.out}: {{}}".format
        await write_results(system, config.out, write, done, failed)
        last = self.history.last
        return {"count": last.count, "mean": last.mean, "top_ids": last.top_ids.tolist()}

    def release(self) -> None:
        try:
            self.store.close()  # closed already, unless the job failed before
        finally:
            if self.results_lock is not None:
                self.results_lock.release()


async def _iterate(job: _Memstore, start: int) -> AsyncGenerator[Step, None]:
    """The iterations from ``start``: a batch of reinforcements, the decay and aggregate, the commit."""
    system, config, store, history = job.system, job.config, job.store, job.history
    streams = SampleRandom(config.seed)
    batch = int(round(config.records * config.reinforce))
    b_lo, b_hi = rank_rows(batch, system.size, system.rank)
    for iteration in range(start, config.iterations):
        began = time.perf_counter()
        if job.recovery is not None and "resumed_at" not in job.recovery:
            job.recovery["resumed_at"] = time.time()
        entries = range(b_lo, b_hi)
        picked = streams.integers(iteration + 1, entries, 1, 0, config.records)[:, 0]
        deltas = (0.1 * streams.normal(iteration + 1, entries, 1, stream=1)[:, 0]).astype(np.float32)
        await store.reinforce(record_ids(picked), deltas, iteration)
        if job.failure is not None:
            job.failure.strike(system.rank, iteration, store.local_directory)
        result = await store.iterate(config.rate, config.top)
        seconds = time.perf_counter() - began
        history.append(result, seconds)
        if config.checkpoint_dir:
            await store.commit(history.to_arrays(slice(-1, None)))
        text = f"mean quality {result.mean:.4f}  {1e3 * seconds:.2f} ms/iteration"
        yield Step(text, config.records, {"iteration": seconds})


def _process_started_at() -> float | None:
    """When this process began (seconds since the epoch, to the kernel's clock tick), so that a restart's cost splits
    into the launch and the start-up; None where ``/proc`` does not say."""
    try:
        fields = open("/proc/self/stat").read().rpartition(")")[2].split()  # the name in () may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22
    except (OSError, IndexError, ValueError, AttributeError):
        return None
    return time.time() - age


def _write_results(
    file: h5py.File,
    config: MemstoreConfig,
    ranks: int,
    history: IterationHistory,
    nbytes: int,
    recovery: dict | None,
) -> None:
    stamp(file, RESULTS_FORMAT, ranks, config.to_dict())
    for name, values in history.to_arrays().items():
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
                f"{path}: {settings['records']:,} records, {len(seconds)} iterations on {counted(ranks, 'rank')}, "
                f"mpiscale {file.attrs['mpiscale_version']}, {file.attrs['created']}",
                f"time per iteration: median {1e3 * np.median(seconds):.2f} ms, first {1e3 * seconds[0]:.2f} ms",
                f"last iteration: mean quality {file['mean'][-1]:.6f}, maximum {file['maximum'][-1]:.6f}, "
                f"count {int(file['count'][-1])}",
                f"top 5 ids: {', '.join(str(i) for i in file['top_ids'][-1][:5])}",
                f"records: {file.attrs['records_file']}",
            ]
        )
