"""The compression job (``mpiscale compress-adapters``): many LoRA adapters into shared components per layer group.

Every rank checks its block of the adapters before anything is written (the
headers against the first adapter, then every matrix read once: a bad one
ends the job with one message). Then the layer groups go one at a time, a
step each of the jobs' common lifecycle: each rank reads its adapters' A and
B of that group, the ranks find the group's shared components together
(:mod:`.pca`: a sum over adapters, so one allreduce makes it exact for any
number of them), and each rank writes its adapters' loadings, update norms
and errors straight into the one output file (parallel HDF5). Every pass
reads the adapters one at a time: a rank holds one adapter's matrices and a
d x d matrix, however many adapters it has (the Gram path, for fewer rows
than dimensions, gathers its rows: fewer than d x d numbers).

A stop (SIGTERM, a stop command) after a group closes the file as
``OUT.partial``; a killed rank or a failure leaves it as ``OUT.tmp``, flushed
after each group it marked done. ``--resume`` reopens either and does the
remaining groups, on any number of ranks (its data sets are global, by
adapter), the group a killed run had begun written again. ``--add-to EARLIER``
joins new adapters to an earlier compressed file (see :mod:`.earlier`).

For adapter i and group g, with components C_A (k_A x in) and C_B (k_B x out):
A_i ~ L_A C_A with L_A = A_i C_A^T, and B_i ~ C_B^T L_B^T with L_B = B_i^T C_B^T.
Its error is that of its weight update, ||B A - B' A'||_F / ||B A||_F, found
from r x r products (the update itself, out x in, is never formed).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass

import numpy as np

from ..io import DataFileError, OutputLock, RowWriter, fixed_strings, open_file
from ..jobs import (
    Ended,
    OutputAsState,
    Plan,
    Step,
    agreed_cuda_aware,
    choose_torch_device,
    claim_outputs,
    earlier_output,
    give_back,
    recorded_devices,
    run_lifecycle,
    setting_differences,
)
from ..kernels.threads import share_cores
from ..ranks import Comm, on_rank_0, rank_rows, ranks_sharing_cores
from ..runtime import ActorSystem
from .algebra import Algebra, HostAlgebra, TorchAlgebra
from .config import AdaptersConfig
from .earlier import Earlier, update_norm2
from .files import (
    CONFIG,
    Adapter,
    AdapterError,
    Module,
    adapter_names,
    check_alike,
    find_adapters,
    open_adapter,
)
from .layout import ADAPTERS_FORMAT, group_name
from .pca import Components, shared_components
from .weights import weights_file

#: The settings a resumed run must share with the stopped one (the others, such as progress, may change).
RESULT_SETTINGS = (
    "components",
    "variance",
    "max_components",
    "method",
    "oversampling",
    "power_iterations",
    "seed",
    "add_to",
)


async def compress_adapters(system: ActorSystem, config: AdaptersConfig) -> dict:
    """Run the job on every rank; bad input (adapters that do not match, settings) ends it before any group is read,
    with one message naming the adapter and status 2."""
    return await run_lifecycle(system, "compress-adapters", lambda: _prepare(system, config))


@dataclass
class _Compression(OutputAsState):
    """One run: the adapters of every rank (``paths``), this rank's block (``mine``) and the file being written."""

    system: ActorSystem
    config: AdaptersConfig
    comm: Comm
    paths: list[str]
    reference: Adapter
    mine: list[Adapter]
    first: int  # the global index of this rank's first adapter among the new ones
    results_lock: OutputLock | None
    kept: str | None  # an earlier run's file this one goes on from (--resume)
    earlier: Earlier | None  # --add-to: its adapters come first in the file
    plan: Plan
    algebra: Algebra  # where the products and eigensolvers run
    command = "compress-adapters"
    kept_work = "the layer groups done so far"

    @property
    def count(self) -> int:
        """Adapters in the output file."""
        return len(self.paths) + (self.earlier.count if self.earlier else 0)

    @property
    def groups(self) -> tuple[Module, ...]:
        return self.reference.modules

    async def restore(self) -> int:
        """Open the output (an earlier run's, with ``--resume``, else a new one); the groups done."""
        table, kept = self._table(), self.kept
        problem = None
        if self.system.rank == 0:
            problem = self._already_joined(table) or (_not_resumable(kept, self.config, table) if kept else None)
        await self.system.agree(ValueError(f"mpiscale compress-adapters: {problem}") if problem else None,
                                "the adapters and the stopped run")  # fmt: skip
        return self._reopen(kept) if kept is not None else self._create(table)

    def _reopen(self, kept: str) -> int:
        """Go on writing an earlier run's file, without what a killed run began of its next group; the groups done."""
        self.writer = RowWriter.reopen(self.config.out, kept, self.comm)
        done = int(self.writer.file.attrs["groups_done"])  # type: ignore[union-attr]
        self.writer.remove([group_name(index) for index in range(done, len(self.groups))])
        self.writer.mark(device=recorded_devices(self.algebra.device, self.comm))  # this run's, for its groups
        self.say_resumed(kept, done, len(self.groups), "layer groups were done")
        return done

    async def steps(self, start: int) -> AsyncGenerator[Step, None]:
        for index in range(start, len(self.groups)):
            text = self._compress_group(index)
            self._writer.mark(groups_done=index + 1)
            self._writer.flush()  # a killed run's OUT.tmp holds every group it marked
            await asyncio.sleep(0)  # a group computes without awaiting: let the loop take signals and commands now
            yield Step(text, self.count)

    def save(self, done: int) -> None:
        pass  # every completed group is in the file, flushed

    async def finish(self, ended: Ended) -> dict:
        if ended.done < len(self.groups):
            return self._keep(ended.done)
        overall = self._overall_errors()
        kept = [(self._writer.file[f"{group_name(i)}/A/components"].shape[0],  # type: ignore[index]
                 self._writer.file[f"{group_name(i)}/B/components"].shape[0])  # type: ignore[index]
                for i in range(len(self.groups))]  # fmt: skip
        self._writer.close()
        return self._summary(kept, overall)

    def _table(self) -> dict[str, np.ndarray]:
        """Every adapter's name, directory, weights checksum and settings: the earlier file's, then this run's (each
        rank hashes its own; one allgather)."""
        mine = [(a.name, a.path, a.checksum(), json.dumps(a.config, sort_keys=True)) for a in self.mine]
        rows = [row for part in self.comm.allgather(mine) for row in part]
        columns = dict(zip(("name", "path", "sha256", "config"), map(list, zip(*rows, strict=True)), strict=True))
        table = {key: fixed_strings(values) for key, values in columns.items()}
        if self.earlier is not None:
            table = {key: np.concatenate([self.earlier.table[key], values]) for key, values in table.items()}
        return table

    def _already_joined(self, table: dict[str, np.ndarray]) -> str | None:
        """A new adapter whose weights are already in the earlier file (the same checksum)."""
        if self.earlier is None:
            return None
        earlier = {checksum: row for row, checksum in enumerate(table["sha256"][: self.earlier.count])}
        for row in range(self.earlier.count, self.count):
            if table["sha256"][row] in earlier:
                old = table["name"][earlier[table["sha256"][row]]].decode()
                return f"{table['path'][row].decode()}: its weights are in {self.earlier.path} already (as {old})"
        return None

    def _create(self, table: dict[str, np.ndarray]) -> int:
        """The new output file with the adapters' table and the module names (collective); no group done."""
        reference, count = self.reference, self.count
        attrs = {
            "base_model": str(reference.config.get("base_model_name_or_path") or ""),
            "target_modules": json.dumps(reference.config.get("target_modules")),
            "rank": reference.rank,
            "adapters": count,
            "groups_done": 0,
            "device": recorded_devices(self.algebra.device, self.comm),
        }
        bound = np.zeros(count, np.int8)
        bound[: count - len(self.paths)] = 1  # earlier adapters: known only from their compressed form
        replicated = {f"adapters/{key}": values for key, values in table.items()}
        replicated |= {"adapters/error_bound": bound, "modules": fixed_strings([m.name for m in self.groups])}
        layout = {name: (values.shape, values.dtype) for name, values in replicated.items()}
        layout["adapters/error"] = ((count,), np.dtype(np.float64))
        self.writer = RowWriter(self.config.out, layout, self.comm, self.config.to_dict(), attrs, ADAPTERS_FORMAT,
                                resumable=True)  # fmt: skip
        self.writer.write_replicated(replicated)
        self.writer.flush()  # a run killed in its first group leaves a file --resume takes
        return 0

    def _compress_group(self, index: int) -> str:
        """Find group ``index``'s components and write them, and every adapter's loadings, norms and errors."""
        module, rank = self.groups[index], self.reference.rank
        sides = {side: self._components(index, module, side) for side in "AB"}
        group = group_name(index)
        self._writer.add(_group_layout(group, sides, self.count, rank))
        offset = self.earlier.count if self.earlier else 0
        self._write_adapters(group, offset + self.first, *_loadings_and_errors(self.mine, module, sides, rank))
        if self.earlier is not None:
            first, stop = rank_rows(self.earlier.count, self.system.size, self.system.rank)
            vectors = {side: found.vectors for side, found in sides.items()}
            self._write_adapters(group, first, *self.earlier.reprojected(index, first, stop, vectors))
        replicated = {f"{group}/{side}/components": found.vectors for side, found in sides.items()}
        replicated |= {f"{group}/{side}/explained": found.explained for side, found in sides.items()}
        replicated |= {f"{group}/{side}/total": np.array([found.total]) for side, found in sides.items()}
        self._writer.write_replicated(replicated)
        return f"{module.name}: k {len(sides['A'].vectors)} (A) {len(sides['B'].vectors)} (B)"

    def _components(self, index: int, module: Module, side: str) -> Components:
        """The shared components of one side of a group (collective): A's rows, or B's columns as rows, of every
        adapter, re-read one at a time on each pass, and rank 0 adds the earlier file's moment as rows."""
        earlier, unseen = self.earlier.side(index, side) if self.earlier else (np.empty((0, 0)), 0.0)

        def blocks() -> Iterator[np.ndarray]:
            if self.system.rank == 0 and len(earlier):
                yield earlier
            for adapter in self.mine:
                (matrix,) = adapter.read(module, side)
                yield matrix if side == "A" else matrix.T

        config, dimension = self.config, module.inputs if side == "A" else module.outputs
        rows = len(self.paths) * self.reference.rank + len(earlier)
        return shared_components(blocks, rows, dimension, self.comm, config.method, config.components, config.variance,
                                 config.oversampling, config.power_iterations, config.seed, unseen,
                                 config.max_components, self.algebra)  # fmt: skip

    def _write_adapters(
        self, group: str, start: int, loadings: dict[str, np.ndarray], norm2: np.ndarray, error2: np.ndarray
    ) -> None:
        """Adapters ``start...``'s loadings, update norms and relative errors of a group (collective)."""
        relative = np.sqrt(np.divide(error2, norm2, out=np.zeros_like(norm2), where=norm2 > 0))
        arrays = {f"{group}/{side}/loadings": loadings[side] for side in "AB"}
        self._writer.write(start, arrays | {f"{group}/error": relative, f"{group}/norm": np.sqrt(norm2)})

    def _overall_errors(self) -> np.ndarray:
        """Each adapter's relative error over all its groups, from the file (a resumed run did only some groups);
        every rank its block of the adapters, written too (collective)."""
        self._writer.flush()  # the other ranks' rows, visible to this rank's reads
        first, stop = rank_rows(self.count, self.system.size, self.system.rank)
        norm2, error2 = np.zeros(stop - first), np.zeros(stop - first)
        for index in range(len(self.groups)):
            found = self._writer.file[group_name(index)]  # type: ignore[index]
            norm = found["norm"][first:stop]
            norm2 += norm**2
            error2 += (found["error"][first:stop] * norm) ** 2
        overall = np.sqrt(np.divide(error2, norm2, out=np.zeros_like(norm2), where=norm2 > 0))
        self._writer.write(first, {"adapters/error": overall})
        return overall

    def _keep(self, done: int) -> dict:
        """Stopped after ``done`` groups: the file goes to ``OUT.partial`` for a resumed run (collective)."""
        self.keep_stopped(f"the {done} of {len(self.groups)} layer groups done")
        return {"adapters": self.count, "groups": len(self.groups), "groups_done": done, "stopped": True}

    def _summary(self, kept: list[tuple[int, int]], overall: np.ndarray) -> dict:
        """The job's line on rank 0 and its summary on every rank."""
        modules, rank, count = self.groups, self.reference.rank, self.count
        original = count * rank * sum(m.inputs + m.outputs for m in modules)
        stored = sum(ka * m.inputs + kb * m.outputs + count * rank * (ka + kb) for (ka, kb), m in zip(kept, modules))
        worst = max(self.comm.allgather(float(overall.max(initial=0.0))))
        joined = f" ({self.earlier.count} of them from {self.earlier.path})" if self.earlier else ""
        if self.system.rank == 0:
            print(f"wrote {self.config.out}: {count} adapters{joined}, {len(modules)} layer groups, "
                  f"{stored / original:.1%} of the parameters; largest relative error of an adapter's update "
                  f"{worst:.3g}", flush=True)  # fmt: skip
            if stored > original:
                print(_outgrown(stored / original, self.config, modules, count, rank), file=sys.stderr, flush=True)
        return {"adapters": count, "groups": len(modules), "stored_share": stored / original, "worst_error": worst}


