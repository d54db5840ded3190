"""How messages count things ("1 rank", "4 ranks"), name ranks ("ranks 0-3") and say how to finish an interrupted
run. The lowest layer, beside ``mpiscale.errors``: every layer's messages and reports use it."""

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


def how_to_finish(kept: str, command: str, does: str) -> str:
    """The command that finishes the run whose file is ``kept`` (a stopped run's ``OUT.partial``, a killed one's
    ``OUT.tmp``): ``how_to_finish("c.h5.tmp", "encode", "codes")`` is "mpiscale encode --resume --out c.h5, with the
    settings of the run, codes the others"."""
    out = kept.removesuffix(".partial").removesuffix(".tmp")
    return f"mpiscale {command} --resume --out {out}, with the settings of the run, {does} the others"
