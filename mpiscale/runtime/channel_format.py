"""A channel message's header, and the state each end keeps per (peer, lane) (see :mod:`.channels`).

The header is ``HEADER_WORDS`` int64 words at most: the magic, the lane, how the bytes travel (``OVER``,
``FIT`` or ``INLINE``), the array's bytes, a key of three integers, its dtype's code, its number of
dimensions and its shape. Both ends decide fit or over by the same rule from the same history (:class:`Lane`'s
capacity), so nothing is negotiated per message.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAGIC = 0x6D70_6973_6368_616E  # "mpischan"
HEADER_WORDS = 16  # magic, lane, mode, bytes, key (3), dtype, ndim, shape (up to 7)
OVER, FIT, INLINE = 0, 1, 2  # how an array's bytes travel: on the over tag, the fit tag, or after its header
#: Arrays of at most this many bytes travel in their header's message (one message; the receiver copies them out).
INLINE_BYTES = 4096
MAX_DIMS = 7
SHAPE = 9  # the word where the shape begins
HEADER_TAG = 0
#: The dtypes a channel carries (plain numbers, in either byte order), by a code the header holds, and back.
DTYPES = {i: np.dtype(order + char) for i, (char, order) in enumerate(
    (char, order) for char in "?bBhHiIlLqQefdFD" for order in "<>")}  # fmt: skip
CODES = {dtype: code for code, dtype in DTYPES.items()}


def data_tags(lane: int) -> tuple[int, int]:
    """The (fit, over) tags of ``lane``."""
    return 2 * lane + 1, 2 * lane + 2


def channel_header(fields: tuple, array: Any) -> np.ndarray:
    """A message's header: ``fields`` (magic, lane, mode, bytes, key, dtype code), then ``array``'s number of
    dimensions and its shape, as int64 words."""
    return np.array((*fields, array.ndim, *array.shape), np.int64)


def header_bytes(ndim: int) -> int:
    """The bytes of the header of an array of ``ndim`` dimensions (what both ends count for it)."""
    return 8 * (SHAPE + ndim)


@dataclass(eq=False)
class Lane:
    """One (peer, lane) seen from this rank: what was sent on it, or what is posted to receive on it."""

    source: int  # the peer (the destination of a lane sent on)
    lane: int
    tags: tuple[int, int]  # its (fit, over) data tags
    capacity: int | None = None  # the first array's bytes (None: nothing yet, or too big to post ahead)
    buffers: list[np.ndarray] = field(default_factory=list)  # buffers of ``capacity`` bytes, for reuse
    posted: np.ndarray | None = None  # the buffer of the fit receive posted ahead
    what: str = ""  # a send's description (for diagnostics)
    request: Any = None
    arrivals: deque[Arrival] = field(default_factory=deque)  # announced by their headers, not yet delivered
    fits: deque[Arrival] = field(default_factory=deque)  # those of them whose data the fit receives bring


@dataclass(eq=False)
class Arrival:
    """An array whose header arrived: where its bytes are once they are all here."""

    key: tuple[int, int, int]
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    memory: np.ndarray | None = None
