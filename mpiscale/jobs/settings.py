"""A job's settings: one dataclass whose defaults run on a laptop, a TOML file over them, command-line options last.

Each field is declared with ``option(default, help)``; the command line gets
one ``--flag`` per field (its help text and default in ``--help``) and a TOML
file may hold the settings at its top level or in a table named after the job (``[circuits-run]`` for
``mpiscale circuits run``).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Callable
from dataclasses import Field, field, fields
from typing import Any, TypeVar

from ..ranks import launched_rank

Settings = TypeVar("Settings")


def option(default: Any, help: str) -> Any:
    """A settings field with its help text (shown by ``--help``)."""
    return field(default=default, metadata={"help": help})


def option_fields(kind: type) -> list[Field]:
    """The settings' fields, in declaration order."""
    return list(fields(kind))


def add_options(command: argparse.ArgumentParser, kind: type) -> None:
    """``--config`` and one option per field (default None, so only the options given override the file)."""
    command.add_argument(
        "--config", metavar="FILE.toml", help="settings file (top level or a table named after the command)"
    )
    defaults = kind()
    for setting in option_fields(kind):
        flag = "--" + setting.name.replace("_", "-")
        default = getattr(defaults, setting.name)
        text = f"{setting.metadata['help']} (default: {default!r})"
        if isinstance(default, bool):
            command.add_argument(flag, action="store_true", default=None, help=text)
        else:
            command.add_argument(flag, type=type(default), metavar=setting.name.upper(), help=text)


def load_settings(kind: type[Settings], table: str, path: str | None, overrides: dict) -> Settings:
    """Defaults, then the TOML file (top level or a ``[table]``), then ``overrides`` that are not None.

    Raises ``ValueError`` naming the file, the setting and what it should be.
    """
    values: dict = {}
    known = {f.name for f in option_fields(kind)}
    if path:
        try:
            with open(path, "rb") as stream:
                document = tomllib.load(stream)
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"config file {path} is not valid TOML: {error}") from None
        except RecursionError:  # tomllib reads nested arrays and tables by recursion
            raise ValueError(f"config file {path} nests arrays or tables too deep to read") from None
        except OSError as error:
            raise ValueError(f"config file {path} cannot be read: {error}") from None
        values = document.get(table, document)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"config file {path}: unknown settings {unknown}; known: {', '.join(sorted(known))}")
    given = {name: value for name, value in overrides.items() if value is not None and name in known}
    origin = {name: f"config file {path}: " for name in values} | {name: "" for name in given}
    values.update(given)
    defaults = kind()
    for name, value in values.items():
        expected = type(getattr(defaults, name))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            values[name] = float(value)
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ValueError(f"{origin[name]}{name} must be {expected.__name__}, got {value!r}")
    return kind(**values)


def run_job(command: str, kind: type[Settings], args: argparse.Namespace, job: Callable[[Settings], Any]) -> int:
    """Load the settings from ``args`` and run ``job(settings)``; bad settings end every rank before MPI starts.

    Every rank finds the same problem. Rank 0 says it and exits 2, which becomes
    the job's status; the others exit 0, because mpirun would kill rank 0 before
    it printed once another rank had exited non-zero.
    """
    overrides = {f.name: getattr(args, f.name, None) for f in option_fields(kind)}
    try:
        settings = load_settings(kind, command.replace(" ", "-"), args.config, overrides)
    except ValueError as error:
        if launched_rank() != 0:
            return 0
        print(f"mpiscale {command}: {error}", file=sys.stderr)
        return 2
    job(settings)
    return 0
