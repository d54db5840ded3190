"""Collective, verified, multi-level checkpoints that reshard on restart.

``Checkpointer.save(step, sharded=..., replicated=..., meta=...)`` is
collective. Sharded arrays are this rank's rows of a global array; replicated
arrays are the same on every rank (rank 0's copy is saved); ``meta`` is small
JSON (step counters, RNG states, config). The arrays are copied into reusable
buffers and, by default, written by one background thread while compute goes
on; the next ``save``, ``load``, ``wait`` or ``close`` waits for it and raises
if it failed, on every rank.

Levels, after LLNL's Scalable Checkpoint/Restart:

1. ``local``: each rank's shard goes to node-local storage (``local_dir/node-K``);
2. ``partner``: the shard is also copied to a rank on the next node;
3. ``shared``: one parallel HDF5 file in the shared ``directory``, every
   ``shared_every`` saves (every save when there is no ``local_dir``).

A checkpoint counts only once every level of it is written and flushed and
rank 0 has renamed its manifest into place (then ``latest`` is updated).
``load`` takes the newest one it can read and verify: each shard from its own
node, else from the partner copy, else the whole step from the shared file;
a corrupt or lost checkpoint is reported and the previous one is used.
With ``delta=True`` a save stores only arrays whose contents changed since the
last full save (full saves come every ``full_every`` saves and always include
the shared level when there is one); ``load`` combines the two.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._version import __version__
from ..ranks import Comm, agree, as_mpi, chunks, rank_rows, run_agreed, split_nodes
from ..runtime import RuntimeConfig
from .checkpoint_files import (
    CHECKSUM,
    Layout,
    checksum,
    open_shared,
    read_shard,
    read_shared_rows,
    write_atomically,
    write_shard,
    write_shared,
)
from .errors import CheckpointError, DataFileError
from .h5file import CHECKPOINT_FORMAT, dataset, settle_background_io, track_background_io, utc_timestamp
from .redistribute import MAX_MESSAGE_BYTES, redistribute

log = logging.getLogger(__name__)
_PARTNER_TAG = 29


class _Unusable(CheckpointError):
    """One checkpoint cannot be restored; the loader tries the previous one."""


@dataclass
class Restored:
    """A restored checkpoint: this rank's rows of each sharded array, the replicated arrays, the metadata."""

    step: int
    sharded: dict[str, np.ndarray]
    rows: dict[str, tuple[int, int]]
    replicated: dict[str, np.ndarray]
    meta: dict
    sources: dict[int, str] = field(default_factory=dict)  # step read -> "local", "local+partner" or "shared"


@dataclass
class _SaveJob:
    step: int
    sharded: dict[str, np.ndarray]
    replicated: dict[str, np.ndarray]  # rank 0 only
    replicated_specs: dict[str, tuple[tuple[int, ...], str]]
    meta: dict
    index: int
    blocked: float = 0.0


