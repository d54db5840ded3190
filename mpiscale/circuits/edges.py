"""A compiled graph's edge values as raw arrays on a runtime channel, and back.

A value is a node's array, or a model node's dict of layer outputs. It travels
as parts on the lane of the node that made it, each part keyed ``(batch, part,
parts)``: an array is one part; a dict is its names (as bytes) and then its
arrays in the same order. A lane's parts arrive in the order they were sent, so
the parts of one value arrive together and are put back together here.
Anything else (a failure passed on in place of a value) travels as an actor
message instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_SEPARATOR = b"\0"


def as_parts(value: object) -> list[np.ndarray] | None:
    """The parts of ``value`` to send, or None when it does not travel raw (not an array of plain numbers, nor a
    dict of them with string names)."""
    if isinstance(value, np.ndarray):
        return [np.ascontiguousarray(value)] if _plain(value) else None
    if isinstance(value, dict) and value and all(isinstance(k, str) and _SEPARATOR.decode() not in k for k in value):
        arrays = list(value.values())
        if all(isinstance(a, np.ndarray) and _plain(a) for a in arrays):
            names = _SEPARATOR.join(k.encode() for k in value)
            return [np.frombuffer(names, np.uint8), *(np.ascontiguousarray(a) for a in arrays)]
    return None


def _plain(array: np.ndarray) -> bool:
    return array.dtype.kind in "biufc" and not array.dtype.fields and array.ndim <= 7


class Assembler:
    """Puts the parts arriving on each (source, lane) back into values, handing each to ``done(source, lane,
    batch, value)``."""

    def __init__(self, done: Callable[[int, int, int, object], None]) -> None:
        self._done = done
        self._partial: dict[tuple[int, int], list[np.ndarray]] = {}

    def part(self, source: int, lane: int, key: tuple[int, int, int], array: np.ndarray) -> None:
        batch, index, parts = key
        if parts == 1 and index == 0 and (source, lane) not in self._partial:  # a value of one part: as it is
            self._done(source, lane, batch, array)
            return
        held = self._partial.setdefault((source, lane), [])
        if index != len(held) or not 0 < parts:
            raise ValueError(f"graph value part {index} of {parts} (batch {batch}) from rank {source} after "
                             f"{len(held)} parts")  # fmt: skip
        held.append(array)
        if len(held) < parts:
            return
        del self._partial[(source, lane)]
        names = held[0].tobytes().split(_SEPARATOR)
        if len(names) != parts - 1:
            raise ValueError(f"graph value of batch {batch} from rank {source} names {len(names)} parts of "
                             f"{parts - 1}")  # fmt: skip
        self._done(source, lane, batch, {name.decode(): array for name, array in zip(names, held[1:])})
