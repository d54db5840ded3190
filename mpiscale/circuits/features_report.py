"""``mpiscale inspect`` of a features file (``mpiscale.circuit-features/1``, written by ``mpiscale circuits run``).

It says what ran (every circuit of a catalogue, or a composition plan), on
which data, how many of the batches are written (a stopped run's
``OUT.partial`` or a killed run's ``OUT.tmp`` too, with the command that
finishes it), and the circuits most active over the written rows.
"""

from __future__ import annotations

import numpy as np

from ..io import leading_rows, open_file
from ..words import counted, how_to_finish
from .job import FEATURES_FORMAT

SHOWN = 5  # circuits named as the most active


def summarize(path: str) -> str:
    """What ran on which data, how complete the file is, and what it holds."""
    with open_file(path, (FEATURES_FORMAT,)) as file:
        attrs = file.attrs
        ranks, batch_size = int(attrs["world_size"]), int(attrs["batch_size"])
        done = file["done"][()]
        samples = len(file["sample_ids"])
        plan = str(attrs.get("plan_sha256", ""))
        what = f"the plan (SHA-256 {plan[:12]}...)" if plan else "every selected circuit"
        lines = [
            f"{path}: {what} of the catalogue {attrs['catalogue']} on {samples:,} inputs of {attrs['data']}, "
            f"{counted(ranks, 'rank')} ({attrs['device']}), mpiscale {attrs['mpiscale_version']}, "
            f"{attrs['created']}",
            _written(path, done, batch_size),
        ]
        if "features" in file:
            names = [name.decode() for name in file["circuits"][()]]
            lines += _most_active(file["features"], names, done, batch_size)
        else:
            lines += [f"/outputs/{name}: {item.shape[0]:,} x {item.shape[1]}" for name, item in file["outputs"].items()]
    return "\n".join(lines)


def _written(path: str, done: np.ndarray, batch_size: int) -> str:
    written = int(done.sum())
    if written == len(done):
        return f"batches: all {len(done):,} written (--batch-size {batch_size:,})"
    return (f"batches: {written:,} of {len(done):,} written (--batch-size {batch_size:,}); "
            f"{how_to_finish(path, 'circuits run', 'writes')}")  # fmt: skip


def _most_active(features, names: list[str], done: np.ndarray, batch_size: int) -> list[str]:
    """The circuits of the largest mean absolute value over the written batches among the first rows."""
    rows, circuits = features.shape
    first = leading_rows(features)
    values = first[np.repeat(done.astype(bool), batch_size)[: len(first)]]
    lines = [f"/features: {rows:,} x {circuits} ({circuits} circuits)"]
    if len(values):
        activity = np.abs(values).mean(axis=0)
        top = np.argsort(-activity, kind="stable")[:SHOWN]
        where = "the written rows" if len(first) == rows else f"the written rows of the first {len(first):,}"
        lines.append(f"most active over {where} (mean |value|): "
                     + ", ".join(f"{names[i]} {activity[i]:.4g}" for i in top))  # fmt: skip
    return lines