class Checkpointer:
    """Saves and restores checkpoints of one job; every rank of ``comm`` constructs one."""

    def __init__(
        self,
        directory: str | os.PathLike,
        comm: Comm,
        *,
        keep: int = 3,
        local_dir: str | os.PathLike | None = None,
        partner: bool = True,
        shared_every: int = 1,
        background: bool = True,
        delta: bool = False,
        full_every: int = 8,
        ranks_per_node: int | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if shared_every < 0 or (shared_every == 0 and local_dir is None):
            raise ValueError("shared_every must be >= 1, or 0 (never) together with a local_dir")
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every}")
        from mpi4py import MPI

        self._MPI = MPI
        self.layout = Layout(Path(directory), Path(local_dir) if local_dir is not None else None)
        self.keep, self.shared_every, self.background = keep, shared_every, background
        self.delta, self.full_every = delta, full_every
        self._front = as_mpi(comm).Dup()  # collectives of the calling thread
        self._back = as_mpi(comm).Dup()  # collectives of the background writer
        self.rank, self.size = self._front.Get_rank(), self._front.Get_size()
        if ranks_per_node is None:
            ranks_per_node = RuntimeConfig.from_env().ranks_per_node
        node_comm, self.node, self.nodes = split_nodes(self._front, ranks_per_node)
        self._node_leader = node_comm.Get_rank() == 0
        placement = self._front.allgather((self.node, node_comm.Get_rank()))
        node_comm.Free()
        self._partner, self._senders = self._partners(placement) if partner and local_dir is not None else (None, [])
        if partner and local_dir is not None and self.nodes == 1 and self.rank == 0:
            log.warning("checkpoint: one node only, so there is no partner copy (level 2 is off)")
        if self.rank == 0:
            self.layout.shared.mkdir(parents=True, exist_ok=True)
        if self.layout.local is not None and self._node_leader:
            self.layout.node_dir(self.node).mkdir(parents=True, exist_ok=True)
        self._front.Barrier()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mpiscale-checkpoint")
        self._in_flight: Future | None = None
        self._buffers: dict[str, np.ndarray] = {}
        self._saves = 0
        self._last_step: int | None = None
        self._base: dict | None = None  # manifest of the last full save (background thread only)
        self._deltas = 0
        atexit.register(self._at_exit)

    def _partners(self, placement: list[tuple[int, int]]) -> tuple[int | None, list[int]]:
        """The rank on the next node that keeps a copy of each rank's shard."""
        if self.nodes < 2:
            return None, []
        ranks_of = [[r for r, (node, _) in enumerate(placement) if node == n] for n in range(self.nodes)]
        partner_of = []
        for node, local_rank in placement:
            following = ranks_of[(node + 1) % self.nodes]
            partner_of.append(following[local_rank % len(following)])
        return partner_of[self.rank], [r for r, p in enumerate(partner_of) if p == self.rank]

    # ----------------------------------------------------------------- saving
    def save(
        self,
        step: int,
        sharded: dict[str, np.ndarray] | None = None,
        replicated: dict[str, np.ndarray] | None = None,
        meta: dict | None = None,
    ) -> None:
        """Checkpoint ``step`` (collective). Returns once the arrays are copied, or written if not background."""
        started = time.perf_counter()
        sharded, replicated, meta = dict(sharded or {}), dict(replicated or {}), dict(meta or {})
        self.wait()
        settle_background_io()  # other checkpointers' writes: background collectives go one at a time
        problem = self._invalid(step, sharded, replicated, meta)
        signature = None
        if problem is None:
            signature = (
                step,
                sorted((name, a.dtype.str, a.shape[1:]) for name, a in sharded.items()),
                sorted((name, a.dtype.str, a.shape) for name, a in replicated.items()),
            )
        every = self._front.allgather((problem, signature))
        problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(every) if p]
        if problems:
            raise ValueError("checkpoint save: " + "; ".join(problems))
        odd = [r for r, (_, other) in enumerate(every) if other != signature]
        if odd:
            raise ValueError(
                f"checkpoint save of step {step}: ranks disagree on the step, array names, dtypes or row shapes "
                f"(rank {self.rank} passes {signature}; ranks differing from this one: {odd})"
            )
        keep = self._snapshot if self.background else _as_they_are  # a blocking save needs no copy
        job = _SaveJob(
            step=step,
            sharded=keep(sharded, "s:"),
            replicated=keep(replicated, "r:") if self.rank == 0 else {},
            replicated_specs={name: (a.shape, a.dtype.str) for name, a in replicated.items()},
            meta=json.loads(json.dumps(meta)),
            index=self._saves,
        )
        self._saves += 1
        self._last_step = step
        job.blocked = time.perf_counter() - started
        self._in_flight = self._pool.submit(self._write, job)
        track_background_io(self._in_flight)
        if not self.background:
            self.wait()

    def _invalid(self, step, sharded: dict, replicated: dict, meta: dict) -> str | None:
        if not isinstance(step, (int, np.integer)) or step < 0:
            return f"step must be a non-negative integer, got {step!r}"
        if self._last_step is not None and step <= self._last_step:
            return f"step {step} is not after the last saved or loaded step {self._last_step}"
        if set(sharded) & set(replicated):
            return f"names used both sharded and replicated: {sorted(set(sharded) & set(replicated))}"
        for name, array in [*sharded.items(), *replicated.items()]:
            if not isinstance(name, str) or not name or "/" in name:
                return f"array names must be non-empty strings without '/', got {name!r}"
            if not isinstance(array, np.ndarray):
                return f"{name!r} is a {type(array).__name__}, not a numpy array (convert tensors with .numpy())"
            if array.dtype.hasobject:
                return f"{name!r} holds Python objects; only plain numeric arrays can be checkpointed"
        for name, array in sharded.items():
            if array.ndim == 0:
                return f"sharded array {name!r} needs at least one dimension (rows)"
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as error:
            return f"meta is not JSON-serializable: {error}"
        return None

    def _snapshot(self, arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
        """Copy arrays into buffers kept from the previous save (no page faults after the first)."""
        copies = {}
        for name, array in arrays.items():
            buffer = self._buffers.get(prefix + name)
            if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
                buffer = np.empty(array.shape, array.dtype)
            np.copyto(buffer, array)
            self._buffers[prefix + name] = copies[name] = buffer
        return copies

    def wait(self) -> None:
        """Wait for the background save; raise (on every rank) if it failed."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            future.result()

    def _write(self, job: _SaveJob) -> None:
        """The background part of a save (same order of collectives on every rank)."""
        comm, rank, started = self._back, self.rank, time.perf_counter()
        full = not self.delta or self._base is None or self._deltas + 1 >= self.full_every
        levels = []
        if self.layout.local is not None:
            levels += ["local", "partner"] if self._partner is not None else ["local"]
        if self.layout.local is None or (
            self.shared_every and (job.index % self.shared_every == 0 or (self.delta and full))
        ):
            levels.append("shared")
        manifest = self._manifest(job, full, levels)
        stored = [name for name, entry in manifest["arrays"].items() if entry["stored_in"] == job.step]
        mine_sharded = {n: job.sharded[n] for n in stored if n in job.sharded}
        mine_replicated = {n: job.replicated[n] for n in stored if n in job.replicated_specs and rank == 0}
        step, shard_arrays = job.step, {**mine_sharded, **mine_replicated}

        def write_level3() -> None:
            sharded = {n: (manifest["arrays"][n]["blocks"][rank][0], rows) for n, rows in mine_sharded.items()}
            replicated = {n: job.replicated.get(n) for n in stored if n in job.replicated_specs}
            write_shared(self.layout.shared_file(step), comm, self.size, manifest, sharded, replicated)

        def commit() -> None:
            if rank == 0:
                write_atomically(self.layout.manifest(step), json.dumps(manifest, indent=1).encode())
                write_atomically(self.layout.latest, f"{step}\n".encode())

        if "local" in levels:
            path = self.layout.shard(self.node, step, rank)
            run_agreed(
                comm,
                f"level-1 save of step {step}",
                lambda: write_shard(path, step, rank, self.size, shard_arrays),
                CheckpointError,
            )
        if "partner" in levels:
            run_agreed(
                comm, f"level-2 partner copy of step {step}", lambda: self._copy_to_partner(step), CheckpointError
            )
        if "shared" in levels:
            run_agreed(comm, f"level-3 save of step {step}", write_level3, CheckpointError)
        run_agreed(comm, f"commit of checkpoint step {step}", commit, CheckpointError)
        if full:
            self._base, self._deltas = manifest, 0
        else:
            self._deltas += 1
        self._retire(job.step)
        if rank == 0:
            written = sum(_nbytes(manifest["arrays"][name]) for name in stored)
            log.info(
                "checkpoint step %d saved (%s, %s, %d of %d arrays): %.1f MiB in %.2f s; the caller was blocked %.3f s",
                job.step, "+".join(levels), "full" if full else f"delta on step {manifest['base']}", len(stored),
                len(manifest["arrays"]), written / 2**20, time.perf_counter() - started, job.blocked,
            )  # fmt: skip

    def _manifest(self, job: _SaveJob, full: bool, levels: list[str]) -> dict:
        comm = self._back
        mine = {name: (len(rows), checksum(rows)) for name, rows in job.sharded.items()}
        replicated_sums = comm.bcast({n: checksum(a) for n, a in job.replicated.items()}, 0)
        every = comm.allgather(mine)
        arrays: dict[str, dict] = {}
        for name, rows in job.sharded.items():
            blocks, start = [], 0
            for other in every:
                count, crc = other[name]
                blocks.append([start, start + count, crc])
                start += count
            arrays[name] = {
                "kind": "sharded",
                "shape": [start, *rows.shape[1:]],
                "dtype": rows.dtype.str,
                "blocks": blocks,
                "checksum": CHECKSUM,
                "stored_in": job.step,
            }
        for name, (shape, dtype) in job.replicated_specs.items():
            arrays[name] = {
                "kind": "replicated",
                "shape": list(shape),
                "dtype": dtype,
                "blocks": [[0, 1, replicated_sums[name]]],
                "checksum": CHECKSUM,
                "stored_in": job.step,
            }
        base = None if full else self._base
        if base is not None:
            for name, entry in arrays.items():
                old = base["arrays"].get(name)
                if old and all(old.get(k) == entry[k] for k in ("kind", "shape", "dtype", "blocks", "checksum")):
                    arrays[name] = old
        return {
            "format": CHECKPOINT_FORMAT,
            "mpiscale_version": __version__,
            "step": job.step,
            "created": utc_timestamp(),
            "world_size": self.size,
            "levels": levels,
            "base": None if base is None else base["step"],
            "arrays": arrays,
            "meta": job.meta,
        }

    def _copy_to_partner(self, step: int) -> None:
        MPI, comm = self._MPI, self._back
        mine = self.layout.shard(self.node, step, self.rank).read_bytes()
        sizes = comm.allgather(len(mine))
        incoming = {sender: bytearray(sizes[sender]) for sender in self._senders}
        requests = []
        for sender, buffer in incoming.items():
            for piece in chunks(memoryview(buffer), MAX_MESSAGE_BYTES):
                requests.append(comm.Irecv([piece, MPI.BYTE], sender, _PARTNER_TAG))
        for piece in chunks(memoryview(mine), MAX_MESSAGE_BYTES):
            requests.append(comm.Isend([piece, MPI.BYTE], self._partner, _PARTNER_TAG))
        MPI.Request.Waitall(requests)
        for sender, buffer in incoming.items():
            write_atomically(self.layout.shard(self.node, step, sender, copy=True), buffer)

    def _retire(self, step: int) -> None:
        """Delete checkpoints beyond the newest ``keep`` (keeping delta bases and the newest shared one)."""
        kept = None
        if self.rank == 0:
            try:
                kept = self._retire_shared(step)
            except OSError as error:
                log.warning("checkpoint retention in %s failed: %s", self.layout.shared, error)
        kept = self._back.bcast(kept, 0)
        if kept is None or self.layout.local is None or not self._node_leader:
            return
        for entry in self.layout.node_dir(self.node).glob("step-*"):
            old = int(entry.name.split("-")[1])
            if old <= step and old not in kept:
                shutil.rmtree(entry, ignore_errors=True)

    def _retire_shared(self, step: int) -> set[int]:
        steps = self.layout.committed_steps()
        manifests = {s: _read_manifest(self.layout.manifest(s)) for s in steps}
        kept = set(steps[: self.keep])
        with_shared = [s for s, manifest in manifests.items() if manifest and "shared" in manifest["levels"]]
        kept.update(with_shared[:1])
        kept.update(m["base"] for s in list(kept) if (m := manifests[s]) and m["base"] is not None)
        for entry in self.layout.shared.glob("step-*"):
            old = int(entry.name.split("-")[1].split(".")[0])
            if old <= step and old not in kept and entry.suffix != ".json":
                entry.unlink(missing_ok=True)
        for old in steps:
            if old not in kept:
                self.layout.manifest(old).unlink(missing_ok=True)
        return kept

    # ---------------------------------------------------------------- loading
    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, newest first, without reading them (collective)."""
        self.wait()
        return self._front.bcast(self.layout.committed_steps() if self.rank == 0 else None, 0)

    def load(self, step: int | None = None, rows: dict[str, tuple[int, int]] | None = None) -> Restored | None:
        """Restore the newest usable checkpoint (or ``step``), resharded onto this world (collective).

        Each rank gets the rows ``rows[name]`` of each sharded array, by default
        its block as ``np.array_split`` splits the rows. Returns None when there
        is no checkpoint; raises CheckpointError when there are some but none
        can be restored.
        """
        self.wait()
        comm = self._front
        manifests = comm.bcast(self._read_manifests() if self.rank == 0 else None, 0)
        latest = max((s for s, m in manifests if m is not None), default=None)
        tries = [(s, m) for s, m in manifests if (s == step if step is not None else True)]
        if not tries:
            if step is not None:
                raise CheckpointError(f"no checkpoint of step {step} in {self.layout.shared}")
            return None
        by_step = {s: m for s, m in manifests if m is not None}
        reasons = []
        for candidate, manifest in tries:
            started = time.perf_counter()
            try:
                if manifest is None:
                    raise _Unusable(f"its manifest {self.layout.manifest(candidate)} is unreadable")
                restored = self._restore(manifest, by_step, rows or {})
            except _Unusable as error:
                reasons.append(f"step {candidate}: {error}")
                if self.rank == 0:
                    log.warning("checkpoint step %d cannot be restored (%s); trying the previous one", candidate, error)
                continue
            if self.rank == 0:
                took = time.perf_counter() - started
                log.info("restored checkpoint step %d from %s in %.2f s", candidate, restored.sources, took)
                if candidate != latest:
                    log.warning("restored step %d, not the newest (%s)", candidate, latest)
            self._last_step = restored.step
            return restored
        raise CheckpointError(f"no usable checkpoint in {self.layout.shared}: " + "; ".join(reasons))

    def _read_manifests(self) -> list[tuple[int, dict | None]]:
        """Committed checkpoints up to the ``latest`` pointer, newest first."""
        try:
            newest = int(self.layout.latest.read_text().strip())
        except (OSError, ValueError):
            newest = None
        steps = [s for s in self.layout.committed_steps() if newest is None or s <= newest]
        return [(s, _read_manifest(self.layout.manifest(s))) for s in steps]

    def _restore(self, manifest: dict, by_step: dict[int, dict], rows: dict) -> Restored:
        wanted: dict[str, tuple[int, int]] = {}
        for name, entry in manifest["arrays"].items():
            if entry["kind"] == "replicated":
                wanted[name] = (0, 1)
                continue
            total = entry["shape"][0]
            start, stop = rows.get(name, rank_rows(total, self.size, self.rank))
            if not 0 <= start <= stop <= total:
                raise ValueError(f"load: rows {start}:{stop} of {name!r} are outside 0:{total}")
            wanted[name] = (start, stop)
        groups: dict[int, list[str]] = {}
        for name, entry in manifest["arrays"].items():
            groups.setdefault(entry["stored_in"], []).append(name)
        arrays, sources = {}, {}
        for source_step, names in sorted(groups.items()):
            source = by_step.get(source_step)
            if source is None:
                raise _Unusable(f"it needs the arrays of step {source_step}, which is gone")
            got, sources[source_step] = self._fetch(source, sorted(names), {n: wanted[n] for n in names})
            arrays.update(got)
        sharded = {n: a for n, a in arrays.items() if manifest["arrays"][n]["kind"] == "sharded"}
        replicated = {n: a[0] for n, a in arrays.items() if manifest["arrays"][n]["kind"] == "replicated"}
        return Restored(
            manifest["step"], sharded, {n: wanted[n] for n in sharded}, replicated, manifest["meta"], sources
        )

    def _fetch(self, source: dict, names: list[str], wanted: dict) -> tuple[dict[str, np.ndarray], str]:
        """Arrays ``names`` of one saved step: from node-local shards if every one is found, else shared."""
        comm, bad = self._front, set[str]()
        while "local" in source["levels"] and self.layout.local is not None:
            assignment = self._assign_shards(source, bad)
            if assignment is None:
                break
            held, failed = self._read_shards(source, names, assignment)
            failed = [item for items in comm.allgather(failed) for item in items]
            if not failed:
                used = sorted({"partner" if copy else "local" for _, _, copy in assignment.values()})
                specs = {n: (_row_shape(source["arrays"][n]), np.dtype(source["arrays"][n]["dtype"])) for n in names}
                return redistribute(comm, held, wanted, specs), "+".join(used)
            for path, reason in failed:
                bad.add(path)
                if self.rank == 0:
                    log.warning("checkpoint shard %s is unusable (%s); looking for another copy", path, reason)
        if "shared" not in source["levels"]:
            raise _Unusable(f"shards of step {source['step']} are lost from node-local storage and partners")
        return self._read_shared(source, names, wanted), "shared"

    def _assign_shards(self, source: dict, bad: set[str]) -> dict[int, tuple[int, str, bool]] | None:
        """Which rank reads each writer's shard (own copies first, then the least-loaded reader)."""
        found = [
            (writer, copy, path)
            for writer, copy, path in self.layout.shards_on_node(self.node, source["step"])
            if path not in bad and writer < source["world_size"]
        ]
        every = self._front.allgather(found)
        assignment, load = {}, [0] * self.size
        for writer in range(source["world_size"]):
            options = [(c, load[r], r, p) for r, items in enumerate(every) for w, c, p in items if w == writer]
            if not options:
                return None
            copy, _, reader, path = min(options)
            assignment[writer] = (reader, path, copy)
            load[reader] += 1
        return assignment

    def _read_shards(self, source: dict, names: list[str], assignment: dict) -> tuple[dict, list]:
        held: dict[str, list[tuple[int, np.ndarray]]] = {name: [] for name in names}
        failed = []
        for writer, (reader, path, _) in sorted(assignment.items()):
            if reader != self.rank:
                continue
            entries = source["arrays"]
            wanted = [n for n in names if entries[n]["kind"] == "sharded" or writer == 0]
            try:
                data = read_shard(path, wanted)
                for name in wanted:
                    if entries[name]["kind"] == "sharded":
                        start, stop, crc = entries[name]["blocks"][writer]
                        _verify(path, name, data[name], entries[name], stop - start, crc)
                        held[name].append((start, data[name]))
                    else:
                        _verify(path, name, data[name], entries[name], None, entries[name]["blocks"][0][2])
                        held[name].append((0, data[name][None]))
            except (DataFileError, OSError) as error:
                failed.append((path, str(error)))
        return held, failed

    def _read_shared(self, source: dict, names: list[str], wanted: dict) -> dict[str, np.ndarray]:
        comm, path, file = self._front, self.layout.shared_file(source["step"]), None
        error: Exception | None = None
        try:
            file = open_shared(path, comm)
        except DataFileError as failure:
            error = failure
        agree(comm, error, f"opening {path}", _Unusable)
        assert file is not None
        out = {}
        try:
            for name in names:
                entry = source["arrays"][name]
                if entry["kind"] == "replicated":
                    try:
                        data = dataset(file, name)[()]
                        _verify(str(path), name, data, entry, None, entry["blocks"][0][2])
                    except (DataFileError, OSError) as failure:
                        error = error or failure
                        data = np.empty(entry["shape"], np.dtype(entry["dtype"]))
                    out[name] = data[None]
                    continue
                start, stop = wanted[name]
                blocks = [b for b in entry["blocks"] if b[0] < stop and b[1] > start and b[1] > b[0]]
                lo, hi = (blocks[0][0], blocks[-1][1]) if blocks and stop > start else (0, 0)
                data = read_shared_rows(file, name, lo, hi, comm)
                for b_start, b_stop, crc in blocks if hi > lo else []:
                    try:
                        _verify(str(path), name, data[b_start - lo : b_stop - lo], entry, b_stop - b_start, crc)
                    except DataFileError as failure:
                        error = error or failure
                out[name] = data[start - lo : stop - lo]
        finally:
            file.close()  # opened on every rank: the agreement above raised otherwise
        agree(comm, error, f"reading {path}", _Unusable)
        return out

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Wait for the background save (raising its failure) and release resources (collective)."""
        try:
            self.wait()
        finally:
            atexit.unregister(self._at_exit)
            self._pool.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _at_exit(self) -> None:
        try:
            self.wait()
        except Exception as error:  # never silent: the job must fail and say which checkpoint is missing
            print(f"mpiscale: rank {self.rank}: the last checkpoint was NOT saved: {error}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


def _as_they_are(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The caller's arrays, C-contiguous: a synchronous save writes them before the caller goes on."""
    return {name: np.ascontiguousarray(array) for name, array in arrays.items()}


def _verify(path: str, name: str, data: np.ndarray, entry: dict, rows: int | None, crc: int) -> None:
    shape = tuple(entry["shape"]) if rows is None else (rows, *entry["shape"][1:])
    if data.shape != shape or data.dtype != np.dtype(entry["dtype"]):
        raise DataFileError(path, f"holds {data.dtype}{data.shape}, the manifest says {entry['dtype']}{shape}", name)
    if checksum(data, entry.get("checksum", "crc32")) != crc:
        raise DataFileError(path, "checksum mismatch: the data is corrupt", name)


def _nbytes(entry: dict) -> int:
    return int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(entry["dtype"]).itemsize


def _row_shape(entry: dict) -> tuple[int, ...]:
    """Shape of one row as redistributed: replicated arrays travel as a single row."""
    return tuple(entry["shape"][1:]) if entry["kind"] == "sharded" else tuple(entry["shape"])


def _read_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("format") == CHECKPOINT_FORMAT else None
