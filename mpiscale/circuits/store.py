"""Adding circuits to a catalogue: one process, the whole batch or nothing, never two writers at once.

``add_circuits`` reads the catalogue into memory, appends the batch there and
writes the new file under a temporary name, then renames it into place
(``io.write_file``): a reader sees the old file or the new one, and a full
disk, a quota or a refused batch leaves the old one as it was.
A lock beside the catalogue refuses a second writer (another job) while one
is adding. Everything about the batch is checked before a byte is written.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from functools import partial

import h5py
import numpy as np

from .._version import __version__
from ..io import DataFileError, OutputLock, open_file, stamp, write_file
from .layout import CATALOGUE_FORMAT, MODEL_KINDS, model_group, prefix_group, space_group

_FIELD_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TEXT = h5py.string_dtype()


class CatalogueError(DataFileError):
    """A batch or catalogue that cannot be used, with the reason and the fix."""


@dataclass(frozen=True)
class ModelRef:
    """A model file by reference: where it is, what it holds (its SHA-256) and how to load it."""

    path: str
    sha256: str
    kind: str  # one of MODEL_KINDS
    inputs: int  # numbers per input row
    input_dtype: str  # the numpy type it takes them as ("float32", "int64")

    @classmethod
    def of(cls, path: str, kind: str, inputs: int, input_dtype: str) -> ModelRef:
        """The reference to ``path`` as it is now (its bytes hashed)."""
        return cls(os.path.abspath(path), file_sha256(path), kind, inputs, input_dtype)


@dataclass
class NewCircuits:
    """Circuits that share one prefix (a model up to ``layer``), to be added together."""

    model: ModelRef
    layer: str  # the module whose output they project ("" for a user's module: its own output)
    names: list[str]
    atoms: np.ndarray  # (m, width) projections on the layer's output
    source: str  # the dictlearn results file or the module file they came from
    atom_numbers: np.ndarray | None = None  # the source's atom numbers (default -1)
    usage: np.ndarray | None = None  # samples whose codes use each (default -1: unknown)
    top_inputs: np.ndarray | None = None  # (m, top) sample ids, -1 padding
    top_labels: list[list[str]] | None = None
    tags: list[str] = field(default_factory=list)  # the same for every circuit of the batch
    fields: dict[str, list] = field(default_factory=dict)  # key -> one value per circuit (numbers or text)
    space: str = ""  # the embeddings' space name (default: the prefix, model:layer)
    embeddings: np.ndarray | None = None  # (m, d); default the atoms

    @property
    def count(self) -> int:
        return len(self.names)

    def space_name(self) -> str:
        stem = os.path.splitext(os.path.basename(self.model.path))[0]
        return self.space or f"{stem}:{self.layer or 'output'}"


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, read in blocks."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as stream:
            while block := stream.read(1 << 22):
                digest.update(block)
    except OSError as error:
        raise DataFileError(path, f"cannot be read: {error.strerror}") from None
    return digest.hexdigest()


def add_circuits(path: str, batch: NewCircuits) -> int:
    """Append ``batch`` to the catalogue ``path`` (created if missing); the catalogue's circuits after it."""
    check_batch(batch)
    lock = OutputLock(f"{path}.lock", f"the catalogue {path}")
    lock.acquire()
    try:
        earlier = path if os.path.exists(path) else None
        if earlier:
            with open_file(path, (CATALOGUE_FORMAT,)):
                pass  # a file that is not a catalogue is refused before it is read
        return write_file(path, partial(_add, batch=batch, path=path, new=earlier is None), start_from=earlier)
    finally:
        lock.release()


def _add(file: h5py.File, batch: NewCircuits, path: str, new: bool) -> int:
    """Add ``batch`` to the catalogue (a new one, or the earlier one's copy): the circuits it holds after."""
    if new:
        stamp(file, CATALOGUE_FORMAT, 1)
        file.attrs["circuits"] = 0
    _check_against(file, path, batch)
    total = _append(file, batch)
    file.attrs["mpiscale_version"] = __version__
    return total


