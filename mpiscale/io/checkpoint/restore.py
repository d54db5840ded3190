"""Restoring a checkpoint on any world size: each shard from its own node, else a partner's copy, else the shared file.

What is read is verified against the manifest's checksums and redistributed
to the rows each rank asks for, so a job restarts on another number of ranks
or nodes. A step that cannot be read raises ``Unusable`` on every rank, and the
caller tries the one before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from ...ranks import Comm, agree, rank_rows
from ..errors import CheckpointError, DataFileError
from ..h5file import dataset
from ..redistribute import redistribute
from .files import Layout, open_shared, read_shard, read_shared_rows
from .manifest import read_manifest, row_shape, verify

log = logging.getLogger(__name__)


class Unusable(CheckpointError):
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
    seconds: float = 0.0  # how long the restore took


class Restorer:
    """Reads checkpoints of one layout for the ranks of ``comm`` (every method is collective)."""

    def __init__(self, layout: Layout, comm: Comm, node: int) -> None:
        self.layout, self.comm, self.node = layout, comm, node
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def read_manifests(self) -> list[tuple[int, dict | None]]:
        """Committed checkpoints up to the ``latest`` pointer, newest first."""
        try:
            newest = int(self.layout.latest.read_text().strip())
        except (OSError, ValueError):
            newest = None
        steps = [s for s in self.layout.committed_steps() if newest is None or s <= newest]
        return [(s, read_manifest(self.layout.manifest(s))) for s in steps]

    def restore(self, manifest: dict, by_step: dict[int, dict], rows: dict) -> Restored:
        """The checkpoint of ``manifest``: this rank's ``rows`` of each sharded array, and the replicated ones."""
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
                raise Unusable(f"it needs the arrays of step {source_step}, which is gone")
            got, sources[source_step] = self._fetch(source, sorted(names), {n: wanted[n] for n in names})
            arrays.update(got)
        sharded = {n: a for n, a in arrays.items() if manifest["arrays"][n]["kind"] == "sharded"}
        replicated = {n: a[0] for n, a in arrays.items() if manifest["arrays"][n]["kind"] == "replicated"}
        return Restored(
            manifest["step"], sharded, {n: wanted[n] for n in sharded}, replicated, manifest["meta"], sources
        )

    def _fetch(self, source: dict, names: list[str], wanted: dict) -> tuple[dict[str, np.ndarray], str]:
        """Arrays ``names`` of one saved step: from node-local shards if every one is found, else shared."""
        comm, bad = self.comm, set[str]()
        while "local" in source["levels"] and self.layout.local is not None:
            assignment = self._assign_shards(source, bad)
            if assignment is None:
                break
            held, failed = self._read_shards(source, names, assignment)
            failed = [item for items in comm.allgather(failed) for item in items]
            if not failed:
                used = sorted({"partner" if copy else "local" for _, _, copy in assignment.values()})
                specs = {n: (row_shape(source["arrays"][n]), np.dtype(source["arrays"][n]["dtype"])) for n in names}
                return redistribute(comm, held, wanted, specs), "+".join(used)
            for path, reason in failed:
                bad.add(path)
                if self.rank == 0:
                    log.warning("checkpoint shard %s is unusable (%s); looking for another copy", path, reason)
        if "shared" not in source["levels"]:
            raise Unusable(f"shards of step {source['step']} are lost from node-local storage and partners")
        return self._read_shared(source, names, wanted), "shared"

    def _assign_shards(self, source: dict, bad: set[str]) -> dict[int, tuple[int, str, bool]] | None:
        """Which rank reads each writer's shard (own copies first, then the least-loaded reader)."""
        found = [
            (writer, copy, path)
            for writer, copy, path in self.layout.shards_on_node(self.node, source["step"])
            if path not in bad and writer < source["world_size"]
        ]
        every = self.comm.allgather(found)
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
                        verify(path, name, data[name], entries[name], stop - start, crc)
                        held[name].append((start, data[name]))
                    else:
                        verify(path, name, data[name], entries[name], None, entries[name]["blocks"][0][2])
                        held[name].append((0, data[name][None]))
            except (DataFileError, OSError) as error:
                failed.append((path, str(error)))
        return held, failed

    def _read_shared(self, source: dict, names: list[str], wanted: dict) -> dict[str, np.ndarray]:
        comm, path, file = self.comm, self.layout.shared_file(source["step"]), None
        error: Exception | None = None
        try:
            file = open_shared(path, comm)
        except DataFileError as failure:
            error = failure
        agree(comm, error, f"opening {path}", Unusable, entered=True)
        assert file is not None
        out = {}
        try:
            for name in names:
                entry = source["arrays"][name]
                if entry["kind"] == "replicated":
                    try:
                        data = dataset(file, name)[()]
                        verify(str(path), name, data, entry, None, entry["blocks"][0][2])
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
                        verify(str(path), name, data[b_start - lo : b_stop - lo], entry, b_stop - b_start, crc)
                    except DataFileError as failure:
                        error = error or failure
                out[name] = data[start - lo : stop - lo]
        finally:
            file.close()  # opened on every rank: the agreement above raised otherwise
        agree(comm, error, f"reading {path}", Unusable, entered=True)
        return out
