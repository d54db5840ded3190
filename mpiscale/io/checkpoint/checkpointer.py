"""The Checkpointer: checks a save, snapshots its arrays, writes the levels in a background thread, commits, loads."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np

from ... import telemetry
from ...ranks import AnyComm, agree, as_mpi, by_ranks, on_rank_0, run_agreed, split_nodes, world_ranks
from ...runtime import RuntimeConfig
from ..abandon import entered_by_all
from ..errors import CheckpointError, LockedError
from ..h5file import settle_background_io, track_background_io, write_atomically
from ..lock import OutputLock
from ..space import space_problem
from .files import Layout, array_problem, write_shard, write_shared
from .levels import save_levels, space_needed
from .manifest import SaveJob, build_manifest, nbytes
from .partners import choose_partners, copy_to_partner
from .restore import Restored, Restorer, Unusable
from .retention import retire

log = logging.getLogger(__name__)
T = TypeVar("T")


class Checkpointer:
    """Saves and restores checkpoints of one job; every rank of ``comm`` constructs one."""

    def __init__(
        self,
        directory: str | os.PathLike,
        comm: AnyComm,
        *,
        keep: int = 3,
        local_dir: str | os.PathLike | None = None,
        partner: bool = True,
        shared_every: int = 1,
        background: bool = True,
        delta: bool = False,
        full_every: int = 8,
        ranks_per_node: int | None = None,
        when_full: str = "fail",
        timeout_s: float | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if shared_every < 0 or (shared_every == 0 and local_dir is None):
            raise ValueError("shared_every must be >= 1, or 0 (never) together with a local_dir")
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every}")
        if when_full not in ("fail", "skip"):
            raise ValueError(f"when_full must be 'fail' or 'skip', got {when_full!r}")
        from mpi4py import MPI

        self._MPI = MPI
        self.layout = Layout(Path(directory), Path(local_dir) if local_dir is not None else None)
        self.keep, self.shared_every, self.background = keep, shared_every, background
        self.delta, self.full_every = delta, full_every
        entered_by_all(as_mpi(comm), f"Checkpointer({directory})", "open it", path=directory)
        self._front = as_mpi(comm).Dup()  # collectives of the calling thread
        self._front.Set_name(f"{Path(directory).name}/"[-63:])  # (its blocking calls' log in a report; MPI's limit)
        self._back = as_mpi(comm).Dup()  # collectives of the background writer
        self.rank, self.size = self._front.Get_rank(), self._front.Get_size()
        settings = RuntimeConfig.from_env()
        if ranks_per_node is None:
            ranks_per_node = settings.ranks_per_node
        self.when_full = when_full
        self.timeout_s = settings.io_timeout_s if timeout_s is None else timeout_s
        node_comm, self.node, self.nodes, _ = split_nodes(self._front, ranks_per_node)
        self._node_leader = node_comm.Get_rank() == 0
        placement = self._front.allgather((self.node, node_comm.Get_rank()))
        self._ranks_on_node = node_comm.Get_size()
        node_comm.Free()
        self._partner, self._senders = (
            choose_partners(placement, self.rank, self.nodes) if partner and local_dir is not None else (None, [])
        )
        if partner and local_dir is not None and self.nodes == 1 and self.rank == 0:
            log.warning("checkpoint: one node only, so there is no partner copy (level 2 is off)")
        self._lock = OutputLock(self.layout.shared / "lock", f"checkpoint directory {self.layout.shared}")
        problem = None
        self._made_directory = False  # rank 0 made it: an empty one goes again at close
        if self.rank == 0:
            try:
                self._made_directory = not self.layout.shared.exists()
                self.layout.shared.mkdir(parents=True, exist_ok=True)
                self._lock.acquire()
                for debris in self.layout.shared.glob("*.tmp"):  # a dead job's half-written files
                    debris.unlink(missing_ok=True)
            except (OSError, LockedError) as error:
                problem = error
        agree(self._front, problem, "opening the checkpoint directory", CheckpointError, entered=True)
        self._node_lock = self._lock_node_directory()
        self._front.Barrier()
        self._restorer = Restorer(self.layout, self._front, self.node)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mpiscale-checkpoint")
        self._in_flight: Future | None = None
        self._deadline, self._budget_s = 0.0, 0.0  # when the save in flight must have finished (monotonic clock)
        self._phase = ""  # what the writer is doing, for the report if it never finishes
        self._buffers: dict[str, np.ndarray] = {}
        self._saves = 0
        self._last_step: int | None = None
        self._base: dict | None = None  # manifest of the last full save (background thread only)
        self._deltas = 0
        atexit.register(self._at_exit)

    def _lock_node_directory(self) -> OutputLock | None:
        """Each node's first rank makes and locks ``local_dir/node-K`` (collective): a second job on the same
        node-local directory would delete this one's logs and shards as leftovers, so it is refused."""
        if self.layout.local is None:
            return None
        where = self.layout.node_dir(self.node)
        lock = OutputLock(where / "lock", f"node-local directory {where}")
        problem = None
        if self._node_leader:
            try:
                where.mkdir(parents=True, exist_ok=True)
                lock.acquire()
            except (OSError, LockedError) as error:
                problem = error
        try:
            agree(self._front, problem, "opening the node-local directory", CheckpointError, entered=True)
        except CheckpointError:
            lock.release()
            self._lock.release()
            raise
        return lock

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
        entered_by_all(self._front, f"Checkpointer.save(step {step})", "save it")
        settle_background_io()  # other checkpointers' writes: background collectives go one at a time
        problem = self._invalid(step, sharded, replicated, meta)
        signature = None
        if problem is None:
            signature = (
                step,
                sorted((name, a.dtype.str, a.shape[1:]) for name, a in sharded.items()),
                sorted((name, a.dtype.str, a.shape) for name, a in replicated.items()),
            )
        mine = 0
        if problem is None:  # the arrays are numpy arrays
            mine = sum(a.nbytes for a in sharded.values()) + sum(a.nbytes for a in replicated.values()) * (
                self.rank == 0
            )
        every = self._front.allgather((problem, signature, mine))
        if any(p for p, _, _ in every):
            raise ValueError("checkpoint save: " + by_ranks([p for p, _, _ in every], world_ranks(self._front)))
        odd = [r for r, (_, other, _) in enumerate(every) if other != signature]
        if odd:
            members = world_ranks(self._front)  # (the job's ranks, as every line of the job names them)
            raise ValueError(
                f"checkpoint save of step {step}: ranks disagree on the step, array names, dtypes or row shapes "
                f"(rank {members[self.rank]} passes {signature}; ranks differing from this one: "
                f"{[members[r] for r in odd]})"
            )
        full = not self.delta or self._base is None or self._deltas + 1 >= self.full_every
        levels = save_levels(self.layout.local is not None, self._partner is not None, self.shared_every,
                             self._saves, self.delta and full)  # fmt: skip
        sizes = [nbytes for _, _, nbytes in every]
        try:
            room = self._space_problem(levels, mine, sizes)
            agree(self._front, room, f"checkpoint step {step}", CheckpointError, entered=True)
        except CheckpointError as error:
            if self.when_full == "fail":
                raise
            if self.rank == 0:
                log.warning("%s; the job goes on without it (when_full='skip')", error)
            return
        keep = self._snapshot if self.background else _as_they_are  # a blocking save needs no copy
        job = SaveJob(
            step=step,
            sharded=keep(sharded, "s:"),
            replicated=keep(replicated, "r:") if self.rank == 0 else {},
            replicated_specs={name: (a.shape, a.dtype.str) for name, a in replicated.items()},
            meta=json.loads(json.dumps(meta)),
            full=full,
            levels=levels,
        )
        self._saves += 1
        self._last_step = step
        job.blocked = time.perf_counter() - started
        self._budget_s = self._budget(sum(sizes))
        self._deadline = time.monotonic() + self._budget_s
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
            problem = array_problem(name, array, rows=name in sharded)
            if problem is not None:
                return problem
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

    @property
    def partner(self) -> int | None:
        """The rank on the next node that keeps copies of this rank's files (None on one node or without levels 1-2)."""
        return self._partner

    @property
    def senders(self) -> list[int]:
        """The ranks whose copies this rank keeps in its node directory."""
        return list(self._senders)

    @property
    def last_step(self) -> int | None:
        """The step last saved (or being saved) or loaded by this checkpointer."""
        return self._last_step

    def _space_problem(self, levels: list[str], mine: int, sizes: list[int]) -> str | None:
        """Why the save cannot fit on the file systems this rank judges (rank 0 the shared one, a node's leader its
        node's), or None; the ranks agree on it."""
        node = self.layout.node_dir(self.node) if self.layout.local is not None else None
        wanted = space_needed(levels, self.layout.shared, node, mine, sizes, len(self._senders), self._ranks_on_node)
        # One rank a directory judges its room, and sets it aside a moment (the room several ask for at once adds
        # up): another rank's look at the free space meanwhile saw that room taken, and refused a save that fits.
        judges = {"level 3": self.rank == 0, "levels 1-2": self._node_leader}
        problems = [
            space_problem(where, needed, level, reserve=True) for where, needed, level in wanted if judges[level]
        ]
        return next((problem for problem in problems if problem), None)

    def _budget(self, nbytes: int) -> float:
        """Seconds a save of ``nbytes`` may take before the job is ended (``timeout_s``, or 120 s + 20 MB/s)."""
        return self.timeout_s if self.timeout_s > 0 else 120.0 + nbytes / 20e6

    def wait(self) -> None:
        """Wait for the background save; raise (on every rank) if it failed.

        A save that does not finish by its deadline (``timeout_s``) has a rank
        stuck in collective I/O that another rank abandoned (a full disk or
        quota that only some ranks saw). MPI cannot take such a rank back, so the
        checkpointer ends the job (``MPI_Abort``, status 1) with a report naming
        what the writer was doing; the rank that failed has printed its errno.
        """
        future, self._in_flight = self._in_flight, None
        if future is None:
            return
        try:
            future.result(timeout=max(0.0, self._deadline - time.monotonic()))
        except FutureTimeout:
            sys.stdout.flush()
            sys.stderr.write(
                f"mpiscale: rank {self.rank}: a checkpoint save did not finish within its {self._budget_s:.0f} s "
                f"({self._phase}): another rank failed inside collective I/O (a full disk or quota? see its "
                "message). A rank stuck in MPI-IO cannot be taken back, so the job ends here; earlier checkpoints "
                "are intact.\n"
            )
            sys.stderr.flush()
            self._MPI.COMM_WORLD.Abort(1)

    def _write(self, job: SaveJob) -> None:
        """The background part of a save (same order of collectives on every rank)."""
        comm, rank, started = self._back, self.rank, time.perf_counter()
        full, levels = job.full, job.levels
        self._phase = f"checkpoint step {job.step}: manifest"
        manifest = build_manifest(comm, job, self.size, levels, None if full else self._base)
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

        agreed = partial(run_agreed, comm, kind=CheckpointError, entered=True)  # (every rank is in this save)
        if "local" in levels:
            path = self.layout.shard(self.node, step, rank)
            self._phase = f"level-1 save of step {step} to {path}"
            agreed(f"level-1 save of step {step}", lambda: write_shard(path, step, rank, self.size, shard_arrays))
        if "partner" in levels:
            partner = self._partner
            assert partner is not None  # the level is written only where a partner exists
            self._phase = f"level-2 copy of step {step} to rank {partner}"
            agreed(f"level-2 partner copy of step {step}",
                   lambda: copy_to_partner(comm, self.layout, self.node, step, partner, self._senders))  # fmt: skip
        if "shared" in levels:
            self._phase = f"level-3 save of step {step} to {self.layout.shared_file(step)} (collective)"
            agreed(f"level-3 save of step {step}", write_level3)
        self._phase = f"commit of step {step} in {self.layout.shared}"
        agreed(f"commit of checkpoint step {step}", commit)
        self._phase = f"retention after step {step}"
        if full:
            self._base, self._deltas = manifest, 0
        else:
            self._deltas += 1
        retire(self.layout, comm, self.keep, job.step, self.node, self._node_leader)
        if rank == 0:
            written = sum(nbytes(manifest["arrays"][name]) for name in stored)
            log.info(
                "checkpoint step %d saved (%s, %s, %d of %d arrays): %.1f MiB in %.2f s; the caller was blocked %.3f s",
                job.step, "+".join(levels), "full" if full else f"delta on step {manifest['base']}", len(stored),
                len(manifest["arrays"]), written / 2**20, time.perf_counter() - started, job.blocked,
            )  # fmt: skip
            session = telemetry.current()
            if session is not None:
                session.event("checkpoint", f"step {job.step} saved ({'+'.join(levels)}, {written / 2**20:.1f} MiB)")

    # ---------------------------------------------------------------- loading
    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, newest first, without reading them (collective)."""
        self.wait()
        return on_rank_0(self._front, lambda: self._listed(self.layout.committed_steps), (CheckpointError,))

    def _listed(self, read: Callable[[], T]) -> T:
        """``read()`` of the shared directory's listing (rank 0), a directory gone or unreadable said as a
        CheckpointError (which ``on_rank_0`` gives every rank)."""
        try:
            return read()
        except OSError as error:
            raise CheckpointError(f"the checkpoint directory {self.layout.shared} cannot be listed: {error}") from None

    def load(
        self, step: int | None = None, rows: dict[str, tuple[int, int]] | None = None, announce: bool = True
    ) -> Restored | None:
        """Restore the newest usable checkpoint (or ``step``), resharded onto this world (collective).

        Each rank gets the rows ``rows[name]`` of each sharded array, by default
        its block as ``np.array_split`` splits the rows. Returns None when there
        is no checkpoint; raises CheckpointError when there are some but none
        can be restored. ``announce``: log the restore (INFO, rank 0) now; a
        caller that may still refuse the checkpoint calls ``announce`` itself once
        it is taken.
        """
        self.wait()
        entered_by_all(self._front, f"Checkpointer.load({self.layout.shared})", "load it", path=self.layout.shared)
        comm = self._front
        manifests = on_rank_0(comm, lambda: self._listed(self._restorer.read_manifests), (CheckpointError,))
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
                    raise Unusable(f"its manifest {self.layout.manifest(candidate)} is unreadable")
                restored = self._restorer.restore(manifest, by_step, rows or {})
            except Unusable as error:
                reasons.append(f"step {candidate}: {error}")
                if self.rank == 0:
                    log.warning("checkpoint step %d cannot be restored (%s); trying the previous one", candidate, error)
                continue
            restored.seconds = time.perf_counter() - started
            if announce:
                self.announce(restored)
            if self.rank == 0:
                if candidate != latest:
                    log.warning("restored step %d, not the newest (%s)", candidate, latest)
            self._last_step = restored.step
            return restored
        raise CheckpointError(f"no usable checkpoint in {self.layout.shared}: " + "; ".join(reasons))

    def announce(self, restored: Restored) -> None:
        """Say on rank 0 (INFO) which checkpoint was restored, from where, in how long."""
        if self.rank == 0:
            log.info("restored checkpoint step %d from %s in %.2f s", restored.step, restored.sources, restored.seconds)

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Wait for the background save (raising its failure) and release resources (collective)."""
        try:
            self.wait()
        finally:
            atexit.unregister(self._at_exit)
            self._pool.shutdown(wait=True)
            if self._node_lock is not None:
                self._node_lock.release()
            self._lock.release()
            if self._made_directory:  # a job that never needed a checkpoint leaves no empty directory behind
                with contextlib.suppress(OSError):
                    self.layout.shared.rmdir()

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
