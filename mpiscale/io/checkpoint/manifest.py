"""A checkpoint's manifest: each array's kind, shape, row blocks and checksums, the levels written, the metadata.

The manifest (``step-NNNNNNNN.json`` in the shared directory) is what commits a
checkpoint, and what a restore checks every byte it reads against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..._version import __version__
from ...ranks import Comm
from ..errors import DataFileError
from ..h5file import CHECKPOINT_FORMAT, utc_timestamp
from .files import CHECKSUM, checksum


@dataclass
class SaveJob:
    """One save, as the background writer gets it."""

    step: int
    sharded: dict[str, np.ndarray]
    replicated: dict[str, np.ndarray]  # rank 0 only
    replicated_specs: dict[str, tuple[tuple[int, ...], str]]
    meta: dict
    full: bool  # False: a delta save, arrays unchanged since the last full save point to it
    levels: list[str]  # "local", "partner", "shared": what this save writes
    blocked: float = 0.0


def build_manifest(comm: Comm, job: SaveJob, world_size: int, levels: list[str], base: dict | None) -> dict:
    """The manifest of ``job`` (collective on ``comm``).

    With ``base`` (the last full save's manifest), arrays unchanged since then point to it instead.
    """
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
        "world_size": world_size,
        "levels": levels,
        "base": None if base is None else base["step"],
        "arrays": arrays,
        "meta": job.meta,
    }


def verify(path: str, name: str, data: np.ndarray, entry: dict, rows: int | None, crc: int) -> None:
    """Raise DataFileError unless ``data`` has the manifest entry's shape, dtype and checksum ``crc``."""
    shape = tuple(entry["shape"]) if rows is None else (rows, *entry["shape"][1:])
    if data.shape != shape or data.dtype != np.dtype(entry["dtype"]):
        raise DataFileError(path, f"holds {data.dtype}{data.shape}, the manifest says {entry['dtype']}{shape}", name)
    if checksum(data, entry.get("checksum", "crc32")) != crc:
        raise DataFileError(path, "checksum mismatch: the data is corrupt", name)


def nbytes(entry: dict) -> int:
    """Bytes of the whole array of a manifest entry."""
    return int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(entry["dtype"]).itemsize


def row_shape(entry: dict) -> tuple[int, ...]:
    """Shape of one row as redistributed: replicated arrays travel as a single row."""
    return tuple(entry["shape"][1:]) if entry["kind"] == "sharded" else tuple(entry["shape"])


def read_manifest(path: Path) -> dict | None:
    """The manifest at ``path``, or None if it is missing, unreadable or of another format."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("format") == CHECKPOINT_FORMAT else None
