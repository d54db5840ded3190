"""The distributed dictionary-learning job: every rank codes its slice, one allreduce, the same update everywhere.

``learn(system, config)`` runs on every rank inside ``mpiscale.run``. Each
iteration a rank reads its part of the global mini-batch, sparse-codes it,
fills its part of the batch statistics and awaits one allreduce; every rank
then applies the same update to the same sums, so the dictionaries stay
identical and the result does not depend on the number of ranks (up to the
order in which the allreduce adds). Checkpoints hold the whole learner state,
so a resumed run, on any number of ranks, continues exactly where it stopped.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..io import DATASET_FORMAT, BatchReader, Checkpointer, CheckpointError, OutputLock, close_after
from ..jobs import (
    Ended,
    HeldOutputs,
    Plan,
    Step,
    check_replaceable,
    choose_numba_device,
    claim_outputs,
    give_back,
    load_state,
    open_checkpointer,
    restore_compatible,
    run_lifecycle,
    same_bits_everywhere,
    settings_meta,
    state_arrays,
    write_results,
)
from ..kernels.threads import blas_beside_numba, share_cores
from ..ranks import Comm, ranks_sharing_cores
from ..runtime import ActorSystem
from ..words import counted
from .config import DictLearnConfig
from .data import (
    DataInfo,
    check_data,
    initial_dictionary,
    memory_problem,
    online_batches,
    resident_block,
    size_problems,
)
from .history import History
from .iteration import Iteration, Rule
from .results import RESULTS_FORMAT, JobResults, results_bytes, write
from .synthetic import recovery_rate, write_planted_dataset
from .update import DictionaryState, close_pairs

log = logging.getLogger(__name__)

#: Settings a checkpoint must share with the run that resumes it.
_COMPATIBLE = (
    "atoms", "sparsity", "method", "coder", "alpha", "batch_size", "seed", "forgetting", "shuffle_window_mib",
    "max_residual", "remove_mean",
)  # fmt: skip
#: Settings added after checkpoints were first written, as a checkpoint that does not name them was saved.
_ADDED = {"max_residual": 0.0, "remove_mean": False}
#: Why a resumed run refuses data other than its checkpoint's (``DataInfo.fingerprint``).
_OTHER_DATA = ("the data's values differ from those the checkpoint learned from: written again, or replaced; resume "
               "on the data it learned from, or start afresh with another --checkpoint-dir")  # fmt: skip
#: Rows coded at once by the whole-data error: 8,192 rows of 256 atoms are 16 MiB of codes and correlations.
EVAL_ROWS = 8192


async def _whole_data_error(system: ActorSystem, step: Iteration, block) -> float:
    """The relative error of the whole (resident) data set's codes (collective), coded ``EVAL_ROWS`` rows at a
    time: the codes and correlations of all of a rank's rows at once took 2 x 400 MB for 200,000 signals of 256
    atoms, which grows with the data set, not with the batch."""
    sums = np.zeros(2)
    signals = block[1]
    for start in range(0, len(signals), EVAL_ROWS):
        rows = step.prepared(signals[start : start + EVAL_ROWS])
        residual = rows - step.code(rows).dense() @ step.state.dictionary  # rebuilt() gathers rows x L x features
        sums += (np.einsum("sf,sf->", residual, residual), np.einsum("sf,sf->", rows, rows))
    await system.world.allreduce(sums, out=sums)
    return math.sqrt(sums[0] / sums[1]) if sums[1] > 0 else 0.0


def _prepare_data(config: DictLearnConfig, comm: Comm) -> DataInfo:
    """The data checked; a synthetic set is only planned here (its sizes checked), and written by ``_planted``
    once nothing can refuse the job any more, so that a refused run never rewrites an earlier run's set."""
    path, name = config.data_path
    batch_size = config.batch_size if config.method == "online" else None  # mod reads no mini-batches
    too_many = memory_problem(config.atoms, comm)
    if too_many:
        raise ValueError(too_many)
    if config.data:
        return check_data(path, name, config.atoms, config.sparsity, batch_size, comm)
    problems = size_problems(config.atoms, config.sparsity, batch_size, config.samples, config.features)
    if problems:
        raise ValueError(f"the synthetic data set: {problems}")
    check_replaceable(path, DATASET_FORMAT, comm, "the synthetic data set's file")  # (it sits beside --out)
    return DataInfo(path, name, config.samples, config.features)


