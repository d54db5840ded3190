"""Buffers askers lend for their replies: ``ask(..., reply_into=buffer)``.

A large reply's parts are received into memory the engine allocates, and the asker then holds an array over that
memory. An asker that owns a buffer for the reply (often the very array it sent: a parameter server's vector, a
stage's activations) lends it instead, and a reply that is one array of the buffer's size is received there: no
allocation, no fresh pages to fault in, no copy.

A reply whose parts travel apart names its ask in its frame, so its one array is received into the buffer lent
for that ask, when the sizes fit. The load then checks that the message is that reply, an array over the buffer;
one that is not (a damaged or foreign frame) is moved to memory of its own before it is delivered, and the buffer
is offered again. A reply that came elsewhere (small replies travel in their frame; an ask of an actor of the same
rank) is copied into the buffer. A reply that is not an array of the buffer's dtype and shape is refused.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from .dispatch import REPLY


@dataclass(eq=False)
class Loan:
    """A buffer lent for the reply to one ask."""

    ask_id: int
    source: int  # the rank asked: only its frames go into the buffer
    memory: memoryview  # the buffer's bytes
    address: int  # where they are
    held: asyncio.Future | None = None  # while a frame's parts are received into it: done when all are there
    repaid: bool = False  # the reply it was lent for is in it


def lendable(buffer: object, what: str) -> np.ndarray:
    """``buffer`` if a reply can be received into it (a writable, C-contiguous numpy array); else TypeError."""
    if not isinstance(buffer, np.ndarray):
        raise TypeError(f"{what}: reply_into must be a writable, C-contiguous numpy array, got {type(buffer).__name__}")
    flags = buffer.flags
    if not flags.c_contiguous or not flags.writeable:
        raise TypeError(f"{what}: reply_into must be a writable, C-contiguous numpy array, got an array not both")
    if buffer.dtype.hasobject:
        raise TypeError(f"{what}: reply_into cannot be an array of Python objects")
    return buffer


def into(buffer: np.ndarray, value: object, in_place: bool, ref: object, method: str) -> np.ndarray:
    """``buffer`` holding the reply ``value`` to ask ``method`` of ``ref`` (copied in, unless it was received there:
    ``in_place``); ValueError for a reply that is not an array of the buffer's dtype and shape."""
    if value is buffer:
        return buffer
    if not isinstance(value, np.ndarray) or value.dtype != buffer.dtype or value.shape != buffer.shape:
        got = f"{value.dtype}{value.shape}" if isinstance(value, np.ndarray) else f"a {type(value).__name__}"
        raise ValueError(f"ask({method!r}) to {ref}: the reply is {got}, the buffer given as reply_into "
                         f"{buffer.dtype}{buffer.shape}")  # fmt: skip
    if not in_place:
        np.copyto(buffer, value)
    return buffer


class Lending:
    """The buffers lent for replies not yet come, by ask."""

    def __init__(self) -> None:
        self._offers: dict[int, Loan] = {}
        self.bytes_in_place = 0  # of replies received straight into their lent buffers

    def lend(self, ask_id: int, source: int, buffer: object, what: str, offer_over: int | None) -> Loan | None:
        """The loan of ``buffer`` (see :func:`lendable`) for the reply to ask ``ask_id`` of rank ``source``, if it
        holds more than ``offer_over`` bytes (else None: a smaller reply travels in its frame; ``offer_over`` None:
        the ask is of this rank)."""
        array = lendable(buffer, what)
        if offer_over is None or array.nbytes <= offer_over:
            return None
        memory = memoryview(array.reshape(-1).view(np.uint8))  # its bytes (numpy exports no buffer of dates)
        loan = self._offers[ask_id] = Loan(ask_id, source, memory, array.ctypes.data)
        return loan

    def claim(self, source: int, answers: int, sizes: list[int]) -> Loan | None:
        """The buffer lent for the reply to ask ``answers``, for a message from ``source`` whose parts (its pickle
        stream, then its one array) have ``sizes`` bytes, now held by it; None if none was lent or it does not fit."""
        loan = self._offers.get(answers)
        if loan is None or loan.source != source or loan.held is not None or len(sizes) != 2:
            return None
        if sizes[1] != len(loan.memory):
            return None
        loan.held = asyncio.get_running_loop().create_future()
        return loan

    def repaid(self, loan: Loan, envelope: object) -> bool:
        """The message that held ``loan``'s buffer is in, loaded as ``envelope``: whether it is the reply the buffer
        was lent for, an array over the buffer (no longer offered then: the reply is in it)."""
        held, loan.held = loan.held, None
        if held is not None:
            held.set_result(None)
        if (type(envelope) is tuple and len(envelope) == 4 and envelope[0] == REPLY and envelope[1] == loan.ask_id
                and envelope[3] is False and isinstance(envelope[2], np.ndarray)
                and envelope[2].__array_interface__["data"][0] == loan.address):  # fmt: skip
            self._offers.pop(loan.ask_id, None)
            self.bytes_in_place += len(loan.memory)
            loan.repaid = True
            return True
        return False

    def end(self, loan: Loan) -> asyncio.Future | None:
        """The ask is over: its buffer is no longer offered. Returns what to await before the buffer is the
        asker's again: the parts of a message still being received into it (an ask that timed out meanwhile)."""
        self._offers.pop(loan.ask_id, None)
        return loan.held
