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
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..io import BatchReader, Checkpointer, CheckpointError, OutputLock
from ..jobs import (
    ProgressLine,
    check_outputs,
    close_checkpointer,
    lock_results,
    restore_compatible,
    same_bits_everywhere,
    settings_meta,
    start_agreed,
    steer,
    write_results,
)
from ..kernels.devices import resolve_device
from ..kernels.threads import share_cores
from ..ranks import Comm, host_placement, ranks_sharing_cores
from ..runtime import ActorSystem, JobRefused
from .coding import correlations_of, gram_matrix, lasso_encode_gram, omp_encode_gram
from .config import DictLearnConfig
from .data import DataInfo, check_data, initial_dictionary, online_batches, resident_block
from .history import History
from .results import JobResults, results_bytes, write
from .synthetic import recovery_rate, write_planted_dataset
from .update import BatchStatistics, DictionaryState, atoms_to_replace, mod_update, online_update, replace_atoms

log = logging.getLogger(__name__)

#: Settings a checkpoint must share with the run that resumes it.
_COMPATIBLE = (
    "atoms", "sparsity", "method", "coder", "alpha", "batch_size", "seed", "forgetting", "shuffle_window_mib"
)  # fmt: skip


def _code(config: DictLearnConfig, dictionary: np.ndarray, signals: np.ndarray, device: str, gram: np.ndarray):
    """Codes of ``signals``; ``gram`` is ``D D^T`` of ``dictionary``, computed once per dictionary by the caller."""
    correlations = correlations_of(signals, dictionary)
    if config.coder == "lasso":
        return lasso_encode_gram(gram, correlations, config.alpha)
    return omp_encode_gram(gram, correlations, config.sparsity, device)


async def _whole_data_error(system: ActorSystem, config, dictionary, block, device: str, gram: np.ndarray) -> float:
    _, rows = block
    codes = _code(config, dictionary, rows, device, gram)
    residual = rows - codes @ dictionary
    sums = np.array([np.einsum("sf,sf->", residual, residual), np.einsum("sf,sf->", rows, rows)])
    await system.world.allreduce(sums, out=sums)
    return math.sqrt(sums[0] / sums[1]) if sums[1] > 0 else 0.0


def _prepare_data(config: DictLearnConfig, comm: Comm) -> tuple[DataInfo, np.ndarray | None]:
    path, name = config.data_path
    planted = None
    if not config.data:
        planted = write_planted_dataset(
            path, config.samples, config.features, config.planted, config.sparsity, config.snr_db, config.seed, comm
        )
    info = check_data(path, name, config.atoms, config.sparsity, config.batch_size, comm)
    return info, planted


def _restore(config: DictLearnConfig, info, checkpoints: Checkpointer) -> tuple[int, DictionaryState, History] | None:
    def within_iterations(restored) -> None:
        if restored.step > config.iterations:
            raise CheckpointError(
                f"the newest checkpoint in {config.checkpoints} is at iteration {restored.step}, past --iterations "
                f"{config.iterations}: give --iterations {restored.step} or more to continue it"
            )

    restored = restore_compatible(
        checkpoints, config.resume, config.checkpoints, _compatibility(config, info), "iteration", within_iterations
    )
    if restored is None:
        return None
    arrays = restored.replicated
    state = DictionaryState(arrays["dictionary"], arrays["a"], arrays["b"], arrays["idle"])
    return restored.step, state, History.from_arrays(arrays)


@dataclass
class _Job:
    """Everything checked and loaded before the first iteration."""

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


async def learn(system: ActorSystem, config: DictLearnConfig) -> dict:
    """Run the job on every rank; returns a summary (the same on every rank).

    Bad input (data, sizes, output paths, checkpoints, device, another job on
    the same outputs) ends the job before the first iteration with one message,
    no traceback and exit status 2: every rank finds the same problem, and the
    ranks agree on it before they stop. A checkpoint or the results file that
    cannot be written (full disk, quota, a rank stuck in collective I/O) ends it
    with one message and status 1. Other errors keep their tracebacks.
    """
    job = await start_agreed(system, "dictlearn", lambda: _prepare(system, config))
    try:
        return await _run(system, config, job)
    finally:
        if job.results_lock is not None:
            job.results_lock.release()


