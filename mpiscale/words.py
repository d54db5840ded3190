"""How messages count things ("1 rank", "4 ranks") and name ranks ("ranks 0-3"). The lowest layer, beside
``mpiscale.errors``: every layer's messages and reports use it."""

from __future__ import annotations


def counted(count: int, word: str) -> str:
    """``count`` and ``word``, plural unless there is one: ``counted(3, "file")`` is "3 files"."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def ranks_named(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-3' or 'ranks 0, 2'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