def check_batch(batch: NewCircuits) -> None:
    """Refuse a batch that is inconsistent in itself (names, shapes, NaN, tags, fields)."""
    where, count = batch.source, batch.count
    if batch.model.kind not in MODEL_KINDS:
        raise CatalogueError(where, f"model kind {batch.model.kind!r} is not one of {', '.join(MODEL_KINDS)}")
    if count == 0:
        raise CatalogueError(where, "holds no circuits to add")
    empty = [name for name in batch.names if not name.strip()]
    if empty:
        raise CatalogueError(where, "a circuit needs a name (an empty one was given)")
    seen: set[str] = set()
    for name in batch.names:
        if name in seen:
            raise CatalogueError(where, f"names two circuits {name!r}: names must be unique")
        seen.add(name)
    _check_matrix(where, "atoms", batch.atoms, count)
    _check_float32(where, batch.atoms)
    if batch.embeddings is not None:
        _check_matrix(where, "embeddings", batch.embeddings, count)
    for tag in batch.tags:
        if not tag or "," in tag or tag != tag.strip():
            raise CatalogueError(where, f"tag {tag!r}: a tag is a non-empty word without commas or edge spaces")
    for key, values in batch.fields.items():
        if not _FIELD_KEY.match(key):
            raise CatalogueError(where, f"field {key!r}: a field's name is letters, digits and _, not starting "
                                        "with a digit")  # fmt: skip
        if len(values) != count:
            raise CatalogueError(where, f"field {key!r} has {len(values)} values for {count} circuits")
        _field_kind(where, key, values)


def _check_float32(where: str, atoms: np.ndarray) -> None:
    """Refuse atoms float32, as the catalogue keeps them, cannot hold: past its largest value (they became
    infinite) or so small that a row became zeros."""
    with np.errstate(over="ignore"):
        stored = atoms.astype(np.float32)
    over = np.flatnonzero(~np.isfinite(stored).all(axis=1))
    kept = "the catalogue keeps atoms as float32"
    if len(over):
        largest = np.finfo(np.float32).max
        raise CatalogueError(
            where, f"atoms row {int(over[0])} holds values past float32's largest, {largest:.3g}: {kept}"
        )
    flat = np.flatnonzero(~np.any(stored != 0, axis=1))
    if len(flat):
        largest = np.abs(atoms[flat[0]]).max()
        raise CatalogueError(
            where, f"atoms row {int(flat[0])} is zeros in float32 (its largest value is {largest:.3g}): {kept}"
        )


def row_norms(matrix: np.ndarray) -> np.ndarray:
    """Each row's Euclidean norm (float64), with no overflow or underflow of the squares at any scale float64 holds:
    a row of 1e160 had an infinite norm (and a unit vector of zeros), one of 1e-170 a norm of 0."""
    peaks = np.abs(matrix).max(axis=1, initial=0.0)
    scaled = matrix / np.where(peaks > 0, peaks, 1.0)[:, None]
    return peaks * np.linalg.norm(scaled, axis=1)


def _check_matrix(where: str, what: str, matrix: np.ndarray, count: int) -> None:
    if matrix.ndim != 2 or len(matrix) != count or matrix.shape[1] == 0:
        raise CatalogueError(where, f"{what} have shape {matrix.shape}, expected ({count}, width)")
    bad = np.flatnonzero(~np.isfinite(matrix).all(axis=1))
    if len(bad):
        raise CatalogueError(where, f"{what} row {int(bad[0])} holds NaN or infinite values")
    flat = np.flatnonzero(~np.any(matrix != 0, axis=1))
    if len(flat):
        raise CatalogueError(where, f"{what} row {int(flat[0])} is all zeros: it has no direction")


def _field_kind(where: str, key: str, values: list) -> str:
    """``number`` or ``text`` for a field's values (all one kind; booleans are numbers)."""
    numbers = all(isinstance(v, (int, float, np.integer, np.floating)) for v in values)
    if numbers:
        return "number"
    if all(isinstance(v, str) for v in values):
        return "text"
    raise CatalogueError(where, f"field {key!r} mixes numbers and text, or holds other values: give one kind")


