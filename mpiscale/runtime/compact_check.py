"""Which marshal streams are safe to load as a compact message (:mod:`.compact`).

marshal is not safe against damaged or crafted data: a back-reference to a tuple that is still being read gives
the reader a tuple with empty slots, which crashes the interpreter, and a declared length is allocated before the
data behind it is read (500 random byte strings took 86 s). A compact body is checked first: one marshal object of
the kinds an encoder writes for a compact message (None, bools, ints, floats, str, bytes, tuples and dicts), every
length within the bytes that are there, every back-reference to an object already read, nested at most
:data:`MAX_DEPTH` deep, and nothing after it. ``_wire.pyx`` has the compiled twin, held to the same errors.
"""

from __future__ import annotations

from ..errors import MpiscaleError

MAX_DEPTH = 32
_CONSTANTS = frozenset(b"NFT")
_FIXED = {ord("i"): 4, ord("g"): 8}  # int32, binary float
_LONG = ord("l")  # digit count (int32, signed), then 2 bytes a digit
_STRINGS = frozenset(b"sutaA")  # bytes, unicode, interned, ascii, ascii interned: int32 length, then the bytes
_SHORT_STRINGS = frozenset(b"zZ")  # short ascii (interned): one byte of length
_SMALL_TUPLE, _TUPLE, _DICT, _REF, _NULL = map(ord, ")({r0")
_FLAG_REF = 0x80


class NotCompact(MpiscaleError, ValueError):
    """The bytes are not a compact message (a corrupt or foreign frame)."""


def check(data: bytes) -> None:
    """Raise :class:`NotCompact` unless ``data`` is safe to give ``marshal.loads`` as a compact body."""
    refs: list[bool] = []  # per back-reference index: whether its object has been read to its end
    end = _object(data, 0, refs, 0)
    if end != len(data):
        raise NotCompact(f"not a compact message: {len(data) - end} bytes after the marshal data")


def _need(data: bytes, at: int, count: int) -> None:
    if count > len(data) - at:
        raise NotCompact(f"not a compact message: marshal data ends early at byte {at}")


def _int32(data: bytes, at: int) -> int:
    _need(data, at, 4)
    return int.from_bytes(data[at : at + 4], "little", signed=True)


def _length(data: bytes, at: int) -> int:
    length = _int32(data, at)
    if length < 0:
        raise NotCompact(f"not a compact message: negative length at byte {at}")
    return length


def _object(data: bytes, at: int, refs: list[bool], depth: int) -> int:
    """The offset after the object at ``at``."""
    if depth > MAX_DEPTH:
        raise NotCompact(f"not a compact message: nested deeper than {MAX_DEPTH} at byte {at}")
    _need(data, at, 1)
    code = data[at]
    kind, flagged, start = code & ~_FLAG_REF, code & _FLAG_REF, at
    at += 1
    if kind in _CONSTANTS and not flagged:
        return at
    if kind == _REF and not flagged:
        index = _int32(data, at)
        if not (0 <= index < len(refs) and refs[index]):
            raise NotCompact(f"not a compact message: a reference at byte {start} to an object not read yet")
        return at + 4
    if kind in _FIXED or kind == _LONG or kind in _STRINGS or kind in _SHORT_STRINGS:
        if kind in _FIXED:
            size = _FIXED[kind]
        elif kind == _LONG:
            size, at = 2 * abs(_int32(data, at)), at + 4
        elif kind in _STRINGS:
            size, at = _length(data, at), at + 4
        else:
            _need(data, at, 1)
            size, at = data[at], at + 1
        _need(data, at, size)
        if flagged:
            refs.append(True)
        return at + size
    if kind not in (_SMALL_TUPLE, _TUPLE, _DICT):
        raise NotCompact(f"not a compact message: marshal type {code:#04x} at byte {start} is not one it holds")
    index = len(refs)
    if flagged:
        refs.append(False)
    if kind == _DICT:
        while True:
            _need(data, at, 1)
            if data[at] == _NULL:
                at += 1
                break
            at = _object(data, _object(data, at, refs, depth + 1), refs, depth + 1)
    else:
        if kind == _SMALL_TUPLE:
            _need(data, at, 1)
            count, at = data[at], at + 1
        else:
            count, at = _length(data, at), at + 4
        _need(data, at, count)  # every item takes a byte at least: no length beyond the data is allocated
        for _ in range(count):
            at = _object(data, at, refs, depth + 1)
    if flagged:
        refs[index] = True
    return at
