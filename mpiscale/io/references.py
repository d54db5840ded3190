"""Paths one output records of another file (the data a dictionary was learned on, the model activations came
from), and finding that file again from wherever a later command runs.

A path typed relative to where a job ran means nothing from another folder.
So an output records both spellings: the absolute one, and the one relative
to the output's own folder (``NAME`` and ``NAME_relative``). A reader tries
the recorded path (absolute, or relative to where it runs), the relative one
beside the output, the recorded one beside it, and the file's name alone
beside it: files moved together, or a tree copied elsewhere, are found.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

from .errors import DataFileError
from .sources import split_spec


def recorded(name: str, spec: str, out: str) -> dict[str, str]:
    """The attributes that record data spec ``spec`` (FILE, FILE:/dataset, a pattern or a list) in output ``out``:
    ``name`` absolute, ``name_relative`` relative to ``out``'s folder."""
    path, dataset = split_spec(spec)
    suffix = f":/{dataset}" if dataset else ""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute, os.path.dirname(os.path.abspath(out)))
    return {name: absolute + suffix, f"{name}_relative": relative + suffix}


def locate(attrs: Mapping, name: str, named_by: str) -> str:
    """The spec recorded as ``name`` in ``named_by``'s attributes ``attrs``, its file part found (see the module
    docstring); a DataFileError names every place tried."""
    spec = str(attrs[name])
    relative = str(attrs.get(f"{name}_relative", "") or "")
    return _found(spec, named_by, relative)


def _found(spec: str, named_by: str, relative: str = "") -> str:
    """``spec`` (as ``named_by`` records it) with a file part that exists; ``relative``: its spelling relative to
    ``named_by``'s folder, when recorded."""
    path, dataset = split_spec(spec)
    suffix = f":/{dataset}" if dataset else ""
    folder = os.path.dirname(os.path.abspath(named_by))
    tries = [path]
    if relative:
        tries.append(os.path.join(folder, split_spec(relative)[0]))
    if not os.path.isabs(path):
        tries.append(os.path.join(folder, path))
    tries.append(os.path.join(folder, os.path.basename(path)))
    for candidate in dict.fromkeys(tries):
        if os.path.exists(candidate) or glob.glob(candidate):
            return candidate + suffix
    raise DataFileError(named_by, (
        f"names {path}, found neither from {os.getcwd()} nor beside it (tried {', '.join(dict.fromkeys(tries))}): "
        "give the file's path yourself"
    ))  # fmt: skip
