"""The ``mpiscale`` command: its parser built from the command registry (``mpiscale.commands``), and ``main``."""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module
from typing import TYPE_CHECKING, NoReturn

from . import run_dir
from ._version import __version__
from .commands import COMMANDS, GROUPS, Command, children
from .jobs import add_options
from .ranks import launched_rank
from .srun_tasks import launch_refused

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

_AT_LEAST_ONE = ("tokens", "laps", "samples", "top_inputs", "atoms")
_AT_LEAST_ZERO = ("compute_ms",)


class _Parser(argparse.ArgumentParser):
    """argparse, with options spelled out (``--atom`` is no ``--atoms``, as a TOML file's key is not) and, under a
    launcher, help, the version and a mistake said once: by rank 0, whose status 2 becomes the job's. Every rank
    parses the same command line, so the others leave with no words and status 0, as ``run_job`` does for bad
    settings: mpirun kills the job a moment after a rank exits non-zero, before a slow rank 0 has spoken."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        """Help, usage, the version and errors, printed by rank 0 alone under a launcher (argparse prints them all
        here)."""
        if launched_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str) -> NoReturn:
        if launched_rank() != 0:
            sys.exit(0)
        super().error(message)


def parser() -> argparse.ArgumentParser:
    """The argument parser: every command of the registry, with its options documented in --help."""
    top = _Parser(
        prog="mpiscale",
        description="Actor runtime on MPI. Run jobs under launch/mpiscale-run -n N -- mpiscale ...",
    )
    top.add_argument("--version", action="version", version=f"mpiscale {__version__}")
    below: dict[tuple[str, ...], argparse._SubParsersAction] = {(): _sub_commands(top, [], required=True)}
    parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {(): top}
    for command in COMMANDS:
        *parent, word = command.words
        for depth in range(1, len(parent) + 1):  # the groups above it (circuits, bench) or a job with sub-commands
            key = tuple(parent[:depth])
            if key not in parsers:
                group = below[key[:-1]].add_parser(
                    key[-1], help=_group_help(list(key)), description=GROUPS.get(key[-1])
                )
                parsers[key] = group
            if key not in below:
                below[key] = _sub_commands(parsers[key], list(key), required=key[-1] in GROUPS)
        made = below[tuple(parent)].add_parser(word, help=command.summary, description=command.description or None)
        _add_arguments(made, command)
        parsers[tuple(command.words)] = made
    return top


def _sub_commands(parser: argparse.ArgumentParser, words: list[str], required: bool) -> argparse._SubParsersAction:
    dest = "_".join(["command", *words])
    return parser.add_subparsers(dest=dest, required=required, metavar="{" + ",".join(children(words)) + "}",
                                 parser_class=_Parser)  # fmt: skip


def _group_help(words: list[str]) -> str:
    return f"{GROUPS.get(words[-1], '')}: {', '.join(children(words))}"


def _add_arguments(made: argparse.ArgumentParser, command: Command) -> None:
    for option in command.options:
        made.add_argument(*option.flags, **option.settings)
    if command.one_of:
        exclusive = made.add_mutually_exclusive_group(required=True)
        for option in command.one_of:
            exclusive.add_argument(*option.flags, **option.settings)
    if command.job is not None:
        add_options(made, command.job.load("settings"))
    made.set_defaults(handler=command.handler, job_entry=command.job)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (the process's arguments by default) and run the command's handler; its exit status, noted for
    the launcher too (:mod:`mpiscale.run_dir`: a refusal's 2 then survives an mpirun that dies as the job ends)."""
    try:
        status = _command(argv)
    except SystemExit as leaving:  # argparse's refusals, a refused job
        code = leaving.code
        run_dir.note("status", str(code if isinstance(code, int) else 0 if code is None else 1))
        raise
    run_dir.note("status", str(status))
    return status


def _command(argv: list[str] | None) -> int:
    top = parser()
    args = top.parse_args(argv)
    for name in _AT_LEAST_ONE:
        if (getattr(args, name, 1) or 1) < 1:
            top.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in _AT_LEAST_ZERO:
        if not getattr(args, name, 0) >= 0:  # (NaN too)
            top.error(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    _check_written_files(top, args)
    refused = launch_refused()
    if refused is not None:  # said once, by rank 0, whose status becomes the step's (see _Parser)
        return refused
    module, function = args.handler.split(":")
    status = 0
    try:
        status = getattr(import_module(module), function)(args)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left (a pipe into head, a launcher ending the job): nobody to tell
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


def _check_written_files(top: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a ``--json`` or ``--plot`` file that cannot be written before the work: a bench ran to its end and
    then failed writing into a directory that is not there, its record lost."""
    from .commands.files import plot_path
    from .jobs import check_outputs

    for option in ("json", "plot"):
        path = getattr(args, option, None)
        if not isinstance(path, str) or not path:
            continue
        try:
            if option == "plot":
                path = args.plot = plot_path(path)
            check_outputs(path, None, "the file")
        except ValueError as error:
            top.error(f"--{option} {path}: {error}")
        except ImportError as error:
            top.error(f"--{option} needs matplotlib ({error})")


if __name__ == "__main__":
    sys.exit(main())
