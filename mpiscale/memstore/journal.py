"""The store's write-ahead journal: each commit's applied updates, durable on this rank's node and its partner's.

A commit is one record of the operations a rank applied since the last one
(``Op``: upserted rows, deleted ids, reinforcement sums, decays) and the
caller's small notes. ``write`` appends it to this rank's log and sends it to
the partner rank on the next node, which appends it to its copy; both are
fsynced before ``write`` returns. Files, in ``local_dir/node-K/wal/`` (or
``directory/wal/`` without node-local storage)::

    run-<id>.rank-00003-of-00004.from-00000020.wal        rank 3's commits after checkpoint 20
    run-<id>.copy-of-rank-00001-of-00004.from-00000020.wal  the partner copy of rank 1's

A node keeps its disk when a rerun numbers the nodes anew (the first node lost:
the second is the rerun's first), so recovery reads every ``node-K`` folder on
a node's disk, not only the one of its new number. A new segment starts at
every checkpoint, so the segments before the previous checkpoint can go.
``directory/journal.json`` names the run whose logs follow the newest
checkpoint, and the job's settings: logs of other runs (a dead node's
leftovers) are never replayed.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np

from ..io import Checkpointer, CheckpointError, ReplayReport, WriteAheadLog, encode_record, replay, write_atomically
from ..ranks import as_mpi
from ..runtime import ActorSystem, end_job

log = logging.getLogger(__name__)

_SEGMENT = re.compile(r"^run-([0-9a-f]+)\.(rank|copy-of-rank)-(\d+)-of-(\d+)\.from-(\d+)\.wal$")
OP_KINDS = ("upsert", "delete", "reinforce", "decay")


@dataclass
class Op:
    """One operation as a rank applied it: ``ids`` and per-id ``values`` (rows or sums), or a ``scalar``."""

    kind: str
    ids: np.ndarray | None = None
    values: np.ndarray | None = None
    scalar: float = 0.0  # the decay rate, or the reinforcement's iteration


@dataclass
class Commit:
    """A decoded record: its number, operations and notes."""

    number: int
    ops: list[Op]
    notes: dict[str, np.ndarray] = field(default_factory=dict)


def encode_commit(ops: list[Op], notes: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The named arrays of a record."""
    arrays = {"kinds": np.array([OP_KINDS.index(op.kind) for op in ops], np.int8)}
    arrays["scalars"] = np.array([op.scalar for op in ops], np.float64)
    for j, op in enumerate(ops):
        if op.ids is not None:
            arrays[f"{j}.ids"] = op.ids
        if op.values is not None:
            arrays[f"{j}.values"] = op.values
    return arrays | {f"note.{name}": np.asarray(value) for name, value in notes.items()}


def decode_commit(number: int, arrays: dict[str, np.ndarray]) -> Commit:
    ops = [
        Op(OP_KINDS[kind], arrays.get(f"{j}.ids"), arrays.get(f"{j}.values"), float(scalar))
        for j, (kind, scalar) in enumerate(zip(arrays["kinds"], arrays["scalars"]))
    ]
    notes = {name[5:]: value for name, value in arrays.items() if name.startswith("note.")}
    return Commit(number, ops, notes)


@dataclass(frozen=True)
class Segment:
    """One log file: whose commits (an old rank of an old world), which copy, after which checkpoint; on which node
    of this run it lies, and in which ``node-K`` folder of that node's disk (the node's number in the run that
    wrote it: a node keeps its disk when the nodes are numbered anew)."""

    node: int
    copy: bool
    rank: int
    world: int
    start: int
    name: str
    folder: int = 0


