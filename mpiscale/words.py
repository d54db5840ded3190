"""How messages count things: "1 rank", "4 ranks". The lowest layer, beside ``mpiscale.errors``: every layer's
messages and reports use it."""

from __future__ import annotations


def counted(count: int, word: str) -> str:
    """``count`` and ``word``, plural unless there is one: ``counted(3, "file")`` is "3 files"."""
    return f"{count} {word}{'' if count == 1 else 's'}"
