"""The compression job (``mpiscale compress-adapters``): many LoRA adapters into shared components per layer group.

Every rank checks the headers of its block of adapters against the first
one, then the layer groups go one at a time: each rank reads its adapters'
A and B of that group (a first pass checks them, so that a bad one ends the
job with one message), the ranks find the group's shared components together
(:mod:`.pca`: a sum over adapters, so one allreduce makes it exact for any
number of them), and each rank writes its adapters' loadings and errors
straight into the one output file (parallel HDF5). Every pass reads the
adapters one at a time: a rank holds one adapter's matrices and a d x d
matrix, however many adapters it has (the Gram path, for fewer rows than
dimensions, gathers its rows: fewer than d x d numbers).

For adapter i and group g, with components C_A (k_A x in) and C_B (k_B x out):
A_i ~ L_A C_A with L_A = A_i C_A^T, and B_i ~ C_B^T L_B^T with L_B = B_i^T C_B^T.
Its error is that of its weight update, ||B A - B' A'||_F / ||B A||_F, found
from r x r products (the update itself, out x in, is never formed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from ..io import OutputLock, RowWriter
from ..jobs import ProgressLine, check_not_an_input, check_outputs, lock_results, run_without_steps
from ..kernels.threads import share_cores
from ..ranks import AgreedError, Comm, rank_rows, ranks_sharing_cores, run_agreed
from ..runtime import ActorSystem
from .config import AdaptersConfig
from .files import CONFIG, WEIGHTS, Adapter, AdapterError, Module, check_alike, find_adapters, open_adapter
from .pca import Components, shared_components

ADAPTERS_FORMAT = "mpiscale.adapters/1"


class _BadWeights(AgreedError):
    """An adapter's matrices could not be read, or hold NaN, on some rank: bad input (status 2)."""


@dataclass
class _Job:
    comm: Comm
    paths: list[str]
    reference: Adapter
    mine: list[Adapter]  # this rank's block of the adapters
    first: int  # the global index of this rank's first adapter
    lock: OutputLock | None


async def compress_adapters(system: ActorSystem, config: AdaptersConfig) -> dict:
    """Run the job on every rank; bad input (adapters that do not match, settings) ends it before any group is read,
    with one message naming the adapter and status 2."""
    return await run_without_steps(system, "compress-adapters", lambda: _prepare(system, config),
                                   lambda job: _compress(system, config, job), _BadWeights)  # fmt: skip


def _prepare(system: ActorSystem, config: AdaptersConfig) -> _Job:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    share_cores(ranks_sharing_cores(comm))  # BLAS threads: this rank's share of the host's cores
    if not config.adapters:
        raise ValueError("give --adapters: a directory, a glob or a list of PEFT adapter directories")
    check_outputs(config.out, None)
    paths = find_adapters(config.adapters)
    names: dict[str, str] = {}
    for path in paths:
        name = os.path.basename(os.path.normpath(path))
        if name in names:
            raise AdapterError(path, f"has the name of {names[name]}: adapters are named by their directories")
        names[name] = path
    weights = [os.path.join(path, name) for path in paths for name in (WEIGHTS, CONFIG)]
    check_not_an_input(config.out, weights, comm)
    lock = lock_results(config.out, comm)  # the last collective: the checks below may fail on one rank alone
    try:
        reference = open_adapter(paths[0])
        first, stop = rank_rows(len(paths), system.size, system.rank)
        mine = [open_adapter(path) for path in paths[first:stop]]
        for adapter in mine:
            check_alike(adapter, reference)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return _Job(comm, paths, reference, mine, first, lock)


def _compress(system: ActorSystem, config: AdaptersConfig, job: _Job) -> dict:
    comm, reference, count = job.comm, job.reference, len(job.paths)
    table = _adapter_table(job)
    modules = reference.modules
    attrs = {
        "base_model": str(reference.config.get("base_model_name_or_path") or ""),
        "target_modules": json.dumps(reference.config.get("target_modules")),
        "rank": reference.rank,
        "adapters": count,
    }
    layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        f"adapters/{key}": ((count,), v.dtype) for key, v in table.items()
    }
    layout["adapters/error"] = ((count,), np.dtype(np.float64))
    names = _strings([m.name for m in modules])
    layout["modules"] = ((len(modules),), names.dtype)
    progress = ProgressLine(len(modules), 0, config.progress_every if system.rank == 0 else None, "adapters", "group")
    norms, errors = np.zeros(len(job.mine)), np.zeros(len(job.mine))
    kept: list[tuple[int, int]] = []
    with RowWriter(config.out, layout, comm, config.to_dict(), attrs, ADAPTERS_FORMAT) as writer:
        _write_replicated(writer, system.rank, {"modules": names}
                          | {f"adapters/{key}": values for key, values in table.items()})  # fmt: skip
        for index, module in enumerate(modules):
            run_agreed(comm, f"reading {module.name}", partial(_check_group, job.mine, module), _BadWeights)
            sides = _group(config, comm, module, job.mine, count * reference.rank)
            group = f"groups/{index:04d}"
            writer.add(_group_layout(group, sides, count, reference.rank))
            loadings, norm2, error2 = _loadings_and_errors(job.mine, module, sides["A"], sides["B"])
            norms += norm2
            errors += error2
            relative = np.sqrt(np.divide(error2, norm2, out=np.zeros_like(norm2), where=norm2 > 0))
            writer.write(job.first, {f"{group}/{side}/loadings": loadings[side] for side in sides}
                         | {f"{group}/error": relative})  # fmt: skip
            replicated = {f"{group}/{side}/components": c.vectors for side, c in sides.items()}
            replicated |= {f"{group}/{side}/explained": c.explained for side, c in sides.items()}
            _write_replicated(writer, system.rank, replicated)
            kept.append((len(sides["A"].vectors), len(sides["B"].vectors)))
            text = f"{module.name}: k {kept[-1][0]} (A) {kept[-1][1]} (B)"
            progress.update(index + 1, text, count)
        overall = np.sqrt(np.divide(errors, norms, out=np.zeros_like(norms), where=norms > 0))
        writer.write(job.first, {"adapters/error": overall})
    progress.finish()
    return _summary(system, config, job, kept, overall)