def _check_against(file: h5py.File, path: str, batch: NewCircuits) -> None:
    """Refuse a batch that clashes with what the catalogue holds: names, widths, dimensions, field kinds."""
    if "circuits/name" in file:
        known = set(file["circuits/name"].asstr()[()])
        clash = [name for name in batch.names if name in known]
        if clash:
            raise CatalogueError(path, f"holds a circuit named {clash[0]!r} already ({len(clash)} of the batch's "
                                       "names are taken): choose other names")  # fmt: skip
    prefix = _find_prefix(file, batch)
    if prefix is not None and file[prefix].attrs["width"] != batch.atoms.shape[1]:
        stored = file[prefix].attrs["width"]
        raise CatalogueError(batch.source, f"atoms are {batch.atoms.shape[1]} wide, but layer {batch.layer!r} of "
                                           f"{batch.model.path} is {stored} wide in {path}")  # fmt: skip
    space = _find_space(file, batch.space_name())
    dimension = (batch.embeddings if batch.embeddings is not None else batch.atoms).shape[1]
    if space is not None and file[space].attrs["dimension"] != dimension:
        raise CatalogueError(batch.source, f"embeddings have {dimension} numbers, but space {batch.space_name()!r} "
                                           f"of {path} has {file[space].attrs['dimension']}")  # fmt: skip
    for key, values in batch.fields.items():
        column = f"circuits/fields/{key}"
        if column in file:
            stored = "text" if h5py.check_string_dtype(file[column].dtype) else "number"
            if stored != _field_kind(batch.source, key, values):
                raise CatalogueError(batch.source, f"field {key!r} is {stored} in {path}, not "
                                                   f"{_field_kind(batch.source, key, values)}")  # fmt: skip


def _find_model(file: h5py.File, model: ModelRef) -> str | None:
    for name in sorted(file.get("models", {})):
        if file[f"models/{name}"].attrs["sha256"] == model.sha256:
            return f"models/{name}"
    return None


def _find_prefix(file: h5py.File, batch: NewCircuits) -> str | None:
    model = _find_model(file, batch.model)
    for name in sorted(file.get("prefixes", {})):
        group = file[f"prefixes/{name}"]
        if (
            model is not None
            and group.attrs["model"] == int(model.split("/")[1])
            and group.attrs["layer"] == batch.layer
        ):
            return f"prefixes/{name}"
    return None


def _find_space(file: h5py.File, name: str) -> str | None:
    for key in sorted(file.get("spaces", {})):
        if file[f"spaces/{key}"].attrs["name"] == name:
            return f"spaces/{key}"
    return None


def _append(file: h5py.File, batch: NewCircuits) -> int:
    """Write the batch into the (copied) catalogue; the circuits it holds after."""
    first, count = int(file.attrs["circuits"]), batch.count
    circuit_rows = np.arange(first, first + count, dtype=np.int64)
    model = _find_model(file, batch.model) or _new_model(file, batch.model)
    prefix = _find_prefix(file, batch) or _new_group(file, prefix_group(len(file.get("prefixes", {}))),
                                                     model=int(model.split("/")[1]), layer=batch.layer,
                                                     width=batch.atoms.shape[1])  # fmt: skip
    prefix_start = _extend(file[prefix], "atoms", batch.atoms.astype(np.float32))
    _extend(file[prefix], "circuit", circuit_rows)
    embeddings = (batch.embeddings if batch.embeddings is not None else batch.atoms).astype(np.float64)
    norms = row_norms(embeddings)
    space = _find_space(file, batch.space_name()) or _new_group(file, space_group(len(file.get("spaces", {}))),
                                                                name=batch.space_name(),
                                                                dimension=embeddings.shape[1])  # fmt: skip
    space_start = _extend(file[space], "vectors", (embeddings / norms[:, None]).astype(np.float32))
    _extend(file[space], "norm", norms)
    _extend(file[space], "circuit", circuit_rows)
    minus_one = np.full(count, -1, np.int64)
    columns = file.require_group("circuits")
    _extend(columns, "name", np.array(batch.names, dtype=object), _TEXT)
    _extend(columns, "prefix", np.full(count, int(prefix.split("/")[1]), np.int32))
    _extend(columns, "row", np.arange(prefix_start, prefix_start + count, dtype=np.int64))
    _extend(columns, "space", np.full(count, int(space.split("/")[1]), np.int32))
    _extend(columns, "space_row", np.arange(space_start, space_start + count, dtype=np.int64))
    _extend(columns, "atom", _or(batch.atom_numbers, minus_one))
    _extend(columns, "usage", _or(batch.usage, minus_one))
    _extend(columns, "tags", np.array([",".join(batch.tags)] * count, dtype=object), _TEXT)
    _extend(columns, "source", np.array([batch.source] * count, dtype=object), _TEXT)
    _append_top(columns, batch, first)
    for key, values in batch.fields.items():
        kind = _field_kind(batch.source, key, values)
        data = np.array(values, dtype=object) if kind == "text" else np.asarray(values, np.float64)
        _extend_field(columns, key, data, first)
    for key in columns.get("fields", {}):
        if key not in batch.fields:  # the batch has no value for an earlier field: NaN or empty text
            _extend_field(columns, key, None, first, count)
    file.attrs["circuits"] = first + count
    return first + count


