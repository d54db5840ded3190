"""Which levels a save writes, and the room each needs: level 1 (this node's directory), level 2 (a copy on a
partner node's) and level 3 (the shared directory)."""

from __future__ import annotations

from pathlib import Path


def save_levels(local: bool, partnered: bool, shared_every: int, saves: int, full_after_deltas: bool) -> list[str]:
    """The levels the next save writes: the node's (and its partner's) when there is a node-local directory, and the
    shared one every ``shared_every``-th save, on a full save that follows deltas, or always without a local one."""
    levels = []
    if local:
        levels += ["local", "partner"] if partnered else ["local"]
    shared_turn = shared_every and (saves % shared_every == 0 or full_after_deltas)
    if not local or shared_turn:
        levels.append("shared")
    return levels


def space_needed(
    levels: list[str], shared: Path, node: Path | None, mine: int, sizes: list[int], senders: int, ranks_on_node: int
) -> list[tuple[Path, int, str]]:
    """(directory, bytes, level) a save needs: level 3 every rank's bytes in the shared directory; levels 1 and 2
    this node's shards and the partner copies it keeps (for ``senders`` ranks, at most the largest shard each)."""
    wanted = []
    if "shared" in levels:
        wanted.append((shared, sum(sizes), "level 3"))
    if "local" in levels and node is not None:
        copies = max(sizes) * senders if "partner" in levels else 0
        wanted.append((node, (mine + copies) * ranks_on_node, "levels 1-2"))
    return wanted