def _prepare(system: ActorSystem, config: AdaptersConfig) -> _Compression:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    share_cores(ranks_sharing_cores(comm), scipy_blas=True)  # BLAS threads: this rank's share of the host's cores
    if not config.adapters:
        raise ValueError("give --adapters: a directory, a glob or a list of PEFT adapter directories")
    paths = find_adapters(config.adapters)
    names: dict[str, str] = {}
    for path, name in zip(paths, adapter_names(paths)):
        if name in names:
            raise AdapterError(path, f"has the name of {names[name]} ({name}): adapters are named by their "
                                     "directories, or by the part of their paths that differs")  # fmt: skip
        names[name] = path
    named = {path: name for name, path in names.items()}
    inputs = [file for path in paths for file in (weights_file(path), os.path.join(path, CONFIG))]
    algebra = _algebra(config, comm)
    lock = claim_outputs(config.out, None, [*inputs, config.add_to], comm, ADAPTERS_FORMAT)
    try:
        kept = on_rank_0(comm, lambda: _earlier_run(config))  # (the last collective: what follows may fail on one rank)
        earlier = Earlier.open(config.add_to) if config.add_to else None
        if earlier is not None:
            _check_new_names(earlier, names)
        reference = earlier.reference if earlier else open_adapter(paths[0], named[paths[0]])
        first, stop = rank_rows(len(paths), system.size, system.rank)
        mine = [open_adapter(path, named[path]) for path in paths[first:stop]]
        for adapter in mine:
            check_alike(adapter, reference)
            for module in adapter.modules:
                adapter.read(module)  # unreadable or NaN: refused now, not half-way
    except BaseException:
        give_back(lock)
        raise
    plan = Plan("group", "adapters", len(reference.modules), config.progress_every, saves=True)
    return _Compression(system, config, comm, paths, reference, mine, first, lock, kept, earlier, plan, algebra)