async def _run(system: ActorSystem, config: DictLearnConfig, job: _Job) -> dict:
    failure: CheckpointError | None = None
    try:
        summary = await _iterate(system, config, job)
        _save_final_checkpoint(config, job)
    except CheckpointError as error:  # raised alike on every rank: the checkpointer agrees on its failures
        failure = error
    finally:
        closing = close_checkpointer(job.checkpoints)  # always: it releases the directory's lock
        failure = failure or closing
    if failure is not None:
        raise JobRefused(f"mpiscale dictlearn: {failure}", status=1) from None
    await same_bits_everywhere(system, [job.state.dictionary], "dictionaries")
    summary["world_size"] = system.size
    summary["threads"] = job.threads
    if job.planted is not None:  # the same on every rank: the ranks agreed on the dictionary
        summary["recovery_rate"] = recovery_rate(job.planted, job.state.dictionary)
    placement = job.comm.allgather((socket.gethostname(), job.device_label))
    results = JobResults(
        config=config,
        info=job.info,
        dictionary=job.state.dictionary,
        history=job.history,
        planted=job.planted,
        recovery_rate=summary.get("recovery_rate"),
        world_size=system.size,
        hosts=sorted({host for host, _ in placement}),
        devices=[label for _, label in placement],
        threads=job.threads,
        stop_reason=summary["stop_reason"],
    )
    rate = summary.get("recovery_rate")
    recovered = f"; planted atoms recovered: {rate:.1%}" if rate is not None else ""
    done = f"wrote {config.out}: {summary['iterations']} iterations on {system.size} ranks{recovered}"
    await write_results(
        system, config.out, partial(write, results=results), done,
        lambda error: _unwritten_results(config, job, results, error),
    )  # fmt: skip
    return summary


def _save_final_checkpoint(config: DictLearnConfig, job: _Job) -> None:
    """Checkpoint the last iteration if the loop did not, so the learned state outlives a failed results write."""
    if job.checkpoints is not None and config.checkpoint_every:
        _save_checkpoint(config, job, job.checkpoints, job.history.iterations)


def _save_checkpoint(config: DictLearnConfig, job: _Job, checkpoints: Checkpointer, step: int) -> None:
    """The state after ``step`` iterations: dictionary, statistics, history, and the settings it belongs to."""
    if checkpoints.last_step == step:
        return
    meta = settings_meta(_compatibility(config, job.info))
    checkpoints.save(step, replicated=job.state.arrays() | job.history.arrays(config.atoms), meta=meta)


def _unwritten_results(config: DictLearnConfig, job: _Job, results: JobResults, error: OSError) -> str:
    """Why the results file could not be written, how much it needs, and where the learned dictionary is."""
    needed = results_bytes(results) / 2**20
    text = f"mpiscale dictlearn: could not write {config.out} (about {needed:.1f} MiB): {error}"
    checkpoints = job.checkpoints
    if checkpoints is not None and checkpoints.last_step == job.history.iterations:
        return (
            f"{text}. The learned dictionary is safe in the checkpoint of iteration {checkpoints.last_step} in "
            f"{config.checkpoints}: make room, then run the same command with --resume to write the results"
        )
    return f"{text}. The learned dictionary is lost with this run; --checkpoint-every N keeps a final checkpoint"


