"""The files a stopped or killed mpiscale run leaves (``OUT.partial``, ``OUT.tmp``), refused as input data.

collect's activations, encode's codes and circuits run's features are written
as the run goes and marked as they are (``rows_done``, or ``done`` flags per
batch); the rest holds nothing yet (zeros, or what a killed run began), so
learning from such a file would take it for data without a word. A job reading
one as data refuses it, saying how to finish the run.
"""

from __future__ import annotations

import h5py
import numpy as np

from ..words import how_to_finish


def unfinished_run(file: h5py.File) -> str | None:
    """Why no data set of ``file`` can be read as data: it is an unfinished run's, whose marks say how far it is
    complete; or None."""
    kind = file.attrs.get("format", "")
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    if kind.startswith("mpiscale.circuit-features/") and "done" in file:
        flags = np.asarray(file["done"][()], bool)
        done, total, unit, command, does = int(flags.sum()), len(flags), "batches", "circuits run", "writes"
    elif "rows_done" not in file.attrs:  # (files of before the marks: complete)
        return None
    elif kind.startswith("mpiscale.activations/"):
        done, total = int(file.attrs["rows_done"]), len(file["sample_ids"])
        unit, command, does = "rows", "collect", "collects"
    elif kind.startswith("mpiscale.codes/"):
        done, total = int(file.attrs["rows_done"]), int(file.attrs["shape"][0])
        unit, command, does = "signals", "encode", "codes"
    else:
        return None
    if done >= total:
        return None
    return (f"holds {done:,} of its {total:,} {unit}, an unfinished run's (the others hold nothing yet): "
            f"{how_to_finish(file.filename, command, does)}")  # fmt: skip
