"""Where checkpoint files live and how each kind is written and read.

Shared directory (level 3, and the commit records)::

    step-00000120.json   manifest: arrays, row blocks, checksums, levels, metadata
    step-00000120.h5     parallel HDF5 file with every array at its global shape
    latest               the step of the newest committed checkpoint

Node-local directory (levels 1 and 2), one per node::

    node-0/step-00000120/rank-00003.h5          rank 3's own shard
    node-0/step-00000120/copy-of-rank-00001.h5  the partner copy of a rank on another node

Every file is written under a temporary name, flushed, then renamed.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import crc32c
import h5py
import numpy as np

from ...ranks import Comm
from ..h5file import (
    CHECKPOINT_FORMAT,
    SHARD_FORMAT,
    dataset,
    file_access,
    file_with_room,
    open_file,
    publish,
    published,
    stamp,
    unstorable,
)
from ..rows import read_rows, write_rows

#: Data sets of the level-3 file start on 1 MiB boundaries, and each rank writes its own contiguous
#: block independently: at 4 ranks on 2 cores this was about twice as fast as collective (two-phase) I/O,
#: whose aggregators copy every block once more.
ALIGNMENT = 1 << 20
_STEP = re.compile(r"^step-(\d{8,})\.json$")
_SHARD = re.compile(r"^(rank|copy-of-rank)-(\d+)\.h5$")


#: Checksums by name, as manifests record them. New checkpoints use CRC-32C, which the CPU computes
#: in hardware (about 6x zlib's CRC-32 here); checkpoints whose entries name none used zlib's CRC-32.
CHECKSUMS = {"crc32c": crc32c.crc32c, "crc32": zlib.crc32}
CHECKSUM = "crc32c"


def array_problem(name: object, array: object, rows: bool) -> str | None:
    """Why ``array`` cannot be checkpointed under ``name`` (``rows``: a sharded array, which needs them); None when
    it can. Said before any file is made: unicode, dates and records failed in the write, and left its .tmp."""
    if not isinstance(name, str) or not name or "/" in name:
        return f"array names must be non-empty strings without '/', got {name!r}"
    if not isinstance(array, np.ndarray):
        return f"{name!r} is a {type(array).__name__}, not a numpy array (convert tensors with .numpy())"
    if array.dtype.hasobject:
        return f"{name!r} holds Python objects; only plain numeric arrays can be checkpointed"
    if array.dtype.names:
        return f"{name!r} is an array of records ({array.dtype}); save each field as an array of its own"
    problem = unstorable(array.dtype)
    if problem is not None:
        return f"{name!r} is {array.dtype}, {problem}"
    if rows and array.ndim == 0:
        return f"sharded array {name!r} needs at least one dimension (rows)"
    return None


def checksum(array: np.ndarray, algorithm: str = CHECKSUM) -> int:
    """Checksum of an array's bytes in C order (CRC-32C by default)."""
    return CHECKSUMS[algorithm](memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))


@dataclass(frozen=True)
class Layout:
    """Paths of one checkpoint series."""

    shared: Path
    local: Path | None

    def manifest(self, step: int) -> Path:
        return self.shared / f"step-{step:08d}.json"

    def shared_file(self, step: int) -> Path:
        return self.shared / f"step-{step:08d}.h5"

    @property
    def latest(self) -> Path:
        return self.shared / "latest"

    def node_dir(self, node: int) -> Path:
        assert self.local is not None
        return self.local / f"node-{node}"

    def step_dir(self, node: int, step: int) -> Path:
        return self.node_dir(node) / f"step-{step:08d}"

    def shard(self, node: int, step: int, rank: int, copy: bool = False) -> Path:
        return self.step_dir(node, step) / f"{'copy-of-rank' if copy else 'rank'}-{rank:05d}.h5"

    def committed_steps(self) -> list[int]:
        """Steps with a manifest in the shared directory, newest first."""
        found = [int(m.group(1)) for m in map(_STEP.match, os.listdir(self.shared)) if m]
        return sorted(found, reverse=True)

    def shards_on_node(self, node: int, step: int) -> list[tuple[int, bool, str]]:
        """(writer rank, is a partner copy, path) of every shard of ``step`` in this node's directory ``node-K``;
        if it has none, those of the other ``node-*`` directories on this node's disk. A job resumed on fewer or
        other nodes numbers them anew, and a node's disk keeps the shards under the number it had before."""
        assert self.local is not None
        own = self.node_dir(node)
        found = _shards_in(own / f"step-{step:08d}")
        if found:
            return found
        try:
            others = sorted(p for p in self.local.glob("node-*") if p != own and p.is_dir())
        except OSError:
            return []
        return [shard for directory in others for shard in _shards_in(directory / f"step-{step:08d}")]