def _prepare(system: ActorSystem, config: DictLearnConfig) -> _Job:
    """Check the input, pick cores and device, load the data's first atoms or the newest checkpoint (collective)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD  # blocking I/O and checks; the iterations' allreduce goes through system.world
    device = resolve_device(config.device) if config.coder == "omp" else "cpu"
    rank_on_host, _ = host_placement(comm)
    threads = share_cores(ranks_sharing_cores(comm))
    label = device
    if device == "cuda":
        from ..kernels.devices import select_gpu

        label = f"cuda:{select_gpu(rank_on_host)}"
    check_outputs(config.out, config.checkpoints if config.checkpoint_every or config.resume else None)
    results_lock = lock_results(config.out, comm)  # before anything is written
    checkpoints = None
    try:
        info, planted = _prepare_data(config, comm)
        state = DictionaryState.start(initial_dictionary(info, config.atoms, config.seed, comm))
        history, start, checkpoints = History.start(config.iterations), 0, None
        if config.checkpoint_every or config.resume:
            checkpoints = Checkpointer(config.checkpoints, comm, keep=2)
            restored = _restore(config, info, checkpoints)
            if restored is not None:
                start, state, history = restored
                if system.rank == 0:
                    print(f"resumed from the checkpoint of iteration {start} in {config.checkpoints}", flush=True)
            elif config.resume and system.rank == 0:
                log.warning("--resume: no checkpoint in %s, starting from the beginning", config.checkpoints)
        return _Job(comm, info, planted, state, history, start, checkpoints, device, label, threads, results_lock)
    except BaseException:
        if checkpoints is not None:
            close_checkpointer(checkpoints)  # its lock too: the job never started
        if results_lock is not None:
            results_lock.release()
        raise


async def _iterate(system: ActorSystem, config: DictLearnConfig, job: _Job) -> dict:
    rank, size = system.rank, system.size
    info, state, history = job.info, job.state, job.history
    start, checkpoints, device = job.start, job.checkpoints, job.device
    stats = BatchStatistics(config.atoms, info.features, size, config.max_replace)
    alpha = config.alpha if config.coder == "lasso" else 0.0
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
    progress = ProgressLine(config.iterations, start, config.progress_every if rank == 0 else None, "signals")
    previous_time = history.metrics["time_s"][-1] if history.metrics["time_s"] else 0.0
    gram = gram_matrix(state.dictionary)
    clock = time.perf_counter()
    stop_reason = "iterations"
    try:
        for iteration in range(start, config.iterations):
            began = time.perf_counter()
            if reader is not None:
                ids, signals = await anext(batches)
            else:
                assert block is not None  # "mod" keeps the whole data resident
                ids, signals = block
            read = time.perf_counter()
            codes = _code(config, state.dictionary, signals, device, gram)
            stats.fill(rank, ids, signals, codes, state.dictionary, alpha)
            coded = time.perf_counter()
            await system.world.allreduce(stats.buffer, out=stats.buffer)
            reduced = time.perf_counter()
            if config.method == "online":
                online_update(state, stats, iteration, config.forgetting)
            else:
                mod_update(state, stats)
            gram = gram_matrix(state.dictionary)  # for the duplicate check and the next batch's coder
            replace = atoms_to_replace(state, stats.usage, config.replace_after, config.duplicate_cosine, gram)
            replaced = replace_atoms(state, replace, stats.worst_signals()) if replace else 0
            if replaced:
                gram = gram_matrix(state.dictionary)
            updated = time.perf_counter()
            full_error = math.nan
            if config.eval_every and (iteration + 1) % config.eval_every == 0:
                full_error = await _whole_data_error(system, config, state.dictionary, block, device, gram)
            row = stats.metrics(alpha) | {
                "replaced": float(replaced),
                "read_s": read - began,
                "compute_s": coded - read,
                "comm_s": reduced - coded,
                "update_s": updated - reduced,
                "time_s": previous_time + (updated - clock),
                "full_error": full_error,
            }
            history.record(row, stats.usage)
            phases = {"read": row["read_s"], "coding": row["compute_s"], "allreduce": row["comm_s"],
                      "update": row["update_s"]}  # fmt: skip
            progress.update(iteration + 1, _progress_text(row), stats.sum("signals"), phases)
            if checkpoints is not None and config.checkpoint_every and (iteration + 1) % config.checkpoint_every == 0:
                _save_checkpoint(config, job, checkpoints, iteration + 1)
            saving = None if checkpoints is None else partial(_save_checkpoint, config, job, checkpoints, iteration + 1)
            stopped = await steer(system, f"iteration {iteration + 1}", saving)
            clock += time.perf_counter() - updated  # evaluation, progress and checkpoints do not count as training
            if stopped or (config.target_error and full_error <= config.target_error):
                stop_reason = "stopped" if stopped else "target_error"
                break
    finally:
        if reader is not None:
            await batches.aclose()
            reader.close()
    progress.finish()
    return {"iterations": history.iterations, "stop_reason": stop_reason}


def _progress_text(row: dict) -> str:
    return f"objective {row['objective']:.4e}  error {row['error']:.4f}  non-zeros {row['sparsity']:.2f}"


def _compatibility(config: DictLearnConfig, info) -> dict:
    values = {name: getattr(config, name) for name in _COMPATIBLE}
    return values | {"features": info.features, "samples": info.samples}
