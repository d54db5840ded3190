"""A pickle-free encoding for small messages of plain values.

Most runtime messages are small tuples of names, numbers and a few small numpy
arrays (an envelope: kind, actor, method, arguments, ask id). Pickling one costs
microseconds: a Python reducer call per array and a rebuild call per array on
the other side. Here such a tuple is written with :mod:`marshal` (C code, no
Python calls per element) after each small array is replaced by its dtype
string, shape and bytes; the positions of those arrays travel beside it.

What qualifies (anything else goes through pickle, so no value changes type):

* the top level is a tuple;
* each element is a scalar of exactly ``None``, ``bool``, ``int``, ``float``,
  ``str`` or ``bytes`` (subclasses such as enums or numpy scalars do not
  qualify), a C-contiguous plain-dtype ``numpy.ndarray`` (exactly, not a
  subclass) of at most :data:`MAX_ARRAY_BYTES`, a dict with ``str`` keys and
  scalar values, or a tuple of scalars and such arrays.

Received arrays are writable copies, as pickled ones are writable views.
The dtype codes here (:func:`plain_dtype_code`, :func:`dtype_from_code`) are
also those of the pickled path's out-of-band arrays.
"""

from __future__ import annotations

import marshal
from typing import Any

import numpy as np

from .compact_check import NotCompact, check

#: Largest array that travels in a compact message; larger ones go out of band, without a copy.
MAX_ARRAY_BYTES = 4096
_SCALARS = frozenset({type(None), bool, int, float, str, bytes})
_codes: dict[np.dtype, str | None] = {}
_dtypes: dict[str, np.dtype] = {}


def plain_dtype_code(dtype: np.dtype) -> str | None:
    """``dtype.str`` for a dtype whose bytes are its values, None for object, structured or sub-array ones
    (cached)."""
    code = _codes.get(dtype, "")
    if code == "":
        plain = not dtype.hasobject and dtype.fields is None and dtype.subdtype is None
        code = _codes[dtype] = dtype.str if plain else None
    return code


def dtype_from_code(code: str) -> np.dtype:
    """The dtype a :func:`plain_dtype_code` names (cached); ValueError for one that holds objects."""
    dtype = _dtypes.get(code)
    if dtype is None:
        dtype = np.dtype(code)
        if dtype.hasobject:
            raise ValueError(f"dtype {code!r} holds objects")
        _dtypes[code] = dtype
    return dtype


def _array_entry(array: np.ndarray) -> tuple | None:
    code = plain_dtype_code(array.dtype)
    if code is None or array.nbytes > MAX_ARRAY_BYTES or not array.flags.c_contiguous:
        return None
    return (code, array.shape, array.tobytes())


def _plain_dict(value: dict) -> bool:
    scalars = _SCALARS
    for key, item in value.items():
        if type(key) is not str or type(item) not in scalars:
            return False
    return True


def encode(message: object) -> bytes | None:
    """The compact bytes of ``message``, or None when it does not qualify."""
    if type(message) is not tuple:
        return None
    scalars = _SCALARS
    items: list | None = None
    positions: list[int] = []
    for index, item in enumerate(message):
        kind = type(item)
        if kind in scalars:
            continue
        if kind is np.ndarray:
            entry = _array_entry(item)
            if entry is None:
                return None
            items = items or list(message)
            items[index] = entry
            positions.append(index << 16)
        elif kind is tuple:
            inner = _encode_inner(item, index, positions)
            if inner is None:
                return None
            if inner is not item:
                items = items or list(message)
                items[index] = inner
        elif kind is dict:
            if not _plain_dict(item):
                return None
        else:
            return None
    body = message if items is None else tuple(items)
    return marshal.dumps((body, tuple(positions)))


def _encode_inner(values: tuple, outer: int, positions: list[int]) -> tuple | None:
    """``values`` with its arrays replaced, or None when it does not qualify. A position is ``outer << 16`` for
    an array at the top level, plus ``1 + index`` for one inside a tuple there."""
    scalars = _SCALARS
    replaced: list | None = None
    for index, item in enumerate(values):
        kind = type(item)
        if kind in scalars:
            continue
        if kind is not np.ndarray or index >= 0xFFFF:
            return None
        entry = _array_entry(item)
        if entry is None:
            return None
        replaced = replaced or list(values)
        replaced[index] = entry
        positions.append((outer << 16) + 1 + index)
    return values if replaced is None else tuple(replaced)


def decode(data: Any) -> tuple:
    """The message whose compact bytes are ``data``; :class:`NotCompact` if they are not well formed."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise NotCompact(f"not a compact message: {type(data).__name__} is not bytes")
    data = bytes(data)
    check(data)  # marshal is not safe against damaged data
    try:
        loaded = marshal.loads(data)
    except (ValueError, EOFError, TypeError) as error:
        raise NotCompact(f"not a compact message: {error}") from None
    if type(loaded) is not tuple or len(loaded) != 2:
        raise NotCompact("not a compact message: wrong structure")
    body, positions = loaded
    if type(body) is not tuple or type(positions) is not tuple:
        raise NotCompact("not a compact message: wrong structure")
    return with_arrays(body, positions) if positions else body


def with_arrays(body: tuple, positions: tuple) -> tuple:
    """A decoded ``body`` with the array entries at ``positions`` rebuilt into arrays (the compiled decoder's
    too: the arrays are built by numpy either way)."""
    items = list(body)
    for position in positions:
        outer, inner = divmod(position, 1 << 16) if type(position) is int else (-1, 0)
        if not 0 <= outer < len(items):
            raise NotCompact(f"not a compact message: array position {position!r} is outside the message")
        if inner == 0:
            items[outer] = _rebuild(items[outer])
        else:
            values = items[outer]
            if type(values) is not tuple or inner > len(values):
                raise NotCompact(f"not a compact message: array position {position!r} is outside the message")
            values = list(values)
            values[inner - 1] = _rebuild(values[inner - 1])
            items[outer] = tuple(values)
    return tuple(items)


def _rebuild(entry: Any) -> np.ndarray:
    try:
        code, shape, data = entry
        array = np.frombuffer(bytearray(data), dtype=dtype_from_code(code))
        if len(shape) == 1 and array.shape == shape:
            return array
        return array.reshape(shape)
    except (TypeError, ValueError) as error:
        raise NotCompact(f"not a compact message: bad array entry: {error}") from None