def _algebra(config: AdaptersConfig, comm: Comm) -> Algebra:
    """numpy on the host, or torch on this rank's GPU (collective: the device rule, agreed by every rank)."""
    device = choose_torch_device(config.device, comm)
    if device == "cpu":
        return HostAlgebra()
    return TorchAlgebra(device, config.precision, cuda_aware=agreed_cuda_aware(comm, device))


def _check_new_names(earlier: Earlier, names: dict[str, str]) -> None:
    """Refuse a new adapter named as an earlier one: names are how adapters are exported."""
    for old in earlier.table["name"]:
        if old.decode() in names:
            path = names[old.decode()]
            raise AdapterError(path, f"has the name of an adapter in {earlier.path}: adapters are named by their "
                                     "directories")  # fmt: skip


def _earlier_run(config: AdaptersConfig) -> str | None:
    """The file an earlier run left for this one to go on from (``jobs.earlier_output``), refused without
    ``--resume``: a plain run would write its groups again over it."""
    kept = earlier_output(config.out)
    if kept is not None and not config.resume:
        raise ValueError(f"{kept} holds the layer groups an earlier run completed: pass --resume to finish it (on any "
                         "number of ranks), or remove it to start over")  # fmt: skip
    return kept


def _not_resumable(kept: str, config: AdaptersConfig, table: dict[str, np.ndarray]) -> str | None:
    """Why the stopped run in ``kept`` cannot go on with these settings and adapters (None: it can)."""
    remedy = f"remove {kept} to start over, or run with the settings and adapters it was started with"
    try:
        with open_file(kept, (ADAPTERS_FORMAT,)) as file:
            saved = json.loads(file.attrs["config"])
            same = all(np.array_equal(file[f"adapters/{key}"][()], table[key]) for key in ("name", "sha256"))
            done = "groups_done" in file.attrs
    except (DataFileError, KeyError, OSError, ValueError) as error:
        return f"{kept} cannot be resumed ({error}); remove it to start over"
    settings = config.to_dict()
    differences = setting_differences(saved, {key: settings[key] for key in RESULT_SETTINGS}, "stopped run")
    if differences:
        return f"{kept} was started with other settings ({'; '.join(differences)}): {remedy}"
    if not same:
        return f"{kept} holds other adapters (names or weights differ): {remedy}"
    if not done:
        return f"{kept} does not say how many groups it completed; remove it to start over"
    return None


