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
    """``--config`` and one option per field (default None, so only the options given override the file).

    A boolean is ``--name`` / ``--no-name`` (so a file's ``true`` can be undone); a tuple default makes a list
    option (``--hidden 128 64``, or ``--hidden 128,64``) of the type of its elements.
    """
    command.add_argument(
        "--config", metavar="FILE.toml", help="settings file (top level or a table named after the command)"
    )
    defaults = kind()
    for setting in option_fields(kind):
        flag = "--" + setting.name.replace("_", "-")
        default = getattr(defaults, setting.name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else repr(default)
        text = f"{setting.metadata['help']} (default: {shown})"
        metavar = setting.name.upper()
        if isinstance(default, bool):
            command.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif isinstance(default, tuple):
            parse = _items_of(_element_type(kind, setting.name, default))
            command.add_argument(flag, type=parse, nargs="*", action=_Joined, metavar=metavar, help=text)
        else:
            command.add_argument(flag, type=_parser_of(type(default)), metavar=metavar, help=text)


def _element_type(kind: type, name: str, default: tuple) -> type:
    """The type of a list setting's elements: its default's (a list setting has a non-empty default)."""
    if not default:
        raise TypeError(f"{kind.__name__}.{name}: a list setting's default names its element type: give one element")
    return type(default[0])


def _parser_of(kind: type) -> Callable[[str], Any]:
    """How an option's text becomes a value of ``kind``: a whole number may be written as a float (``--samples
    1e6``, as scientists write counts; it said "invalid int value: '1e6'"); ``1.5`` stays refused."""
    return _whole_number if kind is int else kind


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        value = float(text)  # (a ValueError for what is no number: argparse says "invalid int value")
        if not value.is_integer():
            raise ValueError(text) from None
        return int(value)


_whole_number.__name__ = "int"  # argparse names the type in its error: "invalid int value: '1.5'"


def _items_of(element: type) -> Callable[[str], list]:
    """An argument's items: ``"128,64"`` is two, each converted to ``element``."""

    convert = _parser_of(element)

    def parse(text: str) -> list:
        return [convert(part.strip()) for part in text.split(",") if part.strip()]

    parse.__name__ = element.__name__  # argparse names the type in its error: "invalid int value"
    return parse


class _Joined(argparse.Action):
    """A list option's values, however split over arguments and commas, as one tuple."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, tuple(item for items in values for item in items))


def load_settings(kind: type[Settings], table: str, path: str | None, overrides: dict) -> Settings:
    """Defaults, then the TOML file (top level or a ``[table]``), then ``overrides`` that are not None.

    Raises ``ValueError`` naming the file, the setting and what it should be.
    """
    values: dict = {}
    known = {f.name for f in option_fields(kind)}
    if path:
        try:
            with open(path, "rb") as stream:  # (a byte order mark, as Notepad writes, was "Invalid statement")
                document = tomllib.loads(stream.read().decode("utf-8-sig"))
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"config file {path} is not valid TOML: {error}") from None
        except RecursionError:  # tomllib reads nested arrays and tables by recursion
            raise ValueError(f"config file {path} nests arrays or tables too deep to read") from None
        except OSError as error:
            raise ValueError(f"config file {path} cannot be read: {error}") from None
        values = document.get(table, document)
        outside = sorted(key for key, value in document.items() if not isinstance(value, dict)) if table in document \
            else []  # fmt: skip
        if outside:  # (they were read by nothing: a file with the command's table is read there alone)
            raise ValueError(f"config file {path}: {', '.join(outside)} outside its [{table}] table, where "
                             f"{table} reads its settings: move {'it' if len(outside) == 1 else 'them'} into the "
                             "table")  # fmt: skip
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"config file {path}: unknown settings {unknown}; known: {', '.join(sorted(known))}")
    given = {name: value for name, value in overrides.items() if value is not None and name in known}
    origin = {name: f"config file {path}: " for name in values} | {name: "" for name in given}
    values.update(given)
    defaults = kind()
    for name, value in values.items():
        expected = type(getattr(defaults, name))
        if expected is tuple:
            values[name] = _list_setting(kind, name, getattr(defaults, name), value, origin[name])
        elif expected is float and isinstance(value, int) and not isinstance(value, bool):
            values[name] = float(value)
        elif expected is int and isinstance(value, float) and value.is_integer():
            values[name] = int(value)  # (a count written as 1e6, or 8.0)
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ValueError(f"{origin[name]}{name} must be {expected.__name__}, got {value!r}")
        if name in _SHARED_RULES and not _SHARED_RULES[name][0](values[name]):
            raise ValueError(f"{origin[name]}{name} must be {_SHARED_RULES[name][1]}, got {value!r}")
    return kind(**values)


def _names_something(path: str) -> bool:
    return bool(path.strip())


#: Settings several jobs share, checked where they are read: (holds, what a value must be). A seed of -1 ended a
#: job with a traceback from deep in its random streams; a progress interval of NaN or -1 was taken; an empty
#: results path ended encode, collect and compress-adapters after all their work, when the output was renamed. An
#: empty data or checkpoint path given (``--data "$DATA"`` with DATA unset) ran the job on its default without a
#: word: generated data, or memstore not durable.
_SHARED_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (lambda seed: 0 <= seed < 2**64, "an integer from 0 to 2**64 - 1"),
    "progress_every": (lambda seconds: seconds >= 0, "a number of seconds >= 0 (0: only the last line)"),
    "out": (_names_something, "a file's path (an unset variable in the job script gives none)"),
} | {
    name: (_names_something, "a path, or left out for its default (an unset variable in the job script gives an "
           "empty one)")
    for name in ("data", "checkpoint_dir", "local_dir")
}  # fmt: skip


def _list_setting(kind: type, name: str, default: tuple, value: Any, origin: str) -> tuple:
    """A list setting as a tuple of its element type: from a list (TOML's array), a tuple (the command line) or a
    comma-separated string (the form earlier versions took)."""
    element = _element_type(kind, name, default)
    if isinstance(value, str):
        try:
            return tuple(_items_of(element)(value))
        except ValueError:
            raise ValueError(f"{origin}{name} must be a list of {element.__name__}, got {value!r}") from None
    if element is int and isinstance(value, list | tuple):  # (whole numbers written as floats, as for one number)
        value = [int(item) if isinstance(item, float) and item.is_integer() else item for item in value]
    wrong = not isinstance(value, list | tuple) or any(
        not isinstance(item, element) or (element is int and isinstance(item, bool)) for item in value
    )
    if wrong:
        raise ValueError(f"{origin}{name} must be a list of {element.__name__}, got {value!r}")
    return tuple(value)


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
