"""``mpiscale inspect`` of an activations file (``mpiscale.activations/1``, written by ``mpiscale collect``).

It says where the rows came from (the model, the inputs and their labels), each
layer's data set with its share of zeros and its mean, a dead layer (all zeros)
or a broken model (non-finite values) showing at a glance, and the command that
learns a dictionary from a layer. Only the first 64 MiB of a large layer's
rows are read, so the report is quick on a file of any size.
"""

from __future__ import annotations

import numpy as np

from ..io import leading_rows, open_file
from ..words import counted, how_to_finish
from .collect import ACTIVATIONS_FORMAT


def summarize(path: str) -> str:
    """Provenance, each layer's shape and numbers, and the next step; of a stopped or killed run's file
    (``OUT.partial``, ``OUT.tmp``), the rows it collected and how to finish (its numbers over those rows)."""
    with open_file(path, (ACTIVATIONS_FORMAT,)) as file:
        attrs = file.attrs
        ranks = int(attrs["world_size"])
        layers = [name for name, item in file.items() if name != "sample_ids" and hasattr(item, "shape")]
        samples = len(file["sample_ids"])
        done = int(attrs.get("rows_done", samples))  # (files of before the marks: complete)
        labels = attrs.get("labels") or "none"
        lines = [
            f"{path}: activations of {samples:,} inputs from the model {attrs['model']} on "
            f"{counted(ranks, 'rank')} ({attrs['device']}), mpiscale {attrs['mpiscale_version']}, "
            f"{attrs['created']}",
            f"inputs: {attrs['inputs']}; labels: {labels}",
        ]
        if done < samples:
            lines.append(f"rows: {done:,} of {samples:,} collected; {how_to_finish(path, 'collect', 'collects')}")
        for name in layers:
            lines.append(_layer_line(name, file[name], done))
        if done < samples:
            return "\n".join(lines)
    if layers:
        lines.append(f"learn a dictionary of a layer: mpiscale dictlearn --data {path}:/{layers[0]}")
    return "\n".join(lines)


def _layer_line(name: str, dataset, done: int) -> str:
    """A layer's shape, and its share of zeros, mean and non-finite values over its first rows (of the ``done``
    rows collected)."""
    rows, width = dataset.shape
    shape = f"/{name}: {rows:,} x {width} {dataset.dtype}"
    if not done:
        return shape
    values = leading_rows(dataset)[:done]
    finite = np.isfinite(values)
    where = "all rows" if len(values) == rows else f"its first {len(values):,} rows"
    numbers = f"{np.mean(values == 0):.1%} zeros, mean {values[finite].mean() if finite.any() else np.nan:.4g}"
    broken = int((~finite).sum())
    return f"{shape}; over {where}: {numbers}" + (f", {broken:,} values NaN or infinite" if broken else "")