def _outgrown(share: float, config: AdaptersConfig, modules: tuple[Module, ...], count: int, rank: int) -> str:
    """The warning for a compressed form larger than the adapters, with the cap that keeps every group smaller: k
    components of a group cost k (in + out) numbers and 2 k per adapter row, against its rows' r (in + out)."""
    rows = count * rank
    cap = min(rows * (m.inputs + m.outputs) // (m.inputs + m.outputs + 2 * rows) for m in modules)
    asked = f"--components {config.components}" if config.components else f"--variance {config.variance:g}"
    return (
        f"mpiscale compress-adapters: WARNING: the compressed file holds {share:.1%} of the adapters' parameters, "
        f"more than the {count} adapters of rank {rank} themselves: {asked} keeps too many components. Lower "
        f"--variance, or cap each group with --max-components {max(cap, 1)} or fewer to store less than the adapters"
    )


def _group_layout(group: str, sides: dict[str, Components], count: int, rank: int) -> dict:
    """The data sets of one group, whose shapes are known once its components are."""
    layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        f"{group}/error": ((count,), np.dtype(np.float64)),
        f"{group}/norm": ((count,), np.dtype(np.float64)),
    }
    for side, found in sides.items():
        k, dimension = found.vectors.shape
        layout[f"{group}/{side}/components"] = ((k, dimension), np.dtype(np.float32))
        layout[f"{group}/{side}/loadings"] = ((count, rank, k), np.dtype(np.float32))
        layout[f"{group}/{side}/explained"] = ((k,), np.dtype(np.float64))
        layout[f"{group}/{side}/total"] = ((1,), np.dtype(np.float64))
    return layout


def _loadings_and_errors(
    adapters: list[Adapter], module: Module, sides: dict[str, Components], rank: int
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Each adapter's loadings on both sides, and its update's squared norm and squared error (one read each).

    With projections P_A and P_B the rebuilt update is P_B B A P_A, so its
    squared error is ||B A||^2 - ||P_B B A P_A||^2 = tr(B^T B A A^T) - tr(L_B L_B^T L_A L_A^T).
    """
    a_side, b_side = sides["A"].vectors, sides["B"].vectors
    a_loads, b_loads = np.empty((len(adapters), rank, len(a_side))), np.empty((len(adapters), rank, len(b_side)))
    norm2, error2 = np.zeros(len(adapters)), np.zeros(len(adapters))
    for i, adapter in enumerate(adapters):
        a, b = adapter.read(module)
        a_loads[i], b_loads[i] = a @ a_side.T, b.T @ b_side.T
        norm2[i] = update_norm2(a, b.T)
        error2[i] = max(norm2[i] - update_norm2(a_loads[i], b_loads[i]), 0.0)
    return {"A": a_loads, "B": b_loads}, norm2, error2
