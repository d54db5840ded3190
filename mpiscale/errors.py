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
