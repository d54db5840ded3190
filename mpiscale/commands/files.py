"""``mpiscale index`` and ``mpiscale inspect``: commands on files, in one process."""

from __future__ import annotations

import argparse
import sys

from ..words import counted


def index(args: argparse.Namespace) -> int:
    """Write an index file that presents several HDF5 files as one data set."""
    from ..io import DataFileError, resolve_files, write_index

    try:
        files = [path for pattern in args.files for path in resolve_files(pattern)]
        shapes = write_index(args.index, files, [args.dataset] if args.dataset else None)
    except (DataFileError, ValueError) as error:
        return _refused("index", error)
    arrays = ", ".join(f"/{name} {shape}" for name, shape in shapes.items())
    print(f"wrote {args.index}: {counted(len(files), 'file')} as one data set: {arrays}")
    return 0


def inspect(args: argparse.Namespace) -> int:
    """Summarize a results file (its job found by its ``format``), and list top inputs or draw it when asked; a
    file, data set or data path that cannot be read is one line and exit status 2."""
    from importlib import import_module

    from ..errors import MpiscaleError
    from ..io import DataFileError, open_file, same_file
    from ..jobs import job_of_results, jobs_with

    try:
        with open_file(args.results) as file:
            kind = str(file.attrs.get("format", ""))
    except DataFileError as error:
        return _refused("inspect", error)
    job = job_of_results(kind)
    if job is None or job.report is None:
        return _refused("inspect", f"{args.results} is not a results file of {jobs_with('report', 'or')}")
    if args.top_inputs and job.name != "dictlearn":
        return _refused("inspect", "--top-inputs needs a dictlearn results file")
    if args.plot and not job.plots:
        return _refused("inspect", f"--plot draws {jobs_with('plots', 'and')} results, not {job.name}'s")
    if args.plot and same_file(args.plot, args.results):
        return _refused("inspect", f"--plot {args.plot} is the results file itself: name the image another file")
    report = import_module(job.report)
    try:
        print(report.summarize(args.results))
        if args.top_inputs:
            from ..dictlearn import format_top_inputs, top_inputs

            entries, samples = top_inputs(args.results, args.top_inputs, args.data)
            print(format_top_inputs(entries, samples, args.atoms))
        if args.plot:
            report.plot(args.results, args.plot)
            print(f"wrote {args.plot}")
    except BrokenPipeError:  # the reader of the report left (a pipe into head): the command line's to handle
        raise
    except (MpiscaleError, OSError) as error:
        return _refused("inspect", error)
    except KeyError as error:  # a data set or attribute the format has: the file is damaged, or still being written
        return _refused("inspect", f"{args.results}: not a whole {job.name} file (damaged?): {error.args[0]}")
    return 0


def plot_path(plot: str) -> str:
    """Where ``--plot`` draws: ``plot``, or ``plot.png`` where it has no suffix (as matplotlib writes it); a
    ValueError for a format matplotlib does not draw (``--plot out.h5`` ended in its traceback, after the work)."""
    import os

    from matplotlib.figure import Figure

    suffix = os.path.splitext(plot)[1][1:].lower()
    if not suffix:
        plot, suffix = f"{plot}.png", "png"
    drawn = Figure().canvas.get_supported_filetypes()
    if suffix not in drawn:
        raise ValueError(f"matplotlib draws {', '.join(sorted(drawn))}, not {suffix}")
    return plot


def _refused(command: str, problem: object) -> int:
    print(f"mpiscale {command}: {problem}", file=sys.stderr)
    return 2
