"""``mpiscale encode``: sparse codes of a data set with a learned dictionary, across ranks, into one CSR file.

The rows are coded in rounds of ``batch_size`` signals per rank: each round
covers the next rows of the data set, split over the ranks, so the codes of
successive rounds follow one another in row order and the file is plain CSR
(``codes/data``, ``codes/indices``, ``codes/indptr``), written collectively
as it goes. As the rounds go (``jobs.MarkedRounds``: at most every quarter
second, and at a stop) the file records how many rows and non-zeros are
complete (``rows_done``, ``nnz_done``) and is flushed. A stop keeps the file as
``OUT.partial``, a kill leaves ``OUT.tmp``; ``--resume`` reopens either, drops
what followed its last mark and goes on, on any number of ranks.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import h5py
import numpy as np

from ..io import (
    DataFileError,
    OutputLock,
    RowWriter,
    ShardedDataset,
    close_after,
    read_dataset,
    recorded,
    split_spec,
)
from ..jobs import (
    Ended,
    MarkedRounds,
    Plan,
    Step,
    choose_numba_device,
    claim_outputs,
    earlier_output,
    give_back,
    kept_file,
    run_lifecycle,
    setting_differences,
)
from ..kernels.threads import share_cores
from ..ranks import Comm, on_rank_0, rank_rows, ranks_sharing_cores
from ..runtime import ActorSystem
from ..words import counted
from .codes import CODES_FORMAT, csr_rows
from .coding import correlations_of, gram_matrix, lasso_encode_gram, omp_rows
from .config import EncodeConfig
from .data import DataInfo, check_data, memory_problem
from .iteration import without_means
from .results import RESULTS_FORMAT

#: Settings a resumed run must share with the run whose rows it keeps.
_KEPT_SETTINGS = ("dictionary", "data", "coder", "max_residual", "alpha")


async def encode(system: ActorSystem, config: EncodeConfig) -> dict:
    """Run the job on every rank; bad input ends it before any row is coded, with one message and status 2."""
    return await run_lifecycle(system, "encode", lambda: _prepare(system, config))


@dataclass
class _Atoms:
    """The dictionary and how it was learned (when a dictlearn results file gives it)."""

    atoms: np.ndarray  # atoms x features, unit rows
    sparsity: int  # the learning job's, or 3
    remove_mean: bool  # the learning job's, or False


@dataclass
class _Encoding(MarkedRounds):
    system: ActorSystem
    config: EncodeConfig
    comm: Comm
    info: DataInfo
    atoms: np.ndarray
    sparsity: int
    remove_mean: bool
    device: str
    kept: str | None  # the earlier run's file this one goes on from
    first_row: int  # rows already coded (by an earlier run)
    nonzeros: int  # their non-zeros
    results_lock: OutputLock | None
    plan: Plan
    command = "encode"
    kept_work = "the signals coded so far"

    async def restore(self) -> int:
        config, samples, atoms = self.config, self.info.samples, len(self.atoms)
        if self.kept is not None:
            self.writer = RowWriter.reopen(config.out, self.kept, self.comm)
            self.writer.grow({"codes/data": self.nonzeros, "codes/indices": self.nonzeros})  # drop the unmarked
            self.say_resumed(self.kept, self.first_row, samples, "signals were coded")
            return 0
        layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            "codes/data": ((0,), np.dtype(np.float64)),
            "codes/indices": ((0,), np.dtype(np.int32)),
            "codes/indptr": ((samples + 1,), np.dtype(np.int64)),
            "residual_norm": ((samples,), np.dtype(np.float64)),
            "dictionary": (self.atoms.shape, np.dtype(np.float64)),
        }
        if self.remove_mean:
            layout["mean"] = ((samples,), np.dtype(np.float64))
        attrs: dict = recorded("data", self.info.spec, config.out)
        attrs |= recorded("dictionary_file", config.dictionary, config.out)
        attrs |= {"shape": [samples, atoms], "sparsity": self.sparsity, "remove_mean": int(self.remove_mean),
                  "device": self.device, "rows_done": 0, "nnz_done": 0,
                  "data_fingerprint": self.info.fingerprint}  # fmt: skip
        self.writer = RowWriter(config.out, layout, self.comm, config.to_dict(), attrs, CODES_FORMAT,
                                growing=("codes/data", "codes/indices"), resumable=True)  # fmt: skip
        self.writer.write_replicated({"dictionary": self.atoms, "codes/indptr": np.zeros(1, np.int64)})
        self.writer.flush()
        return 0

    async def steps(self, start: int) -> AsyncGenerator[Step, None]:
        size, rank = self.system.size, self.system.rank
        gram = gram_matrix(self.atoms)
        data, failure = ShardedDataset(self.info.path, self.info.name, self.comm), None
        try:
            for index in range(start, self.plan.total):
                began = time.perf_counter()
                first = self.first_row + index * self.round_rows
                count = min(self.round_rows, self.info.samples - first)
                lo, hi = (first + bound for bound in rank_rows(count, size, rank))
                signals = np.asarray(data.read_collective(lo, hi), np.float64).reshape(hi - lo, self.info.features)
                read = time.perf_counter()
                means = signals.mean(axis=1) if self.remove_mean else None
                if means is not None:
                    signals = without_means(signals)
                values, indices, ends, rebuilt = self._code(gram, signals)
                residual = np.linalg.norm(signals - rebuilt, axis=1)
                coded = time.perf_counter()
                self._write(lo, first + count, (values, indices, ends), residual, means)
                yield Step(f"{first + count:,} of {self.info.samples:,} signals, {self.nonzeros:,} non-zeros",
                           float(count), {"read": read - began, "coding": coded - read,
                                          "write": time.perf_counter() - coded})  # fmt: skip
        except BaseException as error:
            failure = error
            raise
        finally:
            close_after(data, failure)  # (the other ranks may wait in this round's write)

    def _code(self, gram: np.ndarray, signals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(values, their atoms, each row's end, the signals the codes rebuild) of this rank's signals: OMP keeps
        its codes sparse (signals x SPARSITY), Lasso's come dense."""
        config = self.config
        if config.coder == "lasso":
            codes = lasso_encode_gram(gram, correlations_of(signals, self.atoms), config.alpha)
            return *csr_rows(codes), codes @ self.atoms
        target = config.max_residual or None
        rows = omp_rows(signals, self.atoms, self.sparsity, "cpu" if target else self.device, target, gram)
        values, indices, starts = rows.csr()
        return values, indices, starts[1:], rows.rebuilt(self.atoms)

    def _write(self, lo: int, rows_done: int, csr: tuple, residual: np.ndarray, means: np.ndarray | None) -> None:
        """This rank's rows from ``lo`` (``csr``: values, atoms, each row's end) into the file where they belong,
        then the rounds marked done up to row ``rows_done`` where a mark is due (collective: one allgather carries
        the ranks' counts of non-zeros and rank 0's word)."""
        values, indices, ends = csr
        counts = self.comm.allgather((len(values), self.mark_due()))
        before = self.nonzeros + sum(count for count, _ in counts[: self.system.rank])
        total = self.nonzeros + sum(count for count, _ in counts)
        writer = self._writer
        writer.grow({"codes/data": total, "codes/indices": total})
        writer.write(before, {"codes/data": values, "codes/indices": indices})
        writer.write(lo + 1, {"codes/indptr": before + ends})
        writer.write(lo, {"residual_norm": residual} | ({"mean": means} if means is not None else {}))
        self.nonzeros = total
        self.rounds_written(counts[0][1], rows_done=rows_done, nnz_done=total)

    async def finish(self, ended: Ended) -> dict:
        config, samples = self.config, self.info.samples
        summary = {"signals": samples, "nonzeros": self.nonzeros, "stopped": ended.done < self.plan.total}
        self.mark()
        if summary["stopped"]:
            self.keep_stopped("the coded signals")
            return summary
        self._writer.close()
        if self.system.rank == 0:
            print(f"wrote {config.out}: codes of {samples:,} signals over {len(self.atoms)} atoms, "
                  f"{self.nonzeros / max(samples, 1):.2f} non-zeros a signal, on {counted(self.system.size, 'rank')}",
                  flush=True)  # fmt: skip
        return summary


