"""The root of mpiscale's exceptions.

Every exception mpiscale defines derives from :class:`MpiscaleError`, and
also from the built-in a caller would catch without knowing mpiscale (a bad
data file is a ``ValueError``, a missing reply a ``TimeoutError``). So
``except MpiscaleError`` catches everything the package raises on purpose,
and code written against the built-ins keeps working. The classes live with
their layer: ``mpiscale.runtime.errors`` and ``mpiscale.io.errors``.
"""

from __future__ import annotations


class MpiscaleError(Exception):
    """Base class of every exception mpiscale defines."""


def refuse_a_str(names: object, argument: str, what: str) -> None:
    """Refuse a str where a list of names is wanted: iterated, it is its letters, each taken as a name."""
    if isinstance(names, str):
        raise TypeError(f"{argument} is a list of {what}, got the str {names!r}: give [{names!r}]")