def _new_model(file: h5py.File, model: ModelRef) -> str:
    name = model_group(len(file.get("models", {})))
    _new_group(
        file,
        name,
        path=model.path,
        sha256=model.sha256,
        kind=model.kind,
        inputs=model.inputs,
        input_dtype=model.input_dtype,
    )
    if model.kind == "train":
        file[name]["weights"] = h5py.ExternalLink(model.path, "/model")
    return name


def _new_group(file: h5py.File, where: str, **attrs) -> str:
    group = file.create_group(where)
    for key, value in attrs.items():
        group.attrs[key] = value
    return where


def _or(values: np.ndarray | None, default: np.ndarray) -> np.ndarray:
    return default if values is None else np.asarray(values, np.int64)


def _extend(group: h5py.Group, name: str, rows: np.ndarray, dtype=None, fill=None) -> int:
    """Append ``rows`` to data set ``name`` (created resizable); the first new row's index."""
    if name not in group:
        shape = (0, *rows.shape[1:])
        group.create_dataset(name, shape, dtype or rows.dtype, maxshape=(None, *rows.shape[1:]), chunks=True,
                             fillvalue=fill)  # fmt: skip
    dataset = group[name]
    start = dataset.shape[0]
    dataset.resize(start + len(rows), axis=0)
    dataset[start:] = rows
    return start


def _append_top(columns: h5py.Group, batch: NewCircuits, first: int) -> None:
    """``top_inputs`` and ``top_labels``, widened (with -1 and "") when this batch keeps more inputs."""
    count = batch.count
    top = batch.top_inputs if batch.top_inputs is not None else np.full((count, 0), -1, np.int64)
    labels = batch.top_labels or [[] for _ in range(count)]
    width = max(top.shape[1], columns["top_inputs"].shape[1] if "top_inputs" in columns else 0, 1)
    padded = np.full((count, width), -1, np.int64)
    padded[:, : top.shape[1]] = top
    texts = np.full((count, width), "", dtype=object)
    for row, values in enumerate(labels):
        texts[row, : len(values)] = values
    for name, rows, dtype, fill in (("top_inputs", padded, np.int64, -1), ("top_labels", texts, _TEXT, None)):
        if name not in columns:
            columns.create_dataset(name, (first, width), dtype, maxshape=(None, None), chunks=True, fillvalue=fill)
        dataset = columns[name]
        if dataset.shape[1] < width:
            dataset.resize(width, axis=1)
        dataset.resize(first + count, axis=0)
        dataset[first:, :width] = rows
        if dataset.shape[1] > width:
            dataset[first:, width:] = -1 if fill == -1 else ""


def _extend_field(columns: h5py.Group, key: str, values: np.ndarray | None, first: int, count: int = 0) -> None:
    """A user field's values (None: this batch has none), the column created with earlier rows empty."""
    name = f"fields/{key}"
    if name not in columns:
        text = values is not None and values.dtype == object
        columns.create_dataset(name, (first,), _TEXT if text else np.float64, maxshape=(None,), chunks=True,
                               fillvalue=None if text else np.nan)  # fmt: skip
    dataset = columns[name]
    if values is None:
        empty = h5py.check_string_dtype(dataset.dtype) is not None
        values = np.array([""] * count, dtype=object) if empty else np.full(count, np.nan)
    dataset.resize(first + len(values), axis=0)
    dataset[first:] = values