def _planted(config: DictLearnConfig, comm: Comm) -> np.ndarray | None:
    """Write the synthetic set the job learns from (collective); its planted atoms (None for the user's data)."""
    if config.data:
        return None
    path, _ = config.data_path
    return write_planted_dataset(
        path, config.samples, config.features, config.planted, config.sparsity, config.snr_db, config.seed, comm
    )


def _restore(
    config: DictLearnConfig, info: DataInfo, checkpoints: Checkpointer, state: DictionaryState, history: History
) -> int:
    """The iterations of the checkpoint a resumed run continues, its state loaded into ``state`` and ``history``."""

    def within_iterations(restored) -> None:
        if restored.step > config.iterations:
            raise CheckpointError(
                f"the newest checkpoint in {config.checkpoints} is at iteration {restored.step}, past --iterations "
                f"{config.iterations}: give --iterations {restored.step} or more to continue it"
            )

    restored = restore_compatible(
        checkpoints,
        config.resume,
        config.checkpoints,
        _compatibility(config, info),
        "iteration",
        within_iterations,
        why={"data": _OTHER_DATA},
        added=_ADDED | {"data": info.fingerprint},  # a checkpoint of an earlier version kept no fingerprint
    )
    if restored is None:
        return 0
    load_state(restored.replicated, state, history)
    return restored.step


async def learn(system: ActorSystem, config: DictLearnConfig) -> dict:
    """Run the job on every rank; returns a summary (the same on every rank).

    Bad input (data, sizes, output paths, checkpoints, device, another job on
    the same outputs) ends the job before the first iteration with one message,
    no traceback and exit status 2: every rank finds the same problem, and the
    ranks agree on it before they stop. A checkpoint or the results file that
    cannot be written (full disk, quota, a rank stuck in collective I/O) ends it
    with one message and status 1. Other errors keep their tracebacks.
    """
    return await run_lifecycle(system, "dictlearn", lambda: _prepare(system, config))


