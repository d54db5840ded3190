"""Each learned atom's top inputs: the samples whose codes use it most (`inspect --top-inputs`).

A circuit-analysis user learns a dictionary from a layer's activations
(``mpiscale collect``, then ``mpiscale dictlearn``) and asks what each atom
stands for. ``top_inputs`` codes every row of the data the dictionary was
learned from with the job's own coder, a block of rows at a time (one process,
bounded memory), keeps each atom's ``top`` largest coefficients, and names the
samples by their ``sample_ids`` and, when the activations file names them, by
their class labels.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..io import DataFileError, ShardedDataset, locate, open_file, split_spec
from .coding import correlations_of, gram_matrix, lasso_encode_gram, omp_encode_gram
from .results import RESULTS_FORMAT

_BLOCK_ROWS = 65536


@dataclass(frozen=True)
class AtomEntry:
    """One atom: how many samples use it, and its strongest samples (ids, coefficients, labels or None)."""

    atom: int
    used_by: int
    ids: np.ndarray
    coefficients: np.ndarray
    labels: np.ndarray | None


def top_inputs(results: str, top: int = 5, data: str | None = None) -> tuple[list[AtomEntry], int]:
    """(one entry per atom, most used first; rows coded) for the dictionary in ``results``.

    ``data`` (FILE:/dataset) overrides the data set the results file names.
    """
    with open_file(results, (RESULTS_FORMAT,)) as file:
        dictionary = file["dictionary"][()]
        config = json.loads(file.attrs["config"])
        source = data or locate(file.attrs, "data", results)
    path, name = split_spec(source)
    gram = gram_matrix(dictionary)
    atoms = len(dictionary)
    best = np.full((top, atoms), -np.inf)
    best_rows = np.zeros((top, atoms), np.int64)
    used = np.zeros(atoms, np.int64)
    with ShardedDataset(path, name) as rows:
        samples = len(rows)
        for lo in range(0, samples, _BLOCK_ROWS):
            block = np.asarray(rows.read(lo, min(lo + _BLOCK_ROWS, samples)), np.float64).reshape(
                -1, dictionary.shape[1]
            )
            correlations = correlations_of(block, dictionary)
            if config["coder"] == "lasso":
                codes = lasso_encode_gram(gram, correlations, config["alpha"])
            else:
                codes = omp_encode_gram(gram, correlations, config["sparsity"])
            used += np.count_nonzero(codes, axis=0)
            strength = np.abs(codes)
            candidates = np.concatenate([best, strength])
            numbers = np.concatenate([best_rows, np.arange(lo, lo + len(block))[:, None].repeat(atoms, axis=1)])
            keep = np.argpartition(-candidates, min(top, len(candidates)) - 1, axis=0)[:top]
            best, best_rows = np.take_along_axis(candidates, keep, 0), np.take_along_axis(numbers, keep, 0)
        attrs, first_file = rows.attrs(), rows.files[0]
    ids = _sample_ids(path, samples)
    labels = _labels(locate(attrs, "labels", first_file)) if attrs.get("labels") else None
    entries = []
    for atom in np.argsort(-used, kind="stable"):
        order = np.argsort(-best[:, atom], kind="stable")
        found = np.isfinite(best[order, atom]) & (best[order, atom] > 0)
        rows_of_atom = best_rows[order[found], atom]
        sample_ids = ids[rows_of_atom] if ids is not None else rows_of_atom
        entries.append(
            AtomEntry(
                int(atom),
                int(used[atom]),
                sample_ids,
                best[order[found], atom],
                labels[sample_ids] if labels is not None else None,
            )
        )
    return entries, samples


def _sample_ids(path: str, samples: int) -> np.ndarray | None:
    """The ``sample_ids`` data set beside the rows (as ``mpiscale collect`` writes it), if there is one."""
    try:
        with ShardedDataset(path, "sample_ids") as ids:
            return np.asarray(ids.read(0, len(ids)), np.int64) if len(ids) == samples else None
    except DataFileError:
        return None


def _labels(spec: str) -> np.ndarray:
    path, name = split_spec(spec)
    with ShardedDataset(path, name) as labels:
        return np.asarray(labels.read(0, len(labels))).reshape(-1)  # (a column too)


def format_top_inputs(entries: list[AtomEntry], samples: int, most: int = 20) -> str:
    """The ``most`` most used atoms, each with its strongest samples as ``id [label] |coefficient|``."""
    lines = [
        f"atoms by use, with the samples that use each most (sample id [label] |coefficient|), of {samples} coded:"
    ]
    for entry in entries[:most]:
        shown = []
        for index, sample in enumerate(entry.ids):
            label = f" [{entry.labels[index]}]" if entry.labels is not None else ""
            shown.append(f"{sample}{label} {entry.coefficients[index]:.3g}")
        summary = ""
        if entry.labels is not None and len(entry.labels):
            counts = Counter(int(v) for v in entry.labels).most_common(2)
            summary = "; top labels " + ", ".join(f"{label} x{count}" for label, count in counts)
        share = entry.used_by / max(samples, 1)
        lines.append(f"atom {entry.atom:4d}: used by {share:6.1%} of samples{summary}: {', '.join(shown)}")
    if len(entries) > most:
        lines.append(f"... {len(entries) - most} more atoms (--atoms N shows more)")
    return "\n".join(lines)
