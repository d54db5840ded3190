"""The ``mpiscale`` command: doctor, demo, the jobs, index, inspect, watch, control and bench NAME."""

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


def _job(args: argparse.Namespace) -> int:
    """A job command: its settings from the defaults, --config and the options, then the job on every rank.

    The job's module is imported only now (train's imports torch), from its registry entry.
    """
    from .jobs import JOBS, observed, run_job
    from .runtime import run

    entry = JOBS[args.job_name]
    job = entry.load("entry")

    def under_telemetry(config):
        out = getattr(config, "out", None)
        return run(lambda system: observed(system, entry.name, out, lambda: job(system, config), entry.steers))

    return run_job(entry.name, args.job_settings, args, under_telemetry)


def _export_adapter(args: argparse.Namespace) -> int:
    """``compress-adapters export FILE NAME [--to DIRECTORY]``: one process, no MPI job."""
    from .adapters.export import export_adapter
    from .errors import MpiscaleError

    if len(args.export) != 3 or args.export[0] != "export":
        print("mpiscale compress-adapters: the only positional form is: export FILE NAME [--to DIRECTORY]",
              file=sys.stderr)  # fmt: skip
        return 2
    _, compressed, name = args.export
    directory = args.to or name
    try:
        tensors = export_adapter(compressed, name, directory)
    except (MpiscaleError, OSError) as error:
        print(f"mpiscale compress-adapters export: {error}", file=sys.stderr)
        return 2
    print(f"wrote {directory}: adapter {name} rebuilt from {compressed} ({len(tensors) // 2} modules)")
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
    from importlib import import_module

    from .io import DataFileError, open_file
    from .jobs import JOBS, job_of_results

    try:
        with open_file(args.results) as file:
            kind = str(file.attrs.get("format", ""))
    except DataFileError as error:
        print(f"mpiscale inspect: {error}", file=sys.stderr)
        return 2

    def jobs_that(has: str, last: str) -> str:  # "dictlearn, train or memstore"
        names = [name for name, entry in JOBS.items() if getattr(entry, has)]
        return f"{', '.join(names[:-1])} {last} {names[-1]}" if len(names) > 1 else names[0]

    job = job_of_results(kind)
    if job is None or job.report is None:
        print(f"mpiscale inspect: {args.results} is not a results file of {jobs_that('report', 'or')}", file=sys.stderr)
        return 2
    if args.top_inputs and job.name != "dictlearn":
        print("mpiscale inspect: --top-inputs needs a dictlearn results file", file=sys.stderr)
        return 2
    if args.plot and not job.plots:
        print(f"mpiscale inspect: --plot draws {jobs_that('plots', 'and')} results, not {job.name}'s", file=sys.stderr)
        return 2
    report = import_module(job.report)
    print(report.summarize(args.results))
    if args.top_inputs:
        from .dictlearn.catalogue import catalogue, format_catalogue

        entries, samples = catalogue(args.results, args.top_inputs, args.data)
        print(format_catalogue(entries, samples, args.atoms))
    if args.plot:
        report.plot(args.results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _broker_settings(args: argparse.Namespace, command: str):
    """The telemetry settings of the environment (user, password, TLS), with ``--broker`` if given; None if unset."""
    import os

    from .telemetry import TelemetrySettings

    environ = dict(os.environ) | ({"MPISCALE_BROKER": args.broker} if args.broker else {})
    try:
        settings = TelemetrySettings.from_env(environ)
    except ValueError as error:
        print(f"mpiscale {command}: {error}", file=sys.stderr)
        return None
    if settings.broker is None:
        print(f"mpiscale {command}: give --broker HOST:PORT (or set MPISCALE_BROKER)", file=sys.stderr)
        return None
    return settings


def _watch(args: argparse.Namespace) -> int:
    """Show a job from its broker (JOB --broker) or its telemetry file (--file); 0 when it finished or stopped."""
    import asyncio
    import time
    from pathlib import Path

    from .telemetry import GONE_INTERVALS, watch_broker, watch_file

    if args.file:
        if not Path(args.file).is_file():
            print(f"mpiscale watch: {args.file} does not exist", file=sys.stderr)
            return 2
        view = watch_file(Path(args.file), follow=not args.no_follow)
    else:
        settings = _broker_settings(args, "watch")
        if not args.job or settings is None:
            print("mpiscale watch: give JOB --broker HOST:PORT, or --file FILE.telemetry.jsonl", file=sys.stderr)
            return 2
        try:
            view = asyncio.run(watch_broker(settings, args.job, timeout_s=args.timeout))
        except TimeoutError:
            print(f"mpiscale watch: job {args.job} did not end within {args.timeout} s", file=sys.stderr)
            return 1
        except Exception as error:  # aiomqtt's errors: say which broker and why, no traceback
            print(f"mpiscale watch: broker {settings.broker[0]}:{settings.broker[1]}: {error}", file=sys.stderr)
            return 1
    state = view.latest.get("status", {}).get("state")
    now = time.time()
    silent = view.silent_s(now)
    if state == "stopped":
        print("mpiscale watch: the job stopped on request; its state is saved, and a resumed run goes on")
    elif view.gone(now) and silent is not None:
        print(f"mpiscale watch: the job ({state}) has said nothing for {silent:.0f} s, {GONE_INTERVALS} heartbeat "
              "intervals: it died without a final status, or its rank 0 is blocked", file=sys.stderr)  # fmt: skip
    elif state != "finished":
        print(f"mpiscale watch: the job ended {state or 'without a status'}", file=sys.stderr)
    return 0 if state in ("finished", "stopped") else 1


def _control(args: argparse.Namespace) -> int:
    """Send a command to a running job; 0 when the job completed it, 1 if it rejected it or did not answer."""
    import asyncio

    from .telemetry import LEVELS, Command, JobEnded, NoToken, new_id, send_command

    if (args.command_name == "log-level") != (args.level is not None) or (args.level or "INFO").upper() not in LEVELS:
        print("mpiscale control: log-level takes a LEVEL (DEBUG, INFO, WARNING, ERROR); other commands none",
              file=sys.stderr)  # fmt: skip
        return 2
    settings = _broker_settings(args, "control")
    if settings is None:
        return 2
    command = Command(new_id(), args.command_name, args.level.upper() if args.level else None)
    where = f"{settings.broker[0]}:{settings.broker[1]}"
    try:
        done = asyncio.run(send_command(settings, args.job, command, args.timeout))
    except JobEnded as error:
        print(f"mpiscale control: {error}", file=sys.stderr)
        return 1
    except NoToken as error:
        print(f"mpiscale control: {error}", file=sys.stderr)
        return 2
    except TimeoutError:
        print(f"mpiscale control: no answer from job {args.job} within {args.timeout:g} s: is it running, "
              f"publishing to {where}, and may this user read its topics?", file=sys.stderr)  # fmt: skip
        return 1
    except Exception as error:  # aiomqtt's errors: say which broker and why, no traceback
        print(f"mpiscale control: broker {where}: {error}", file=sys.stderr)
        return 1
    return 0 if done else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench.registry import BENCHMARKS

    BENCHMARKS[args.name].start(args, args.json or f"bench-{args.name}.json")
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser (every option documented in --help)."""
    from .bench.registry import BENCHMARKS
    from .circuits.commands import add_commands as add_circuit_commands
    from .jobs import JOBS, add_options

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

    settings = "Settings come from the defaults, then --config FILE.toml, then these options."
    nested = {"circuits": add_circuit_commands(commands)}  # commands with sub-commands, one of them a job
    for entry in JOBS.values():
        kind = entry.load("settings")
        parent, _, name = entry.name.rpartition(" ")
        where = nested[parent] if parent else commands
        job = where.add_parser(name, help=entry.summary, description=f"{entry.description} {settings}")
        add_options(job, kind)
        job.set_defaults(handler=_job, job_settings=kind, job_name=entry.name)
        if entry.name == "compress-adapters":
            job.add_argument("export", nargs="*", metavar="export FILE NAME",
                             help="instead of compressing: rebuild adapter NAME of the compressed FILE in the PEFT "
                             "format, into the new directory --to")  # fmt: skip
            job.add_argument("--to", metavar="DIRECTORY", help="export: the adapter's directory (default: ./NAME)")

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

    inspect = commands.add_parser("inspect", help="summarize a results file of dictlearn, train or memstore; --plot "
                                  "draws dictlearn's and train's")  # fmt: skip
    inspect.add_argument("results", help="the results file of a dictlearn, train or memstore run")
    inspect.add_argument("--plot", metavar="FILE.png", help="draw learning curves (and atoms of image patches)")
    inspect.add_argument(
        "--top-inputs",
        type=int,
        metavar="N",
        help="dictlearn: for each atom, the N samples whose codes use it most, with their labels when known",
    )
    inspect.add_argument("--atoms", type=int, default=20, help="--top-inputs: how many atoms to list (default: 20)")
    inspect.add_argument("--data", metavar="FILE.h5:/X", help="--top-inputs: code these rows instead of the run's data")
    inspect.set_defaults(handler=_inspect)

    watch = commands.add_parser(
        "watch",
        help="a running job's progress, slowest rank and events, from its broker or its telemetry file",
        description="Show a job's telemetry until it ends; exit 0 if it finished or stopped on request, 1 if it "
        "failed or was lost.",
    )
    watch.add_argument("job", nargs="?", help="the job id (printed at its start; Slurm's job id under Slurm)")
    watch.add_argument("--broker", metavar="HOST:PORT", help="the MQTT broker the job publishes to")
    watch.add_argument("--file", metavar="FILE.telemetry.jsonl", help="a job's telemetry file (no broker)")
    watch.add_argument("--no-follow", action="store_true", help="--file: show what is there now, then stop")
    watch.add_argument("--timeout", type=float, help="--broker: give up after this many seconds")
    watch.set_defaults(handler=_watch)

    control = commands.add_parser(
        "control",
        help="send a running job a command: checkpoint, stop (checkpoint, then exit 0), dump, log-level LEVEL",
        description="Publish a command to a job's control topic and print its answers; exit 0 when the job "
        "completed it, 1 when it rejected it or did not answer. The broker's user, password and CA file come from "
        "MPISCALE_BROKER_USER, MPISCALE_BROKER_PASSWORD and MPISCALE_BROKER_CA.",
    )
    control.add_argument("job", help="the job id (printed at its start; Slurm's job id under Slurm)")
    control.add_argument("command_name", metavar="command", choices=["checkpoint", "stop", "dump", "log-level"])
    control.add_argument("level", nargs="?", help="log-level: DEBUG, INFO, WARNING or ERROR")
    control.add_argument("--broker", metavar="HOST:PORT", help="the job's MQTT broker (default: MPISCALE_BROKER)")
    control.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the answer (default: 60)")
    control.set_defaults(handler=_control)

    bench = commands.add_parser("bench", help="benchmarks against a baseline measured in the same run")
    bench.add_argument(
        "name", choices=list(BENCHMARKS), help="; ".join(f"{b.name}: {b.what}" for b in BENCHMARKS.values())
    )
    bench.add_argument("--samples", type=int, help="random: samples to generate (default: 4,000,000)")
    bench.add_argument("--size-mib", type=int, help="checkpoint: total state in MiB (default: 1024; 128 with --quick)")
    bench.add_argument(
        "--dir",
        default="bench-scratch",
        help="adapters, checkpoint, dictlearn, reader, telemetry: scratch directory for data and checkpoints "
        "(default: %(default)s)",
    )
    bench.add_argument("--json", help="where to write the JSON record (default: bench-NAME.json)")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, noisier)")
    bench.set_defaults(handler=_bench)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "export", None):
        return _export_adapter(args)
    for name in ("tokens", "laps", "samples", "top_inputs", "atoms"):
        if (getattr(args, name, 1) or 1) < 1:
            parser().error(f"--{name} must be at least 1")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
