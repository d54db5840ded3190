"""A channel's sending end (see :mod:`.channels`): each array's header and bytes to their destination, by the
rule of its (peer, lane) that the receiver applies too.

This is the reference; ``_wire.ChannelSender`` is its compiled twin, which sends an array that fits MPI's count
on a lane it has sent on before in C, and hands the rest (a lane's first array, an array over ``chunk_bytes``,
anything refused) to the reference it holds.
"""

from __future__ import annotations

import operator
from typing import Any, Protocol

import numpy as np

from ..ranks import Comm, chunks
from .channel_format import (
    CODES,
    FIT,
    HEADER_TAG,
    INLINE,
    MAGIC,
    MAX_DIMS,
    OVER,
    Lane,
    channel_header,
    data_tags,
    header_bytes,
)


class Traffic(Protocol):
    """What a sender needs of the progress engine: its sends kept alive until done, and counted."""

    def track(self, request: Any, what: str, keep: object) -> None: ...

    def count_sent(self, messages: int, nbytes: int) -> None: ...

    def kick(self) -> None: ...


class Sender:
    """The sending end of a channel on ``comm``, through ``endpoint`` (the message path's MPI calls)."""

    def __init__(self, MPI: Any, comm: Comm, endpoint: Any, traffic: Traffic, name: str, lanes: int,
                 chunk_bytes: int, inline_bytes: int) -> None:  # fmt: skip
        self.MPI, self.comm, self.endpoint, self.traffic, self.name = MPI, comm, endpoint, traffic, name
        self.lanes, self.chunk_bytes, self.inline_bytes = lanes, chunk_bytes, inline_bytes
        self.sending: dict[tuple[int, int], Lane] = {}
        self.closed = False

    def send(self, dest: int, lane: int, key: tuple[int, int, int], array: np.ndarray) -> None:
        """``Channel.send``."""
        key = self._key(key)
        state = self.sending.get((dest, lane))
        if state is None:
            state = self.sending[(dest, lane)] = self._lane(dest, lane)
        code = CODES.get(array.dtype) if isinstance(array, np.ndarray) else None
        if code is None or array.ndim > MAX_DIMS or not array.flags.c_contiguous or self.closed:
            self._refuse(array)
        nbytes = array.nbytes
        if nbytes <= self.inline_bytes:
            mode = INLINE
        else:
            capacity = state.capacity
            mode = FIT if capacity is not None and nbytes <= capacity else OVER
            if capacity is None and nbytes <= self.chunk_bytes:
                state.capacity = nbytes  # the same rule the receiver applies to the header
        traffic, tag = self.traffic, state.tags[0 if mode == FIT else 1]
        fields = (MAGIC, lane, mode, nbytes, *key, code)
        if nbytes <= self.chunk_bytes:
            for request in self.endpoint.send_array(dest, HEADER_TAG, tag, fields, array, mode == INLINE):
                traffic.track(request, state.what, None)
        else:
            comm, MPI = self.comm, self.MPI
            header = channel_header(fields, array)  # (never inline: too big)
            traffic.track(comm.Isend([header, MPI.BYTE], dest, HEADER_TAG), state.what, header)
            for piece in chunks(memoryview(array).cast("B"), self.chunk_bytes):
                traffic.track(comm.Isend([piece, MPI.BYTE], dest, tag), state.what, array)
        traffic.count_sent(1, nbytes + header_bytes(array.ndim))
        traffic.kick()

    def close(self) -> None:
        """Refuse any send from now on."""
        self.closed = True

    def _lane(self, dest: int, lane: int) -> Lane:
        if not isinstance(lane, int | np.integer):
            raise TypeError(f"channel {self.name!r}: a lane is an integer, got {type(lane).__name__} {lane!r}")
        if not 0 <= lane < self.lanes:
            raise ValueError(f"channel {self.name!r}: lane {lane!r} is outside 0..{self.lanes - 1}")
        if not isinstance(dest, int | np.integer) or not 0 <= dest < self.comm.Get_size():
            raise ValueError(f"channel {self.name!r}: rank {dest!r} is no rank of this job of {self.comm.Get_size()}")
        return Lane(dest, lane, data_tags(lane), what=f"channel {self.name!r} lane {lane} to rank {dest}")

    def _key(self, key: object) -> tuple[int, int, int]:
        """``key`` as three ints (numpy's integers too); TypeError for anything else, which would go out as a header
        the receiver cannot read (it ends the job)."""
        try:
            parts = tuple(operator.index(part) for part in key)  # type: ignore[attr-defined]
        except TypeError:
            parts = ()
        if len(parts) != 3 or not all(-(2**63) <= part < 2**63 for part in parts):
            raise TypeError(f"channel {self.name!r}: a key is three integers of 64 bits, got {key!r}")
        return parts

    def _refuse(self, array: object) -> None:
        """Say why ``array`` cannot be sent."""
        if self.closed:
            raise RuntimeError(f"channel {self.name!r} is closed")
        if isinstance(array, np.ndarray) and array.dtype in CODES and array.ndim <= MAX_DIMS:
            raise ValueError(f"channel {self.name!r} sends C-contiguous arrays (np.ascontiguousarray makes one)")
        what = f"{array.dtype} array of {array.ndim} dims" if isinstance(array, np.ndarray) else type(array).__name__
        raise TypeError(f"channel {self.name!r} sends numpy arrays of plain numbers (bool, integers, floats, "
                        f"complex) and at most {MAX_DIMS} dims, got a {what}")  # fmt: skip