@dataclass
class _Learning(HeldOutputs):
    """The job between its checks and its results (a ``jobs.SteppedJob``)."""

    system: ActorSystem
    config: DictLearnConfig
    comm: Comm
    info: DataInfo
    planted: np.ndarray | None
    state: DictionaryState
    history: History
    start: int
    checkpoints: Checkpointer | None
    device: str
    device_label: str
    threads: int
    results_lock: OutputLock | None  # rank 0's hold on the results path
    plan: Plan

    async def restore(self) -> int:
        return self.start  # restored while preparing, where a bad checkpoint is bad input

    def save(self, done: int) -> None:
        """The state after ``done`` iterations: dictionary, statistics, history, and the settings it belongs to."""
        assert self.checkpoints is not None
        meta = settings_meta(_compatibility(self.config, self.info))
        self.checkpoints.save(done, replicated=state_arrays(self.state, self.history), meta=meta)

    def steps(self, start: int) -> AsyncGenerator[Step, None]:
        return _iterate(self, start)

    async def finish(self, ended: Ended) -> dict:
        system, config = self.system, self.config
        await same_bits_everywhere(system, [self.state.dictionary], "dictionaries")
        stop_reason = "stopped" if ended.stopped else ended.reached or "iterations"
        summary: dict = {"iterations": self.history.iterations, "stop_reason": stop_reason,
                         "world_size": system.size, "threads": self.threads}  # fmt: skip
        if self.planted is not None:  # the same on every rank: the ranks agreed on the dictionary
            summary["recovery_rate"] = recovery_rate(self.planted, self.state.dictionary)
        summary["close_pairs"], closest = close_pairs(self.state.dictionary, config.duplicate_cosine)
        if summary["close_pairs"] and config.duplicate_cosine < 1 and system.rank == 0:
            print(f"note: {summary['close_pairs']} pairs of atoms remain at |cosine| above --duplicate-cosine "
                  f"{config.duplicate_cosine} (up to {closest:.3f}). A replacement takes a badly coded signal and "
                  "the last batches had none to spare: the data may hold fewer distinct directions than "
                  f"{config.atoms} atoms, and fewer atoms would do", flush=True)  # fmt: skip
        placement = self.comm.allgather((socket.gethostname(), self.device_label))
        results = JobResults(
            config=config,
            info=self.info,
            dictionary=self.state.dictionary,
            history=self.history,
            planted=self.planted,
            recovery_rate=summary.get("recovery_rate"),
            world_size=system.size,
            hosts=sorted({host for host, _ in placement}),
            devices=[label for _, label in placement],
            threads=self.threads,
            stop_reason=stop_reason,
        )
        rate = summary.get("recovery_rate")
        recovered = f"; planted atoms recovered: {rate:.1%}" if rate is not None else ""
        done = f"wrote {config.out}: {summary['iterations']} iterations on {counted(system.size, 'rank')}{recovered}"
        await write_results(
            system, config.out, partial(write, results=results), done, partial(self._unwritten_results, results)
        )
        return summary

    def _unwritten_results(self, results: JobResults, error: OSError) -> str:
        """Why the results file could not be written, how much it needs, and where the learned dictionary is."""
        config, checkpoints = self.config, self.checkpoints
        needed = results_bytes(results) / 2**20
        text = f"mpiscale dictlearn: could not write {config.out} (about {needed:.1f} MiB): {error}"
        if checkpoints is not None and checkpoints.last_step == self.history.iterations:
            return (
                f"{text}. The learned dictionary is safe in the checkpoint of iteration {checkpoints.last_step} in "
                f"{config.checkpoints}: make room, then run the same command with --resume to write the results"
            )
        return f"{text}. The learned dictionary is lost with this run; --checkpoint-every N keeps a final checkpoint"


