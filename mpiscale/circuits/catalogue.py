"""Reading a catalogue: its circuits' columns (whole or a block of rows), models, prefixes and spaces.

``Catalogue(path)`` opens the file read-only with plain h5py, so any number
of ranks (or a notebook) may read it at once. Columns are read by name, for a
block of rows when a rank searches its share; ``model`` and ``layer`` are
derived from each circuit's prefix, and a user's field is read by its key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import h5py
import numpy as np

from ..errors import refuse_a_str
from ..io import open_file
from .layout import CATALOGUE_FORMAT, NUMBER_COLUMNS, TEXT_COLUMNS, prefix_group, space_group
from .store import CatalogueError, ModelRef

#: Columns derived from the prefix of each circuit.
DERIVED_COLUMNS = ("model", "layer")


@dataclass(frozen=True)
class Prefix:
    """A model up to one layer, and the atoms of its circuits."""

    index: int
    model: ModelRef
    layer: str
    width: int
    count: int  # circuits (rows of its atoms)


@dataclass(frozen=True)
class LayerCircuits:
    """Some circuits of one prefix: its model (an index of ``Catalogue.models``) and layer, their atoms
    (m x width), and where they stand among the circuits asked for (their output columns)."""

    model: int
    layer: str
    atoms: np.ndarray
    columns: np.ndarray

    def project(self, outputs: np.ndarray, into: np.ndarray) -> None:
        """The layer's ``outputs`` projected on the atoms, into their columns of ``into``: one product."""
        into[:, self.columns] = outputs @ self.atoms.T


@dataclass(frozen=True)
class Space:
    """Embeddings of one kind: the vectors similar-search compares."""

    index: int
    name: str
    dimension: int
    count: int


class Catalogue:
    """A catalogue file, open for reading (a context manager)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file: h5py.File = open_file(path, (CATALOGUE_FORMAT,))
        self.count = int(self.file.attrs["circuits"])
        self.models = [
            ModelRef(
                str(group.attrs["path"]),
                str(group.attrs["sha256"]),
                str(group.attrs["kind"]),
                int(group.attrs["inputs"]),
                str(group.attrs["input_dtype"]),
            )
            for _, group in sorted(self.file.get("models", {}).items())
        ]
        self.prefixes = [
            Prefix(
                index,
                self.models[int(group.attrs["model"])],
                str(group.attrs["layer"]),
                int(group.attrs["width"]),
                len(group["circuit"]),
            )  # fmt: skip
            for index, (_, group) in enumerate(sorted(self.file.get("prefixes", {}).items()))
        ]
        self.spaces = [
            Space(index, str(group.attrs["name"]), int(group.attrs["dimension"]), len(group["circuit"]))
            for index, (_, group) in enumerate(sorted(self.file.get("spaces", {}).items()))
        ]

    def __enter__(self) -> Catalogue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()

    def fields(self) -> list[str]:
        """The user's field keys."""
        return sorted(self.file.get("circuits/fields", {}))

    def keys(self) -> list[str]:
        """Every column a filter may name."""
        return [*TEXT_COLUMNS, *DERIVED_COLUMNS, *NUMBER_COLUMNS, "tag", *self.fields()]

    def column(self, key: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Column ``key`` for circuits ``start:stop``: numbers, or text as a numpy array of str."""
        stop = self.count if stop is None else stop
        if key in DERIVED_COLUMNS:
            prefixes = self.column("prefix", start, stop)
            names = [os.path.basename(p.model.path) if key == "model" else p.layer for p in self.prefixes]
            return np.array(names + [""], dtype=str)[prefixes] if len(names) else np.array([], dtype=str)
        name = f"circuits/{key}" if key in (*NUMBER_COLUMNS, *TEXT_COLUMNS) else f"circuits/fields/{key}"
        if name not in self.file:
            raise CatalogueError(self.path, f"has no column {key!r}; its columns: {', '.join(self.keys())}")
        dataset = self.file[name]
        if h5py.check_string_dtype(dataset.dtype) is not None:
            return np.array(dataset.asstr()[start:stop], dtype=str)
        return dataset[start:stop]

    def is_text(self, key: str) -> bool:
        """Whether column ``key`` holds text (else numbers)."""
        if key in DERIVED_COLUMNS or key in TEXT_COLUMNS or key == "tag":
            return True
        name = f"circuits/fields/{key}"
        return name in self.file and h5py.check_string_dtype(self.file[name].dtype) is not None

    def atoms(self, prefix: int) -> np.ndarray:
        """The atoms (m x width) of a prefix's circuits, in their order."""
        return self.file[f"{prefix_group(prefix)}/atoms"][()]

    def prefix_circuits(self, prefix: int) -> np.ndarray:
        """The table rows of a prefix's circuits, in the order of its atoms."""
        return self.file[f"{prefix_group(prefix)}/circuit"][()]

    def layers_of(self, rows: np.ndarray) -> list[LayerCircuits]:
        """The circuits of ``rows`` (table rows, ascending) grouped by prefix: what runs them is one pass of each
        model and one product per layer."""
        parts = []
        for prefix in self.prefixes:
            circuits = self.prefix_circuits(prefix.index)
            chosen = np.isin(circuits, rows)
            if chosen.any():
                model = self.models.index(prefix.model)
                columns = np.searchsorted(rows, circuits[chosen])
                parts.append(LayerCircuits(model, prefix.layer, self.atoms(prefix.index)[chosen], columns))
        return parts

    def vectors(self, space: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(unit vectors, their circuits' rows) of space rows ``start:stop``."""
        group = self.file[space_group(space)]
        return group["vectors"][start:stop], group["circuit"][start:stop]

    def rows_named(self, names: list[str] | tuple[str, ...]) -> dict[str, int]:
        """The table row of each of ``names`` the catalogue holds (one read of the names; the others are left
        out)."""
        refuse_a_str(names, "names", "circuit names")  # (its letters were looked up as names)
        wanted = set(names)
        return {str(name): row for row, name in enumerate(self.column("name")) if name in wanted}

    def find(self, names: list[str]) -> list[int]:
        """The rows of the circuits named ``names``, in their order; a name the catalogue does not hold is
        refused."""
        found = self.rows_named(names)
        missing = [name for name in names if name not in found]
        if missing:
            raise CatalogueError(self.path, f"holds no circuit named {missing[0]!r} ({self.count} circuits; "
                                            "`mpiscale circuits search` lists them)")  # fmt: skip
        return [found[name] for name in names]

    def space_named(self, name: str | None, dimension: int | None) -> Space:
        """The space called ``name``, or else the only one of ``dimension`` numbers."""
        if name:
            for space in self.spaces:
                if space.name == name:
                    return space
            known = ", ".join(s.name for s in self.spaces) or "none"
            raise CatalogueError(self.path, f"has no embedding space {name!r}; its spaces: {known}")
        matching = [s for s in self.spaces if dimension is None or s.dimension == dimension]
        if len(matching) == 1:
            return matching[0]
        listed = ", ".join(f"{s.name} ({s.dimension})" for s in self.spaces) or "none"
        wanted = f"of {dimension} numbers " if dimension is not None else ""
        how = "several" if matching else "no"
        raise CatalogueError(self.path, f"has {how} embedding spaces {wanted}(spaces: {listed}): give --space NAME")