def _check_group(adapters: list[Adapter], module: Module) -> None:
    """Read every adapter's matrices of ``module`` once, so that a bad one is agreed on before any collective."""
    for adapter in adapters:
        adapter.read(module)


def _group(
    config: AdaptersConfig, comm: Comm, module: Module, adapters: list[Adapter], rows: int
) -> dict[str, Components]:
    """The shared components of the A rows and of the B columns of one group (``rows`` of each over all the ranks;
    collective); each pass re-reads one side of the adapters one at a time, so a rank never holds more than one."""

    def find(side: str, dimension: int) -> Components:
        def blocks() -> Iterator[np.ndarray]:  # A's rows, or B's columns as rows
            for adapter in adapters:
                (matrix,) = adapter.read(module, side)
                yield matrix if side == "A" else matrix.T

        return shared_components(blocks, rows, dimension, comm, config.method, config.components, config.variance,
                                 config.oversampling, config.power_iterations, config.seed)  # fmt: skip

    return {"A": find("A", module.inputs), "B": find("B", module.outputs)}


def _group_layout(group: str, sides: dict[str, Components], count: int, rank: int) -> dict:
    """The data sets of one group, whose shapes are known once its components are."""
    layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {f"{group}/error": ((count,), np.dtype(np.float64))}
    for side, found in sides.items():
        k, dimension = found.vectors.shape
        layout[f"{group}/{side}/components"] = ((k, dimension), np.dtype(np.float32))
        layout[f"{group}/{side}/loadings"] = ((count, rank, k), np.dtype(np.float32))
        layout[f"{group}/{side}/explained"] = ((k,), np.dtype(np.float64))
    return layout


def _loadings_and_errors(
    adapters: list[Adapter], module: Module, a_side: Components, b_side: Components
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Each adapter's loadings on both sides, and its update's squared norm and squared error (one read each).

    With projections P_A and P_B the rebuilt update is P_B B A P_A, so its
    squared error is ||B A||^2 - ||P_B B A P_A||^2 = tr(B^T B A A^T) - tr(L_B L_B^T L_A L_A^T).
    """
    rank = adapters[0].rank if adapters else 0
    a_loads = np.empty((len(adapters), rank, len(a_side.vectors)))
    b_loads = np.empty((len(adapters), rank, len(b_side.vectors)))
    norm2, error2 = np.zeros(len(adapters)), np.zeros(len(adapters))
    for i, adapter in enumerate(adapters):
        a, b = adapter.read(module)
        a_loads[i] = a @ a_side.vectors.T
        b_loads[i] = b.T @ b_side.vectors.T
        norm2[i] = np.einsum("ij,ji->", b.T @ b, a @ a.T)
        kept = np.einsum("ij,ji->", b_loads[i] @ b_loads[i].T, a_loads[i] @ a_loads[i].T)
        error2[i] = max(norm2[i] - kept, 0.0)
    return {"A": a_loads, "B": b_loads}, norm2, error2


def _adapter_table(job: _Job) -> dict[str, np.ndarray]:
    """Every adapter's name, directory, weights checksum and settings (each rank hashes its own; one allgather)."""
    mine = [(a.name, a.path, a.checksum(), json.dumps(a.config, sort_keys=True)) for a in job.mine]
    rows = [row for part in job.comm.allgather(mine) for row in part]
    columns = list(zip(*rows, strict=True))
    return {key: _strings(list(values)) for key, values in zip(("name", "path", "sha256", "config"), columns,
                                                                strict=True)}  # fmt: skip


def _strings(values: list[str]) -> np.ndarray:
    """Fixed-length UTF-8 bytes (parallel HDF5 writes no variable-length strings)."""
    encoded = [value.encode() for value in values]
    return np.array(encoded, dtype=f"S{max(1, *map(len, encoded))}")


def _write_replicated(writer: RowWriter, rank: int, arrays: dict[str, np.ndarray]) -> None:
    """Arrays every rank holds: rank 0 writes them, the others take part in the collective write with no rows."""
    writer.write(0, arrays if rank == 0 else {name: array[:0] for name, array in arrays.items()})


def _summary(system: ActorSystem, config: AdaptersConfig, job: _Job, kept: list, overall: np.ndarray) -> dict:
    """The job's line on rank 0 and its summary on every rank."""
    modules, rank = job.reference.modules, job.reference.rank
    count = len(job.paths)
    original = count * rank * sum(m.inputs + m.outputs for m in modules)
    stored = sum(ka * m.inputs + kb * m.outputs + count * rank * (ka + kb) for (ka, kb), m in zip(kept, modules))
    worst = max(job.comm.allgather(float(overall.max(initial=0.0))))
    if system.rank == 0:
        print(f"wrote {config.out}: {count} adapters, {len(modules)} layer groups, {stored / original:.1%} of the "
              f"parameters; largest relative error of an adapter's update {worst:.3g}", flush=True)  # fmt: skip
    return {"adapters": count, "groups": len(modules), "stored_share": stored / original, "worst_error": worst}
