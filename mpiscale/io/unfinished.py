"""The files a stopped or killed mpiscale run leaves (``OUT.partial``, ``OUT.tmp``), refused as input data.

collect's activations and encode's codes are written in rounds and marked
(``rows_done``) as they go; the rows after the mark hold nothing yet (zeros, or
what a killed run began of them), so learning from such a file would take them
for data without a word. A job reading one as data refuses it, saying how to
finish the run.
"""

from __future__ import annotations

import h5py

from ..words import how_to_finish

#: format prefix -> (its job, what the job does to the others, what its rows are)
_MARKED_RUNS = {
    "mpiscale.activations/": ("collect", "collects", "rows"),
    "mpiscale.codes/": ("encode", "codes", "signals"),
}


def unfinished_run(file: h5py.File) -> str | None:
    """Why no data set of ``file`` can be read as data: it is an unfinished run's, whose mark says how far it is
    complete; or None."""
    kind = file.attrs.get("format", "")
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    run = next((run for prefix, run in _MARKED_RUNS.items() if kind.startswith(prefix)), None)
    if run is None or "rows_done" not in file.attrs:  # (files of before the marks: complete)
        return None
    command, does, unit = run
    total = int(file.attrs["shape"][0]) if unit == "signals" else len(file["sample_ids"])
    done = int(file.attrs["rows_done"])
    if done >= total:
        return None
    return (f"holds {done:,} of its {total:,} {unit}, an unfinished run's (the others hold nothing yet): "
            f"{how_to_finish(file.filename, command, does)}")  # fmt: skip