def _prepare(system: ActorSystem, config: EncodeConfig) -> _Encoding:
    """Check the dictionary, the data and the outputs, and find an earlier run to go on from (collective)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    share_cores(ranks_sharing_cores(comm), scipy_blas=True)
    if not config.dictionary or not config.data:
        raise ValueError("give --dictionary RESULTS.h5 (a dictlearn results file, or FILE.h5:/atoms) and --data "
                         "FILE.h5:/dataset")  # fmt: skip
    learned = _load_atoms(config.dictionary)
    atoms, features = learned.atoms.shape
    too_many = memory_problem(atoms, comm, matrices=1)  # (before the data's scan: it needs the atoms alone)
    if too_many:
        raise ValueError(too_many)
    info = check_data(*split_spec(config.data), 1, 1, None, comm)
    if features != info.features:
        hint = " (a SPAMS dictionary is features x atoms: transpose it)" if atoms == info.features else ""
        raise DataFileError(info.path, f"signals of {info.features} values cannot be coded with atoms of {features} "
                                       f"(the dictionary is atoms x features{hint})", info.name)  # fmt: skip
    _no_zero_rows(learned.atoms, config.dictionary)
    _refuse_atoms_as_columns(learned.atoms, config.dictionary)
    sparsity = config.sparsity or min(learned.sparsity, atoms)
    if sparsity > min(atoms, features):
        raise ValueError(f"sparsity {sparsity} exceeds the {atoms} atoms or the {features} features of a signal")
    remove_mean = {"auto": learned.remove_mean, "yes": True, "no": False}[config.remove_mean]
    label = choose_numba_device(config.device if config.coder == "omp" and not config.max_residual else "cpu", comm)
    lock = claim_outputs(config.out, None, [config.data, config.dictionary], comm, CODES_FORMAT)
    try:
        kept, first_row, nonzeros = on_rank_0(
            comm, lambda: _earlier_run(config, info, sparsity, remove_mean, learned.atoms)
        )
    except BaseException:
        give_back(lock)
        raise
    rounds = math.ceil((info.samples - first_row) / (config.batch_size * system.size))
    plan = Plan("round", "signals", rounds, config.progress_every, saves=True)
    return _Encoding(system, config, comm, info, learned.atoms, sparsity, remove_mean, label.split(":")[0], kept,
                     first_row, nonzeros, lock, plan)  # fmt: skip


def _load_atoms(spec: str) -> _Atoms:
    """The atoms of a dictlearn results file, or of any array of atoms x features; refuses what cannot code."""
    path, name = split_spec(spec)
    sparsity, remove_mean = 3, False
    if not name and h5py.is_hdf5(path):
        with h5py.File(path, "r") as file:
            if file.attrs.get("format") == RESULTS_FORMAT:
                learned = json.loads(file.attrs["config"])
                sparsity, remove_mean = int(learned["sparsity"]), bool(learned.get("remove_mean", False))
                name = "dictionary"
    atoms = np.asarray(read_dataset(path, name), np.float64)
    if atoms.ndim != 2 or not atoms.size:
        raise DataFileError(path, f"the dictionary must be atoms x features, got shape {atoms.shape}", name)
    if not np.isfinite(atoms).all():
        raise DataFileError(path, "the dictionary holds NaN or infinite values", name)
    return _Atoms(atoms, sparsity, remove_mean)


def _no_zero_rows(atoms: np.ndarray, spec: str) -> None:
    """Refuse an atom of zeros (it codes nothing); atoms of any other norm are taken as they are (OMP picks among
    them as among unit atoms, and the codes weigh the atoms given)."""
    zero = np.flatnonzero(~atoms.any(axis=1))
    if len(zero):
        raise DataFileError(spec, f"atom {zero[0]} is all zeros ({len(zero)} atoms are): drop it, or replace it")


def _refuse_atoms_as_columns(atoms: np.ndarray, spec: str) -> None:
    """Refuse a square dictionary whose columns are unit vectors and whose rows are not: atoms kept as columns (a
    SPAMS dictionary, features x atoms), which a square shape lets through, each signal then coded with rows that
    are no atoms, without a word. (Atoms of other norms are taken; only this pattern is refused.)"""
    if atoms.shape[0] != atoms.shape[1]:
        return  # (the shape check above refuses SPAMS's layout of any other shape)
    columns, rows = (bool(np.allclose(np.linalg.norm(atoms, axis=axis), 1.0, rtol=0, atol=1e-6)) for axis in (0, 1))
    if columns and not rows:
        raise DataFileError(spec, (
            f"the dictionary is square ({atoms.shape[0]} x {atoms.shape[1]}) and its columns are unit vectors, its "
            "rows not: its atoms look kept as columns (features x atoms, as SPAMS keeps them), and the job takes "
            "atoms as rows: transpose it (D.T)"
        ))  # fmt: skip


def _earlier_run(
    config: EncodeConfig, info: DataInfo, sparsity: int, remove_mean: bool, atoms: np.ndarray
) -> tuple[str | None, int, int]:
    """(the earlier run's file or None, its rows coded, their non-zeros); refuses what cannot be resumed: other
    settings, other atoms behind the same dictionary's name (learned again since), which would code the rest of
    the signals with atoms other than those the file holds, or other data behind the same name."""
    kept = earlier_output(config.out)
    if kept is None:
        return None, 0, 0
    with kept_file(kept, CODES_FORMAT, "rows_done") as file:
        stored = json.loads(file.attrs["config"])
        marks = int(file.attrs["rows_done"]), int(file.attrs["nnz_done"])
        then = {"sparsity": int(file.attrs["sparsity"]), "remove_mean": bool(file.attrs["remove_mean"])}
        rows = file["residual_norm"].shape[0]
        coded_with = file["dictionary"][()]
        fingerprint_then = file.attrs.get("data_fingerprint")  # (None in a file of an earlier version)
    if not config.resume:
        raise ValueError(f"{kept} holds {marks[0]:,} coded signals of an earlier run: pass --resume to finish it (on "
                         "any number of ranks), or remove it to start over")  # fmt: skip
    changed = setting_differences(stored, {key: getattr(config, key) for key in _KEPT_SETTINGS}, "stopped run")
    changed += setting_differences(then, {"sparsity": sparsity, "remove_mean": remove_mean}, "stopped run")
    if rows != info.samples:
        changed.append(f"the data's rows: {rows} then, {info.samples} now")
    if not np.array_equal(coded_with, atoms):
        changed.append(f"the dictionary's atoms: other values in {config.dictionary} now (learned again, or replaced)")
    if fingerprint_then is not None and fingerprint_then != info.fingerprint:
        changed.append(f"the data's values: other values in {config.data} now (written again, or replaced)")
    if changed:
        raise ValueError(f"{kept} cannot be resumed with other settings ({'; '.join(changed)}): run it as it was, "
                         "or remove it to start over")  # fmt: skip
    return kept, *marks