def _shards_in(directory: Path) -> list[tuple[int, bool, str]]:
    """(writer rank, is a partner copy, path) of the shard files in ``directory`` (none if it is not there)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in sorted(names):
        match = _SHARD.match(name)
        if match:
            found.append((int(match.group(2)), match.group(1) != "rank", str(directory / name)))
    return found


def write_shard(path: Path, step: int, rank: int, world_size: int, arrays: dict[str, np.ndarray]) -> None:
    """Write one rank's shard (serial HDF5) atomically, its room set aside first: a full disk or quota raises
    ``OSError`` before the arrays are written, and leaves nothing behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    nbytes = sum(array.nbytes for array in arrays.values())
    with published(path) as temporary, file_with_room(temporary, nbytes, len(arrays)) as file:
        stamp(file, SHARD_FORMAT, world_size, {"step": step, "rank": rank})
        for name, array in arrays.items():
            file.create_dataset(name, data=array)


def read_shard(path: str, names: list[str]) -> dict[str, np.ndarray]:
    """Arrays ``names`` of a shard file (DataFileError if missing, truncated, foreign or incomplete)."""
    with open_file(path, (SHARD_FORMAT,)) as file:
        return {name: dataset(file, name)[()] for name in names}


def write_shared(
    path: Path,
    comm: Comm,
    world_size: int,
    manifest: dict,
    sharded: dict[str, tuple[int, np.ndarray]],
    replicated: dict,
) -> None:
    """Write the level-3 file (collective open and close): every array at its global shape, then flush and rename.

    ``sharded`` maps names to (first global row, this rank's rows); ``replicated``
    holds the arrays rank 0 writes (other ranks pass the same names).
    """
    temporary = path.with_name(path.name + ".tmp")
    rank = comm.Get_rank()
    aligned = {"alignment_threshold": ALIGNMENT, "alignment_interval": ALIGNMENT}
    with h5py.File(temporary, "w", **file_access(comm), **aligned) as file:
        stamp(file, CHECKPOINT_FORMAT, world_size, {"step": manifest["step"]})
        file.attrs["manifest"] = json.dumps(manifest)
        for name in sorted(sharded):
            entry = manifest["arrays"][name]
            target = file.create_dataset(name, tuple(entry["shape"]), np.dtype(entry["dtype"]), fill_time="never")
            start, rows = sharded[name]
            write_rows(target, start, rows)  # independent: each rank writes its one contiguous block
        for name in sorted(replicated):
            entry = manifest["arrays"][name]
            target = file.create_dataset(name, tuple(entry["shape"]), np.dtype(entry["dtype"]), fill_time="never")
            if rank == 0:  # independent write: dataset creation is collective, the data need not be
                target[()] = replicated[name]
        file.flush()  # MPI_File_sync on every rank
    if rank == 0:
        publish(temporary, path)
    comm.Barrier()


def read_shared_rows(file: h5py.File, name: str, start: int, stop: int, comm: Comm) -> np.ndarray:
    """Rows ``start:stop`` of a level-3 array, collectively."""
    return read_rows(dataset(file, name), start, stop, comm)


def open_shared(path: Path, comm: Comm) -> h5py.File:
    """Open a level-3 file collectively, checking its format."""
    return open_file(path, (CHECKPOINT_FORMAT,), comm)