def _prepare(system: ActorSystem, config: DictLearnConfig) -> _Learning:
    """Check the input, pick cores and device, load the data's first atoms or the newest checkpoint (collective)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD  # blocking I/O and checks; the iterations' allreduce goes through system.world
    label = choose_numba_device(config.device if config.coder == "omp" else "cpu", comm)
    device = label.split(":")[0]
    threads = share_cores(ranks_sharing_cores(comm), scipy_blas=True)
    # the checkpoints are always open: a stop checkpoints without periodic ones too
    results_lock = claim_outputs(config.out, config.checkpoints, [config.data], comm, RESULTS_FORMAT)
    checkpoints = None
    try:
        info = _prepare_data(config, comm)
        state = DictionaryState.start(np.zeros((config.atoms, info.features)))  # what a checkpoint restores into
        history, start = History.start(config.iterations, config.atoms), 0
        checkpoints = open_checkpointer(config.checkpoints, comm, config.local_dir, config.shared_every)
        start = _restore(config, info, checkpoints, state, history)
        planted = _planted(config, comm)  # every check passed: nothing can refuse the job now
        if not start:
            state = DictionaryState.start(initial_dictionary(info, config.atoms, config.seed, comm, config.remove_mean))
        if start and system.rank == 0:
            print(f"resumed from the checkpoint of iteration {start} in {config.checkpoints}", flush=True)
        elif config.resume and not start and system.rank == 0:
            log.warning("--resume: no checkpoint in %s, starting from the beginning", config.checkpoints)
        plan = Plan("iteration", "signals", config.iterations, config.progress_every, config.checkpoint_every, True,
                    checkpoint_at_end=config.checkpoint_every > 0)  # fmt: skip
        return _Learning(
            system, config, comm, info, planted, state, history, start, checkpoints, device, label, threads,
            results_lock, plan,
        )  # fmt: skip
    except BaseException:
        give_back(results_lock, checkpoints)  # the job never started
        raise


async def _iterate(job: _Learning, start: int) -> AsyncGenerator[Step, None]:
    """The iterations from ``start``, one ``Step`` after each."""
    system, config = job.system, job.config
    rank, size = system.rank, system.size
    info, history = job.info, job.history
    step = Iteration(rule_of(config), job.state, size, job.device)
    block = resident_block(info, job.comm) if config.method == "mod" or config.eval_every else None
    reader = None
    if config.method == "online":
        reader = BatchReader(
            info.path,
            [info.name],
            config.batch_size,
            job.comm,
            shuffle=True,
            seed=config.seed,
            drop_last=True,
            shuffle_window=config.shuffle_window(info.features),
            in_memory=config.keep_in_memory,
        )
        batches = online_batches(reader, info.name, start)
    previous_time = history.metrics["time_s"][-1] if history.metrics["time_s"] else 0.0
    clock = time.perf_counter()
    failure: BaseException | None = None
    with blas_beside_numba():  # the coding on several threads, the products beside it on one
        try:
            for iteration in range(start, config.iterations):
                began = time.perf_counter()
                if reader is not None:
                    ids, signals = await anext(batches)
                else:
                    assert block is not None  # "mod" keeps the whole data resident
                    ids, signals = block
                read = time.perf_counter()
                step.fill(rank, ids, signals)
                coded = time.perf_counter()
                await system.world.allreduce(step.stats.buffer, out=step.stats.buffer)
                reduced = time.perf_counter()
                replaced = step.apply(iteration)
                updated = time.perf_counter()
                full_error = recovered = math.nan
                if config.eval_every and (iteration + 1) % config.eval_every == 0:
                    full_error = await _whole_data_error(system, step, block)
                    if job.planted is not None:  # the same on every rank: the ranks agreed on the dictionary
                        recovered = recovery_rate(job.planted, step.state.dictionary)
                row = step.stats.metrics(step.rule.penalty) | {
                    "replaced": float(replaced),
                    "read_s": read - began,
                    "compute_s": coded - read,
                    "comm_s": reduced - coded,
                    "update_s": updated - reduced,
                    "time_s": previous_time + (updated - clock),
                    "full_error": full_error,
                    "recovered": recovered,
                }
                history.record(row, step.stats.usage)
                phases = {"read": row["read_s"], "coding": row["compute_s"], "allreduce": row["comm_s"],
                          "update": row["update_s"]}  # fmt: skip
                reached = "target_error" if config.target_error and full_error <= config.target_error else None
                yield Step(_progress_text(row), step.stats.sum("signals"), phases, reached)
                clock += time.perf_counter() - updated  # evaluation, progress and checkpoints do not count as training
        except BaseException as error:
            failure = error
            raise
        finally:
            if reader is not None:
                await batches.aclose()
                close_after(reader, failure)  # (after an error of this rank's alone, the others wait in the allreduce)


def _progress_text(row: dict) -> str:
    recovered = "" if math.isnan(row["recovered"]) else f"  planted recovered {row['recovered']:.0%}"
    return f"objective {row['objective']:.4e}  error {row['error']:.4f}  non-zeros {row['sparsity']:.2f}{recovered}"


def rule_of(config: DictLearnConfig) -> Rule:
    """The iteration's rule of a job's settings."""
    return Rule(config.method, config.coder, config.sparsity, config.alpha, config.forgetting, config.replace_after,
                config.max_replace, config.duplicate_cosine, config.max_residual, config.remove_mean)  # fmt: skip


def _compatibility(config: DictLearnConfig, info: DataInfo) -> dict:
    values = {name: getattr(config, name) for name in _COMPATIBLE}
    return values | {"features": info.features, "samples": info.samples, "data": info.fingerprint}