class Journal:
    """This rank's log and the partner copies it keeps; built on the checkpointer's nodes and partners."""

    def __init__(self, system: ActorSystem, checkpoints: Checkpointer) -> None:
        self.system, self.checkpoints = system, checkpoints
        layout = checkpoints.layout
        self.directory = layout.shared
        self.record_file = layout.shared / "journal.json"
        self._local = layout.local
        self.node = checkpoints.node if layout.local is not None else 0
        self.run = ""
        self.start = 0
        self._own: WriteAheadLog | None = None
        self._copies: dict[int, WriteAheadLog] = {}
        self.bytes_written = 0
        #: For the small blocking exchanges of recovery and set-up (never in flight with the store's collectives).
        self.comm = as_mpi(system.world.comm).Dup()
        self.nodes_of: list[int] = self.comm.allgather(self.node)

    @property
    def local_directory(self) -> Path | None:
        """This rank's node-local directory (None without node-local storage)."""
        return self._local / f"node-{self.node}" if self._local is not None else None

    def wal_dir(self, node: int) -> Path:
        return (self._local / f"node-{node}" if self._local is not None else self.directory) / "wal"

    def _wal_dirs(self) -> list[tuple[int, Path]]:
        """Every log folder this rank's node holds, with the node number in its name: its own, and those its disk
        kept from runs that numbered the nodes otherwise."""
        if self._local is None:
            return [(0, self.wal_dir(0))]
        found = [(int(path.name[5:]), path / "wal") for path in self._local.glob("node-*") if path.name[5:].isdigit()]
        return sorted(found) or [(self.node, self.wal_dir(self.node))]

    def _path(self, copy: bool, rank: int, start: int) -> Path:
        kind = "copy-of-rank" if copy else "rank"
        name = f"run-{self.run}.{kind}-{rank:05d}-of-{self.system.size:05d}.from-{start:08d}.wal"
        return self.wal_dir(self.node) / name

    # ------------------------------------------------------------ the run's record
    def read_record(self) -> dict | None:
        """``journal.json``: the run whose logs count and the job's settings (None before the first run)."""
        try:
            return json.loads(self.record_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{self.record_file} cannot be read ({error}); it names the logs to replay") from None

    def begin(self, start: int, meta: dict) -> None:
        """Start a new run's logs after checkpoint ``start``; other runs' logs on this node go (collective)."""
        run = self.comm.bcast(secrets.token_hex(6) if self.system.rank == 0 else None, 0)
        if self.system.rank == 0:
            record = {"run": run, "start": start, "ranks": self.system.size, "meta": meta}
            write_atomically(self.record_file, json.dumps(record).encode())
        self.comm.Barrier()
        self.run, self.start = run, start
        if self.system.rank == self.nodes_of.index(self.node):  # the node's first rank tidies its disk's logs
            self.wal_dir(self.node).mkdir(parents=True, exist_ok=True)
            for _, directory in self._wal_dirs():  # (other runs': the recovered state is checkpointed already)
                for path in directory.glob("run-*.wal"):
                    if not path.name.startswith(f"run-{run}."):
                        path.unlink(missing_ok=True)
        self.comm.Barrier()
        self._own = _opened(self._path(False, self.system.rank, start))

    # ------------------------------------------------------------------ writing
    async def write(self, number: int, ops: list[Op], notes: dict[str, np.ndarray]) -> None:
        """Make commit ``number`` durable here and in the partner's copy (collective)."""
        if self._own is None:
            raise RuntimeError("the journal is not open: call MemoryStore.recover() first")
        data = encode_record(number, encode_commit(ops, notes))
        _append(self._own, data)  # (fsyncs in threads, overlapping the exchange, were slower here)
        partner, copied = self.checkpoints.partner, 0
        if partner is not None:
            counts = np.zeros(self.system.size, np.int64)
            counts[partner] = len(data)
            received, sources = await self.system.world.alltoallv(np.frombuffer(data, np.uint8), counts)
            offsets, copied = np.concatenate([[0], np.cumsum(sources)]), len(received)
            for source in np.flatnonzero(sources):
                copy = self._copies.get(int(source))
                if copy is None:
                    copy = self._copies[int(source)] = _opened(self._path(True, int(source), self.start))
                _append(copy, memoryview(received[offsets[source] : offsets[source + 1]]))
        self.bytes_written += len(data) + copied

    def rotate(self, start: int, keep_from: int) -> None:
        """New segments after checkpoint ``start``; this rank's segments before checkpoint ``keep_from`` go."""
        self.close()
        self.start = start
        self._own = _opened(self._path(False, self.system.rank, start))
        senders = set(self.checkpoints.senders)
        for path in self.wal_dir(self.node).glob(f"run-{self.run}.*.wal"):
            segment = _parse(self.node, self.node, path.name)
            if segment is None or segment.start >= keep_from:
                continue
            if (segment.copy and segment.rank in senders) or (not segment.copy and segment.rank == self.system.rank):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the open segments (they stay on disk)."""
        for segment in [self._own, *self._copies.values()]:
            if segment is not None:
                segment.close()
        self._own, self._copies = None, {}

    # ----------------------------------------------------------------- reading
    def listing(self, run: str | None) -> list[Segment]:
        """The segments of ``run`` (None: of any run) on this rank's node, in every log folder its disk holds."""
        pattern = f"run-{run}.*.wal" if run is not None else "run-*.wal"
        found = [_parse(self.node, folder, path.name) for folder, directory in self._wal_dirs()
                 for path in directory.glob(pattern)]  # fmt: skip
        return [segment for segment in found if segment is not None]

    def wal_places(self) -> str:
        """Where the logs live, for messages: every node's log directory."""
        return str(self._local / "node-*" / "wal") if self._local is not None else str(self.wal_dir(0))

    def read(self, segments: list[Segment], after: int) -> tuple[list[Commit], str]:
        """(the consecutive commits after ``after`` in one old rank's ``segments``, the log whose last record was
        torn or ""); a gap ends them, with a warning."""
        commits: list[Commit] = []
        torn = ""
        for segment in sorted(segments, key=lambda s: s.start):
            path = self.wal_dir(segment.folder) / segment.name
            report = ReplayReport()
            try:
                records = list(replay(path, report))
            except OSError as error:
                raise CheckpointError(f"the log {path} cannot be read: {error}") from error
            torn = str(path) if report.torn_bytes else torn
            for number, arrays in records:
                expected = after + len(commits) + 1
                if number > expected:
                    log.warning("%s jumps from commit %d to %d: the commits after %d are redone", path, expected - 1,
                                number, expected - 1)  # fmt: skip
                    return commits, torn
                if number == expected:
                    commits.append(decode_commit(number, arrays))
        return commits, torn


def _parse(node: int, folder: int, name: str) -> Segment | None:
    match = _SEGMENT.match(name)
    if match is None:
        return None
    _, kind, rank, world, start = match.groups()
    return Segment(node, kind != "rank", int(rank), int(world), int(start), name, folder)


def existing_segments(run: str, found: list[Segment]) -> dict[int, list[Segment]]:
    """Per old rank, the segments to read: its own node's copy if any, else its partner's (the most segments)."""
    worlds = {segment.world for segment in found}
    if len(worlds) > 1:
        raise CheckpointError(f"the logs of run {run} come from several world sizes {sorted(worlds)}")
    chosen: dict[int, list[Segment]] = {}
    for rank in sorted({segment.rank for segment in found}):
        places: dict[tuple[int, bool], list[Segment]] = {}
        for segment in found:
            if segment.rank == rank:
                places.setdefault((segment.node, segment.copy), []).append(segment)
        best = max(places, key=lambda place: (len(places[place]), not place[1]))
        chosen[rank] = places[best]
    return chosen


def lost_logs(found: list[Segment], ranks: int | None) -> list[int]:
    """Old ranks with no log anywhere: of ``ranks`` (the run's world, as its record says), or of the world the
    logs found name (records of older versions do not say)."""
    world = ranks if ranks is not None else (found[0].world if found else 0)
    return sorted(set(range(world)) - {segment.rank for segment in found})


def _opened(path: Path) -> WriteAheadLog:
    """The log segment ``path``, opened to append (made if missing); a disk that refuses it ends the job as
    ``_append`` does."""
    try:
        return WriteAheadLog(path)
    except OSError as error:
        _refused(str(path), error)


def _append(log: WriteAheadLog, record: bytes | bytearray | memoryview) -> None:
    """Append ``record`` to ``log``, durable; a write the disk refuses (full, a quota) ends the job in one line."""
    try:
        log.append_encoded(record)
    except OSError as error:
        _refused(log.path, error)


def _refused(path: str, error: OSError) -> NoReturn:
    """End the job over the log ``path`` its disk refused (this rank alone may see it: a node's own disk). What was
    logged before and the checkpoints stay whole (a torn last record is cut off as the log is read back)."""
    end_job(f"the memory store's log {path} could not be written ({error.strerror or error}): the checkpoints and "
            "the commits logged before are intact; free space there and run the same command, which goes on from "
            "them")  # fmt: skip
