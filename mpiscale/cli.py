"""The ``mpiscale`` command: ``doctor``, ``demo``, ``dictlearn``, ``index``, ``inspect``, ``bench NAME``."""

from __future__ import annotations

import argparse
import sys


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import checks, report

    text, status = report(checks())
    print(text)
    return status


def _demo(args: argparse.Namespace) -> int:
    from .apps.demo import demo
    from .runtime import run

    summary = run(lambda system: demo(system, tokens=args.tokens, laps=args.laps))
    if summary.get("greeting") is not None or summary["ranks"] == 1:
        print(
            f"demo ok: {summary['ranks']} ranks, {summary['token_hops']} token hops, allreduce {summary['allreduce']}"
        )
    return 0


def _dictlearn(args: argparse.Namespace) -> int:
    from .dictlearn.config import load_config, option_fields
    from .dictlearn.learner import learn
    from .ranks import launched_rank
    from .runtime import run

    overrides = {f.name: getattr(args, f.name) for f in option_fields()}
    try:
        config = load_config(args.config, overrides)
    except ValueError as error:
        # Every rank finds the same problem before MPI starts. Rank 0 says it and exits 2, which becomes the
        # job's status; the others exit 0, because mpirun would kill rank 0 before it printed once another rank
        # had exited non-zero.
        if launched_rank() != 0:
            return 0
        print(f"mpiscale dictlearn: {error}", file=sys.stderr)
        return 2
    run(lambda system: learn(system, config))
    return 0


def _index(args: argparse.Namespace) -> int:
    from .io import DataFileError, resolve_files, write_index

    try:
        files = [path for pattern in args.files for path in resolve_files(pattern)]
        shapes = write_index(args.index, files, [args.dataset] if args.dataset else None)
    except (DataFileError, ValueError) as error:
        print(f"mpiscale index: {error}", file=sys.stderr)
        return 2
    arrays = ", ".join(f"/{name} {shape}" for name, shape in shapes.items())
    print(f"wrote {args.index}: {len(files)} files as one data set: {arrays}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .dictlearn.results import plot, summarize

    print(summarize(args.results))
    if args.plot:
        plot(args.results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench.registry import BENCHMARKS

    BENCHMARKS[args.name].start(args, args.json or f"bench-{args.name}.json")
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser (every option documented in --help)."""
    top = argparse.ArgumentParser(
        prog="mpiscale",
        description="Actor runtime on MPI. Run jobs under launch/mpiscale-run -n N -- mpiscale ...",
    )
    commands = top.add_subparsers(dest="command", required=True)

    doctor = commands.add_parser("doctor", help="report MPI, h5py, numba/CUDA support and how to fix gaps")
    doctor.set_defaults(handler=_doctor)

    demo = commands.add_parser("demo", help="runtime demo: actors pass tokens round a ring, then allreduce")
    demo.add_argument("--tokens", type=int, default=100, help="tokens each rank starts (default: 100)")
    demo.add_argument("--laps", type=int, default=3, help="laps of the ring each token makes (default: 3)")
    demo.set_defaults(handler=_demo)

    learn = commands.add_parser(
        "dictlearn",
        help="distributed sparse dictionary learning (run under launch/mpiscale-run -n N)",
        description="Learn a dictionary from FILE.h5:/dataset, or from a planted synthetic set when --data is "
        "not given. Settings come from the defaults, then --config FILE.toml, then these options.",
    )
    _add_config_options(learn)
    learn.set_defaults(handler=_dictlearn)

    index = commands.add_parser(
        "index",
        help="present several HDF5 files as one data set (an index file with a virtual data set)",
        description="Write INDEX.h5, which mpiscale reads as the rows of FILES in order (globs are expanded in "
        "numeric order: run-2 before run-10), and plain h5py reads through a virtual data set.",
    )
    index.add_argument("index", metavar="INDEX.h5", help="the index file to write")
    index.add_argument("files", nargs="+", metavar="FILE", help="HDF5 files (or quoted globs) in row order")
    index.add_argument("--dataset", metavar="/PATH", help="the data set to index (default: every data set)")
    index.set_defaults(handler=_index)

    inspect = commands.add_parser("inspect", help="summarize a dictlearn results file; --plot draws it")
    inspect.add_argument("results", help="the results.h5 of a dictlearn run")
    inspect.add_argument("--plot", metavar="FILE.png", help="draw learning curves (and atoms of image patches)")
    inspect.set_defaults(handler=_inspect)

    from .bench.registry import BENCHMARKS

    bench = commands.add_parser("bench", help="benchmarks against a baseline measured in the same run")
    bench.add_argument(
        "name", choices=list(BENCHMARKS), help="; ".join(f"{b.name}: {b.what}" for b in BENCHMARKS.values())
    )
    bench.add_argument("--samples", type=int, help="random: samples to generate (default: 4,000,000)")
    bench.add_argument("--size-mib", type=int, help="checkpoint: total state in MiB (default: 1024; 128 with --quick)")
    bench.add_argument(
        "--dir",
        default="bench-scratch",
        help="checkpoint, dictlearn, reader: scratch directory for data and checkpoints (default: %(default)s)",
    )
    bench.add_argument("--json", help="where to write the JSON record (default: bench-NAME.json)")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, noisier)")
    bench.set_defaults(handler=_bench)
    return top


def _add_config_options(command: argparse.ArgumentParser) -> None:
    """One option per DictLearnConfig field (default None: only given options override the config file)."""
    from .dictlearn.config import DictLearnConfig, option_fields

    command.add_argument("--config", metavar="FILE.toml", help="settings file (top level or a [dictlearn] table)")
    defaults = DictLearnConfig()
    for option in option_fields():
        flag = "--" + option.name.replace("_", "-")
        default = getattr(defaults, option.name)
        text = f"{option.metadata['help']} (default: {default!r})"
        if isinstance(default, bool):
            command.add_argument(flag, action="store_true", default=None, help=text)
        else:
            command.add_argument(flag, type=type(default), metavar=option.name.upper(), help=text)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("tokens", "laps", "samples"):
        if (getattr(args, name, 1) or 1) < 1:
            parser().error(f"--{name} must be at least 1")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
